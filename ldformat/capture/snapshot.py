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

**When the step is known valid.** Only the training thread checks the versions: there every
in-place op it started has run (without CUDA) or been enqueued (CUDA), so its counter has
moved. A thread that checked while an op still ran could miss it and record a mix. The check
runs at the next optimizer pre-hook (the fence, which waits for what is left of the copies;
on CUDA the training stream waits for them), before the runtime takes a buffer set, flushes or
closes, and at the start of every forward pass once the copies have completed
(:meth:`LazySnapshots.settle`, without waiting): so a step becomes durable while training
evaluates after it. A change seen by a check may have raced the copy: the step is dropped. A
change after a check that found the copies complete cannot reach them.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..chain.captured import CapturedTensor
from .staging import BufferSet, Stager

log = logging.getLogger("ldformat.capture")


@dataclass
class _Open:
    """The snapshot under way: the live tensors, their versions when the step ended, the copy."""

    step: int
    names: list[str]
    tensors: list[torch.Tensor]
    versions: list[tuple[int, int]]
    valid: Future[bool]  # whether the copies hold the step's state: resolved once, on the training thread
    copied: Future[None] | None = None  # without CUDA: the copy thread's job
    event: torch.cuda.Event | None = None  # CUDA: recorded after the side stream's copies


class LazySnapshots:
    """Starts a step's lazy copies (:meth:`start`) and fences them (:meth:`fence`).

    One snapshot is open at a time: the step that ended last. The background writer waits
    for ``valid`` before it reads the buffers, and drops the step when it is ``False``.
    ``valid``, ``enabled`` and ``dropped`` change on the training thread only.
    """

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.enabled = True  # False once a user's in-place change was seen: copies happen at the step's end
        self.dropped: list[int] = []  # steps whose snapshot a change invalidated
        self._executor: ThreadPoolExecutor | None = None
        self._open: _Open | None = None
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
        else:
            # Submitted last: the copy thread would otherwise contend for the GIL with the loops above.
            snap.copied = self._executor.submit(_copy_all, targets, snap.tensors)
        self._open = snap
        return captured, snap.valid

    def fence(self) -> None:
        """Make sure the open snapshot's copies are done before anything changes the state (on
        CUDA: make the training's stream wait for them), and resolve its ``valid`` unless
        :meth:`settle` has. Runs at the next optimizer pre-hook, and before the
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
            if not snap.valid.done():
                snap.valid.set_exception(e)
            raise
        self._check(snap)

    def settle(self) -> None:
        """Resolve the open snapshot's ``valid`` if its copies have completed, without waiting
        (the runtime calls it as a forward pass starts: a step's state becomes durable while
        training evaluates after it). The fence still runs at the next optimizer pre-hook."""
        snap = self._open
        if snap is None or snap.valid.done():
            return
        done = snap.event.query() if snap.event is not None else (  # type: ignore[no-untyped-call]
            snap.copied is not None and snap.copied.done())
        if done and (snap.copied is None or snap.copied.exception() is None):
            self._check(snap)

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

    def _check(self, snap: _Open) -> None:
        """Resolve ``valid`` from the versions now (on the training thread), unless it is resolved already."""
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


def _copy_all(targets: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for dst, src in zip(targets, tensors, strict=True):
            dst.copy_(src)
