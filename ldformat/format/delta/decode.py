"""Decoding a delta batch (spec §10.5 "Decoding a batch").

:func:`decode_batch` decodes some rows of a batch, or all; :class:`RowDecoder` decodes them
one at a time into reused buffers for a replay. Both check the metadata, the listed chunks
and every count before any values chunk is decompressed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from ...errors import CorruptChainError
from ..manifest import SlotInfo
from .arith import WIDTH_DTYPES, Segment
from .profile import (
    MAX_ARRAY_ELEMENTS,
    MAX_COUNTS,
    MAX_SPARSE_INDEX,
    ProfileArray,
    array_metadata,
    check_bounded,
    check_listed,
)
from .slots import NP_DTYPES


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


def _slot_widths(slots: tuple[SlotInfo, ...], where: str = "batch") -> np.ndarray:
    widths = []
    for s in slots:
        dtype = NP_DTYPES.get(s.dtype) if isinstance(s.dtype, str) else None
        if dtype is None:
            raise CorruptChainError(f"{where}: slot {s.name} has dtype {s.dtype!r}, not one of spec §5.6.4")
        widths.append(np.dtype(dtype).itemsize)
    return np.array(widths, dtype=np.int64)


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


def decode_batch(
    objects: Mapping[str, bytes | np.ndarray], slots: tuple[SlotInfo, ...], rows: int, where: str,
    wanted: range | None = None,
) -> DecodedBatch:
    """Decode the rows ``wanted`` (default: all) of one group.

    ``objects`` maps every listed key to its verified bytes; it may be lazy: only the
    metadata, ``counts`` and the chunks holding the wanted rows are looked up. Nothing is
    decompressed before the metadata is checked against ``rows`` and the slots, and no values
    chunk before every count is checked against its slot (spec §10.5), so decoding some rows
    and decoding all of them agree on those rows, or fail alike on everything but the
    content of the other rows' chunks.
    """
    wanted = range(rows) if wanted is None else wanted
    arrays = decode_batch_checks(objects, slots, rows, where, wanted)
    if arrays is None:
        counts, data = _decode_with_zarr(objects, array_metadata(objects, where), slots, rows, where, wanted)
    else:
        counts, data = _decode_profile(arrays, objects, slots, rows, where, wanted)
    return DecodedBatch(slots=slots, counts=counts, segments=_segments(data, counts, slots, wanted, where))


class RowDecoder:
    """Decodes the rows of one batch one at a time, for a replay that uses each row once.

    The checks are those of :func:`decode_batch` (metadata, listed chunks, every count and
    array length before any values chunk is decompressed; spec §10.5), made once. :meth:`row`
    then decodes only the chunks that row needs, in parallel, each chunk of the batch once
    when rows are asked for in order, and decompresses them straight into buffers that are
    reused: the segments a row returns stay valid until ``buffers - 1`` further rows have
    been decoded (a replay takes what it keeps by copy). ``follows``: the decoder of the
    previous batch, whose buffers this one takes over, going on with its turns (a row of
    that batch still being replayed keeps its buffer). A group outside the 1.0 codec chain
    is decoded whole by :func:`decode_batch`.
    """

    def __init__(self, objects: Mapping[str, bytes | np.ndarray], slots: tuple[SlotInfo, ...], rows: int,
                 where: str, wanted: range, *, buffers: int = 2, follows: RowDecoder | None = None) -> None:
        self._objects, self._slots, self._where = objects, slots, where
        self.buffers: int = max(1, buffers)  # rows decoded into buffers of their own, in turn
        self._buffers: dict[str, list[np.ndarray]] = {}
        self._turn = 0
        if follows is not None and follows.buffers == self.buffers:
            self._buffers, self._turn = follows._buffers, follows._turn
        self._whole: DecodedBatch | None = None
        self._arrays: dict[str, ProfileArray] = {}
        first = decode_batch_checks(objects, slots, rows, where, wanted)  # decode_batch's checks
        if first is None:
            self._whole = decode_batch(objects, slots, rows, where, wanted)
            return
        self._arrays = first
        self._counts = first["counts"].read(objects, None, where, None)
        _check_counts(self._counts, rows, slots, where)
        _check_lengths(first, self._counts, slots, where)
        self._wanted = wanted
        self._cache: dict[str, dict[int, np.ndarray]] = {}

    def row(self, r: int, pool: ThreadPoolExecutor | None = None) -> DecodedBatch:
        """A :class:`DecodedBatch` holding row ``r`` alone (``r`` among the rows ``wanted``)."""
        if self._whole is not None:
            return DecodedBatch(self._whole.slots, self._whole.counts, {r: self._whole.segments[r]})
        if r not in self._wanted:
            raise KeyError(f"row {r} was not decoded (decoded rows: {self._wanted.start}..{self._wanted.stop - 1})")
        turn, self._turn = self._turn % self.buffers, self._turn + 1
        data: dict[str, np.ndarray] = {}
        for name, span in _element_ranges(self._counts, self._slots, r, r + 1).items():
            flat = self._arrays.get(name)
            if flat is None or not span:
                continue
            ring = self._buffers.setdefault(name, [])
            while len(ring) <= turn:
                ring.append(np.empty(0, flat.dtype))
            if ring[turn].shape[0] < len(span):
                ring[turn] = np.empty(len(span), flat.dtype)
            data[name] = flat.read(self._objects, span, self._where, pool, ring[turn],
                                   self._cache.setdefault(name, {}))
        return DecodedBatch(slots=self._slots, counts=self._counts,
                            segments=_segments(data, self._counts, self._slots, range(r, r + 1), self._where))


def decode_batch_checks(objects: Mapping[str, bytes | np.ndarray], slots: tuple[SlotInfo, ...], rows: int,
                        where: str, wanted: range) -> dict[str, ProfileArray] | None:
    """The checks :func:`decode_batch` makes before decoding anything; the arrays if all are in
    the 1.0 codec chain, else None."""
    if wanted.step != 1 or not 0 <= wanted.start <= wanted.stop <= rows:
        raise CorruptChainError(f"{where}: rows {wanted.start}..{wanted.stop - 1} are not rows of a batch of {rows}")
    _slot_widths(slots, where)
    if rows * max(1, len(slots)) > MAX_COUNTS:
        raise CorruptChainError(f"{where}: {rows} rows of {len(slots)} slots exceed the {MAX_COUNTS} counts a batch "
                                "may have (spec §10.5)")
    metadata = array_metadata(objects, where)
    counts_meta = metadata.get("counts")
    if counts_meta is None:
        raise CorruptChainError(f"{where}: counts array missing")
    if counts_meta.shape != (rows, len(slots)):
        raise CorruptChainError(f"{where}: counts has shape {list(counts_meta.shape)}, expected [{rows}, "
                                f"{len(slots)}] (spec §10.5)")
    for name, array in metadata.items():
        check_listed(name, array.grid, objects, where)
    return metadata if all(a.profile for a in metadata.values()) else None


def _check_counts(counts: np.ndarray, rows: int, slots: tuple[SlotInfo, ...], where: str) -> None:
    """Every count against its slot, in every row, before any values chunk is read (spec §10.5)."""
    if counts.shape != (rows, len(slots)) or counts.dtype != np.int64:
        raise CorruptChainError(f"{where}: counts array missing or of the wrong shape")
    if not counts.size:
        return
    cap = 1 << 62
    numel = np.array([min(s.numel, cap) for s in slots], dtype=np.int64)
    sparse = np.array([s.encoding == "sparse" for s in slots], dtype=bool)
    limit = np.where(sparse, np.minimum(numel, MAX_SPARSE_INDEX), numel)
    bad = (counts < -1) | (counts > limit) | (~sparse & (counts >= 0) & (counts != numel))
    if bad.any():
        r, j = (int(x) for x in np.argwhere(bad)[0])
        slot = slots[j]
        rule = (f"at most {int(limit[j])} for a sparse slot" if sparse[j]
                else f"-1 or {slot.numel} for a {slot.encoding} slot")
        raise CorruptChainError(f"{where}: counts of {slot.name} (row {r}) is {int(counts[r, j])}; it must be {rule} "
                                f"of shape {list(slot.shape)} (spec §10.5)")


def _check_lengths(metadata: Mapping[str, ProfileArray], counts: np.ndarray, slots: tuple[SlotInfo, ...],
                   where: str) -> None:
    """Each 1-D array holds exactly the elements the counts of all rows give (spec §10.5)."""
    present = np.maximum(counts, 0)
    widths = _slot_widths(slots, where)
    sparse = np.array([s.encoding == "sparse" for s in slots], dtype=bool)
    for name, columns in [(f"values_u{w * 8}", widths == w) for w in WIDTH_DTYPES] + [("indices", sparse)]:
        part = present[:, columns] if len(slots) else np.zeros((0, 0), np.int64)
        if float(part.sum(dtype=np.float64)) > MAX_ARRAY_ELEMENTS:
            raise CorruptChainError(f"{where}: the counts give {name} more than 2^48 elements")
        total = int(part.sum())
        array = metadata.get(name)
        length = 0 if array is None else array.shape[0]
        if length != total:
            raise CorruptChainError(
                f"{where}: {name} has {length if array is not None else 'no'} elements; the counts of the batch give "
                f"{total} (spec §10.5)")


def _decode_profile(arrays: dict[str, ProfileArray], objects: Mapping[str, bytes | np.ndarray],
                    slots: tuple[SlotInfo, ...], rows: int, where: str,
                    wanted: range) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    counts = arrays["counts"].read(objects, None, where, None)
    _check_counts(counts, rows, slots, where)
    _check_lengths(arrays, counts, slots, where)
    data: dict[str, np.ndarray] = {}
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()),
                            thread_name_prefix="ldformat-decode") as pool:
        for name, span in _element_ranges(counts, slots, wanted.start, wanted.stop).items():
            flat = arrays.get(name)
            if flat is None or not span:
                continue
            data[name] = flat.read(objects, span, where, pool)
    return counts, data


def _decode_with_zarr(objects: Mapping[str, bytes | np.ndarray], metadata: dict[str, ProfileArray],
                      slots: tuple[SlotInfo, ...], rows: int, where: str,
                      wanted: range) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    proto = default_buffer_prototype()
    store = MemoryStore({})

    def load(keys: list[str]) -> None:
        for k in keys:
            if k not in store._store_dict:
                data = objects[k]
                name = k.split("/", 1)[0]
                if k.startswith(f"{name}/c/") and name in metadata:
                    check_bounded(metadata[name], data, k, where)
                store._store_dict[k] = proto.buffer.from_array_like(np.frombuffer(data, np.uint8))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load([k for k in objects if k == "zarr.json" or k.endswith("/zarr.json")])
            group = zarr.open_group(store, mode="r")
            arrays = {name: zarr.open_array(store, path=name, mode="r") for name in sorted(group.array_keys())}
            if sorted(arrays) != sorted(metadata):
                raise CorruptChainError(f"{where}: the arrays zarr opens differ from the listed array metadata")
            load([k for k in objects if k.startswith("counts/c/")])
            counts = np.asarray(arrays["counts"][...])
            _check_counts(counts, rows, slots, where)
            _check_lengths(metadata, counts, slots, where)
            data: dict[str, np.ndarray] = {}
            for name, span in _element_ranges(counts, slots, wanted.start, wanted.stop).items():
                flat = arrays.get(name)
                if flat is None or not span:
                    continue
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
    cum = np.cumsum(gaps, dtype=np.int64)  # wraps like uint64: differences within a segment stay exact
    widths = _slot_widths(slots, where)
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
                if n and (not 0 <= idx[-1] < min(slot.numel, MAX_SPARSE_INDEX)
                          or (n > 1 and np.any(gaps[index_pos - n + 1 : index_pos] == 0))):
                    raise CorruptChainError(f"{where}: indices of {slot.name} (row {r}) out of range or unsorted")
            elif n != slot.numel:
                raise CorruptChainError(f"{where}: {slot.name} (row {r}) has {n} values, expected {slot.numel}")
            row[j] = (idx, vals)
        segments[r] = row
    return segments
