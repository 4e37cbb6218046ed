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

import os
import struct
import threading
import warnings
import zlib
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeGuard

import google_crc32c
import numpy as np
import torch
import zarr
from numcodecs import Blosc, Zstd
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from ..errors import CorruptChainError, UsageError
from .jsonvalue import JSON, MAX_ZARR_JSON_BYTES, JSONObject, parse_json
from .manifest import Encoding, SlotInfo
from .predict import COEFFICIENTS as PREDICT_COEFFICIENTS
from .state import bits_view

WIDTH_DTYPES: dict[int, type[np.uint8 | np.uint16 | np.uint32 | np.uint64]] = {
    1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
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

Segment = tuple[np.ndarray | None, np.ndarray]  # (sorted int64 indices or None, raw bits)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a CPU tensor as a flat unsigned numpy array (no copy if contiguous)."""
    flat = bits_view(t.detach().contiguous()).reshape(-1)
    return flat.numpy().view(WIDTH_DTYPES[t.element_size()])


def _create(store: MemoryStore, name: str, shape: tuple[int, ...], dtype: np.dtype, codec: BloscOptions,
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


def default_encode_threads() -> int:
    """Threads a writer compresses with by default: half of this process's share of the cores,
    at most 8 (training keeps the others), and 1, the writer's own thread, when that share is 3
    cores or fewer. The share is the cores it may use divided by ``LOCAL_WORLD_SIZE`` (set by
    torchrun: the processes of one job on this machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 1:
        cores //= int(local)
    return max(1, min(8, cores // 2)) if cores > 3 else 1


def check_encode_threads(threads: object) -> int:
    """``threads`` if it is a count of encode threads (an int >= 1), else UsageError."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UsageError(f"encode_threads must be a count >= 1, not {threads!r}")
    return threads


class EncodePool(ThreadPoolExecutor):
    """A pool of compression threads that says how many it has (an encoder keeps at most
    ``threads + 1`` chunks in flight: the memory of a batch in progress stays bounded)."""

    def __init__(self, threads: int) -> None:
        super().__init__(max_workers=threads, thread_name_prefix="ldformat-encode")
        self.threads = threads


_encode_pools: dict[tuple[int, int], EncodePool] = {}
_encode_pools_lock = threading.Lock()


def encode_pool(threads: int) -> EncodePool | None:
    """The process's pool of ``threads`` compression threads (None for 1: compress inline).
    Keyed by process id too: a forked child must not use its parent's threads, which it lacks."""
    if threads <= 1:
        return None
    key = (os.getpid(), threads)
    with _encode_pools_lock:
        pool = _encode_pools.get(key)
        if pool is None:
            pool = _encode_pools[key] = EncodePool(threads)
        return pool


def default_encode_pool() -> EncodePool | None:
    """The process's pool of :func:`default_encode_threads` threads (None: compress inline)."""
    return encode_pool(default_encode_threads())


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

    def __init__(self, width: int, codec: BloscOptions, pool: EncodePool | None = None) -> None:
        """``pool``: compress chunks on its threads (blosc releases the GIL), at most
        ``workers + 1`` at a time; the objects are the same bytes as without it."""
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
        self._pool = pool
        self._in_flight: deque[tuple[Future[bytes], np.ndarray]] = deque()  # in chunk order
        self._spare: list[np.ndarray] = []  # chunk buffers whose compression is done
        self._max_in_flight = (pool.threads + 1) if pool is not None else 0

    def append(self, data: np.ndarray) -> None:
        """Add elements at the end; ``data`` may be reused by the caller once this returns."""
        data = np.ascontiguousarray(data, dtype=self.dtype.newbyteorder("<")).reshape(-1)  # `bytes` codec: little
        n, pos, chunk = data.shape[0], 0, self._chunk
        if self._fill:  # top up the pending chunk first
            pos = min(n, chunk - self._fill)
            self._buffer()[self._fill : self._fill + pos] = data[:pos]
            self._fill += pos
            if self._fill == chunk:
                self._compress_pending()
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
            if self._chunks or self._in_flight:
                pending[self._fill :] = 0
                self._compress_pending()
            else:  # the whole array is shorter than a chunk: one chunk of exactly its length
                self._compress(pending[: self._fill])
            self._fill = 0
        while self._in_flight:
            self._collect()
        self._pending, self._spare = None, []
        return {f"{name}/c/{i}": data for i, data in enumerate(self._chunks)}

    def _buffer(self) -> np.ndarray:
        if self._pending is None:
            self._pending = (self._spare.pop() if self._spare
                             else np.empty(self._chunk, dtype=self.dtype.newbyteorder("<")))
        return self._pending

    def _encode(self, chunk: np.ndarray) -> bytes:
        # codec chain bytes -> blosc -> crc32c, as zarr's codecs do it; crc32c appends the checksum little-endian
        data: bytes = self._blosc.encode(chunk.view(np.uint8))
        return data + int(google_crc32c.value(data)).to_bytes(4, "little")

    def _compress(self, chunk: np.ndarray) -> None:
        """Compress a chunk the caller may reuse once this returns."""
        if self._pool is None:
            self._chunks.append(self._encode(chunk))
            return
        own = self._spare.pop() if self._spare else np.empty(self._chunk, dtype=self.dtype.newbyteorder("<"))
        own = own[: chunk.shape[0]]
        own[:] = chunk
        self._submit(own)

    def _compress_pending(self) -> None:
        """Compress the full pending buffer; with a pool it is handed over, not copied."""
        if self._pool is None:
            self._chunks.append(self._encode(self._buffer()))
            return
        buf, self._pending = self._buffer(), None
        self._submit(buf)

    def _submit(self, buf: np.ndarray) -> None:
        assert self._pool is not None
        while len(self._in_flight) >= self._max_in_flight:
            self._collect()
        try:
            future = self._pool.submit(self._encode, buf)
        except RuntimeError:  # the pool refuses work at interpreter exit: compress here
            future = Future()
            future.set_result(self._encode(buf))
        self._in_flight.append((future, buf))

    def _collect(self) -> None:
        """Wait for the oldest chunk in flight; its buffer becomes spare."""
        future, buf = self._in_flight.popleft()
        self._chunks.append(future.result())
        if buf.base is not None:  # a short view of a chunk buffer (an array's last chunk)
            buf = buf.base
        if buf.shape[0] == self._chunk:
            self._spare.append(buf)


class BatchEncoder:
    """Encodes a delta batch row by row (spec §10.1); values are compressed as they arrive.

    Per row: :meth:`start_row`, then :meth:`add` for its segments in increasing slot order
    (segment order). :meth:`finish` returns the objects of the group.
    """

    def __init__(self, pool: EncodePool | None = None, values: BloscOptions = VALUE_CODECS) -> None:
        """``pool``: threads that compress value chunks (see :class:`ArrayEncoder`); ``values``:
        the blosc settings of the ``values_uW`` arrays."""
        self.counts: list[dict[int, int]] = []  # per row: slot -> elements stored
        self._indices: ArrayEncoder | None = None  # exists iff a sparse segment was added
        self._values: dict[int, ArrayEncoder] = {}
        self._pool = pool
        self.value_codecs = values  # may change until the first value is added

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
            encoder = self._values[width] = ArrayEncoder(width, self.value_codecs, self._pool)
        encoder.append(values)

    def finish(self, n_slots: int, attributes: JSONObject) -> dict[str, bytes]:
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


def encode_batch(slots: list[SlotInfo], rows: list[dict[int, Segment]], attributes: JSONObject,
                 pool: EncodePool | None = None) -> dict[str, bytes]:
    """Encode rows into the objects of one Zarr group: {relative key: bytes}."""
    encoder = BatchEncoder(pool)
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


def _slot_widths(slots: tuple[SlotInfo, ...], where: str = "batch") -> np.ndarray:
    widths = []
    for s in slots:
        dtype = _NP_DTYPES.get(s.dtype) if isinstance(s.dtype, str) else None
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


# -- slot bounds (spec §10.3) ---------------------------------------------------------------
_NP_DTYPES: dict[str, type[np.generic]] = {
    "bool": np.uint8, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64,
    # format 1.2: their bits, by width
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8, "complex64": np.uint64}
# Counts entries of one batch: rows x slots, so `counts` holds at most 128 MiB (spec §10.5).
MAX_COUNTS = 1 << 24
# Indices are stored as uint32 gaps, and every index is below 2^32 (spec §10.1).
MAX_SPARSE_INDEX = 1 << 32
# Per array, the elements all rows of a batch hold together (a sanity bound: 2^48 elements).
_MAX_ARRAY_ELEMENTS = 1 << 48
# An optimizer slot may hold 2^20 elements whatever the model: state whose size does not scale
# with the parameters (a generator's state, a histogram), which a tiny model's P^2 could not hold.
OPTIMIZER_SLOT_FLOOR = 1 << 20
_KIND_SLOTS: dict[str, dict[str, tuple[Encoding, ...]]] = {
    "grad.topk": {"grad": ("sparse",), "model": ("dense",)},
    "grad.dense": {"grad": ("dense",), "model": ("dense",)},
    "state.xor": {"model": ("xor", "sub", "adam.w"), "optimizer": ("xor", "sub", "adam.v"), "predict": ("dense",)},
}
PREDICTED: tuple[Encoding, ...] = ("adam.v", "adam.w")  # computed from a prediction (spec §11.3)


def _index(text: str) -> int | None:
    """A parameter index written in decimal without leading zeros, else None."""
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0") or len(text) > 19:
        return None
    return int(text)


def _schema_tables(schema: JSON) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[str], int]:
    """(stored model entries by name: (dtype, shape), optimizer params, total parameter numel) of a root schema."""
    where = "the chain's schema (ldformat.json)"
    model = schema.get("model") if isinstance(schema, dict) else None
    optimizer = schema.get("optimizer") if isinstance(schema, dict) else None
    listed = optimizer.get("params") if isinstance(optimizer, dict) else None
    params = [p for p in listed if isinstance(p, str)] if isinstance(listed, list) else []
    if not isinstance(model, list) or not isinstance(listed, list) or len(params) != len(listed):
        raise CorruptChainError(f"{where}: schema.model or schema.optimizer.params is malformed (spec §5.6)")
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    total = 0
    for e in model:
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(e, dict) or not isinstance(name, str):
            raise CorruptChainError(f"{where}: a schema.model entry is malformed (spec §5.6.1)")
        if e.get("alias_of") is not None:
            continue
        shape, dtype = e.get("shape"), e.get("dtype")
        dims = tuple(d for d in shape if _is_count(d)) if isinstance(shape, list) else ()
        if not isinstance(shape, list) or len(dims) != len(shape) or not _shape_ok(dims):
            raise CorruptChainError(f"{where}: schema.model entry {name!r} has a malformed shape {shape!r}")
        if dtype not in _NP_DTYPES or not isinstance(dtype, str):
            raise CorruptChainError(f"{where}: schema.model entry {name!r} has dtype {dtype!r}, "
                                    "not one of spec §5.6.4")
        entries[name] = (dtype, dims)
        if e.get("role") == "parameter":
            total += _numel(dims)
    for p in params:
        if p not in entries:
            raise CorruptChainError(f"{where}: schema.optimizer.params names {p!r}, which is not a stored "
                                    "schema.model entry (spec §5.6.2)")
    return entries, params, total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_slot_bound(parameter_elements: int) -> int:
    """The most elements an ``optimizer/…`` slot may hold in a chain whose schema's parameters
    have ``parameter_elements`` elements together (P): ``max(2^20, P^2)`` (spec §10.3).

    Every second-order statistic of the gradients (a full-matrix preconditioner, Kronecker
    factors, blocks of them, stacked) is indexed by pairs of parameter elements, so it holds at
    most P^2; P alone, the bound up to 1.6's reference reader, refused preconditioner matrices
    that the writer recorded (e.g. pytorch-optimizer's DASH).
    """
    return max(OPTIMIZER_SLOT_FLOOR, parameter_elements * parameter_elements)


def _shape_ok(shape: tuple[int, ...]) -> bool:
    """A shape torch can hold: the product of max(1, d) over the dimensions is below 2^63."""
    span = 1
    for d in shape:
        span *= max(1, d)
    return span < 1 << 63


def check_slots(slots: tuple[SlotInfo, ...], schema: JSON, kind: str, where: str) -> None:
    """Check a batch's slots against the chain's schema before anything of the batch is decoded (spec §10.3).

    Names are unique and in the namespaces of ``kind``, with its encoding; dtypes are those of
    spec §5.6.4; ``grad/<i>`` has exactly the dtype and shape of parameter ``i``, ``model/<key>``
    those of its schema entry, and an ``optimizer/…`` slot holds at most
    :func:`optimizer_slot_bound` elements. Raises CorruptChainError naming the slot.
    """
    model, params, total = _schema_tables(schema)
    allowed = _KIND_SLOTS.get(kind)
    if allowed is None:
        raise CorruptChainError(f"{where}: unknown delta kind {kind!r}")
    seen: set[str] = set()
    for slot in slots:
        name = slot.name
        bad = f"{where}: slot {name!r}"
        if name in seen:
            raise CorruptChainError(f"{bad} appears twice in the batch (spec §10.3)")
        seen.add(name)
        if slot.dtype not in _NP_DTYPES:
            raise CorruptChainError(f"{bad} has dtype {slot.dtype!r}, not one of spec §5.6.4")
        space, _, rest = name.partition("/")
        encodings = allowed.get(space)
        if encodings is None or not rest:
            raise CorruptChainError(f"{bad} is not a slot name a {kind} chain uses (spec §10.3, §11)")
        if slot.encoding not in encodings:
            raise CorruptChainError(f"{bad} has encoding {slot.encoding!r}; a {kind} chain stores it as "
                                    f"{' or '.join(map(repr, encodings))} (spec §11)")
        if slot.encoding in PREDICTED and slot.dtype != "float32":
            raise CorruptChainError(f"{bad} is {slot.dtype}; encoding {slot.encoding!r} is for float32 tensors "
                                    "(spec §11.3)")
        if space in ("grad", "predict"):
            i = _index(rest)
            if i is None or i >= len(params):
                raise CorruptChainError(f"{bad} names no optimizer parameter (the chain has {len(params)})")
            expected: tuple[str, tuple[int, ...]] | None = (
                model[params[i]] if space == "grad" else ("float32", (PREDICT_COEFFICIENTS,)))
        elif space == "model":
            expected = model.get(rest)
            if expected is None:
                raise CorruptChainError(f"{bad} names no stored schema.model entry (spec §8)")
            if slot.encoding == "adam.w" and rest not in params:
                raise CorruptChainError(f"{bad} has encoding 'adam.w' but is not an optimizer parameter (spec §11.3)")
        else:
            i_text, _, key = rest.partition("/")
            i = _index(i_text)
            structure = i_text == "ref"  # optimizer/ref/...: a tensor of the optimizer structure (§8.2)
            if not key or not structure and (i is None or i >= len(params)):
                raise CorruptChainError(f"{bad} names no optimizer parameter (the chain has {len(params)})")
            if slot.encoding == "adam.v" and (structure or key == "exp_avg"):
                raise CorruptChainError(f"{bad} has encoding 'adam.v', which is for optimizer/<i>/<key> other than "
                                        "the first moment exp_avg it is predicted from (spec §10.3, §11.3.1)")
            expected = None
            bound = optimizer_slot_bound(total)
            if not _shape_ok(slot.shape) or slot.numel > bound:
                raise CorruptChainError(f"{bad} has shape {list(slot.shape)}: more elements than the {bound} an "
                                        f"optimizer tensor may hold in a chain of {total} parameter elements "
                                        "(max(2^20, P^2); spec §10.3)")
        if expected is not None and (slot.dtype, slot.shape) != expected:
            raise CorruptChainError(f"{bad} is {slot.dtype} {list(slot.shape)}; the schema says {expected[0]} "
                                    f"{list(expected[1])} (spec §10.3)")


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


def _is_count(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


@dataclass
class _ProfileArray:
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
        return _numel(self.chunks) * self.dtype.itemsize

    @classmethod
    def parse(cls, name: str, raw: bytes | np.ndarray, where: str) -> _ProfileArray:
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
        shape_t = tuple(s for s in shape if _is_count(s)) if isinstance(shape, list) else ()
        if not isinstance(shape, list) or len(shape_t) != len(shape):
            raise bad(f"shape {shape!r} is not a list of non-negative integers")
        chunks_t = tuple(c for c in chunks if _is_count(c))
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
        n = _numel(self.chunks)
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


def _check_bounded(array: _ProfileArray, data: bytes | np.ndarray, key: str, where: str) -> None:
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


def _array_metadata(objects: Mapping[str, bytes | np.ndarray], where: str) -> dict[str, _ProfileArray]:
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
        arrays[parts[0]] = _ProfileArray.parse(parts[0], objects[key], where)
    return arrays


def _profile_arrays(objects: Mapping[str, bytes | np.ndarray], where: str) -> dict[str, _ProfileArray] | None:
    """Every array of the group, if all use the 1.0 codec chain (else None: decode with zarr)."""
    arrays = _array_metadata(objects, where)
    return arrays if all(a.profile for a in arrays.values()) else None


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
        counts, data = _decode_with_zarr(objects, _array_metadata(objects, where), slots, rows, where, wanted)
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
        self._arrays: dict[str, _ProfileArray] = {}
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
                        where: str, wanted: range) -> dict[str, _ProfileArray] | None:
    """The checks :func:`decode_batch` makes before decoding anything; the arrays if all are in
    the 1.0 codec chain, else None."""
    if wanted.step != 1 or not 0 <= wanted.start <= wanted.stop <= rows:
        raise CorruptChainError(f"{where}: rows {wanted.start}..{wanted.stop - 1} are not rows of a batch of {rows}")
    _slot_widths(slots, where)
    if rows * max(1, len(slots)) > MAX_COUNTS:
        raise CorruptChainError(f"{where}: {rows} rows of {len(slots)} slots exceed the {MAX_COUNTS} counts a batch "
                                "may have (spec §10.5)")
    metadata = _array_metadata(objects, where)
    counts_meta = metadata.get("counts")
    if counts_meta is None:
        raise CorruptChainError(f"{where}: counts array missing")
    if counts_meta.shape != (rows, len(slots)):
        raise CorruptChainError(f"{where}: counts has shape {list(counts_meta.shape)}, expected [{rows}, "
                                f"{len(slots)}] (spec §10.5)")
    for name, array in metadata.items():
        _check_listed(name, array.grid, objects, where)
    return metadata if all(a.profile for a in metadata.values()) else None


def _check_listed(name: str, grid: tuple[int, ...], objects: Mapping[str, object], where: str) -> None:
    # Zarr would read an unlisted (missing) chunk as fill value: refuse it (spec §10.2).
    if _numel(grid) > len(objects):  # before enumerating a grid a hostile shape makes huge
        raise CorruptChainError(f"{where}: {name} has {_numel(grid)} chunks; the commit record lists {len(objects)} "
                                "objects in all")
    for coords in np.ndindex(*grid):
        key = f"{name}/c/" + "/".join(map(str, coords))
        if key not in objects:
            raise CorruptChainError(f"{where}: chunk {key} is not listed in the commit record")


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


def _check_lengths(metadata: Mapping[str, _ProfileArray], counts: np.ndarray, slots: tuple[SlotInfo, ...],
                   where: str) -> None:
    """Each 1-D array holds exactly the elements the counts of all rows give (spec §10.5)."""
    present = np.maximum(counts, 0)
    widths = _slot_widths(slots, where)
    sparse = np.array([s.encoding == "sparse" for s in slots], dtype=bool)
    for name, columns in [(f"values_u{w * 8}", widths == w) for w in WIDTH_DTYPES] + [("indices", sparse)]:
        part = present[:, columns] if len(slots) else np.zeros((0, 0), np.int64)
        if float(part.sum(dtype=np.float64)) > _MAX_ARRAY_ELEMENTS:
            raise CorruptChainError(f"{where}: the counts give {name} more than 2^48 elements")
        total = int(part.sum())
        array = metadata.get(name)
        length = 0 if array is None else array.shape[0]
        if length != total:
            raise CorruptChainError(
                f"{where}: {name} has {length if array is not None else 'no'} elements; the counts of the batch give "
                f"{total} (spec §10.5)")


def _decode_profile(arrays: dict[str, _ProfileArray], objects: Mapping[str, bytes | np.ndarray],
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


def _decode_with_zarr(objects: Mapping[str, bytes | np.ndarray], metadata: dict[str, _ProfileArray],
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
                    _check_bounded(metadata[name], data, k, where)
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


def _torch_dtype(name: str) -> torch.dtype:
    from .jsonvalue import parse_dtype

    return parse_dtype(name)


SIGNED_NP: dict[int, type[np.uint8 | np.int16 | np.int32 | np.int64]] = {
    1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


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


def _flat_bits(target: torch.Tensor) -> tuple[np.ndarray, bool]:
    """The bits of ``target`` as a flat unsigned numpy array, and whether it is ``target``'s own
    memory (a contiguous CPU tensor) rather than a copy to be written back."""
    view = bits_view(target)
    own = view.device.type == "cpu" and view.is_contiguous() and not view.requires_grad
    flat = view.reshape(-1) if own else view.detach().to("cpu").contiguous().reshape(-1)
    return flat.numpy().view(WIDTH_DTYPES[target.element_size()]), own


def xor_into(target: torch.Tensor, seg: Segment) -> None:
    """``target ^= bits`` in place, on the raw bits of ``target``.

    A contiguous CPU target is XORed by numpy: one thread, without the GIL, so that it runs
    beside the decoding of the next step instead of contending with it as torch's
    multi-threaded kernels do.
    """
    _, vals = seg
    signed = np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize])
    view = bits_view(target)
    if view.device.type == "cpu" and view.is_contiguous() and not view.requires_grad:
        flat = view.reshape(-1).numpy()
        if flat.shape != signed.shape:
            raise ValueError(f"xor of {signed.shape[0]} elements into a tensor of {flat.shape[0]}")
        np.bitwise_xor(flat, signed, out=flat)
        return
    view.reshape(-1).bitwise_xor_(torch.from_numpy(signed))


# -- difference coding (slot encoding ``sub``, spec §11.3) -----------------------------------
# Elements per pass: chunks of 128 Ki elements stay in the L2 cache, so the subtraction, the
# base update and the zigzag cost about the memory traffic of the two XORs they replace.
_SUB_CHUNK = 1 << 17
_SIGNED_WIDTH: dict[int, type[np.int8 | np.int16 | np.int32 | np.int64]] = {
    1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _zigzag_chunk(d: np.ndarray, tmp: np.ndarray) -> None:
    """``d = (d << 1) XOR (d >>arith (W - 1))`` in place: small differences of either sign
    become small unsigned numbers (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...)."""
    signed = _SIGNED_WIDTH[d.dtype.itemsize]
    np.right_shift(d.view(signed), d.dtype.itemsize * 8 - 1, out=tmp.view(signed))
    np.left_shift(d, 1, out=d)
    np.bitwise_xor(d, tmp, out=d)


def _unzigzag_chunk(z: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out = (z >> 1) XOR -(z AND 1)``, the inverse of :func:`_zigzag_chunk` (``out`` may be ``z``)."""
    np.bitwise_and(z, 1, out=tmp)
    np.negative(tmp, out=tmp)  # 0 or all ones (unsigned arithmetic wraps)
    np.right_shift(z, 1, out=out)
    np.bitwise_xor(out, tmp, out=out)


def difference_delta(bits: np.ndarray, base: np.ndarray | None, out: np.ndarray) -> None:
    """A ``sub`` slot's values: ``out = zigzag((bits - base) mod 2^W)``, and ``base`` moves on to
    ``bits``. Flat unsigned arrays of one width; ``out`` may be ``bits`` (then ``bits`` is
    overwritten). ``base`` None: the tensor appears, and is coded against all-zero bits."""
    n = bits.shape[0]
    tmp = np.empty(min(n, _SUB_CHUNK), bits.dtype)
    copy = out is not bits
    for i in range(0, n, _SUB_CHUNK):
        b, o = bits[i:i + _SUB_CHUNK], out[i:i + _SUB_CHUNK]
        if base is None:
            if copy:
                np.copyto(o, b)
        else:
            a = base[i:i + _SUB_CHUNK]
            np.subtract(b, a, out=o)  # o = d (wraps mod 2^W)
            np.add(a, o, out=a)  # a + d = the new bits, whether or not o is b
        _zigzag_chunk(o, tmp[: o.shape[0]])


def undifference(values: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
    """``out (+)= unzigzag(values)`` mod 2^W: apply a ``sub`` slot's values to ``out`` (its
    base's bits), or with ``accumulate`` False decode them into ``out`` (a merge's start)."""
    n = values.shape[0]
    if out.shape[0] != n:
        raise ValueError(f"difference of {n} elements applied to a tensor of {out.shape[0]}")
    width = WIDTH_DTYPES[values.dtype.itemsize]
    values, out = values.view(width), out.view(width)
    tmp = np.empty(min(n, _SUB_CHUNK), width)
    dec = np.empty(min(n, _SUB_CHUNK), width) if accumulate else None
    for i in range(0, n, _SUB_CHUNK):
        z, o = values[i:i + _SUB_CHUNK], out[i:i + _SUB_CHUNK]
        if dec is None:
            _unzigzag_chunk(z, o, tmp[: z.shape[0]])
        else:
            d = dec[: z.shape[0]]
            _unzigzag_chunk(z, d, tmp[: z.shape[0]])
            np.add(o, d, out=o)


def sub_into(target: torch.Tensor, seg: Segment) -> None:
    """``bits(target) += unzigzag(values)`` mod 2^W in place: replay of a ``sub`` slot (spec §11.6)."""
    _, vals = seg
    flat, own = _flat_bits(target)
    undifference(np.ascontiguousarray(vals), flat, accumulate=True)
    if not own:
        bits_view(target).reshape(-1).copy_(torch.from_numpy(flat.view(SIGNED_NP[flat.dtype.itemsize])))


def apply_state_delta(target: torch.Tensor, seg: Segment, encoding: str) -> None:
    """Apply one ``state.xor`` slot to the tensor it changes: XOR (``xor``) or addition (``sub``)."""
    if encoding == "sub":
        sub_into(target, seg)
    else:
        xor_into(target, seg)


def state_delta_tensor(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """The tensor a ``state.xor`` slot creates where its base has none (spec §11.3: the base is
    all-zero bits, so an ``xor`` slot holds the bits and a ``sub`` slot their zigzag)."""
    t = segment_to_tensor(seg, slot)
    if slot.encoding == "sub":
        flat, _ = _flat_bits(t)
        undifference(flat, flat, accumulate=False)
    return t
