"""Strict JSON (spec §6.4): every record, root and lock file is parsed by one strict parser.

Hostile JSON is normal input: each rule is checked through :class:`ChainReader` opening a
copy of a golden chain whose newest record (or root file) was rewritten, with a recomputed
checksum wherever the hostile content still has a canonical form, so that only the parse
rule can refuse it. Every refusal is a :class:`FormatError` naming the file, never a
traceback; valid JSON within the limits parses exactly as ``json.loads`` does.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import TESTS

from ldformat import ChainReader, CorruptChainError
from ldformat.errors import FormatError
from ldformat.format.checksum import with_checksum
from ldformat.format.jsonvalue import (
    MAX_INLINE_TENSOR_BYTES,
    MAX_JSON_DEPTH,
    MAX_LOCK_BYTES,
    MAX_RECORD_BYTES,
    MAX_ROOT_BYTES,
    canonical,
    decode,
    encode,
    parse_json,
)

GOLDEN = TESTS / "golden"


def golden_chain(kind: str) -> Path:
    """The oldest format version's golden chain of ``kind`` (format 1.0 chains must always read)."""
    found = sorted(GOLDEN.glob(f"*/{kind}/chain"))
    assert found, f"no golden {kind} chain"
    return found[0]


def copy_chain(kind: str, tmp_path: Path) -> Path:
    dst = tmp_path / kind
    shutil.copytree(golden_chain(kind), dst)
    return dst


def last_record(chain: Path) -> Path:
    return sorted((chain / "log").glob("*.json"))[-1]


def rewrite_log(chain: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to every record, in order; recompute checksums and re-link ``prev``."""
    prev: str | None = None
    for i, path in enumerate(sorted((chain / "log").glob("*.json"))):
        doc = json.loads(path.read_bytes())
        if i:
            doc["prev"] = prev
        change(doc)
        doc = with_checksum(doc)
        prev = doc["checksum"]
        path.write_bytes(canonical(doc) + b"\n")


def record_bytes(doc: dict[str, Any], inject: tuple[str, str] | None = None) -> bytes:
    """Canonical bytes of ``doc`` with a valid checksum; ``inject`` = (placeholder, raw JSON text):
    a string member holding the placeholder is replaced by the raw text after serialization."""
    data = canonical(with_checksum(doc)) + b"\n"
    if inject is not None:
        placeholder, text = inject
        quoted = json.dumps(placeholder).encode()
        assert data.count(quoted) == 1
        data = data.replace(quoted, text.encode())
    return data


def set_extra(doc: dict[str, Any], value: Any) -> None:
    doc["deltas"][-1]["steps"][-1]["extra"]["hostile"] = value


def open_fails(chain: Path, rel: str, *, cls: type[Exception] = FormatError, match: str = "") -> str:
    with pytest.raises(cls) as info:
        ChainReader(chain)
    message = str(info.value)
    assert f"{chain}/{rel}" in message, message
    assert match in message, message
    assert "Traceback" not in message
    return message


def hostile_record(tmp_path: Path, value_text: str, *, valid: Any = 0) -> tuple[Path, str]:
    """A chain whose newest record holds ``value_text`` (raw JSON) in a step's extra; the checksum is that of
    the record with ``valid`` there instead (so a reader that accepts the text then fails its checksum)."""
    chain = copy_chain("grad.dense", tmp_path)
    path = last_record(chain)
    doc = json.loads(path.read_bytes())
    set_extra(doc, "@@hostile@@")
    data = record_bytes(doc, ("@@hostile@@", value_text))
    path.write_bytes(data)
    return chain, path.relative_to(chain).as_posix()


def valid_hostile_record(tmp_path: Path, value: Any, kind: str = "grad.dense") -> tuple[Path, str]:
    """A chain whose newest record holds ``value`` in a step's extra, with a correct checksum."""
    chain = copy_chain(kind, tmp_path)
    path = last_record(chain)
    doc = json.loads(path.read_bytes())
    set_extra(doc, value)
    path.write_bytes(record_bytes(doc))
    return chain, path.relative_to(chain).as_posix()


# -- records through ChainReader ---------------------------------------------------------------
def test_golden_chains_still_parse(tmp_path: Path) -> None:
    for kind in ("grad.dense", "grad.topk", "state.xor"):
        reader = ChainReader(golden_chain(kind))
        assert reader.steps


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(tmp_path: Path, literal: str) -> None:
    chain, rel = hostile_record(tmp_path, literal)
    open_fails(chain, rel, match=literal)


def test_a_number_overflowing_binary64_is_refused(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, "1e999")
    open_fails(chain, rel, match="binary64")


def test_a_5000_digit_integer_is_refused_before_conversion(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, "9" * 5000)
    open_fails(chain, rel, match="5000 characters")


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, 10**19 * 99])
def test_integers_outside_int64_are_refused_even_with_a_valid_checksum(tmp_path: Path, value: int) -> None:
    chain, rel = valid_hostile_record(tmp_path, value)
    open_fails(chain, rel, match="")


