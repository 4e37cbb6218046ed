"""The Zarr v3 profile of a delta batch (spec §10.2 "Zarr profile", limits of §10.5 "Decoding a batch").

What a writer writes: the metadata and codec chain of each array (``bytes`` -> ``blosc`` ->
``crc32c``, ``CHUNK_BYTES`` chunks) with its blosc settings. What a reader accepts: the
metadata of a group and its arrays, strictly parsed (:class:`ProfileArray`), the codec chains
whose decompressed sizes can be bounded before decompressing, every chunk listed, and the
sizes a batch may have.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeGuard

import google_crc32c
import numpy as np
import zarr
from numcodecs import Blosc, Zstd
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.storage import MemoryStore

from ...errors import CorruptChainError
from ..jsonvalue import JSON, MAX_ZARR_JSON_BYTES, JSONObject, parse_json

CHUNK_BYTES = 8 << 20


class BloscOptions(TypedDict, total=False):
    """Keyword arguments of zarr's ``BloscCodec`` besides ``typesize``."""

    cname: Literal["zstd", "lz4"]
    clevel: int
    shuffle: Literal["noshuffle", "shuffle", "bitshuffle"]
    blocksize: int


# Measured (docs/implementation-notes.md "Codec ratios"): bitshuffle+zstd on gap-coded indices,
# byte shuffle+zstd on values.
INDEX_CODECS: BloscOptions = {"cname": "zstd", "clevel": 3, "shuffle": "bitshuffle"}
# 1 MiB blosc blocks: on a 30M-parameter xor delta, ratio 0.787 -> 0.742 and encode 0.85 -> 0.44
# core-s (benchmarks/, "Value codec variants").
VALUE_CODECS: BloscOptions = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}
COUNT_CODECS: BloscOptions = {"cname": "zstd", "clevel": 3, "shuffle": "shuffle"}
# Batches of Adam-predicted state.xor rows (format 1.6), mostly small integers after the
# zigzag: on a 29.5M AdamW step lz4 stores 0.297 of the raw bytes against zstd's 0.270 at half
# the CPU (0.126 against 0.239 core-s to encode, 0.073 against 0.119 to decode); on plain
# differences (no prediction) it would store 13% more than zstd, which they keep. clevel 3
# (lz4 acceleration 7) encodes 10% faster than 5 for 0.2% more bytes (docs/implementation-notes.md
# "Codec ratios").
DIFFERENCE_VALUE_CODECS: BloscOptions = {"cname": "lz4", "clevel": 3, "shuffle": "shuffle", "blocksize": 1 << 20}


# Counts entries of one batch: rows x slots, so `counts` holds at most 128 MiB (spec §10.5).
MAX_COUNTS = 1 << 24
# Indices are stored as uint32 gaps, and every index is below 2^32 (spec §10.1).
MAX_SPARSE_INDEX = 1 << 32
# Per array, the elements all rows of a batch hold together (a sanity bound: 2^48 elements).
MAX_ARRAY_ELEMENTS = 1 << 48


