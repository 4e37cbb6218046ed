"""Encoding a delta batch (spec §10.1 "Batch layout"), byte-identical to zarr writing it whole.

:class:`BatchEncoder` takes a batch row by row and compresses each array's chunks as their
elements arrive, on an :class:`EncodePool` of threads; :func:`encode_batch` encodes rows held
in memory. The arrays' metadata and codecs are the profile's (spec §10.2, :mod:`.profile`).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BloscCodec
from zarr.storage import MemoryStore

from ...errors import UsageError
from ..jsonvalue import JSONObject
from ..manifest import SlotInfo
from .arith import WIDTH_DTYPES, Segment
from .profile import CHUNK_BYTES, COUNT_CODECS, INDEX_CODECS, VALUE_CODECS, BloscOptions, create_profile_array


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
        create_profile_array(store, "counts", counts.shape, counts.dtype, COUNT_CODECS, counts)
        chunks: dict[str, bytes] = {}
        for name, encoder in arrays:
            create_profile_array(store, name, (encoder.size,), encoder.dtype, encoder.codec)  # metadata only
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