@pytest.mark.parametrize("value", [(1 << 63) - 1, -(1 << 63)])
def test_int64_extremes_are_accepted(tmp_path: Path, value: int) -> None:
    chain, _ = valid_hostile_record(tmp_path, value)
    reader = ChainReader(chain)
    entry = reader.state.deltas[reader.latest_step or 0][1]
    assert entry.extra["hostile"] == value


def test_200k_deep_nesting_is_refused_without_recursion_error(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, "[" * 200_000 + "]" * 200_000)
    open_fails(chain, rel, match="nested deeper")


def test_nesting_just_past_the_limit_is_refused_even_with_a_valid_checksum(tmp_path: Path) -> None:
    # record > deltas > delta entry > steps > step entry > extra: 6 levels, then the value's own.
    ok: Any = 0
    for _ in range(MAX_JSON_DEPTH - 6):
        ok = [ok]
    chain, _ = valid_hostile_record(tmp_path / "ok", ok)
    ChainReader(chain)
    chain, rel = valid_hostile_record(tmp_path / "deep", [ok])
    open_fails(chain, rel, match=f"deeper than {MAX_JSON_DEPTH}")


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    """A reader that re-serializes would see only the last value (and a valid checksum): refuse."""
    chain = copy_chain("grad.dense", tmp_path)
    path = last_record(chain)
    data = path.read_bytes()
    assert data.count(b'"reason":') == 1
    path.write_bytes(data.replace(b'"reason":', b'"reason":"evil","reason":', 1))
    open_fails(chain, path.relative_to(chain).as_posix(), match="duplicate key 'reason'")


def test_duplicate_keys_deep_inside_are_refused(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, '{"a":1,"a":1}')
    open_fails(chain, rel, match="duplicate key 'a'")


def test_invalid_utf8_is_refused(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, '"caf@"')
    path = chain / rel
    path.write_bytes(path.read_bytes().replace(b"caf@", b"caf\xe9"))  # latin-1, not UTF-8
    open_fails(chain, rel, match="not UTF-8")


def test_an_unpaired_surrogate_escape_is_refused(tmp_path: Path) -> None:
    chain, rel = hostile_record(tmp_path, '"\\ud800"')
    open_fails(chain, rel, match="surrogate")


def record_of_size(tmp_path: Path, size: int) -> tuple[Path, str]:
    """A chain whose newest record is canonical, has a valid checksum and is exactly ``size`` bytes long."""
    chain = copy_chain("grad.dense", tmp_path)
    path = last_record(chain)
    doc = json.loads(path.read_bytes())
    set_extra(doc, "")
    set_extra(doc, "x" * (size - len(record_bytes(doc))))
    path.write_bytes(record_bytes(doc))
    assert path.stat().st_size == size
    return chain, path.relative_to(chain).as_posix()


def test_a_record_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    chain, rel = record_of_size(tmp_path, MAX_RECORD_BYTES + 1)
    message = open_fails(chain, rel)
    assert str(MAX_RECORD_BYTES) in message


def test_a_record_at_the_size_limit_is_read(tmp_path: Path) -> None:
    chain, _ = record_of_size(tmp_path, MAX_RECORD_BYTES)
    assert ChainReader(chain).steps == ChainReader(golden_chain("grad.dense")).steps


@pytest.mark.parametrize("extra", [1, 2, 3, 1 << 20])
def test_oversize_tagged_tensor_is_refused_while_parsing(tmp_path: Path, extra: int) -> None:
    data = base64.b64encode(bytes(MAX_INLINE_TENSOR_BYTES + extra)).decode()
    value = {"$tensor": {"dtype": "uint8", "shape": [MAX_INLINE_TENSOR_BYTES + extra], "data": data}}
    chain, rel = valid_hostile_record(tmp_path, value)
    open_fails(chain, rel, match="$tensor")


