"""One step's capture on the training thread, from the optimizer's hooks to the background writer
(docs/capture-runtime.md "Capture points", "Pipeline", "Lazy snapshot", "Bounded cost").

A step goes through the :class:`Phase` values in order. The cadence decides at the pre-hook
whether it is captured (:mod:`.cadence`); a captured step takes a staging set (``OPEN``),
copies its gradients at the pre-hook and the rest at the post-hook (``ENDED``), and is queued
when the wrapped ``scheduler.step()`` (else ``scaler.update()``, else the post-hook) returns
(``IDLE`` again). A step that is not captured runs ``SKIPPING`` and ends ``SKIPPED``.

The previous step may still be in hand-off while the next runs: its lazy snapshot
(:mod:`.snapshot`) or its read in pieces (:mod:`.pieces`). :meth:`StepLifecycle.fence` waits
for it wherever the state is about to change or a staging set is taken;
:meth:`StepLifecycle.settle` judges it without waiting as a forward pass starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from ..chain.captured import (
    CapturedStep,
    CapturedTensor,
    CopyToHost,
    around_closure,
    capture_gradients,
    capture_tensors,
    inverse_scale,
    live_buffers,
    nested_step,
)
from ..format.dtensors import local
from ..format.dtypes import dtype_name
from ..format.jsonvalue import JSON
from ..format.state import encode_param_groups
from .background import Queued
from .ddp import RankStates, peer_residual_tensors
from .extra import MAX_LR_GROUPS, MAX_SCALARS, check_scalars, step_lrs
from .parts import Parts
from .rng import capture_rng
from .staging import BufferSet


class Phase(Enum):
    """Where the step that runs now (or ran last) is in its capture."""

    IDLE = "idle"  # no step open: the last captured one was queued
    SKIPPING = "skipping"  # a step the cadence does not capture runs (pre-hook to post-hook)
    SKIPPED = "skipped"  # it ended at the post-hook: a scaler.update() that follows closes nothing
    OPEN = "open"  # a captured step holds a staging set: gradients staged or captured at the pre-hook
    ENDED = "ended"  # its post-step parts are captured; queued once the scheduler, scaler or post-hook closes it


@dataclass
class OpenStep:
    """The step being captured on the training thread, until it is finalized and queued."""

    step: int
    buffers: BufferSet
    stepped: bool
    hyper: JSON = None
    tensors: dict[str, CapturedTensor] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    optimizer: JSON = None  # xor: the optimizer structure after the step (spec §8.2)
    pre_end: float = 0.0
    # Data parallel, exchanged when the step ends (before any collective of the next step):
    ranks: Future[RankStates | None] | None = None  # the other ranks' RNG states and data positions
    valid: Future[bool] | None = None  # xor's lazy snapshot: resolved at the next fence (snapshot.py)
    peer_residuals: dict[str, torch.Tensor] | None = None  # 'lowdiff' anchors: the other ranks' residuals
    # xor in pieces (docs/capture-runtime.md "Host memory"): the live tensors the writer reads
    # piece by piece, and their versions when the step ended (a change before they are read fails).
    live: dict[str, torch.Tensor] | None = None
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    nbytes: int = 0  # the state's bytes (the policy's step size)


HookResult = tuple[tuple[object, ...], dict[str, object]] | None


class StepLifecycle:
    """Captures each step from the optimizer's hooks and hands it to the background writer."""

    def __init__(self, parts: Parts, *, step: int) -> None:
        self.parts = parts
        self.phase = Phase.IDLE
        self.open: OpenStep | None = None  # the step in phase OPEN or ENDED
        self.step = step  # the last step that ended (captured or not)
        self.closed = False
        self.scalars: dict[str, float] = {}  # logged for the step that closes next (log())
        self.skipped_scalars: dict[str, float] = {}  # the last uncaptured step's, if close() captures it
        self.skipped_lrs: list[object] = []
        self.after_capture = True  # whether the step of the interval now running was captured
        self.background_mark = (0.0, False)  # the background's busy seconds and activity at the last pre-hook
        self.last_pre: float | None = None
        self.last_queued_at: float | None = None
        self.last_step_bytes = 0
        self.last_anchor = max([a for a in parts.writer.anchors if a <= step], default=step)
        self.state_keys = self.optimizer_state_keys()
        self.staged_versions: dict[str, tuple[int, int]] = {}

    # -- the hand-off of the previous step ----------------------------------------------------
    def fence(self) -> None:
        """Before the state changes or a staging set is taken: the last step's lazy copies are
        done and judged, and the writer has read (and the training thread judged) its pieces."""
        self.parts.lazy.fence()
        self.parts.pieces.hold()

    def settle(self) -> None:
        """As a forward pass starts: the last step's lazy snapshot or pieces are judged if their
        copies are done, without waiting, so that the writer can commit the step meanwhile."""
        self.parts.lazy.settle()
        self.parts.pieces.hold(wait=False)

    # -- the hooks -----------------------------------------------------------------------------
    def stage_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """``lowdiff+``: copy parameter ``index``'s gradient as soon as backward accumulated it."""

        def hook(p: torch.Tensor) -> None:
            # Staging only: fires once per micro-batch and before clipping/unscaling; the
            # pre-hook re-copies any gradient whose version changed since.
            if self.closed or p.grad is None:
                return
            started = time.perf_counter()
            buffers = self.stage_buffers()
            name = f"grad/{index}"
            grad = local(p.grad)
            self.parts.stager.copy(buffers.buffer(name, grad), grad)
            self.staged_versions[name] = (grad._version, grad.data_ptr())
            self.parts.stats.stall_s += time.perf_counter() - started

        return hook

    def forget_staged(self) -> None:
        """GradScaler.unscale_ rewrote the gradients in place without bumping their versions."""
        self.staged_versions.clear()

    def pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                 kwargs: dict[str, object]) -> HookResult:
        if nested_step(optimizer):
            return None  # super().step() inside a subclass's step: the outer call is the step
        started = time.perf_counter()
        parts = self.parts
        parts.raise_if_failed()
        if parts.exchanges is not None:
            # The previous step's exchange ran during this step's forward and backward: a failed
            # one (a rank died, a copy rank drifted) stops this step before it changes the state.
            parts.exchanges.settle()
        self.fence()  # the optimizer is about to change what the last step's snapshot copies
        if self.last_pre is not None:
            parts.stats.step_times.append(started - self.last_pre)
            self._account_interval(started - self.last_pre)
        self.last_pre = started
        if self.phase is Phase.SKIPPING:
            return None  # the step already began, uncaptured
        if self.phase is not Phase.OPEN:
            if self.phase is Phase.ENDED:
                self.finalize()  # the previous step, which no scheduler or scaler call closed
                parts.pieces.hold()
            if not self._begin_step():
                # Kept by reference (no copy, no GPU sync) in case close() captures this step.
                self.skipped_lrs = [group.get("lr") for group in optimizer.param_groups[:MAX_LR_GROUPS]]
                parts.stats.stall_s += time.perf_counter() - started
                return None
            self.stage_buffers()
            # The writer may have failed while this step waited for a buffer set (it keeps
            # handing sets back, unencoded, once it has): stop here, not a step later.
            parts.raise_if_failed()
        return self._pre_step(optimizer, args, kwargs, started)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object],
                  started: float) -> HookResult:
        """The captured step's gradients and hyperparameters, or a closure that captures them."""
        pending = self.open
        if pending is None:  # unreachable: stage_buffers always leaves an open step
            raise RuntimeError("ldformat capture has no pending step")
        stats = self.parts.stats
        if self.parts.kind != "state.xor":
            def failed() -> None:
                pending.stepped = False  # the optimizer will not step: nothing to replay

            wrapped = around_closure(args, kwargs, lambda: self._capture_gradients(optimizer, pending), failed)
            if wrapped is not None:
                pending.pre_end = time.perf_counter()
                stats.stall_s += pending.pre_end - started
                return wrapped
        self._capture_gradients(optimizer, pending)
        pending.pre_end = time.perf_counter()
        stats.stall_s += pending.pre_end - started
        return None

    def post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if nested_step(optimizer):
            return
        if self.phase is Phase.SKIPPING:
            self._end_uncaptured()
            return
        started = time.perf_counter()
        pending = self.open
        if pending is None or self.phase is Phase.ENDED:
            return
        parts = self.parts
        parts.stats.optimizer_times.append(started - pending.pre_end)
        if parts.committer is not None:
            parts.committer.step_ended(pending.step)
        self.capture_after_step(pending)
        if parts.scheduler is None and parts.scaler is None:
            self.finalize()
        parts.stats.stall_s += time.perf_counter() - started

    def after_scaler_update(self) -> None:
        started = time.perf_counter()
        if self.closed:
            return
        parts = self.parts
        parts.raise_if_failed()
        if self.phase is Phase.SKIPPED:  # the step ended uncaptured at the optimizer's post-hook
            self.phase = Phase.IDLE
            return
        if self.phase is not Phase.ENDED:
            # GradScaler skipped the step and a non-fused optimizer's hooks never fired.
            if self.open is None and not self._begin_step():
                self._end_uncaptured()
                self.phase = Phase.IDLE  # nothing follows the update that could close it
                return
            buffers = self.stage_buffers()
            pending = self.open
            if pending is None or pending.buffers is not buffers:
                raise RuntimeError("ldformat capture has no pending step")
            pending.stepped = False
            self.capture_after_step(pending)
        if parts.scheduler is None:
            self.finalize()
        parts.stats.stall_s += time.perf_counter() - started

    def after_scheduler_step(self) -> None:
        started = time.perf_counter()
        if self.closed or self.phase is not Phase.ENDED:
            return
        self.finalize()
        self.parts.stats.stall_s += time.perf_counter() - started

    # -- the phases ------------------------------------------------------------------------------
    def stage_buffers(self) -> BufferSet:
        """The open step's staging set; opens step ``step + 1`` with a free set if none is open."""
        if self.open is not None and self.phase is Phase.OPEN:
            return self.open.buffers
        if self.open is not None:  # the previous step was never finalized by a wrapper
            self.finalize()
        self.fence()  # before waiting for a buffer set: the background writer may wait for it
        buffers, waited = self.parts.pool.acquire()
        self.parts.stats.backpressure_s += waited  # part of the stall its caller times
        self.open, self.phase = OpenStep(step=self.step + 1, buffers=buffers, stepped=True), Phase.OPEN
        self.staged_versions = {}
        return buffers

    def _begin_step(self) -> bool:
        """Whether the step about to run is captured (:mod:`.cadence`); if not, it runs ``SKIPPING``."""
        step = self.step + 1
        if self.phase is Phase.SKIPPED:
            self.phase = Phase.IDLE
        self.skipped_scalars, self.skipped_lrs = {}, []
        cadence = self.parts.cadence
        self.after_capture = cadence.due(step)
        if self.after_capture:
            cadence.captured(step)
        else:
            self.phase = Phase.SKIPPING
        return self.after_capture

    def _end_uncaptured(self) -> None:
        """The uncaptured step ended: the live state moved on, the chain did not."""
        self.phase = Phase.SKIPPED
        self.step += 1
        # Logged for a step the chain does not hold, unless close() or flush() captures it.
        self.skipped_scalars, self.scalars = self.scalars, {}
        self.parts.stats.steps += 1

    def _account_interval(self, seconds: float) -> None:
        """One step interval, for the capture cadence (:meth:`Cadence.interval`)."""
        stats = self.parts.stats
        busy, active = stats.background_wall_s, self.parts.background.active
        clean = not self.after_capture and not active and self.background_mark == (busy, False)
        # The background's CPU time bounds what it can take from training (its I/O waits take nothing).
        self.parts.cadence.interval(seconds, after_capture=self.after_capture, clean=clean, stall_s=stats.stall_s,
                                    background_s=stats.background_cpu_s)
        self.background_mark = (busy, active)
        stats.capture_every, stats.overhead = self.parts.cadence.every, self.parts.cadence.overhead

    # -- what is copied where -----------------------------------------------------------------
    def _stage_copy(self, buffers: BufferSet, *, reuse_staged: bool = True) -> CopyToHost:
        """Copies into ``buffers``; a gradient unchanged since its staging copy is not copied again."""

        def copy(name: str, t: torch.Tensor) -> torch.Tensor:
            buf = buffers.buffer(name, t)
            if not reuse_staged or self.staged_versions.get(name) != (t._version, t.data_ptr()):
                self.parts.stager.copy(buf, t)  # not staged, or changed since (clipping, accumulation, unscale_)
            return buf

        return copy

    def _capture_gradients(self, optimizer: torch.optim.Optimizer, pending: OpenStep) -> None:
        """The gradients the optimizer is about to consume, and the hyperparameters it uses."""
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            pending.stepped = False  # a fused optimizer skips this step (GradScaler found inf)
            return
        parts = self.parts
        parts.writer.check_param_groups()
        pending.hyper = encode_param_groups(optimizer, with_params=False)
        inv_scale = inverse_scale(getattr(optimizer, "grad_scale", None))
        if parts.compress and parts.compressor is not None:
            parts.compressor.compress_(parts.model)
        # A scaled gradient is multiplied into a new tensor: never the staged copy.
        copy = self._stage_copy(pending.buffers, reuse_staged=inv_scale is None)
        pending.tensors.update(capture_gradients(parts.params, parts.param_names, parts.kind, parts.compressor,
                                                 copy, inv_scale=inv_scale))

    def capture_after_step(self, pending: OpenStep) -> None:
        """Buffers (or the whole state for xor), RNG and data position: final after the step."""
        parts = self.parts
        live, lazy = self._after_step_tensors(pending)
        eager = capture_tensors({n: t for n, t in live.items() if n not in lazy}, self._stage_copy(pending.buffers))
        # Nothing the training queues from here on may change a tensor before its copy is done
        # (the copies of the pre-hook, if any, ran alongside the optimizer step).
        parts.stager.mark(pending.buffers)
        parts.stager.fence(pending.buffers)
        if pending.live is not None:
            eager.update({n: CapturedTensor(bits=np.empty(0, np.uint8), dtype=dtype_name(t.dtype),
                                            shape=tuple(t.shape)) for n, t in pending.live.items()})
        elif lazy:
            later, pending.valid = parts.lazy.start(pending.step, lazy, pending.buffers)
            eager.update(later)
        pending.tensors.update({n: eager[n] for n in live})  # in the state's order
        pending.rng = capture_rng()
        pending.data = parts.data_state()
        if pending is self.open:
            self.phase = Phase.ENDED
        self._exchange_at_step_end(pending)

    def _after_step_tensors(self, pending: OpenStep) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What the step captures after ``optimizer.step()``, and which of it is copied later
        (lazily, or by the writer piece by piece); the buffers forward changes are copied now."""
        parts = self.parts
        lazy: dict[str, torch.Tensor] = {}
        if parts.mode != "xor":
            return live_buffers(parts.model, parts.buffer_names), lazy
        live, pending.optimizer = parts.writer.live_state()
        pending.nbytes = sum(t.numel() * t.element_size() for t in live.values())
        if parts.in_pieces:  # read by the writer, piece by piece; the buffers forward changes are staged now
            pending.live = {n: t for n, t in live.items() if n not in parts.buffer_keys}
            pending.versions = {n: (t._version, t.data_ptr()) for n, t in pending.live.items()}
            parts.stager.follow()  # the writer's copies come after the step's kernels, whatever its stream
            lazy = pending.live
        elif parts.lazy.enabled:  # parameters and optimizer state: copied while the next step runs
            lazy = {n: t for n, t in live.items() if n not in parts.buffer_keys}
        return live, lazy

    def _exchange_at_step_end(self, pending: OpenStep) -> None:
        """The other ranks join these as their step ends too (ResidualPeer), in this order. Here,
        not at finalize, which a scheduler stepped per epoch delays to the next step's pre-hook,
        after the next step's collectives: the peers would wait for rank 0 there, and rank 0 for
        them in those collectives."""
        parts = self.parts
        if parts.world_size > 1 and parts.compressor is not None and (
                pending.step - self.last_anchor >= parts.tuning.anchor_every):
            pending.peer_residuals = peer_residual_tensors(parts.compressor, parts.param_names, parts.process_group)
        if parts.exchanges is not None and parts.rank_extras is not None:  # the gather runs on its thread
            ranks = parts.exchanges.submit(pending.rng, pending.data, parts.digest())
            if parts.rank_extras.rank == 0:  # rank 0's writer waits for it and records the others'
                pending.ranks = ranks

    # -- the hand-off to the background writer ----------------------------------------------
    def finalize(self) -> None:
        """Queue the open step for the background writer (``IDLE`` again); the chain's step moves to it."""
        pending = self.open
        if pending is None:
            return
        ended = self.phase is Phase.ENDED
        self.open, self.phase = None, Phase.IDLE
        if not ended:
            self.capture_after_step(pending)
        parts = self.parts
        step = pending.step
        anchor, anchor_tensors, structure = self._anchor(pending)
        captured = CapturedStep(
            step=step,
            stepped=pending.stepped,
            hyper=pending.hyper if pending.stepped else None,  # xor: for Adam prediction only
            param_groups=encode_param_groups(parts.optimizer, with_params=True),
            extra=None,
            tensors=pending.tensors,
            anchor=anchor,
            anchor_tensors=anchor_tensors,
            optimizer=structure,
            scratch=True,  # the staging buffers, refilled only after the writer's encoded()
        )
        self.last_step_bytes = pending.nbytes or sum(ct.bits.nbytes for ct in pending.tensors.values())
        scalars, self.scalars = self.scalars, {}
        if pending.stepped and pending.hyper is not None:  # the lr the step used; a logged lr wins
            scalars = {**step_lrs(pending.hyper, MAX_SCALARS - len(scalars)), **scalars}
        self.last_queued_at = time.monotonic()
        self._queue(pending, captured, scalars)
        self.step = step
        parts.cadence.captured(step)
        parts.stats.captured += 1
        if anchor:
            self.last_anchor = step
        parts.stats.steps += 1
        parts.tuning.after_step(parts.writer, self.last_step_bytes)

    def _anchor(self, pending: OpenStep) -> tuple[bool, dict[str, torch.Tensor] | None, JSON]:
        """Whether the step is an anchor, and the anchor's tensors and optimizer structure when
        they are not the step's own (``None``: the writer builds the anchor from the step)."""
        parts = self.parts
        anchor = pending.step - self.last_anchor >= parts.tuning.anchor_every
        # A step the optimizer skipped can still create its state: a fused optimizer
        # initializes it before the kernel sees GradScaler's found_inf. Replay cannot rebuild
        # that, so such a step becomes an anchor of the live state.
        state_keys = self.optimizer_state_keys()
        live_anchor = (parts.mode != "xor" and parts.world_size == 1 and not pending.stepped
                       and state_keys != self.state_keys)
        self.state_keys = state_keys
        anchor = anchor or live_anchor
        anchor_tensors, structure = None, pending.optimizer
        # lowdiff+ anchors are the CPU replica's state, which equals the live state only when
        # training steps the optimizer on the CPU too (spec §11.8): on another device an
        # anchor is a snapshot of the live state, which re-seeds the replica.
        replica_exact = parts.device_type == "cpu"
        if anchor and (parts.mode == "lowdiff" or live_anchor or (parts.mode == "lowdiff+" and not replica_exact)):
            anchor_tensors, structure = parts.writer.snapshot_anchor()
            if pending.peer_residuals is not None:
                anchor_tensors.update(pending.peer_residuals)
        return anchor, anchor_tensors, structure

    def _queue(self, pending: OpenStep, captured: CapturedStep, scalars: dict[str, float]) -> None:
        parts = self.parts
        parts.pieces.hold()  # the step before, if it was read in pieces: judged before its verdict is replaced
        pieces, reading, judging = None, None, None
        if pending.live is not None:
            staged = {n: ct for n, ct in pending.tensors.items() if n not in pending.live}
            pieces, reading, judging = parts.pieces.hand_off(pending.step, pending.live, pending.versions, staged,
                                                             pending.buffers)
        parts.background.put(Queued(captured, parts.raw_extra(pending.rng, pending.data, None, scalars),
                                    pending.buffers, pending.ranks, self.last_queued_at, pending.valid,
                                    pieces, reading))
        parts.pieces.reading, parts.pieces.judging = reading, judging  # once queued: the writer sets reading

    def capture_live(self) -> None:
        """Capture the live state if steps ran since the last capture (``flush`` and ``close``:
        the chain then ends at the state training reached)."""
        parts = self.parts
        parts.lazy.fence()
        if (parts.mode != "xor" or self.open is not None or self.phase is Phase.SKIPPING
                or (self.step <= parts.cadence.last_captured and self.step not in parts.lazy.dropped)):
            return
        parts.pieces.hold()  # the writer may wait for its verdict before it hands the set back
        buffers, waited = parts.pool.acquire()
        parts.stats.backpressure_s += waited
        skipped = self.phase is Phase.SKIPPED
        self.open, self.phase = OpenStep(step=self.step, buffers=buffers, stepped=True), Phase.OPEN
        parts.cadence.captured(self.step)
        self.capture_after_step(self.open)
        lrs = {("lr" if g == 0 else f"lr/{g}"): float(lr) for g, lr in enumerate(self.skipped_lrs)
               if isinstance(lr, (int, float)) and not isinstance(lr, bool)
               or isinstance(lr, torch.Tensor) and lr.numel() == 1}
        self.scalars = {**lrs, **self.skipped_scalars, **self.scalars}  # the step's, as if it had been captured
        self.finalize()
        if skipped:  # the step this captured ended uncaptured: a scaler.update() after it still closes nothing
            self.phase = Phase.SKIPPED

    def finalize_ended(self) -> None:
        """Queue the step whose post-step parts are captured, if no wrapper closed it yet."""
        if self.phase is Phase.ENDED:
            self.finalize()

    def committed_all(self) -> None:
        """Every queued step is durable now: a crash loses only what runs from the last of them."""
        parts = self.parts
        if self.last_queued_at is not None and parts.writer.durable_step == self.step:
            parts.stats.durable_at = self.last_queued_at

    def log(self, scalars: dict[str, object]) -> None:
        checked = check_scalars(dict(scalars), len(set(self.scalars) - set(scalars)))
        self.scalars.update(checked)

    def optimizer_state_keys(self) -> frozenset[tuple[int, str]]:
        state = self.parts.optimizer.state
        return frozenset((i, k) for i, p in enumerate(self.parts.params) for k in state.get(p, {}))
