"""Anchor objects (spec §9; docs/implementation-notes.md "Anchor objects").

Streamed canonical write, strict header, single-copy load.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from ldformat.errors import CorruptChainError, UnsupportedStateError
from ldformat.format.anchor import SAFETENSORS_DTYPES, anchor_parts, decode_anchor, encode_anchor, tensor_bytes
from ldformat.format.checksum import object_checksum, object_checksum_parts
from ldformat.stores import LocalStore
from ldformat.stores.crc32c import crc32c_hex

WHERE = "chain/anchors/7-abcd.safetensors"


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/f64": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "model/f32": torch.randn(5, 3, generator=g),
        "model/f16": torch.randn(7, generator=g).half(),
        "model/bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "model/i64": torch.randint(-(2**62), 2**62, (4,), dtype=torch.int64, generator=g),
        "model/i32": torch.randint(-(2**30), 2**30, (3,), dtype=torch.int32, generator=g),
        "model/i16": torch.randint(-(2**15), 2**15, (5,), dtype=torch.int16, generator=g),
        "model/i8": torch.randint(-128, 128, (3,), dtype=torch.int8, generator=g),
        "model/u8": torch.randint(0, 256, (9,), dtype=torch.uint8, generator=g),
        "model/bool": torch.tensor([True, False, True]),
        "model/scalar": torch.tensor(2.5, dtype=torch.float64),
        "model/scalar_bool": torch.tensor(True),
        "model/empty": torch.empty(0, 4),
        "model/empty_i16": torch.empty(3, 0, dtype=torch.int16),
        "optimizer/0/exp_avg": torch.full((2, 2), -0.0),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g.view(-1).view(torch.uint8) if g.numel() else g,
                           t.reshape(-1).view(torch.uint8) if t.numel() else t), name


def header_of(data: bytes) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", data[:8])
    return dict(json.loads(data[8 : 8 + n]))


def build(header: dict[str, Any], payload: bytes, pad: bool = True) -> bytearray:
    body = json.dumps(header).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    return bytearray(struct.pack("<Q", len(body)) + body + payload)


META = {"ldformat.format": "anchor", "ldformat.step": "7"}


# -- writing -------------------------------------------------------------------------------
def test_round_trip_of_every_dtype() -> None:
    tensors = every_dtype()
    data = encode_anchor(tensors, 7)
    assert_same(decode_anchor(bytearray(data), 7, WHERE), tensors)
    assert_same(decode_anchor(data, 7, WHERE), tensors)  # immutable bytes: copied once


def test_layout_is_canonical_and_aligned() -> None:
    tensors = every_dtype()
    data = encode_anchor(tensors, 7)
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    body = data[8 : 8 + n].rstrip(b" ")
    assert n - len(body) < 8  # space padding only as far as the next multiple of 8
    header = json.loads(body)
    assert header["__metadata__"] == META
    # The header is the canonical JSON of itself (sorted keys, no spaces), then padding.
    assert body == json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    entries = sorted(((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__"))
    order = [k for _, k, v in entries if v["data_offsets"][1] > v["data_offsets"][0]]
    size = {k: tensors[k].element_size() for k in tensors}
    assert order == sorted((k for k in order), key=lambda k: (-size[k], k))
    for offsets, k, _ in entries:
        assert offsets[0] % size[k] == 0, k
    assert header_of(data)["model/scalar"]["shape"] == []


def test_same_input_same_bytes_regardless_of_dict_order() -> None:
    tensors = every_dtype()
    reversed_order = dict(reversed(list(tensors.items())))
    assert encode_anchor(tensors, 7) == encode_anchor(reversed_order, 7) == encode_anchor(tensors, 7)


CHILD = """
import hashlib, sys, torch
sys.path.insert(0, sys.argv[1])
from test_anchor import every_dtype
from ldformat.format.anchor import encode_anchor
print(hashlib.sha256(encode_anchor(every_dtype(), 7)).hexdigest())
"""


@pytest.mark.procs
def test_bytes_are_identical_across_processes() -> None:
    # safetensors.torch.save orders __metadata__ keys differently from one process to the next.
    here = str(Path(__file__).resolve().parent)
    digests = {subprocess.run([sys.executable, "-c", CHILD, here], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip() for _ in range(2)}
    import hashlib

    assert digests == {hashlib.sha256(encode_anchor(every_dtype(), 7)).hexdigest()}


def test_parts_are_zero_copy_views_and_match_encode() -> None:
    tensors = every_dtype()
    parts = anchor_parts(tensors, 7)
    joined = b"".join([parts.header, *(p.tobytes() for p in parts.payloads)])
    assert joined == encode_anchor(tensors, 7) and len(joined) == parts.size
    assert len(parts.payloads) == sum(1 for t in tensors.values() if t.numel())
    ptrs = {t.data_ptr() for t in tensors.values() if t.numel()}
    assert {p.ctypes.data for p in parts.payloads} == ptrs  # views of the tensors' memory


def test_unsupported_dtype_and_name_are_refused() -> None:
    with pytest.raises(UnsupportedStateError, match="complex128"):
        anchor_parts({"model/c": torch.zeros(2, dtype=torch.complex128)}, 0)
    with pytest.raises(UnsupportedStateError, match="__metadata__"):
        anchor_parts({"__metadata__": torch.zeros(2)}, 0)
    w = torch.zeros(4, 3)
    with pytest.raises(UnsupportedStateError, match="share memory"):
        anchor_parts({"model/a": w, "model/b": w[1]}, 0)
    anchor_parts({"model/a": w[:2], "model/b": w[2:]}, 0)  # disjoint views of one storage are fine


def test_checksum_over_parts_equals_checksum_of_joined_bytes() -> None:
    parts = anchor_parts(every_dtype(), 7)
    joined = encode_anchor(every_dtype(), 7)
    path = "anchors/7-abcd.safetensors"
    want = object_checksum(path, joined)
    assert object_checksum_parts(path, parts.parts) == want
    assert object_checksum_parts(path, [memoryview(joined)[:5], bytearray(joined[5:100]), joined[100:], b""]) == want
    assert object_checksum(path, bytearray(joined)) == object_checksum(path, memoryview(joined)) == want
    # The spec's test vectors (§6.3).
    assert object_checksum("anchors/0-00000000.safetensors", b"123456789") == "2fe6fb72"
    assert object_checksum_parts("deltas/1-3-abcd/values_u32/c/0", [b"1234", bytearray(b"5"), b"6789"]) == "ec54ba3d"
    assert object_checksum_parts("deltas/1-3-abcd/values_u32/c/0", []) == "95c351c3"
    assert crc32c_hex(bytearray(b"123456789")) == crc32c_hex(b"123456789") == "e3069283"


def test_write_parts_streams_the_same_bytes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    parts = anchor_parts(every_dtype(), 7)
    store.write_parts("anchors/7-abcd.safetensors", parts.parts)
    assert (tmp_path / "anchors/7-abcd.safetensors").read_bytes() == encode_anchor(every_dtype(), 7)
    store.write("x/plain", b"abc")
    assert store.read("x/plain") == b"abc"
    buf = store.read_buffer("x/plain")  # writable and owned: anchors load from it without a copy
    assert buf.dtype == np.uint8 and buf.flags.writeable and buf.tobytes() == b"abc"


def test_other_stores_get_the_parts_joined() -> None:
    from ldformat.stores import Store

    class MemoryStore(Store):
        def __init__(self) -> None:
            self.objects: dict[str, bytes] = {}

        def write(self, path: str, data: Any) -> None:
            self.objects[path] = bytes(data)

        sync = create_exclusive = read = size = list = delete = exists = None  # type: ignore[assignment]

    store = MemoryStore()
    parts = anchor_parts(every_dtype(), 7)
    store.write_parts("a", parts.parts)
    assert store.objects["a"] == encode_anchor(every_dtype(), 7)


# -- safetensors interoperability ------------------------------------------------------------
def test_safetensors_reads_our_anchors(tmp_path: Path) -> None:
    tensors = every_dtype()
    data = encode_anchor(tensors, 7)
    assert_same(dict(sorted(safetensors.torch.load(data).items())), tensors)
    path = tmp_path / "a.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == META
        assert_same({k: f.get_tensor(k) for k in sorted(f.keys())}, tensors)


def test_we_read_anchors_written_by_safetensors() -> None:
    tensors = every_dtype()
    data = safetensors.torch.save(tensors, metadata=META)
    assert_same(decode_anchor(data, 7, WHERE), tensors)


def test_any_tensor_and_header_order_is_accepted() -> None:
    a = np.arange(3, dtype=np.float32).tobytes()
    b = np.arange(2, dtype=np.int64).tobytes()
    header = {"b": {"shape": [2], "dtype": "I64", "data_offsets": [12, 28]},
              "a": {"data_offsets": [0, 12], "dtype": "F32", "shape": [3]},
              "__metadata__": META}
    out = decode_anchor(build(header, a + b), 7, WHERE)
    assert list(out) == ["a", "b"]
    assert out["a"].tolist() == [0.0, 1.0, 2.0] and out["b"].tolist() == [0, 1]


@pytest.mark.parametrize("pad", [True, False])
def test_unaligned_tensors_are_copied(pad: bool) -> None:
    # A one-byte tensor first leaves the float64 tensor at an odd offset.
    payload = b"\x07" + np.array([1.5, -2.25], dtype=np.float64).tobytes() + np.array([3], np.int32).tobytes()
    header = {"__metadata__": META,
              "u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "d": {"dtype": "F64", "shape": [2], "data_offsets": [1, 17]},
              "i": {"dtype": "I32", "shape": [], "data_offsets": [17, 21]}}
    data = build(header, payload, pad)
    assert safetensors.torch.load(bytes(data))["d"].tolist() == [1.5, -2.25]
    out = decode_anchor(data, 7, WHERE)
    assert out["d"].tolist() == [1.5, -2.25] and out["u"].tolist() == [7] and out["i"].item() == 3
    for t in out.values():
        assert t.data_ptr() % t.element_size() == 0
    out["d"].add_(1)  # writable, and aligned tensors still share the buffer
    out["u"].add_(1)
    start = len(data) - len(payload)
    assert data[start] == 8


# -- loading -------------------------------------------------------------------------------
def test_loaded_tensors_share_the_buffer_are_writable_and_independent() -> None:
    tensors = every_dtype()
    data = bytearray(encode_anchor(tensors, 7))
    out = decode_anchor(data, 7, WHERE)
    lo = np.frombuffer(data, np.uint8).ctypes.data
    ranges = []
    for name, t in out.items():
        if t.numel() == 0:
            continue
        assert lo <= t.data_ptr() < lo + len(data), f"{name} was copied"
        storage = t.untyped_storage()
        assert storage.nbytes() == t.numel() * t.element_size(), f"{name}'s storage spans more than itself"
        ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), "tensors overlap"
    before = {k: v.clone() for k, v in out.items()}
    out["model/f32"].add_(1.0)  # in place, no warning about a read-only buffer
    for name, t in out.items():
        if name != "model/f32":
            assert torch.equal(t, before[name]), f"{name} changed with model/f32"
    assert torch.equal(out["model/f32"], before["model/f32"] + 1)


def test_materialized_tensors_save_with_torch_and_safetensors(tmp_path: Path) -> None:
    tensors = every_dtype()
    out = decode_anchor(bytearray(encode_anchor(tensors, 7)), 7, WHERE)
    model = {k: v for k, v in out.items() if k.startswith("model/f")}
    buf = io.BytesIO()
    torch.save(model, buf)
    # Each tensor has its own storage: saving a few does not save the whole anchor.
    assert len(buf.getvalue()) < 4096
    assert_same(torch.load(io.BytesIO(buf.getvalue())), model)
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(out, str(path))
    assert_same(dict(sorted(safetensors.torch.load_file(str(path)).items())), tensors)


def test_tensor_bytes_reads_the_header() -> None:
    tensors = {"model/w": torch.zeros(3), "compressor/w": torch.zeros(5), "compressor/b": torch.zeros(2, 2)}
    data = bytearray(encode_anchor(tensors, 1))
    assert tensor_bytes(data, "compressor") == 36 and tensor_bytes(data, "model/") == 12


# -- strict header validation ----------------------------------------------------------------
def good() -> tuple[dict[str, Any], bytes]:
    payload = np.arange(4, dtype=np.float32).tobytes() + np.arange(2, dtype=np.int16).tobytes()
    header = {"__metadata__": META,
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "I16", "shape": [2], "data_offsets": [16, 20]}}
    return header, payload


def raw(body: bytes) -> bytearray:
    return bytearray(struct.pack("<Q", len(body)) + body)


def mutate(fn: Any) -> bytearray:
    header, payload = good()
    result = fn(header, payload)
    return result if isinstance(result, bytearray) else build(header, payload)


BAD: dict[str, Any] = {
    "empty object": lambda h, p: bytearray(),
    "short length": lambda h, p: bytearray(b"\x10\x00\x00"),
    "length past the end": lambda h, p: bytearray(struct.pack("<Q", 10_000) + b"{}"),
    "huge length": lambda h, p: bytearray(struct.pack("<Q", 2**63) + b"{}" + bytes(64)),
    "not json": lambda h, p: bytearray(struct.pack("<Q", 8) + b"{nope}  "),
    "not utf-8": lambda h, p: raw(b'{"\xff":1}'),
    "not an object": lambda h, p: bytearray(struct.pack("<Q", 8) + b"[1,2]   "),
    "leading space": lambda h, p: bytearray(struct.pack("<Q", 8) + b"  {}    "),
    "duplicate key": lambda h, p: raw(b'{"__metadata__":{"ldformat.format":"anchor","ldformat.step":"7"},'
                                      b'"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
                                      b'"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'),
    "metadata not strings": lambda h, p: h.update({"__metadata__": {"ldformat.step": 7}}),
    "entry not an object": lambda h, p: h.update({"c": [1]}),
    "unknown dtype": lambda h, p: h["a"].update({"dtype": "F8_E4M3"}),
    "complex dtype": lambda h, p: h["a"].update({"dtype": "C64"}),
    "dtype missing": lambda h, p: h["a"].pop("dtype"),
    "negative dim": lambda h, p: h["a"].update({"shape": [-2, -2]}),
    "float dim": lambda h, p: h["a"].update({"shape": [2.0, 2]}),
    "bool dim": lambda h, p: h["b"].update({"shape": [True, 2]}),
    "shape not a list": lambda h, p: h["a"].update({"shape": 4}),
    "one offset": lambda h, p: h["a"].update({"data_offsets": [0]}),
    "negative offset": lambda h, p: h["a"].update({"data_offsets": [-1, 16]}),
    "gap": lambda h, p: h["b"].update({"data_offsets": [18, 22]}),
    "overlap": lambda h, p: h["b"].update({"data_offsets": [14, 18]}),
    "end before begin": lambda h, p: h["b"].update({"data_offsets": [20, 16]}),
    "size mismatch": lambda h, p: h["b"].update({"shape": [3]}),
    "short data": lambda h, p: build(h, p[:-2]),
    "trailing data": lambda h, p: build(h, p + b"\0\0"),
    "past the end": lambda h, p: h["b"].update({"data_offsets": [16, 24], "shape": [4]}),
    "bool byte 2": lambda h, p: build({"__metadata__": META,
                                       "t": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_header_is_corruption_naming_the_object(case: str) -> None:
    data = mutate(BAD[case])
    with pytest.raises(CorruptChainError, match="not a valid safetensors anchor") as info:
        decode_anchor(data, 7, WHERE)
    assert WHERE in str(info.value)


def test_the_good_case_of_the_bad_ones_reads() -> None:
    out = decode_anchor(mutate(lambda h, p: None), 7, WHERE)
    assert out["a"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and out["b"].tolist() == [0, 1]


@pytest.mark.parametrize("meta", [{}, {"ldformat.format": "anchor", "ldformat.step": "8"},
                                  {"ldformat.format": "delta", "ldformat.step": "7"}])
def test_metadata_must_name_the_step(meta: dict[str, str]) -> None:
    header, payload = good()
    header["__metadata__"] = meta
    if not meta:
        del header["__metadata__"]
    with pytest.raises(CorruptChainError, match="does not name step 7") as info:
        decode_anchor(build(header, payload), 7, WHERE)
    assert WHERE in str(info.value)


def test_every_format_dtype_has_a_safetensors_code() -> None:
    from ldformat.format.dtypes import DTYPES

    assert set(SAFETENSORS_DTYPES.values()) == set(DTYPES.values())
    for code, dtype in SAFETENSORS_DTYPES.items():
        assert safetensors.torch._TYPES[code] == dtype