def test_a_tagged_tensor_of_exactly_1_mib_is_accepted(tmp_path: Path) -> None:
    import torch

    t = torch.arange(MAX_INLINE_TENSOR_BYTES // 4, dtype=torch.int32)
    chain, _ = valid_hostile_record(tmp_path, encode(t))
    reader = ChainReader(chain)
    extra = reader.state.deltas[reader.latest_step or 0][1].extra
    assert torch.equal(decode(extra["hostile"]), t)


# -- root file ---------------------------------------------------------------------------------
def root_rewrite(chain: Path, text_of: Callable[[bytes], bytes]) -> str:
    path = chain / "ldformat.json"
    path.write_bytes(text_of(path.read_bytes()))
    return "ldformat.json"


def test_root_with_nan_is_refused(tmp_path: Path) -> None:
    chain = copy_chain("grad.dense", tmp_path)
    rel = root_rewrite(chain, lambda b: b.replace(b'"format": "ldformat"', b'"format": "ldformat", "x": NaN', 1))
    open_fails(chain, rel, match="NaN")


def test_root_with_a_duplicate_key_is_refused(tmp_path: Path) -> None:
    """The duplicate ``kind`` would win over the checksummed one in a re-serializing reader."""
    chain = copy_chain("grad.dense", tmp_path)
    rel = root_rewrite(chain, lambda b: b.replace(b'"kind":', b'"kind": "state.xor", "kind":', 1))
    open_fails(chain, rel, match="duplicate key 'kind'")


def test_root_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    chain = copy_chain("grad.dense", tmp_path)
    rel = root_rewrite(chain, lambda b: b.rstrip() + b" " * (MAX_ROOT_BYTES + 1 - len(b.rstrip())))
    assert (chain / rel).stat().st_size == MAX_ROOT_BYTES + 1
    open_fails(chain, rel, match=str(MAX_ROOT_BYTES))


def test_deeply_nested_root_is_refused(tmp_path: Path) -> None:
    chain = copy_chain("grad.dense", tmp_path)
    rel = root_rewrite(chain, lambda b: b.replace(b'"format": "ldformat"',
                                                  b'"format": "ldformat", "x": ' + b"[" * 100_000 + b"]" * 100_000, 1))
    open_fails(chain, rel, match="nested deeper")


# -- the parser itself -------------------------------------------------------------------------
@pytest.mark.parametrize("text, why", [
    (b'{"a": NaN}', "NaN"),
    (b"[Infinity]", "Infinity"),
    (b'{"a": 1, "b": {"c": 2, "c": 3}}', "duplicate key 'c'"),
    (b"1" * 21, "21 characters"),
    (b"-" + b"1" * 20, "21 characters"),
    (b"18446744073709551616", "signed 64-bit"),
    (b"9223372036854775808", "signed 64-bit"),
    (b"[1e400]", "binary64"),
    (b"[-1e400]", "binary64"),
    (b"[" * 65 + b"]" * 65, "nested deeper than 64"),
    (b'{"a":' * 65 + b"1" + b"}" * 65, "nested deeper than 64"),
    (b"\xff", "not UTF-8"),
    (b'"\xed\xa0\x80"', "not UTF-8"),  # an encoded surrogate is not UTF-8
    (b'["\\udc00"]', "surrogate"),
    (b'{"\\ud800": 1}', "surrogate"),
    (b"\xef\xbb\xbf{}", "Expecting value"),  # no byte order mark
    (b"{} {}", "Extra data"),
    (b"", "Expecting value"),
])
def test_parse_json_refuses(text: bytes, why: str) -> None:
    with pytest.raises(FormatError) as info:
        parse_json(text, "some/file.json", max_bytes=1 << 20)
    assert str(info.value).startswith("some/file.json: "), str(info.value)
    assert why in str(info.value)
    assert isinstance(info.value, CorruptChainError)


def test_parse_json_limits_are_exact() -> None:
    assert parse_json(b"[" * 64 + b"]" * 64, "f", max_bytes=1000) is not None
    assert parse_json(b"-9223372036854775808", "f", max_bytes=100) == -(1 << 63)
    assert parse_json(b"9223372036854775807", "f", max_bytes=100) == (1 << 63) - 1
    assert parse_json(b'["\\ud83d\\ude00"]', "f", max_bytes=100) == ["\U0001f600"]  # a pair is fine
    assert parse_json(b" " * 10 + b"{}", "f", max_bytes=12) == {}
    with pytest.raises(FormatError, match="13 bytes, more than the 12"):
        parse_json(b" " * 11 + b"{}", "f", max_bytes=12)


def test_lock_files_have_their_own_limit() -> None:
    body = b'{"pid": 1}'
    padded = body + b" " * (MAX_LOCK_BYTES - len(body))
    assert parse_json(padded, "writer.lock", max_bytes=MAX_LOCK_BYTES) == {"pid": 1}
    with pytest.raises(FormatError, match="writer.lock"):
        parse_json(padded + b" ", "writer.lock", max_bytes=MAX_LOCK_BYTES)


def test_the_tensor_size_rule_applies_to_tagged_files_only() -> None:
    big = json.dumps({"$tensor": {"dtype": "uint8", "shape": [1], "data": "A" * (MAX_INLINE_TENSOR_BYTES * 2)}})
    with pytest.raises(FormatError, match="tagged tensor"):
        parse_json(big.encode(), "f", max_bytes=1 << 30)
    assert parse_json(big.encode(), "f", max_bytes=1 << 30, tagged=False)["$tensor"]["shape"] == [1]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(json_values, st.sampled_from([None, 0, 1]))
def test_parse_json_agrees_with_json_loads_within_the_limits(value: Any, indent: int | None) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=bool(indent)).encode()
    assert canonical(parse_json(text, "f", max_bytes=1 << 20)) == canonical(json.loads(text))


