"""CRC-32C, the checksum every object of a chain is verified with (spec §6.3), computed while
the object streams through a store."""

from __future__ import annotations

import google_crc32c
import numpy as np


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
