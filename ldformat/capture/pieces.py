"""An ``xor`` step captured in pieces, when one staging set of the state does not fit the host
budget (docs/capture-runtime.md "Host memory").

The training thread stages only the buffers forward changes when the step ends; the background
writer reads the parameters and the optimizer state from the live tensors, piece by piece,
through one buffer that fits the budget (:meth:`ChainWriter.append_in_pieces`). Training waits
at the next optimizer step until the writer has read them all (the live state is the step's
until then). The row counts only once the training thread has judged the state unchanged while
it was read: there every in-place op it began has moved its tensor's version counter, which a
check on the writer's thread could miss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from ..chain.captured import CapturedTensor
from ..errors import UsageError
from .staging import BufferPool, BufferSet, Stager, arena_bytes, host_bytes
from .stats import CaptureStats
from .tuning import default_max_host_bytes

PIECES = "\0pieces"  # the buffer of a set that a step captured in pieces is read through (no stored name)
PIECE_ALIGN = 64  # bytes: each tensor of a piece starts at a multiple, so that any dtype may view it

Versions = dict[str, tuple[int, int]]
PieceReader = Callable[[list[str]], Iterator[dict[str, CapturedTensor]]]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN


def _changed_message(path: str, names: str, step: int) -> str:
    return (f"{path}: {names} changed in place after optimizer.step() of step {step}, while that step's state "
            "(larger than max_host_bytes) was being captured in pieces; make such changes before optimizer.step()")


class PieceReading:
    """The last step read in pieces, from its hand-off to the writer until the training thread's verdict.

    ``reading`` is set by the writer once it has read every piece; ``judging`` holds the live
    tensors, their versions when the step ended and the verdict the writer waits for.
    """

    def __init__(self, path: str, stager: Stager, pool: BufferPool, stats: CaptureStats,
                 raise_if_failed: Callable[[], None]) -> None:
        self.path = path
        self.stager = stager
        self.pool = pool
        self.stats = stats
        self.raise_if_failed = raise_if_failed
        self.reading: threading.Event | None = None  # set once the writer has read every piece of the last step
        self.judging: tuple[dict[str, torch.Tensor], Versions, Future[list[str]]] | None = None

    def hand_off(self, step: int, live: dict[str, torch.Tensor], versions: Versions,
                 staged: dict[str, CapturedTensor], buffers: BufferSet
                 ) -> tuple[PieceReader, threading.Event, tuple[dict[str, torch.Tensor], Versions, Future[list[str]]]]:
        """What the writer reads the step with, the event it sets once read, and what is judged then."""
        verdict: Future[list[str]] = Future()
        reading = threading.Event()
        return self.reader(step, live, versions, staged, buffers, reading, verdict), reading, (live, versions, verdict)

    def hold(self, wait: bool = True, raise_failed: bool = True) -> None:
        """Wait until the writer has read every piece of the last step (the live state is that
        step's until then), then judge whether the state changed meanwhile; raise if the writer
        failed. ``wait=False`` (as a forward pass starts): only if the reading is done already."""
        reading = self.reading
        if reading is None or not (wait or reading.is_set()):
            return
        self.reading = None
        started = time.perf_counter()
        reading.wait()
        self.stats.pieces_wait_s += time.perf_counter() - started  # part of the stall its caller times
        judging, self.judging = self.judging, None
        if judging is not None:
            # Here, on the training thread, every in-place op it began has run and moved its
            # tensor's version counter; the writer's own checks cannot see one still running.
            live, versions, verdict = judging
            verdict.set_result([n for n, t in live.items() if (t._version, t.data_ptr()) != versions[n]])
        if raise_failed:
            self.raise_if_failed()

    def reader(self, step: int, live: dict[str, torch.Tensor], versions: Versions,
               staged: dict[str, CapturedTensor], buffers: BufferSet, reading: threading.Event,
               verdict: Future[list[str]]) -> PieceReader:
        """What the writer reads a step in pieces with (:meth:`ChainWriter.append_in_pieces`), on
        its own thread: the live tensors copied, piece by piece in the writer's order, into one
        buffer of the step's set that fits the budget beside the buffers staged when it ended."""
        budget = self.pool.max_bytes if self.pool.max_bytes is not None else default_max_host_bytes()
        stager, path = self.stager, self.path

        def read(order: list[str]) -> Iterator[dict[str, CapturedTensor]]:
            sizes = {n: t.numel() * t.element_size() for n, t in live.items()}
            besides = sum(host_bytes(b.numel() * b.element_size(), buffers.pin)
                          for n, b in buffers.tensors.items() if n != PIECES)
            cap = arena_bytes(budget - besides, buffers.pin)
            for name in order:
                if sizes.get(name, 0) > cap:
                    raise UsageError(
                        f"{path}: {name} takes {sizes[name]} bytes of host memory, more than fits "
                        f"max_host_bytes={budget} beside the {besides} bytes of buffers staged when the step ended: "
                        "a piece holds at least one whole tensor; give CaptureOptions(max_host_bytes=...) more")
            size = min(cap, sum(_aligned(n) for n in sizes.values()))
            arena = buffers.buffer(PIECES, torch.empty(size, dtype=torch.uint8, device="meta"))
            piece: dict[str, CapturedTensor] = {}
            copied: list[str] = []
            used = 0

            def ready() -> dict[str, CapturedTensor]:
                stager.sync()
                for name in copied:  # the copy ran after the check: a change made before it is seen
                    t = live[name]
                    if (t._version, t.data_ptr()) != versions[name]:
                        raise UsageError(_changed_message(path, name, step))
                return piece

            for name in order:
                if name not in live:
                    piece[name] = staged[name]
                    continue
                t, n = live[name], sizes[name]
                at = _aligned(used)
                if at + n > size:
                    yield ready()
                    piece, copied, at = {}, [], 0
                view = arena[at:at + n].view(t.dtype).view(t.shape)
                stager.copy(view, t)
                piece[name] = CapturedTensor.of(view)
                copied.append(name)
                used = at + n
            if piece:
                yield ready()
            # Training may go on; the row counts only once the training thread found the state
            # unchanged while it was read (see hold).
            reading.set()
            changed = verdict.result()
            if changed:
                raise UsageError(_changed_message(path, ", ".join(changed[:3]), step))

        return read
