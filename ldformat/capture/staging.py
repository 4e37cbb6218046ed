"""Reusable host buffers and device-to-host copies (docs/capture-runtime.md "Pipeline").

Captured tensors are copied into host buffers that are allocated once and reused, so the
capture path does not allocate per step. With CUDA the buffers are pinned and the copies
run on a side stream, ordered after the work that produced the tensors; the background
writer waits on an event before it reads them. Without CUDA the copy is a plain
``copy_``.
"""

from __future__ import annotations

import queue
import time

import torch


class BufferSet:
    """Host buffers keyed by stored name, allocated on first use and reused afterwards."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer for ``name``, shaped and typed like ``like`` (reallocated if it is not)."""
        shape = tuple(like.shape)
        buf = self.tensors.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype:
            buf = torch.empty(shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self.tensors[name] = buf
        return buf


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

    @staticmethod
    def wait(buffers: BufferSet) -> None:
        if buffers.event is not None:
            buffers.event.synchronize()


class BufferPool:
    """A fixed number of BufferSets; acquiring blocks while all are in flight (back-pressure)."""

    def __init__(self, size: int, pin: bool) -> None:
        self._free: queue.Queue[BufferSet] = queue.Queue()
        for _ in range(size):
            self._free.put(BufferSet(pin))

    def acquire(self) -> tuple[BufferSet, float]:
        start = time.perf_counter()
        buffers = self._free.get()
        return buffers, time.perf_counter() - start

    def release(self, buffers: BufferSet) -> None:
        self._free.put(buffers)
