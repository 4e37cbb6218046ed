"""The lazy snapshot: a step's parameters and optimizer state, copied while the next step runs
(docs/capture-runtime.md "Lazy snapshot").

Between ``optimizer.step()`` of step ``t`` and that of step ``t + 1`` nothing in training
changes the parameters or the optimizer state (DataStates-LLM's observation): forward and
backward only read them. So the copy of an ``xor`` step's state need not stop training. It is
started when the step ends, on the CUDA side stream or, without CUDA, on a thread of its own,
and fenced only at the next optimizer pre-hook: the training thread then waits for what is
left of it, and the next optimizer step runs after it.

What forward does change (BatchNorm running statistics, ``num_batches_tracked``: the
model's buffers) is copied before the step ends, as before. A user's in-place change to a
parameter or an optimizer state tensor inside the window (weight clipping after
``optimizer.step()``, say) is seen by the tensor's version counter or a new storage: the
snapshot may then hold a mix of both states, so it is **dropped** (the step is not recorded:
never a wrong checkpoint) and every later step is copied before it ends instead. Changes
made through ``.data`` bypass version counters: make them before ``optimizer.step()``.
"""

from __future__ import annotations

import logging
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
    tensors: dict[str, torch.Tensor]
    versions: dict[str, tuple[int, int]]
    copied: Future[None] | None  # the CPU copy thread's job
    event: torch.cuda.Event | None  # CUDA: recorded after the side stream's copies
    valid: Future[bool]  # resolved by the fence: whether the copies hold the step's state


class LazySnapshots:
    """Starts a step's lazy copies (:meth:`start`) and fences them (:meth:`fence`).

    One snapshot is open at a time: the step that ended last. The background writer waits
    for ``valid`` before it reads the buffers, and drops the step when it is ``False``.
    """

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.enabled = True  # False once a user's in-place change was seen: copies happen at the step's end
        self.dropped: list[int] = []  # steps whose snapshot a change invalidated
        self._executor: ThreadPoolExecutor | None = None
        self._open: _Open | None = None

    def start(self, step: int, tensors: dict[str, torch.Tensor], buffers: BufferSet
              ) -> tuple[dict[str, CapturedTensor], Future[bool]]:
        """Copy ``tensors`` into ``buffers`` while training goes on; returns what the step
        captures (the buffers, filled once ``valid`` is resolved) and ``valid``."""
        self.fence()  # at most one open snapshot
        versions = {name: (t._version, t.data_ptr()) for name, t in tensors.items()}
        targets = {name: buffers.buffer(name, t) for name, t in tensors.items()}  # allocated here, not on a thread
        copied: Future[None] | None = None
        event = None
        if self.stager.cuda:
            for name, t in tensors.items():
                self.stager.copy(targets[name], t)
            self.stager.mark(buffers)  # the background writer waits for it, the next optimizer step too
            event = buffers.event
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ldformat-snapshot")
            copied = self._executor.submit(_copy_all, targets, tensors)
        valid: Future[bool] = Future()
        self._open = _Open(step, tensors, versions, copied, event, valid)
        return {name: CapturedTensor.of(targets[name]) for name in tensors}, valid

    def fence(self) -> None:
        """Wait for the open snapshot's copies (on CUDA: make the training's stream wait for
        them) and resolve its ``valid``. Runs before anything changes the state again: the
        next optimizer pre-hook, and before the runtime takes a buffer set, flushes or closes."""
        snap, self._open = self._open, None
        if snap is None:
            return
        try:
            if snap.copied is not None:
                snap.copied.result()
            if snap.event is not None and self.stager.device is not None:
                torch.cuda.current_stream(self.stager.device).wait_event(snap.event)
            changed = [name for name, t in snap.tensors.items() if (t._version, t.data_ptr()) != snap.versions[name]]
        except BaseException as e:
            snap.valid.set_exception(e)
            raise
        snap.valid.set_result(not changed)
        if changed:
            self.enabled = False
            self.dropped.append(snap.step)
            log.warning("ldformat: %s changed in place after optimizer.step() of step %d, before the next step: that "
                        "step is not recorded (its snapshot may mix both states), and from now on each step's state "
                        "is copied before optimizer.step() returns (docs/capture-runtime.md \"Lazy snapshot\")",
                        ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else ""), snap.step)

    def close(self) -> None:
        self.fence()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _copy_all(targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name].copy_(t)
