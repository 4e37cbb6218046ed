"""Tagged JSON for hyperparameters and extra state (spec §6, "JSON values").

Plain JSON cannot hold tuples (Adam's ``betas``), non-finite floats, dicts with non-string
keys (scheduler states) or small tensors (RNG states). Those are written as single-key
objects whose key starts with ``$``; a plain dict with a ``$``-key is written as ``$items``.
Floats are written with Python's shortest round-trip repr, so every float reads back bit
for bit.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeAlias

import torch

from ..errors import CorruptChainError, FormatError, UnsupportedStateError
from .dtypes import DTYPES, dtype_name

JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
"""A JSON value: what :func:`parse_json` returns and :func:`encode` makes (spec §6).

A value parsed from a file may be hostile: narrow it with ``isinstance`` before use.
"""

JSONObject: TypeAlias = "dict[str, JSON]"
"""A JSON object: a record, the root file, or a member of them."""

Decoded: TypeAlias = object
"""A decoded value (:func:`decode`): JSON values plus tuples, bytes, small tensors,
non-finite floats and dicts with keys of any of these types; narrow with ``isinstance``."""

MAX_INLINE_TENSOR_BYTES = 1 << 20
# Base64 text of MAX_INLINE_TENSOR_BYTES bytes (with padding): longer `$tensor` data is refused
# while parsing, before it is decoded (spec §6.4, §21.4).
MAX_INLINE_TENSOR_BASE64 = 4 * -(-MAX_INLINE_TENSOR_BYTES // 3)

# Parse limits (spec §6.4). A reader refuses a larger file before reading it when it can.
MAX_RECORD_BYTES = 128 << 20  # log/<seq>.json
MAX_ROOT_BYTES = 16 << 20  # ldformat.json
MAX_LOCK_BYTES = 64 << 10  # writer lock files
MAX_ZARR_JSON_BYTES = 1 << 20  # zarr.json of a batch group or array (spec §10.2)
MAX_JSON_DEPTH = 64  # arrays and objects nested in each other, the outermost counting 1
MAX_INT_CHARS = 20  # "-9223372036854775808"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

class TensorRef:
    """A ``$ref`` value (spec §6.1, §8.2): the stored tensor named ``name`` goes here."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRef) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("TensorRef", self.name))

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r})"


def encode(value: object, where: str = "value") -> JSON:
    """Turn a Python value into plain JSON data, tagging what JSON cannot hold.

    A :class:`TensorRef` becomes ``{"$ref": name}`` (the optimizer structure of spec §8.2).
    """
    if isinstance(value, enum.Enum):  # an IntEnum would come back as a plain int: say so instead
        raise UnsupportedStateError(
            f"{where}: {value!r} is an enum member; a reader could only return its value, not the "
            f"{type(value).__name__} (spec §6.1): use the plain value"
        )
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise UnsupportedStateError(
                f"{where}: the integer {value} is outside the signed 64-bit range readers accept (spec §6.4); "
                "store it as a string or a tensor instead"
            )
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": repr(value)}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"$items": [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, TensorRef):
        return {"$ref": value.name}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_INLINE_TENSOR_BYTES:
            raise UnsupportedStateError(
                f"{where}: tensor of {nbytes} bytes is too large for extra state "
                f"(limit {MAX_INLINE_TENSOR_BYTES}); store it in the model or optimizer instead"
            )
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "$tensor": {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data": base64.b64encode(raw).decode("ascii"),
            }
        }
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise UnsupportedStateError(
        f"{where}: a value of type {type(value).__name__} cannot be stored "
        "(allowed: None, bool, int, float, str, list, tuple, dict, bytes, torch dtypes, small tensors)"
    )


