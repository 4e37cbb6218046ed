"""Reusable host buffers and device-to-host copies (docs/capture-runtime.md "Pipeline").

Captured tensors are copied into host buffers that are allocated once and reused, so the
capture path does not allocate per step. With CUDA the buffers are pinned and the copies
run on a side stream, ordered after the work that produced the tensors; the background
writer waits on an event before it reads them. Without CUDA the copy is a plain
``copy_``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import torch

from ..errors import UsageError

if TYPE_CHECKING:
    from .stats import CaptureStats

log = logging.getLogger("ldformat.capture")


class BufferSet:
    """Host buffers keyed by stored name, allocated on first use and reused afterwards."""

    def __init__(self, pin: bool, pool: BufferPool | None = None) -> None:
        self.pin = pin
        self.pool = pool  # charged for every allocation (the host-memory budget)
        self.tensors: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.nbytes = 0  # host bytes its buffers take, as the budget counts them

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer for ``name``, shaped and typed like ``like`` (reallocated if it is not)."""
        shape = tuple(like.shape)
        buf = self.tensors.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype:
            if buf is not None:  # freed before its replacement is allocated: the two never coexist
                del self.tensors[name]
                self._charge(-host_bytes(buf.numel() * buf.element_size(), self.pin))
                del buf
            self._charge(host_bytes(like.numel() * like.element_size(), self.pin))
            buf = torch.empty(shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self.tensors[name] = buf
        return buf

    def _charge(self, nbytes: int) -> None:
        if self.pool is not None:
            self.pool.charge(self, nbytes)
        else:
            self.nbytes += nbytes


def arena_bytes(available: int, pin: bool) -> int:
    """The largest buffer of at most ``available`` host bytes as the budget counts it: a pinned
    one is a power of two (:func:`host_bytes`)."""
    if available < 1:
        return 0
    return 1 << (available.bit_length() - 1) if pin else available


def host_bytes(nbytes: int, pin: bool) -> int:
    """The host memory a buffer of ``nbytes`` takes: PyTorch's pinned allocator rounds each
    block up to a power of two, so a pinned buffer is counted at that size."""
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


class Stager:
    """Copies device tensors into a BufferSet, on a side stream when CUDA is in use."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device if self.cuda else None
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None  # type: ignore[no-untyped-call]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None or src.device.type != "cuda":
            dst.copy_(src.detach())
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src.detach(), non_blocking=True)
        src.record_stream(self.stream)  # keep src alive until the copy has run

    def mark(self, buffers: BufferSet) -> None:
        """Record an event after every copy queued so far into ``buffers``."""
        buffers.event = self.stream.record_event() if self.stream is not None else None

    def fence(self, buffers: BufferSet) -> None:
        """Make the training's stream wait, on the GPU, for the copies :meth:`mark` covered.

        The side stream reads the live tensors after the work that produced them, but nothing
        else orders it before the work queued next: an in-place change (the next forward's
        BatchNorm update, ``zero_grad(set_to_none=False)``, the next optimizer step, a user's
        edit right after the step) could overwrite a tensor while it is being copied. The
        host does not wait; the copies still overlap the work queued before the fence.
        """
        if buffers.event is not None and self.device is not None:
            torch.cuda.current_stream(self.device).wait_event(buffers.event)

    def follow(self) -> None:
        """Order the copies queued from here on (from any thread) after the work queued so far on
        the calling thread's stream: the step whose state another thread will copy."""
        if self.stream is not None and self.device is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def sync(self) -> None:
        """Wait until every copy queued so far has run (a piece, read by the writer's thread)."""
        if self.stream is not None:
            self.stream.synchronize()

    @staticmethod
    def wait(buffers: BufferSet) -> None:
        if buffers.event is not None:
            buffers.event.synchronize()


class BufferPool:
    """BufferSets within a host-memory budget; acquiring blocks while all are in flight (back-pressure).

    ``max_bytes`` bounds the bytes of every staging buffer of every set together
    (docs/capture-runtime.md "Host memory"). The runtime sizes the pool so that its sets fit;
    should a set grow past that estimate (an optimizer state larger than predicted), the
    free sets are retired first, then the sets in flight as the writer hands them back, and
    only when the one set in use cannot fit alone is the allocation refused.
    """

    def __init__(self, size: int, pin: bool, max_bytes: int | None = None,
                 stats: CaptureStats | None = None) -> None:
        self._cond = threading.Condition()
        self._free: queue.Queue[BufferSet] = queue.Queue()  # changed under _cond only
        for _ in range(size):
            self._free.put(BufferSet(pin, self))
        self.size = size  # sets that exist: free, pending or in flight
        self.max_bytes = max_bytes
        self.stats = stats
        self.bytes = 0  # of every buffer of every set
        self.peak = 0
        self._retired_said = False

    def acquire(self) -> tuple[BufferSet, float]:
        start = time.perf_counter()
        with self._cond:
            while self._free.empty():
                self._cond.wait()
            buffers = self._free.get_nowait()
        return buffers, time.perf_counter() - start

    def release(self, buffers: BufferSet) -> None:
        with self._cond:
            self._free.put(buffers)
            self._cond.notify_all()

    def charge(self, owner: BufferSet, nbytes: int) -> None:
        """Account ``nbytes`` about to be allocated for ``owner`` (negative: freed), within the budget."""
        with self._cond:
            while self.max_bytes is not None and nbytes > 0 and self.bytes + nbytes > self.max_bytes:
                if not self._free.empty():  # a set nobody uses: retire it, with its buffers
                    self._retire(self._free.get_nowait())
                elif self.size > 1:  # the other sets are in flight: wait for the writer to hand one back
                    self._cond.wait()
                else:
                    raise UsageError(
                        f"one staging set of this state needs more than max_host_bytes={self.max_bytes} bytes of "
                        f"host memory ({owner.nbytes + nbytes} bytes so far); give CaptureOptions(max_host_bytes=...)"
                        " at least that much, or stage less per rank (mode 'lowdiff+' stages only the gradients; "
                        "sharding the model stages each rank's shards)")
            self.bytes += nbytes
            owner.nbytes += nbytes
            self.peak = max(self.peak, self.bytes)
            if self.stats is not None:
                self.stats.host_bytes, self.stats.host_bytes_peak = self.bytes, self.peak

    def _retire(self, victim: BufferSet) -> None:
        self.size -= 1
        self.bytes -= victim.nbytes
        victim.nbytes = 0
        victim.tensors.clear()
        if not self._retired_said:
            self._retired_said = True
            log.info("ldformat: a staging set holds more than estimated: %d set(s) in flight now, within "
                     "max_host_bytes=%d", self.size, self.max_bytes)
