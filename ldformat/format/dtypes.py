"""Dtype names (spec §5.6.4 "Dtypes"): the names a chain stores for torch dtypes."""

from __future__ import annotations

import torch

from ..errors import CorruptChainError, UnsupportedStateError

DTYPES: dict[str, torch.dtype] = {
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
    # format 1.2
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The spec's name of a torch dtype; raises UnsupportedStateError for others."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(f"dtype {dtype} is not supported by format 1.x") from None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptChainError(f"unknown dtype {name!r} in chain metadata") from None
