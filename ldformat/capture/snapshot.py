"""The lazy snapshot: a step's parameters and optimizer state, copied while the next step runs
(docs/capture-runtime.md "Lazy snapshot").

Between ``optimizer.step()`` of step ``t`` and that of step ``t + 1`` nothing in training
changes the parameters or the optimizer state (DataStates-LLM's observation): forward and
backward only read them. So the copy of an ``xor`` step's state need not stop training. It is
started when the step ends, on the CUDA side stream or, without CUDA, on a thread of its own.

What forward does change (BatchNorm running statistics, ``num_batches_tracked``: the
model's buffers) is copied before the step ends, as before. A user's in-place change to a
parameter or an optimizer state tensor inside the window (weight clipping after
``optimizer.step()``, say) is seen by the tensor's version counter or a new storage: the
snapshot may then hold a mix of both states, so it is **dropped** (the step is not recorded,
rather than recorded wrong; but see the last paragraph) and every later step is copied before
it ends instead. Changes made through ``.data`` bypass version counters: make them before
``optimizer.step()``.

**When the step is known valid.** As soon as its copies have completed: the copy thread, or
on CUDA a thread that waits for the side stream's event, then compares the versions with those
at the step's end and resolves ``valid``. The background writer need not wait for the next
step, so a step becomes durable while training pauses after it (evaluation, a data stall). A
change seen by that check may have raced the copy: the step is dropped. A change made after
the check cannot reach the snapshot, whose copies had completed (on CUDA a version counter
moves when the in-place kernel is enqueued, so a kernel enqueued after the check runs after
the copies). The next optimizer pre-hook still fences: on CUDA the training stream waits there
for the copies before the optimizer changes the state, without CUDA the training thread waits
for the copy thread, and a snapshot not checked yet is checked there (changes from then on
are ordered after the copies).

What the check cannot see is an in-place op still inside its call on the training thread: the
counter moves once the op has run (without CUDA) or been enqueued (CUDA). On CUDA that window
is a few host instructions; without CUDA it is the op's run time, so an op that began while
the copy ran and still runs at the check can leave part of its change in a recorded step.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..captured import CapturedTensor
from .staging import BufferSet, Stager

log = logging.getLogger("ldformat.capture")


@dataclass
class _Open:
    """The snapshot under way: the live tensors, their versions when the step ended, the copy."""

    step: int
    names: list[str]
    tensors: list[torch.Tensor]
    versions: list[tuple[int, int]]
    valid: Future[bool]  # whether the copies hold the step's state: resolved once, by _check or _fail
    copied: Future[None] | None = None  # without CUDA: the copy thread's job (copy, then check)
    event: torch.cuda.Event | None = None  # CUDA: recorded after the side stream's copies


class LazySnapshots:
    """Starts a step's lazy copies (:meth:`start`) and fences them (:meth:`fence`).

    One snapshot is open at a time: the step that ended last. The background writer waits
    for ``valid`` before it reads the buffers, and drops the step when it is ``False``.
    ``enabled`` and ``dropped`` may change on the snapshot thread.
    """

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.enabled = True  # False once a user's in-place change was seen: copies happen at the step's end
        self.dropped: list[int] = []  # steps whose snapshot a change invalidated
        self._executor: ThreadPoolExecutor | None = None
        self._open: _Open | None = None
        self._lock = threading.Lock()  # the snapshot thread and the fence may both try to resolve valid
        # Per buffer set, each name's buffer and its CapturedTensor: wrapping a buffer costs more
        # than copying a small tensor, and the buffers are reused from step to step.
        self._wrapped: weakref.WeakKeyDictionary[BufferSet, dict[str, tuple[torch.Tensor, CapturedTensor]]] = (
            weakref.WeakKeyDictionary())

    def start(self, step: int, tensors: dict[str, torch.Tensor], buffers: BufferSet
              ) -> tuple[dict[str, CapturedTensor], Future[bool]]:
        """Copy ``tensors`` into ``buffers`` while training goes on; returns what the step
        captures (the buffers, filled once ``valid`` is resolved) and ``valid``."""
        self.fence()  # at most one open snapshot
        names = list(tensors)
        live = list(tensors.values())
        versions = [(t._version, t.data_ptr()) for t in live]
        targets, captured = self._targets(names, live, buffers)  # allocated here, not on a thread
        snap = _Open(step, names, live, versions, Future())
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ldformat-snapshot")
        if self.stager.cuda:
            snap.event = self._copy_on_stream(targets, live, buffers)
            self._executor.submit(self._check_when_copied, snap)
        else:
            # Submitted last: the copy thread would otherwise contend for the GIL with the loops above.
            snap.copied = self._executor.submit(self._copy_and_check, snap, targets)
        self._open = snap
        return captured, snap.valid

    def fence(self) -> None:
        """Make sure the open snapshot's copies are done before anything changes the state (on
        CUDA: make the training's stream wait for them), and resolve its ``valid`` if the
        snapshot thread has not yet. Runs at the next optimizer pre-hook, and before the
        runtime takes a buffer set, flushes or closes."""
        snap, self._open = self._open, None
        if snap is None:
            return
        try:
            if snap.copied is not None:
                snap.copied.result()
            if snap.event is not None and self.stager.device is not None:
                torch.cuda.current_stream(self.stager.device).wait_event(snap.event)
        except BaseException as e:
            self._fail(snap, e)
            raise
        self._check(snap)
        error = snap.valid.exception()
        if error is not None:  # the snapshot thread's
            raise error

    def close(self) -> None:
        self.fence()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _targets(self, names: list[str], live: list[torch.Tensor], buffers: BufferSet
                 ) -> tuple[list[torch.Tensor], dict[str, CapturedTensor]]:
        """The buffer of each tensor (as ``buffers.buffer`` gives it) and what the step captures."""
        held = buffers.tensors
        wrapped = self._wrapped.get(buffers)
        if wrapped is None:
            wrapped = self._wrapped[buffers] = {}
        targets: list[torch.Tensor] = []
        captured: dict[str, CapturedTensor] = {}
        for name, t in zip(names, live, strict=True):
            buf = held.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = buffers.buffer(name, t)
            known = wrapped.get(name)
            if known is None or known[0] is not buf:
                known = wrapped[name] = (buf, CapturedTensor.of(buf))
            targets.append(buf)
            captured[name] = known[1]
        return targets, captured

    def _copy_on_stream(self, targets: list[torch.Tensor], live: list[torch.Tensor], buffers: BufferSet
                        ) -> torch.cuda.Event:
        """Queue every copy on the side stream at once (as :meth:`Stager.copy` does one) and
        record the event that the fence, the snapshot thread and the background writer wait for."""
        stager, stream = self.stager, self.stager.stream
        assert stream is not None
        index = stream.device_index
        elsewhere: list[tuple[torch.Tensor, torch.Tensor]] = []
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # after the work that produced them
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in zip(targets, live, strict=True):
                where = src.get_device()
                if where == index:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # keep src's memory until the copy has run
                elif where < 0:
                    dst.copy_(src)  # a host tensor (an optimizer's step count): copied now
                else:
                    elsewhere.append((dst, src))
        for dst, src in elsewhere:
            stager.copy(dst, src)
        # A blocking event: the snapshot thread sleeps in synchronize() instead of spinning.
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        buffers.event = event  # what Stager.mark records; the background writer waits for it too
        return event

    def _copy_and_check(self, snap: _Open, targets: list[torch.Tensor]) -> None:
        """The copy thread's job without CUDA."""
        try:
            _copy_all(targets, snap.tensors)
        except BaseException as e:
            self._fail(snap, e)
            raise
        self._check(snap)

    def _check_when_copied(self, snap: _Open) -> None:
        """The snapshot thread's job with CUDA: once the side stream's copies have run."""
        assert snap.event is not None
        try:
            snap.event.synchronize()
        except BaseException as e:
            self._fail(snap, e)
            raise
        self._check(snap)

    def _check(self, snap: _Open) -> None:
        """Resolve ``valid`` from the versions now, unless it is resolved already."""
        with self._lock:
            if snap.valid.done():
                return
            try:
                changed = [name for name, t, seen in zip(snap.names, snap.tensors, snap.versions, strict=True)
                           if (t._version, t.data_ptr()) != seen]
            except BaseException as e:
                snap.valid.set_exception(e)
                raise
            if changed:  # before valid: whoever waits for it sees them
                self.enabled = False
                self.dropped.append(snap.step)
            snap.valid.set_result(not changed)
        if changed:
            log.warning("ldformat: %s changed in place after optimizer.step() of step %d, before the copy of its "
                        "state was done: that step is not recorded (its snapshot may mix both states), and from now "
                        "on each step's state is copied before optimizer.step() returns (docs/capture-runtime.md "
                        "\"Lazy snapshot\")", ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else ""),
                        snap.step)

    def _fail(self, snap: _Open, error: BaseException) -> None:
        with self._lock:
            if not snap.valid.done():
                snap.valid.set_exception(error)


def _copy_all(targets: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for dst, src in zip(targets, tensors, strict=True):
            dst.copy_(src)