def decode(data: JSON, where: str = "chain metadata") -> Decoded:
    """Inverse of :func:`encode`; a malformed tagged value raises CorruptChainError naming ``where``."""
    if isinstance(data, list):
        return [decode(v, where) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (key, inner), = data.items()
        if key in _TAGS:
            try:
                return _TAGS[key](inner, where)
            except CorruptChainError:
                raise
            except (ValueError, TypeError, KeyError, RuntimeError, binascii.Error) as e:
                raise CorruptChainError(f"{where}: malformed {key} value ({e}, spec §6.1)") from None
    if any(k.startswith("$") for k in data):
        raise CorruptChainError(f"{where}: unknown tagged value {sorted(data)!r} in chain metadata (spec §6.1)")
    return {k: decode(v, where) for k, v in data.items()}


def _bad(where: str, key: str, why: str) -> CorruptChainError:
    return CorruptChainError(f"{where}: malformed {key} value ({why}, spec §6.1)")


def _decode_float(inner: JSON, where: str) -> float:
    if not isinstance(inner, str) or inner not in ("nan", "inf", "-inf"):
        raise _bad(where, "$float", f"{inner!r} is not 'nan', 'inf' or '-inf'")
    return float(inner)


def _decode_tuple(inner: JSON, where: str) -> tuple[Decoded, ...]:
    if not isinstance(inner, list):
        raise _bad(where, "$tuple", "not an array")
    return tuple(decode(v, where) for v in inner)


def _decode_items(inner: JSON, where: str) -> dict[Decoded, Decoded]:
    pairs = [p for p in inner if isinstance(p, list) and len(p) == 2] if isinstance(inner, list) else []
    if not isinstance(inner, list) or len(pairs) != len(inner):
        raise _bad(where, "$items", "not an array of [key, value] pairs")
    out: dict[Decoded, Decoded] = {}
    for k, v in pairs:
        key = decode(k, where)
        try:
            out[key] = decode(v, where)
        except TypeError:
            raise _bad(where, "$items", f"the key {k!r} is not hashable") from None
    return out


def _base64(text: JSON, where: str, key: str, limit: int | None) -> bytes:
    if not isinstance(text, str):
        raise _bad(where, key, "the data is not a string")
    if limit is not None and len(text) > 4 * -(-limit // 3):
        raise CorruptChainError(f"{where}: a {key} value holds more than {limit} bytes of data, the limit of "
                                "spec §21.4; the chain was not written by a conforming writer")
    return base64.b64decode(text, validate=True)


def _decode_bytes(inner: JSON, where: str) -> bytes:
    return _base64(inner, where, "$bytes", None)


def _decode_tensor(inner: JSON, where: str) -> torch.Tensor:
    if not isinstance(inner, dict) or set(inner) != {"dtype", "shape", "data"}:
        raise _bad(where, "$tensor", "not an object of dtype, shape and data")
    raw = _base64(inner["data"], where, "$tensor", MAX_INLINE_TENSOR_BYTES)
    if len(raw) > MAX_INLINE_TENSOR_BYTES:
        raise CorruptChainError(f"{where}: a $tensor value holds {len(raw)} bytes of data, more than the "
                                f"{MAX_INLINE_TENSOR_BYTES} of spec §21.4")
    name = inner["dtype"]
    if not isinstance(name, str) or name not in DTYPES:
        raise _bad(where, "$tensor", f"unknown dtype {name!r}")
    dtype = DTYPES[name]
    shape = inner["shape"]
    dims = [d for d in shape if isinstance(d, int) and not isinstance(d, bool) and d >= 0] \
        if isinstance(shape, list) else []
    if not isinstance(shape, list) or len(dims) != len(shape):
        raise _bad(where, "$tensor", f"shape {shape!r} is not a list of non-negative integers")
    numel = span = 1
    for d in dims:
        numel *= d
        span *= max(1, d)
    width = torch.empty(0, dtype=dtype).element_size()
    if numel * width != len(raw) or span >= 1 << 63:
        raise _bad(where, "$tensor", f"{len(raw)} bytes of data for shape {shape} of {name}")
    if dtype == torch.bool and raw.translate(None, b"\x00\x01"):
        raise _bad(where, "$tensor", "a bool byte is not 0 or 1")
    buf = bytearray(raw)
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(dims).clone()


def _decode_dtype(inner: JSON, where: str) -> torch.dtype:
    if not isinstance(inner, str) or inner not in DTYPES:
        raise _bad(where, "$dtype", f"unknown dtype {inner!r}")
    return DTYPES[inner]


def _decode_ref(inner: JSON, where: str) -> TensorRef:
    if not isinstance(inner, str):
        raise _bad(where, "$ref", "not a string")
    return TensorRef(inner)


_TAGS: dict[str, Callable[[JSON, str], Decoded]] = {
    "$float": _decode_float, "$tuple": _decode_tuple, "$items": _decode_items, "$bytes": _decode_bytes,
    "$tensor": _decode_tensor, "$dtype": _decode_dtype, "$ref": _decode_ref,
}


# -- strict parsing (spec §6.4) ------------------------------------------------------------
class _Reject(ValueError):
    """A rule of spec §6.4 broken inside the JSON decoder's hooks."""


def _parse_int(text: str) -> int:
    # Checked on the text, before converting: a 5000-digit integer never becomes an int.
    if len(text) > MAX_INT_CHARS:
        raise _Reject(f"an integer of {len(text)} characters (at most {MAX_INT_CHARS})")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _Reject(f"the integer {text} is outside the signed 64-bit range")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject(f"the number {text[:32]}{'...' if len(text) > 32 else ''} overflows binary64")
    return value


def _parse_constant(name: str) -> NoReturn:
    raise _Reject(f"{name} is not JSON (non-finite floats are tagged values, spec §6.1)")


def _object(pairs: list[tuple[str, JSON]]) -> JSONObject:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Reject(f"duplicate key {key!r} in an object")
            seen.add(key)
    return out


def _tagged_object(pairs: list[tuple[str, JSON]]) -> JSONObject:
    out = _object(pairs)
    if len(out) == 1 and "$tensor" in out:
        inner = out["$tensor"]
        data = inner.get("data") if isinstance(inner, dict) else None
        if isinstance(data, str) and _base64_size(data) > MAX_INLINE_TENSOR_BYTES:
            raise _Reject(f"a $tensor value with {_base64_size(data)} bytes of base64 data, more than the "
                          f"{MAX_INLINE_TENSOR_BYTES} bytes a tagged tensor may hold")
    return out


def _base64_size(text: str) -> int:
    """The number of bytes base64 ``text`` (RFC 4648, padded) decodes to, without decoding it."""
    if len(text) > MAX_INLINE_TENSOR_BASE64 or len(text) % 4:
        return len(text) * 3 // 4
    return len(text) // 4 * 3 - text[-2:].count("=")


def _check_nesting(doc: JSON) -> None:
    """Depth at most MAX_JSON_DEPTH and no unpaired surrogate in any string (iterative)."""
    stack: list[tuple[JSON, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            items: Iterable[JSON] = value.values()
            for key in value:
                if not key.isascii():
                    _check_text(key)
        elif isinstance(value, list):
            items = value
        else:
            if isinstance(value, str) and not value.isascii():
                _check_text(value)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _Reject(f"arrays and objects nested deeper than {MAX_JSON_DEPTH} levels")
        for item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif isinstance(item, str) and not item.isascii():
                _check_text(item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Reject("a string holds an unpaired UTF-16 surrogate escape") from None


# Any, not JSON: a JSON value whose callers may index members they checked with ``.get()``
# (which JSON would not allow); callers that keep the value annotate it as JSON.
def parse_json(data: bytes | bytearray | memoryview, where: str, *, max_bytes: int, tagged: bool = True) -> Any:
    """Parse a record, root, lock or Zarr metadata file by the rules of spec §6.4.

    UTF-8 only; at most ``max_bytes`` bytes; no ``NaN``/``Infinity``; no duplicate keys;
    integers of at most 20 characters within the signed 64-bit range; finite numbers;
    nesting at most 64 deep; no unpaired surrogates; with ``tagged``, no ``$tensor`` with
    more than 1 MiB of data. Anything else raises :class:`FormatError` naming ``where``.
    """
    size = len(data)
    if size > max_bytes:
        raise FormatError(f"{where}: {size} bytes, more than the {max_bytes} a reader accepts for this file "
                          "(spec §6.4); the file is damaged or was not written by ldformat: restore it from a copy")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: not UTF-8 (invalid byte at offset {e.start}, spec §6.4); the file is damaged: "
                          "restore it from a copy") from None
    decoder = json.JSONDecoder(object_pairs_hook=_tagged_object if tagged else _object, parse_int=_parse_int,
                               parse_float=_parse_float, parse_constant=_parse_constant)
    try:
        doc: JSON = decoder.decode(text)
        _check_nesting(doc)
    except _Reject as e:
        why = str(e)
    except json.JSONDecodeError as e:
        why = f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        why = f"arrays and objects nested deeper than {MAX_JSON_DEPTH} levels"
    except ValueError as e:  # int()/float() of a malformed number
        why = str(e)
    else:
        return doc
    raise FormatError(f"{where}: not valid JSON within the limits of spec §6.4 ({why}); the file is damaged or "
                      "was not written by a conforming writer: restore it from a copy")


def canonical(obj: JSON) -> bytes:
    """The canonical bytes of a JSON document: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
