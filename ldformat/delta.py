"""Delta batches as Zarr v3 groups (spec §10, "Deltas").

A batch holds the deltas of consecutive steps, one *row* per step, over a list of *slots*
(tensors). Everything is flat and concatenated so that a batch costs a handful of arrays,
not one array per tensor per step:

    counts     int64[rows, slots]   elements stored for (row, slot); -1 = absent
    indices    uint32[...]          sparse slots: sorted flat indices, gap-coded per segment
    values_u8 / values_u16 / values_u32 / values_u64
                                    the raw bits of the values, grouped by element width

Segments are laid out row-major (row 0 slot 0, row 0 slot 1, ...). Every array ends its
codec chain with ``crc32c``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from .errors import CorruptChainError
from .manifest import SlotInfo
from .state import bits_view

WIDTH_DTYPES: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CHUNK_BYTES = 8 << 20
# Measured (spec §23, "Codec ratios"): bitshuffle+zstd on gap-coded indices, byte shuffle+zstd on values.
INDEX_CODECS = {"cname": "zstd", "clevel": 3, "shuffle": "bitshuffle"}
# 1 MiB blosc blocks: on a 30M-parameter xor delta, ratio 0.787 -> 0.742 and encode 0.85 -> 0.44
# core-s (benchmarks/, "Value codec variants").
VALUE_CODECS = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}
COUNT_CODECS = {"cname": "zstd", "clevel": 3, "shuffle": "shuffle"}

Segment = tuple[np.ndarray | None, np.ndarray]  # (sorted int64 indices or None, raw bits)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a CPU tensor as a flat unsigned numpy array (no copy if contiguous)."""
    flat = bits_view(t.detach().contiguous()).reshape(-1)
    return flat.numpy().view(WIDTH_DTYPES[t.element_size()])