def create_profile_array(store: MemoryStore, name: str, shape: tuple[int, ...], dtype: np.dtype, codec: BloscOptions,
            data: np.ndarray | None = None) -> None:
    """Create an array in ``store``: its metadata, and its chunks if ``data`` is given."""
    width = np.dtype(dtype).itemsize
    if len(shape) == 1:
        chunks: tuple[int, ...] = (max(1, min(shape[0], CHUNK_BYTES // width)),)
    else:
        chunks = tuple(max(1, s) for s in shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.create_array(
            store,
            name=name,
            # zarr takes the data, or else the shape and dtype
            data=data,
            shape=None if data is not None else shape,
            dtype=None if data is not None else dtype,
            chunks=chunks,
            compressors=[BloscCodec(typesize=width, **codec), Crc32cCodec()],
            fill_value=0,
            # Every chunk is written, so a reader can insist that every chunk exists:
            # zarr would silently read a missing chunk as the fill value.
            config={"write_empty_chunks": True},
        )


def shape_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n



# -- decoding -----------------------------------------------------------------------------
# Every array's metadata is checked against `rows`, the slots and (once `counts` is decoded)
# the counts before any chunk of it is decompressed, and every chunk's declared decompressed
# size against the size its chunk shape gives (spec §10.2, §10.5). Arrays in the codec chain
# 1.0 writers use (bytes -> blosc -> crc32c) are then decoded directly: each chunk's crc32c is
# checked, then numcodecs decompresses it (without the GIL, so chunks decode in parallel).
# Other chains of the codecs whose output size can be bounded go through zarr.
_ARRAY_DTYPES = {"counts": "int64", "indices": "uint32", "values_u8": "uint8", "values_u16": "uint16",
                 "values_u32": "uint32", "values_u64": "uint64"}
_PROFILE_DTYPES = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "int64": "<i8"}
# Codecs the zarr path accepts: each one's output size can be checked before or while decoding.
_BOUNDED_CODECS = {"bytes", "transpose", "crc32c", "blosc", "gzip", "zstd"}


def is_count(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


@dataclass
class ProfileArray:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    codecs: list[JSONObject]
    profile: bool = True

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    @property
    def chunk_bytes(self) -> int:
        return shape_numel(self.chunks) * self.dtype.itemsize

    @classmethod
    def parse(cls, name: str, raw: bytes | np.ndarray, where: str) -> ProfileArray:
        """The array's metadata, strictly parsed and checked for the array ``name`` (spec §10.2)."""
        key = f"{name}/zarr.json"
        meta: JSON = parse_json(np.asarray(raw, np.uint8).tobytes() if isinstance(raw, np.ndarray) else raw,
                                f"{where}/{key}", max_bytes=MAX_ZARR_JSON_BYTES, tagged=False)

        def bad(why: str) -> CorruptChainError:
            return CorruptChainError(f"{where}/{key}: {why} (spec §10.2)")

        if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
            raise bad("not Zarr v3 array metadata")
        if meta.get("data_type") != _ARRAY_DTYPES[name]:
            raise bad(f"data_type {meta.get('data_type')!r}; {name} is {_ARRAY_DTYPES[name]}")
        grid, keys, codecs = meta.get("chunk_grid"), meta.get("chunk_key_encoding"), meta.get("codecs")
        shape = meta.get("shape")
        conf = grid.get("configuration") if isinstance(grid, dict) else None
        chunks = conf.get("chunk_shape") if isinstance(conf, dict) else None
        if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(chunks, list):
            raise bad("the chunk grid is not a regular grid")
        shape_t = tuple(s for s in shape if is_count(s)) if isinstance(shape, list) else ()
        if not isinstance(shape, list) or len(shape_t) != len(shape):
            raise bad(f"shape {shape!r} is not a list of non-negative integers")
        chunks_t = tuple(c for c in chunks if is_count(c))
        if len(chunks) != len(shape) or len(chunks_t) != len(chunks) or not all(
                1 <= c <= max(1, s) for c, s in zip(chunks_t, shape_t, strict=False)):
            raise bad(f"chunk shape {chunks!r} does not fit shape {shape}: every chunk dimension is at least 1 "
                      "and at most the array's dimension (or 1)")
        if len(shape) != (2 if name == "counts" else 1):
            raise bad(f"{name} has {len(shape)} dimensions")
        named: list[JSONObject] = []
        names: list[str] = []
        for c in codecs if isinstance(codecs, list) else ():
            codec_name = c.get("name") if isinstance(c, dict) else None
            if isinstance(c, dict) and isinstance(codec_name, str):
                named.append(c)
                names.append(codec_name)
        if not isinstance(codecs, list) or len(named) != len(codecs):
            raise bad("malformed codecs")
        unknown = sorted(set(names) - _BOUNDED_CODECS)
        if unknown or names.count("bytes") != 1 or any(n == "transpose" for n in names[names.index("bytes"):]):
            raise bad(f"codec chain {names}: this reader decodes only bytes, transpose, crc32c, blosc, gzip and "
                      "zstd, whose decompressed sizes it can check before decompressing")
        bytes_conf = named[0].get("configuration") or {}
        key_conf = (keys.get("configuration") or {}) if isinstance(keys, dict) else {}
        profile = (names == ["bytes", "blosc", "crc32c"] and isinstance(bytes_conf, dict)
                   and bytes_conf.get("endian", "little") == "little"
                   and isinstance(keys, dict) and keys.get("name") == "default"
                   and isinstance(key_conf, dict) and key_conf.get("separator", "/") == "/"
                   and not meta.get("storage_transformers")
                   and (len(shape_t) == 1 or all(s <= c for s, c in zip(shape_t, chunks_t, strict=True))))
        return cls(name, np.dtype(_PROFILE_DTYPES[_ARRAY_DTYPES[name]]), shape_t, chunks_t, named, profile)

    def decode_chunk(self, data: bytes | np.ndarray, key: str, where: str, out: np.ndarray | None = None) -> np.ndarray:
        """The chunk's elements (in ``out``, exactly one chunk long, when given: no allocation)."""
        buf = np.frombuffer(data, np.uint8)
        if buf.shape[0] < 4 or google_crc32c.extend(0, buf[:-4]) != int.from_bytes(buf[-4:].tobytes(), "little"):
            raise CorruptChainError(f"{where}: chunk {key} fails its crc32c codec check")
        n = shape_numel(self.chunks)
        _check_blosc_frame(buf[:-4], n * self.dtype.itemsize, key, where)
        if out is not None:  # the header declared exactly the chunk's size: blosc writes nothing past it
            if out.dtype != self.dtype or out.size != n or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out is not one writable chunk of the array's dtype")
            try:
                _BLOSC.decode(buf[:-4], out=out.reshape(-1).view(np.uint8))
            except Exception as e:
                raise CorruptChainError(f"{where}: chunk {key} does not decompress ({e})") from None
            return out.reshape(self.chunks)
        try:
            raw = _BLOSC.decode(buf[:-4])
        except Exception as e:
            raise CorruptChainError(f"{where}: chunk {key} does not decompress ({e})") from None
        if len(raw) != n * self.dtype.itemsize:
            raise CorruptChainError(f"{where}: chunk {key} holds {len(raw)} bytes, expected {n * self.dtype.itemsize}")
        return np.frombuffer(raw, self.dtype).reshape(self.chunks)

    def read(self, objects: Mapping[str, bytes | np.ndarray], span: range | None, where: str,
             pool: ThreadPoolExecutor | None, out: np.ndarray | None = None,
             cache: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Elements ``span`` of a 1-D array, or the whole array (one chunk) when ``span`` is None.

        With ``out`` (at least ``len(span)`` elements of the array's dtype), the elements go
        there: a chunk that lies wholly inside ``span`` is decompressed in place, with no
        intermediate buffer. ``cache`` keeps, from one call to the next, the decoded chunk
        that ``span`` ends in, so that reading the rows of a batch one after another
        decompresses every chunk once.
        """
        if span is None:
            if 0 in self.shape:
                return np.zeros(self.shape, self.dtype)
            key = f"{self.name}/c/" + "/".join("0" for _ in self.shape)
            whole = self.decode_chunk(objects[key], key, where)
            return np.ascontiguousarray(whole[tuple(slice(0, s) for s in self.shape)])
        out = np.empty(len(span), self.dtype) if out is None else out[: len(span)]
        (c,) = self.chunks

        def one(i: int) -> None:
            key = f"{self.name}/c/{i}"
            lo, hi = max(span.start, i * c), min(span.stop, (i + 1) * c)
            if lo == i * c and hi == (i + 1) * c:  # the whole chunk: straight into out
                self.decode_chunk(objects[key], key, where, out[lo - span.start : hi - span.start])
                return
            values = cache.get(i) if cache is not None else None
            if values is None:
                values = self.decode_chunk(objects[key], key, where)
            out[lo - span.start : hi - span.start] = values[lo - i * c : hi - i * c]
            if cache is not None and hi < (i + 1) * c:
                cache.clear()
                cache[i] = values  # the next span starts in this chunk

        indices = range(span.start // c, -(-span.stop // c))
        if pool is None or len(indices) < 2:
            for i in indices:
                one(i)
        else:
            for f in [pool.submit(one, i) for i in indices]:
                f.result()
        return out


_BLOSC = Blosc()  # decoding reads the codec settings from each chunk's blosc header
_BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


def _check_blosc_frame(frame: bytes | np.ndarray, expected: int, key: str, where: str, *, exact: bool = True) -> None:
    """The blosc frame header against the size the chunk must decompress to, before decompressing it."""
    if len(frame) < _BLOSC_HEADER.size:
        raise CorruptChainError(f"{where}: chunk {key} is not a blosc frame (shorter than its 16-byte header)")
    head = frame[: _BLOSC_HEADER.size]
    _, _, _, typesize, nbytes, blocksize, cbytes = _BLOSC_HEADER.unpack(
        head.tobytes() if isinstance(head, np.ndarray) else bytes(head))
    if nbytes != expected if exact else nbytes > expected:
        raise CorruptChainError(f"{where}: chunk {key} declares {nbytes} decompressed bytes; its chunk shape gives "
                                f"{expected} (spec §10.2); refused before decompressing")
    if cbytes != len(frame) or typesize < 1 or blocksize > max(1, nbytes):
        raise CorruptChainError(f"{where}: chunk {key} has a malformed blosc header (compressed size {cbytes} of "
                                f"{len(frame)} bytes, typesize {typesize}, blocksize {blocksize})")


def _zstd_content_size(frame: bytes) -> int | None:
    """The Frame_Content_Size of a zstd frame's header (RFC 8878), or None if the header lacks it."""
    if len(frame) < 6 or frame[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = frame[4]
    single = (fhd >> 5) & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if size == 0 or len(frame) < pos + size:
        return None
    return int.from_bytes(frame[pos : pos + size], "little") + (256 if size == 2 else 0)


def check_bounded(array: ProfileArray, data: bytes | np.ndarray, key: str, where: str) -> None:
    """Undo the bytes-to-bytes codecs of a chunk with every output bounded (zarr path; spec §10.2).

    The innermost output must be exactly the chunk's size, every other at most twice that plus
    4 KiB; zarr decodes the chunk again afterwards, knowing it is within bounds.
    """
    names = [c["name"] for c in array.codecs]
    chain = array.codecs[names.index("bytes") + 1 :]
    expected = array.chunk_bytes
    buf = np.asarray(data, np.uint8).tobytes() if isinstance(data, np.ndarray) else bytes(data)
    for i, codec in enumerate(reversed(chain)):
        last = i == len(chain) - 1
        limit = expected if last else 2 * expected + 4096
        name = codec["name"]
        try:
            if name == "crc32c":
                if len(buf) < 4 or google_crc32c.value(buf[:-4]) != int.from_bytes(buf[-4:], "little"):
                    raise CorruptChainError(f"{where}: chunk {key} fails its crc32c codec check")
                buf = buf[:-4]
            elif name == "blosc":
                _check_blosc_frame(buf, limit, key, where, exact=last)
                buf = bytes(_BLOSC.decode(buf))
            elif name == "gzip":
                d = zlib.decompressobj(wbits=31)
                out = d.decompress(buf, limit + 1)
                if len(out) > limit or not d.eof or d.unused_data or d.unconsumed_tail:
                    raise CorruptChainError(f"{where}: chunk {key} is not one gzip member of at most {limit} "
                                            "decompressed bytes (spec §10.2); refused")
                buf = out
            elif name == "zstd":
                size = _zstd_content_size(buf)
                if size is None or size > limit:
                    raise CorruptChainError(f"{where}: chunk {key} is a zstd frame without a content size of at "
                                            f"most {limit} bytes (spec §10.2); refused before decompressing")
                buf = bytes(Zstd().decode(buf))
        except CorruptChainError:
            raise
        except Exception as e:
            raise CorruptChainError(f"{where}: chunk {key} does not decompress ({name}: {e})") from None
    if len(buf) != expected:
        raise CorruptChainError(f"{where}: chunk {key} holds {len(buf)} bytes, expected {expected}")


def array_metadata(objects: Mapping[str, bytes | np.ndarray], where: str) -> dict[str, ProfileArray]:
    """Every array of the group, its metadata strictly parsed and checked (spec §10.2)."""
    if "zarr.json" not in objects:
        raise CorruptChainError(f"{where}: the group metadata zarr.json is not listed (spec §10.2)")
    raw = objects["zarr.json"]
    group: JSON = parse_json(np.asarray(raw, np.uint8).tobytes() if isinstance(raw, np.ndarray) else raw,
                             f"{where}/zarr.json", max_bytes=MAX_ZARR_JSON_BYTES, tagged=False)
    if not isinstance(group, dict) or group.get("zarr_format") != 3 or group.get("node_type") != "group":
        raise CorruptChainError(f"{where}/zarr.json: not Zarr v3 group metadata (spec §10.2)")
    arrays = {}
    for key in objects:
        parts = key.split("/")
        if parts[-1] != "zarr.json" or len(parts) == 1:
            continue
        if len(parts) != 2 or parts[0] not in _ARRAY_DTYPES:
            raise CorruptChainError(f"{where}: {key} is not the metadata of a batch array (a batch holds only "
                                    f"{', '.join(_ARRAY_DTYPES)}; spec §10.2)")
        arrays[parts[0]] = ProfileArray.parse(parts[0], objects[key], where)
    return arrays


def profile_arrays(objects: Mapping[str, bytes | np.ndarray], where: str) -> dict[str, ProfileArray] | None:
    """Every array of the group, if all use the 1.0 codec chain (else None: decode with zarr)."""
    arrays = array_metadata(objects, where)
    return arrays if all(a.profile for a in arrays.values()) else None


def check_listed(name: str, grid: tuple[int, ...], objects: Mapping[str, object], where: str) -> None:
    # Zarr would read an unlisted (missing) chunk as fill value: refuse it (spec §10.2).
    chunks = shape_numel(grid)
    if chunks > len(objects):  # before enumerating a grid a hostile shape makes huge
        raise CorruptChainError(f"{where}: {name} has {chunks} chunks; the commit record lists {len(objects)} "
                                "objects in all")
    for coords in np.ndindex(*grid):
        key = f"{name}/c/" + "/".join(map(str, coords))
        if key not in objects:
            raise CorruptChainError(f"{where}: chunk {key} is not listed in the commit record")
