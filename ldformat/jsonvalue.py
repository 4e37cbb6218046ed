"""Tagged JSON for hyperparameters and extra state (spec §6, "JSON values").

Plain JSON cannot hold tuples (Adam's ``betas``), non-finite floats, dicts with non-string
keys (scheduler states) or small tensors (RNG states). Those are written as single-key
objects whose key starts with ``$``; a plain dict with a ``$``-key is written as ``$items``.
Floats are written with Python's shortest round-trip repr, so every float reads back bit
for bit.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from typing import Any

import google_crc32c
import numpy as np
import torch

from .errors import CorruptChainError, UnsupportedStateError

MAX_INLINE_TENSOR_BYTES = 1 << 20

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The spec's name of a torch dtype; raises UnsupportedStateError for others."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(f"dtype {dtype} is not supported by format 1.0") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptChainError(f"unknown dtype {name!r} in chain metadata") from None


def encode(value: Any, where: str = "value") -> Any:
    """Turn a Python value into plain JSON data, tagging what JSON cannot hold."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
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
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > MAX_INLINE_TENSOR_BYTES:
            raise UnsupportedStateError(
                f"{where}: tensor of {nbytes} bytes is too large for extra state "
                f"(limit {MAX_INLINE_TENSOR_BYTES}); store it in the model or optimizer instead"
            )
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
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
        "(allowed: None, bool, int, float, str, list, tuple, dict, bytes, small tensors)"
    )


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (key, inner), = data.items()
        if key == "$float":
            return float(inner)
        if key == "$tuple":
            return tuple(decode(v) for v in inner)
        if key == "$items":
            return {decode(k): decode(v) for k, v in inner}
        if key == "$bytes":
            return base64.b64decode(inner)
        if key == "$tensor":
            dtype = parse_dtype(inner["dtype"])
            raw = bytearray(base64.b64decode(inner["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(inner["shape"]).clone()
    if any(k.startswith("$") for k in data):
        raise CorruptChainError(f"unknown tagged value {sorted(data)!r} in chain metadata")
    return {k: decode(v) for k, v in data.items()}


def canonical(obj: Any) -> bytes:
    """The canonical bytes of a JSON document: sorted keys, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _crc_input(data: bytes | bytearray | memoryview | np.ndarray) -> bytes | np.ndarray:
    """``data`` as google_crc32c takes it without a copy (it refuses bytearray and memoryview)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Continue the crc32c ``crc`` over the bytes of ``data`` (C-contiguous; no copy)."""
    view = _crc_input(data)
    if len(view) == 0:
        return crc
    return int(google_crc32c.extend(crc, view))


def crc32c_hex(data: bytes | bytearray | memoryview) -> str:
    return f"{crc32c_extend(0, data):08x}"


def object_checksum(path: str, data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """crc32c of the object's chain-relative path (UTF-8) followed by its bytes.

    Seeding with the path matters: a Zarr chunk ends with its own crc32c, and the crc32c of
    any message followed by its own crc32c is a constant, so an unseeded checksum would be
    the same for every intact chunk. Seeded, it still depends only on the path and size for
    an intact chunk (spec §21.5): it catches damage and objects moved between paths, while
    the chunk's own crc32c vouches for its content.
    """
    return object_checksum_parts(path, (data,))


def object_checksum_parts(path: str, parts: Iterable[bytes | bytearray | memoryview | np.ndarray]) -> str:
    """:func:`object_checksum` of the object made of ``parts`` back to back, without joining them."""
    crc = crc32c_extend(0, path.encode())
    for part in parts:
        crc = crc32c_extend(crc, part)
    return f"{crc:08x}"


def with_checksum(doc: dict[str, Any]) -> dict[str, Any]:
    """Return ``doc`` with its ``checksum`` field set (crc32c of the canonical form without it)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return {**body, "checksum": crc32c_hex(canonical(body))}


def verify_checksum(doc: dict[str, Any], where: str) -> None:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    expected = crc32c_hex(canonical(body))
    if doc.get("checksum") != expected:
        raise CorruptChainError(f"{where}: checksum mismatch (the file was modified or damaged)")