def _create(store: MemoryStore, name: str, shape: tuple[int, ...], dtype: Any, codec: dict[str, Any],
            data: np.ndarray | None = None) -> None:
    """Create an array in ``store``: its metadata, and its chunks if ``data`` is given."""
    width = np.dtype(dtype).itemsize
    if len(shape) == 1:
        chunks: tuple[int, ...] = (max(1, min(shape[0], CHUNK_BYTES // width)),)
    else:
        chunks = tuple(max(1, s) for s in shape)
    source: dict[str, Any] = {"data": data} if data is not None else {"shape": shape, "dtype": dtype}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.create_array(
            store,
            name=name,
            **source,
            chunks=chunks,
            compressors=[BloscCodec(typesize=width, **codec), Crc32cCodec()],
            fill_value=0,
            # Every chunk is written, so a reader can insist that every chunk exists:
            # zarr would silently read a missing chunk as the fill value.
            config={"write_empty_chunks": True},
        )


def gap_code(idx: np.ndarray) -> np.ndarray:
    """Sorted flat indices as uint32 gaps: the first absolute, then differences (spec §10.1)."""
    gaps = np.empty(idx.shape[0], dtype=np.uint32)
    if idx.shape[0]:
        gaps[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    return gaps


class ArrayEncoder:
    """Encodes one 1-D batch array incrementally, byte-identical to zarr writing it whole.

    Each chunk is compressed as soon as its elements have arrived, so the encoder holds only
    compressed chunks plus fewer than one chunk of pending elements. The chunk length is
    ``CHUNK_BYTES / width`` unless the whole array is shorter (spec §10.2); that case is
    one chunk, compressed by :meth:`finish` once the length is known.
    """

    def __init__(self, width: int, codec: dict[str, Any]) -> None:
        self.dtype = np.dtype(WIDTH_DTYPES[width])
        self.codec = codec
        self.size = 0
        self._chunk = max(1, CHUNK_BYTES // width)
        # The numcodecs Blosc that zarr's BloscCodec would use (its typesize handling differs
        # between numcodecs versions), so the bytes are zarr's.
        self._blosc = BloscCodec(typesize=width, **codec)._blosc_codec
        self._chunks: list[bytes] = []
        self._pending: np.ndarray | None = None  # one reused chunk-sized buffer
        self._fill = 0

    def append(self, data: np.ndarray) -> None:
        """Add elements at the end; ``data`` may be reused by the caller once this returns."""
        data = np.ascontiguousarray(data, dtype=self.dtype.newbyteorder("<")).reshape(-1)  # `bytes` codec: little
        n, pos, chunk = data.shape[0], 0, self._chunk
        if self._fill:  # top up the pending chunk first
            pos = min(n, chunk - self._fill)
            self._buffer()[self._fill : self._fill + pos] = data[:pos]
            self._fill += pos
            if self._fill == chunk:
                self._compress(self._buffer())
                self._fill = 0
        while n - pos >= chunk:  # whole chunks inside ``data``: compressed from a view, no copy
            self._compress(data[pos : pos + chunk])
            pos += chunk
        if pos < n:  # here the pending buffer is empty
            self._buffer()[: n - pos] = data[pos:]
            self._fill = n - pos
        self.size += n

    def finish(self, name: str) -> dict[str, bytes]:
        """The chunk objects ``<name>/c/<i>``, the last one padded with the fill value as zarr does."""
        if self._fill:
            pending = self._buffer()
            if self._chunks:
                pending[self._fill :] = 0
                self._compress(pending)
            else:  # the whole array is shorter than a chunk: one chunk of exactly its length
                self._compress(pending[: self._fill])
            self._fill = 0
        self._pending = None
        return {f"{name}/c/{i}": data for i, data in enumerate(self._chunks)}

    def _buffer(self) -> np.ndarray:
        if self._pending is None:
            self._pending = np.empty(self._chunk, dtype=self.dtype.newbyteorder("<"))
        return self._pending

    def _compress(self, chunk: np.ndarray) -> None:
        # codec chain bytes -> blosc -> crc32c, as zarr's codecs do it; crc32c appends the checksum little-endian
        data = self._blosc.encode(chunk.view(np.uint8))
        self._chunks.append(data + int(google_crc32c.value(data)).to_bytes(4, "little"))


class BatchEncoder:
    """Encodes a delta batch row by row (spec §10.1); values are compressed as they arrive.

    Per row: :meth:`start_row`, then :meth:`add` for its segments in increasing slot order
    (segment order). :meth:`finish` returns the objects of the group.
    """

    def __init__(self) -> None:
        self.counts: list[dict[int, int]] = []  # per row: slot -> elements stored
        self._indices: ArrayEncoder | None = None  # exists iff a sparse segment was added
        self._values: dict[int, ArrayEncoder] = {}

    @property
    def rows(self) -> int:
        return len(self.counts)

    def start_row(self) -> None:
        self.counts.append({})

    def add(self, slot: int, values: np.ndarray, indices: np.ndarray | None = None) -> None:
        """Add the segment of ``slot`` to the current row; the arrays may be reused afterwards."""
        row = self.counts[-1]
        if row and slot <= next(reversed(row)):
            raise ValueError(f"slot {slot} added after slot {next(reversed(row))}: segments go in slot order")
        row[slot] = values.shape[0]
        if indices is not None:
            if self._indices is None:
                self._indices = ArrayEncoder(4, INDEX_CODECS)
            self._indices.append(gap_code(indices))
        width = values.dtype.itemsize
        encoder = self._values.get(width)
        if encoder is None:
            encoder = self._values[width] = ArrayEncoder(width, VALUE_CODECS)
        encoder.append(values)

    def finish(self, n_slots: int, attributes: dict[str, Any]) -> dict[str, bytes]:
        """The objects of the group, {relative key: bytes}; the encoder is spent afterwards."""
        counts = np.full((len(self.counts), n_slots), -1, dtype=np.int64)
        for r, row in enumerate(self.counts):
            for j, n in row.items():
                counts[r, j] = n
        arrays = [("indices", self._indices)] if self._indices is not None else []
        arrays += [(f"values_u{w * 8}", e) for w, e in sorted(self._values.items()) if e.size]
        store = MemoryStore({})
        zarr.open_group(store, mode="w", attributes={"ldformat": attributes})
        _create(store, "counts", counts.shape, counts.dtype, COUNT_CODECS, counts)
        chunks: dict[str, bytes] = {}
        for name, encoder in arrays:
            _create(store, name, (encoder.size,), encoder.dtype, encoder.codec)  # metadata only
            chunks.update(encoder.finish(name))
        self._values, self._indices = {}, None
        return {**{key: buf.to_bytes() for key, buf in store._store_dict.items()}, **chunks}


def encode_batch(slots: list[SlotInfo], rows: list[dict[int, Segment]], attributes: dict[str, Any]) -> dict[str, bytes]:
    """Encode rows into the objects of one Zarr group: {relative key: bytes}."""
    encoder = BatchEncoder()
    for row in rows:
        encoder.start_row()
        for j in sorted(row):
            idx, vals = row[j]
            encoder.add(j, vals, idx)
    return encoder.finish(len(slots), attributes)


@dataclass
class DecodedBatch:
    """A decoded batch (or the rows of it a replay needs); :meth:`row` returns one step's segments."""

    slots: tuple[SlotInfo, ...]
    counts: np.ndarray
    segments: dict[int, dict[int, Segment]]

    def row(self, r: int) -> dict[str, Segment]:
        if r not in self.segments:
            raise KeyError(f"row {r} was not decoded (decoded rows: {sorted(self.segments)})")
        return {self.slots[j].name: seg for j, seg in self.segments[r].items()}


def _slot_widths(slots: tuple[SlotInfo, ...]) -> np.ndarray:
    return np.array([torch.empty(0, dtype=_torch_dtype(s.dtype)).element_size() for s in slots], dtype=np.int64)


def _element_ranges(counts: np.ndarray, slots: tuple[SlotInfo, ...], first: int, stop: int) -> dict[str, range]:
    """Element ranges of each 1-D array that rows ``first .. stop-1`` occupy (segment order)."""
    present = np.maximum(counts, 0)
    widths = _slot_widths(slots)
    sparse = np.array([s.encoding == "sparse" for s in slots], dtype=bool)
    out = {}
    for name, columns in [(f"values_u{w * 8}", widths == w) for w in WIDTH_DTYPES] + [("indices", sparse)]:
        per_row = present[:, columns].sum(axis=1) if len(slots) else np.zeros(counts.shape[0], np.int64)
        out[name] = range(int(per_row[:first].sum()), int(per_row[:stop].sum()))
    return out


# -- decoding -----------------------------------------------------------------------------
# Arrays in the codec chain 1.0 writers use (bytes -> blosc -> crc32c) are decoded directly:
# each chunk's crc32c is checked, then numcodecs decompresses it (without the GIL, so chunks
# decode in parallel). Anything else goes through zarr, which supports every Zarr v3 codec.
_PROFILE_DTYPES = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "int64": "<i8"}


@dataclass
class _ProfileArray:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[int, ...]

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    @classmethod
    def parse(cls, name: str, raw: bytes | np.ndarray) -> _ProfileArray | None:
        """The array, if its metadata uses the 1.0 codec chain and a simple chunk layout."""
        try:
            meta = json.loads(bytes(raw))
            grid, keys, codecs = meta["chunk_grid"], meta["chunk_key_encoding"], meta["codecs"]
            dtype = _PROFILE_DTYPES.get(meta["data_type"])
            shape = tuple(int(s) for s in meta["shape"])
            chunks = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
            ok = (meta["zarr_format"] == 3 and meta["node_type"] == "array" and dtype is not None
                  and grid["name"] == "regular" and keys["name"] == "default"
                  and keys.get("configuration", {}).get("separator", "/") == "/"
                  and not meta.get("storage_transformers")
                  and [c["name"] for c in codecs] == ["bytes", "blosc", "crc32c"]
                  and codecs[0].get("configuration", {}).get("endian", "little") == "little"
                  and len(shape) == len(chunks) and all(c > 0 for c in chunks) and all(s >= 0 for s in shape))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # let zarr parse (and reject) it
        if not ok or not (len(shape) == 1 or all(s <= c for s, c in zip(shape, chunks, strict=True))):
            return None  # N-D arrays of more than one chunk: zarr
        return cls(name, np.dtype(dtype), shape, chunks)

    def decode_chunk(self, data: bytes | np.ndarray, key: str, where: str) -> np.ndarray:
        buf = np.frombuffer(data, np.uint8)
        if buf.shape[0] < 4 or google_crc32c.extend(0, buf[:-4]) != int.from_bytes(buf[-4:].tobytes(), "little"):
            raise CorruptChainError(f"{where}: chunk {key} fails its crc32c codec check")
        try:
            raw = _BLOSC.decode(buf[:-4])
        except Exception as e:
            raise CorruptChainError(f"{where}: chunk {key} does not decompress ({e})") from None
        n = int(np.prod(self.chunks))
        if len(raw) != n * self.dtype.itemsize:
            raise CorruptChainError(f"{where}: chunk {key} holds {len(raw)} bytes, expected {n * self.dtype.itemsize}")
        return np.frombuffer(raw, self.dtype).reshape(self.chunks)

    def read(self, objects: Mapping[str, bytes | np.ndarray], span: range | None, where: str,
             pool: ThreadPoolExecutor | None) -> np.ndarray:
        """Elements ``span`` of a 1-D array, or the whole array (one chunk) when ``span`` is None."""
        if span is None:
            if 0 in self.shape:
                return np.zeros(self.shape, self.dtype)
            key = f"{self.name}/c/" + "/".join("0" for _ in self.shape)
            whole = self.decode_chunk(objects[key], key, where)
            return np.ascontiguousarray(whole[tuple(slice(0, s) for s in self.shape)])
        out = np.empty(len(span), self.dtype)
        (c,) = self.chunks

        def one(i: int) -> None:
            key = f"{self.name}/c/{i}"
            values = self.decode_chunk(objects[key], key, where)
            lo, hi = max(span.start, i * c), min(span.stop, (i + 1) * c)
            out[lo - span.start : hi - span.start] = values[lo - i * c : hi - i * c]

        indices = range(span.start // c, -(-span.stop // c))
        if pool is None or len(indices) < 2:
            for i in indices:
                one(i)
        else:
            for f in [pool.submit(one, i) for i in indices]:
                f.result()
        return out


_BLOSC = Blosc()  # decoding reads the codec settings from each chunk's blosc header


def _profile_arrays(objects: Mapping[str, bytes | np.ndarray], where: str) -> dict[str, _ProfileArray] | None:
    """Every array of the group, if all use the 1.0 codec chain (else None: decode with zarr)."""
    try:
        group = json.loads(bytes(objects["zarr.json"]))
        if group.get("zarr_format") != 3 or group.get("node_type") != "group":
            return None
    except (KeyError, ValueError, AttributeError):
        return None
    arrays = {}
    for key in objects:
        parts = key.split("/")
        if len(parts) == 2 and parts[1] == "zarr.json":
            array = _ProfileArray.parse(parts[0], objects[key])
            if array is None:
                return None
            arrays[parts[0]] = array
        elif len(parts) > 2 and parts[-1] == "zarr.json":
            return None  # nested groups are not in the format: let zarr decide
    return arrays


def decode_batch(
    objects: Mapping[str, bytes | np.ndarray], slots: tuple[SlotInfo, ...], rows: int, where: str,
    wanted: range | None = None,
) -> DecodedBatch:
    """Decode the rows ``wanted`` (default: all) of one group.

    ``objects`` maps every listed key to its verified bytes; it may be lazy: only the
    metadata, ``counts`` and the chunks holding the wanted rows are looked up.
    """
    wanted = range(rows) if wanted is None else wanted
    arrays = _profile_arrays(objects, where)
    if arrays is None:
        counts, data = _decode_with_zarr(objects, slots, rows, where, wanted)
    else:
        counts, data = _decode_profile(arrays, objects, slots, rows, where, wanted)
    return DecodedBatch(slots=slots, counts=counts, segments=_segments(data, counts, slots, wanted, where))


def _check_listed(name: str, grid: tuple[int, ...], objects: Mapping[str, Any], where: str) -> None:
    # Zarr would read an unlisted (missing) chunk as fill value: refuse it (spec §10.2).
    for coords in np.ndindex(*grid):
        key = f"{name}/c/" + "/".join(map(str, coords))
        if key not in objects:
            raise CorruptChainError(f"{where}: chunk {key} is not listed in the commit record")


def _check_counts(counts: np.ndarray, rows: int, slots: tuple[SlotInfo, ...], where: str) -> None:
    if counts.shape != (rows, len(slots)) or counts.dtype != np.int64:
        raise CorruptChainError(f"{where}: counts array missing or of the wrong shape")


def _check_span(name: str, span: range, length: int, wanted: range, where: str) -> None:
    if span.stop > length:
        raise CorruptChainError(f"{where}: the segments of rows {wanted.start}..{wanted.stop - 1} run past the end "
                                f"of {name}")


def _decode_profile(arrays: dict[str, _ProfileArray], objects: Mapping[str, bytes | np.ndarray],
                    slots: tuple[SlotInfo, ...], rows: int, where: str,
                    wanted: range) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    for name, array in arrays.items():
        _check_listed(name, array.grid, objects, where)
    if "counts" not in arrays:
        raise CorruptChainError(f"{where}: counts array missing")
    counts = arrays["counts"].read(objects, None, where, None)
    _check_counts(counts, rows, slots, where)
    data: dict[str, np.ndarray] = {}
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()),
                            thread_name_prefix="ldformat-decode") as pool:
        for name, span in _element_ranges(counts, slots, wanted.start, wanted.stop).items():
            flat = arrays.get(name)
            if flat is None or not span:
                continue
            if len(flat.shape) != 1:
                raise CorruptChainError(f"{where}: {name} is not a 1-D array")
            _check_span(name, span, flat.shape[0], wanted, where)
            data[name] = flat.read(objects, span, where, pool)
    return counts, data


def _decode_with_zarr(objects: Mapping[str, bytes | np.ndarray], slots: tuple[SlotInfo, ...], rows: int,
                      where: str, wanted: range) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    proto = default_buffer_prototype()
    store = MemoryStore({})

    def load(keys: list[str]) -> None:
        for k in keys:
            if k not in store._store_dict:
                store._store_dict[k] = proto.buffer.from_array_like(np.frombuffer(objects[k], np.uint8))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load([k for k in objects if k == "zarr.json" or k.endswith("/zarr.json")])
            group = zarr.open_group(store, mode="r")
            arrays = {name: zarr.open_array(store, path=name, mode="r") for name in sorted(group.array_keys())}
            for name, array in arrays.items():
                _check_listed(name, array.cdata_shape, objects, where)
            if "counts" not in arrays:
                raise CorruptChainError(f"{where}: counts array missing")
            load([k for k in objects if k.startswith("counts/c/")])
            counts = np.asarray(arrays["counts"][...])
            _check_counts(counts, rows, slots, where)
            data: dict[str, np.ndarray] = {}
            for name, span in _element_ranges(counts, slots, wanted.start, wanted.stop).items():
                flat = arrays.get(name)
                if flat is None or not span:
                    continue
                _check_span(name, span, flat.shape[0], wanted, where)
                chunk = flat.chunks[0]
                load([f"{name}/c/{i}" for i in range(span.start // chunk, -(-span.stop // chunk))])
                data[name] = np.asarray(flat[span.start : span.stop])
    except CorruptChainError:  # includes a lazily read object that is missing or damaged
        raise
    except Exception as e:  # zarr raises many types for damaged data
        raise CorruptChainError(f"{where}: cannot decode delta batch ({type(e).__name__}: {e})") from None
    return counts, data


def _segments(data: dict[str, np.ndarray], counts: np.ndarray, slots: tuple[SlotInfo, ...], wanted: range,
              where: str) -> dict[int, dict[int, Segment]]:
    """Walk the segments of rows ``wanted`` (spec §10.5); ``data`` holds exactly their elements."""
    gaps = data.get("indices", np.empty(0, np.uint32))
    cum = np.cumsum(gaps, dtype=np.int64)
    widths = _slot_widths(slots)
    value_pos: dict[int, int] = {}
    index_pos = 0
    segments: dict[int, dict[int, Segment]] = {}
    for r in wanted:
        row: dict[int, Segment] = {}
        for j, slot in enumerate(slots):
            n = int(counts[r, j])
            if n < 0:
                continue
            width = int(widths[j])
            values = data.get(f"values_u{width * 8}", np.empty(0, WIDTH_DTYPES[width]))
            pos = value_pos.get(width, 0)
            if pos + n > values.shape[0]:
                raise CorruptChainError(f"{where}: values of {slot.name} (row {r}) run past the array")
            vals = values[pos : pos + n]
            value_pos[width] = pos + n
            idx = None
            if slot.encoding == "sparse":
                if index_pos + n > gaps.shape[0]:
                    raise CorruptChainError(f"{where}: indices of {slot.name} (row {r}) run past the array")
                base = cum[index_pos - 1] if index_pos else 0
                idx = cum[index_pos : index_pos + n] - base
                index_pos += n
                if n and (idx[-1] >= slot.numel or (n > 1 and np.any(gaps[index_pos - n + 1 : index_pos] == 0))):
                    raise CorruptChainError(f"{where}: indices of {slot.name} (row {r}) out of range or unsorted")
            elif n != slot.numel:
                raise CorruptChainError(f"{where}: {slot.name} (row {r}) has {n} values, expected {slot.numel}")
            row[j] = (idx, vals)
        segments[r] = row
    return segments


def _torch_dtype(name: str) -> torch.dtype:
    from .jsonvalue import parse_dtype

    return parse_dtype(name)


SIGNED_NP: dict[int, Any] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def segment_to_tensor(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """Rebuild a dense tensor from a segment (a new, writable tensor)."""
    dtype = _torch_dtype(slot.dtype)
    idx, vals = seg
    signed = np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize])
    if idx is None:
        bits = torch.from_numpy(signed.copy())
    else:
        bits = torch.zeros(slot.numel, dtype=torch.from_numpy(signed[:0]).dtype)
        bits[torch.from_numpy(idx)] = torch.from_numpy(signed)
    if dtype == torch.bool:
        return bits.view(torch.bool).reshape(slot.shape)
    return bits.view(dtype).reshape(slot.shape)


def dense_view(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """A dense segment as a tensor sharing the decoded values' memory (no copy)."""
    _, vals = seg
    if not (vals.flags.writeable and vals.flags.c_contiguous):
        vals = vals.copy()
    bits = torch.from_numpy(vals.view(SIGNED_NP[vals.dtype.itemsize]))
    return bits.view(_torch_dtype(slot.dtype)).reshape(slot.shape)


def fill_from_segment(out: torch.Tensor, seg: Segment) -> None:
    """Write a segment into an existing tensor of the slot's dtype and shape (no allocation)."""
    idx, vals = seg
    signed = torch.from_numpy(np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize]))
    view = bits_view(out).reshape(-1)
    if idx is None:
        view.copy_(signed)
    else:
        view.zero_()
        view[torch.from_numpy(idx)] = signed


def xor_into(target: torch.Tensor, seg: Segment) -> None:
    """``target ^= bits`` in place, on the raw bits of ``target``."""
    _, vals = seg
    signed = np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize])
    view = bits_view(target).reshape(-1)
    view.bitwise_xor_(torch.from_numpy(signed))