# -- tagged values ------------------------------------------------------------------------------
@pytest.mark.parametrize("value, why", [
    ({"$tensor": {"dtype": "uint8", "shape": [MAX_INLINE_TENSOR_BYTES + 1],
                  "data": base64.b64encode(bytes(MAX_INLINE_TENSOR_BYTES + 1)).decode()}}, "1048576"),
    ({"$tensor": {"dtype": "float32", "shape": [2], "data": "AAAA"}}, "3 bytes of data"),
    ({"$tensor": {"dtype": "float32", "shape": [0, 1 << 62, 1 << 62], "data": ""}}, "bytes of data for shape"),
    ({"$tensor": {"dtype": "bool", "shape": [1], "data": "Ag=="}}, "bool byte"),
    ({"$tensor": {"dtype": "complex128", "shape": [], "data": ""}}, "unknown dtype"),
    ({"$tensor": {"dtype": "uint8", "shape": [1], "data": "!!!!"}}, "$tensor"),
    ({"$tensor": [1]}, "$tensor"),
    ({"$float": "1.5"}, "$float"),
    ({"$float": 1}, "$float"),
    ({"$tuple": 3}, "$tuple"),
    ({"$items": [[[1], 2]]}, "not hashable"),
    ({"$items": [1]}, "$items"),
    ({"$bytes": 7}, "$bytes"),
    ({"$bytes": "A"}, "$bytes"),
    ({"$other": 1}, "unknown tagged value"),
])
def test_malformed_tagged_values_are_corruption(value: Any, why: str) -> None:
    with pytest.raises(CorruptChainError) as info:
        decode({"extra": [value]}, "log/000000000001.json")
    assert str(info.value).startswith("log/000000000001.json: "), str(info.value)
    assert why in str(info.value)


def test_tagged_values_round_trip() -> None:
    import torch

    value = {"t": (1, 2.5, float("inf")), 3: b"xy", "s": torch.tensor(1.5), "e": torch.empty(0, 5),
             "b": torch.tensor([True, False]), "$k": [torch.arange(6, dtype=torch.int16).reshape(2, 3)]}
    back = decode(json.loads(canonical(encode(value))))
    assert back.keys() == value.keys()
    assert back["t"] == value["t"] and back[3] == b"xy"
    for key in ("s", "e", "b"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key])
    assert torch.equal(back["$k"][0], value["$k"][0])


@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, {"k": [10**30]}, {1 << 64: 0}])
def test_writers_refuse_integers_readers_would_refuse(value: Any) -> None:
    from ldformat import UnsupportedStateError

    with pytest.raises(UnsupportedStateError, match="signed 64-bit range"):
        encode(value, "extra")
