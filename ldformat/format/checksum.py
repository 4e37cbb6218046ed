"""Object checksums and checksummed JSON documents (spec §6.3 "Checksums")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import CorruptChainError
from ..stores.crc32c import crc32c_extend, crc32c_hex
from .jsonvalue import JSON, JSONObject, canonical


def object_checksum(path: str, data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """crc32c of the object's chain-relative path (UTF-8) followed by its bytes.

    Seeding with the path matters: a Zarr chunk ends with its own crc32c, and the crc32c of
    any message followed by its own crc32c is a constant, so an unseeded checksum would be
    the same for every intact chunk. Seeded, it still depends only on the path and size for
    an intact chunk (spec §21.5): it catches damage and objects moved between paths, while
    the chunk's own crc32c vouches for its content.
    """
    return object_checksum_parts(path, (data,))


def object_checksum_seed(path: str) -> int:
    """The crc32c an object's checksum continues from: that of its path (:func:`object_checksum`)."""
    return crc32c_extend(0, path.encode())


def object_checksum_parts(path: str, parts: Iterable[bytes | bytearray | memoryview | np.ndarray]) -> str:
    """:func:`object_checksum` of the object made of ``parts`` back to back, without joining them."""
    crc = object_checksum_seed(path)
    for part in parts:
        crc = crc32c_extend(crc, part)
    return f"{crc:08x}"


def with_checksum(doc: Mapping[str, JSON]) -> JSONObject:
    """Return ``doc`` with its ``checksum`` field set (crc32c of the canonical form without it)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return {**body, "checksum": crc32c_hex(canonical(body))}


def verify_checksum(doc: Mapping[str, JSON], where: str) -> None:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    expected = crc32c_hex(canonical(body))
    if doc.get("checksum") != expected:
        raise CorruptChainError(f"{where}: checksum mismatch (the file was modified or damaged)")
