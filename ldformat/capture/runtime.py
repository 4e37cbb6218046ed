"""The capture runtime: checkpoint every step without stalling training (spec §20; extra state §19).

``Checkpointer`` hooks into the optimizer and captures each step at the points where its
parts are final:

* the optimizer step **pre-hook** of step ``t``: the gradients the optimizer consumes (after
  clipping and unscaling) and the hyperparameters it uses;
* the step **post-hook**: buffers (and for ``xor`` the whole state), RNG states, the data
  position;
* when the wrapped ``scheduler.step()`` (else ``scaler.update()``, else the post-hook)
  returns: the live param groups, scheduler and scaler state. The step is then complete and
  queued.

The training thread only copies into reused host buffers; a background thread encodes,
writes and commits. Training blocks only when every buffer set is in flight.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import os
import queue
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import LdformatError, UnsupportedStateError, UsageError
from ..jsonvalue import encode
from ..log import ROOT_FILE
from ..manifest import SlotInfo, StepEntry
from ..reader import ChainReader
from ..replay import Replayer
from ..state import encode_param_groups
from ..stores import Store
from ..topk import TopK
from ..writer import CapturedStep, CapturedTensor, ChainWriter
from .policy import AdaptiveTuner, PolicyInputs, optimal_anchor_every, optimal_batch_steps
from .rng import capture_rng
from .staging import BufferPool, BufferSet, Stager

log = logging.getLogger("ldformat.capture")

MODES = {"lowdiff": "grad.topk", "lowdiff+": "grad.dense", "xor": "state.xor"}
DEFAULT_ANCHOR_EVERY = 100
DEFAULT_BATCH_STEPS = 4
POLICY_WARMUP_STEPS = 8


@dataclass
class CaptureStats:
    """What the runtime measured. Times in seconds."""

    steps: int = 0
    stall_s: float = 0.0  # training thread inside ldformat: hooks, copies, back-pressure
    backpressure_s: float = 0.0  # part of stall_s spent waiting for a free buffer set
    background_cpu_s: float = 0.0  # CPU time of the background writer thread
    background_wall_s: float = 0.0
    commits: int = 0
    anchors_written: int = 0
    # The most recent per-step measurements (bounded: the policy reads the last 50).
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    optimizer_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    stalls: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    policy: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "stall_s": self.stall_s,
            "backpressure_s": self.backpressure_s,
            "background_cpu_s": self.background_cpu_s,
            "background_wall_s": self.background_wall_s,
            "commits": self.commits,
            "anchors_written": self.anchors_written,
            "policy": self.policy,
        }


@dataclass
class _Pending:
    step: int
    buffers: BufferSet
    stepped: bool
    hyper: Any = None
    tensors: dict[str, CapturedTensor] = field(default_factory=dict)
    rng: Any = None
    data: Any = None
    post_done: bool = False
    pre_end: float = 0.0


class Checkpointer:
    """Checkpoint every optimizer step into an ldformat chain, off the training thread.

    Args:
        path: the chain directory (created, or re-opened to append).
        model, optimizer: the live training objects.
        mode: ``"lowdiff"`` (top-k compressed gradients, kind ``grad.topk``), ``"lowdiff+"``
            (dense gradients staged during backward plus a CPU replica, ``grad.dense``) or
            ``"xor"`` (bitwise state deltas, ``state.xor``).
        scheduler, scaler: an LR scheduler and a GradScaler whose state is captured (their
            ``step``/``update`` methods are wrapped while the checkpointer is open).
        sampler: an object with ``state_dict``/``load_state_dict`` (e.g.
            :class:`ResumableSampler`) whose position is captured.
        anchor_every, batch_steps: in steps, or ``"auto"`` (wasted-time model, spec §20.6).
        topk_ratio: the top-k ratio of ``lowdiff`` mode.
        compressor: a :class:`TopK` to use (e.g. the one a DDP comm hook runs); with
            ``compress=False`` the checkpointer does not compress, it only reads the
            compressor's indices.
        max_stall: bound on the measured stall fraction the adaptive tuner keeps.
        mtbf_hours: mean time between failures, for the policy.
        queue_depth: steps that may wait for the background writer before training blocks.
        stage_during_backward: ``lowdiff+`` copies each gradient to host memory as soon as
            backward has accumulated it, overlapping the copy with the rest of backward.
            Default: only on CUDA; on a CPU nothing runs alongside, so the copy is made
            once at ``optimizer.step()`` instead (clipping or accumulation would otherwise
            make it copy twice).
        step: the step the live state is at when re-opening a chain (default: the chain's
            latest step). Steps after it are truncated, since training will redo them.
        rank, world_size: for data-parallel training; only rank 0 writes.

    Example:
        >>> ck = Checkpointer("runs/chain", model, optimizer, mode="lowdiff")   # doctest: +SKIP
        >>> for x, y in loader:                                                  # doctest: +SKIP
        ...     optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        >>> ck.close()                                                           # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mode: str = "lowdiff",
        scheduler: Any = None,
        scaler: Any = None,
        sampler: Any = None,
        anchor_every: int | str = "auto",
        batch_steps: int | str = "auto",
        topk_ratio: float = 0.01,
        compressor: TopK | None = None,
        compress: bool = True,
        max_stall: float = 0.035,
        mtbf_hours: float = 24.0,
        queue_depth: int = 2,
        max_batch_bytes: int = 1 << 30,
        stage_during_backward: bool | None = None,
        step: int | None = None,
        extra: dict[str, Any] | None = None,
        store: Store | None = None,
        process_group: Any = None,
    ) -> None:
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if queue_depth < 1:
            raise UsageError("queue_depth must be >= 1")
        self.path = str(path)
        self.mode = mode
        self.kind = MODES[mode]
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.user_extra: dict[str, Any] = dict(extra or {})
        self.compressor = compressor if compressor is not None else (TopK(topk_ratio) if mode == "lowdiff" else None)
        self._compress = compress and mode == "lowdiff"
        self.mtbf_s = mtbf_hours * 3600.0
        self.process_group = process_group
        self.world_size = _world_size(process_group)
        if self.world_size > 1 and (mode != "lowdiff" or anchor_every == "auto"):
            raise UsageError(
                "with several ranks, run Checkpointer on rank 0 in mode 'lowdiff' with an integer anchor_every, "
                "and ResidualPeer with the same anchor_every on every other rank"
            )
        self.max_batch_bytes = max_batch_bytes
        self._auto_anchor = anchor_every == "auto"
        self._auto_batch = batch_steps == "auto"
        self.anchor_every = DEFAULT_ANCHOR_EVERY if self._auto_anchor else _positive(anchor_every, "anchor_every")
        self.batch_steps = DEFAULT_BATCH_STEPS if self._auto_batch else _positive(batch_steps, "batch_steps")
        self.tuner = AdaptiveTuner(max_stall=max_stall)
        self.stats = CaptureStats()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self.stager = Stager(device)
        self.pool = BufferPool(queue_depth + 1, pin=self._cuda)
        self._queue: queue.Queue[tuple[CapturedStep, BufferSet] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._pending: _Pending | None = None
        self._last_pre: float | None = None
        self._anchor_write_s: float | None = None
        self._closed = False
        self._policy_done = False
        self._last_step_bytes = 0
        self._stall_accounted = 0.0

        started = time.perf_counter()
        self.writer = self._open_writer(step, store)
        self.writer.max_batch_bytes = max_batch_bytes  # bounds memory whether batch_steps is stated or auto
        if self.writer.commits:  # create() wrote the first anchor
            self._anchor_write_s = time.perf_counter() - started
        self._step = int(self.writer.last_step or 0)
        self._last_anchor = max([a for a in self.writer.anchors if a <= self._step], default=self._step)
        self._param_names: list[str] = self.writer.root.schema["optimizer"]["params"]
        self._params = params
        self._state_keys = self._optimizer_state_keys()
        self._replica: Replayer | None = None
        if mode == "lowdiff+":
            self._replica = self._make_replica()
        self._staged_versions: dict[int, tuple[int, int]] = {}
        self._handles: list[Any] = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
        ]
        if stage_during_backward is None:
            stage_during_backward = self._cuda
        if mode == "lowdiff+" and stage_during_backward:
            for i, p in enumerate(params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._stage_hook(i)))
        self._unwrap: list[Callable[[], None]] = []
        if scheduler is not None:
            self._wrap(scheduler, "step", self._after_scheduler_step)
        if scaler is not None:
            self._wrap(scaler, "update", self._after_scaler_update)
            # GradScaler.unscale_ (also called inside scaler.step) rewrites the gradients in
            # place without bumping their version counters: re-copy every staged gradient.
            self._wrap(scaler, "unscale_", lambda: self._staged_versions.clear())
        self._thread = threading.Thread(target=self._worker, name="ldformat-writer", daemon=True)
        self._thread.start()
        _open_checkpointers.add(self)

    # -- opening --------------------------------------------------------------------------
    def _open_writer(self, step: int | None, store: Store | None) -> ChainWriter:
        exists = store.exists(ROOT_FILE) if store is not None else (Path(self.path) / ROOT_FILE).exists()
        common: dict[str, Any] = {"compressor": self.compressor, "batch_steps": self.batch_steps, "store": store,
                  "capture_hook": False}
        if not exists:
            return ChainWriter.create(self.path, self.model, self.optimizer, kind=self.kind, step=step or 0,
                                      extra=self._raw_extra(capture_rng(), self._data_state()), **common)
        reader = ChainReader(self.path, store=store)
        if reader.kind != self.kind:
            raise UsageError(f"{self.path}: the chain has kind {reader.kind}; mode {self.mode!r} writes {self.kind}")
        latest = reader.latest_step
        target = latest if step is None else step
        if latest is not None and target is not None and target != latest:
            if target not in reader.steps:
                raise UsageError(f"{self.path}: step {target} is not in the chain; resume from one of its steps")
            from ..compact import truncate

            log.warning("%s: truncating steps after %d: training resumes from there", self.path, target)
            truncate(self.path, target, store=store)
        if self.compressor is not None and target is not None:
            tensors = reader.load_anchor_tensors(target) if target in reader.anchors else {}
            residuals = {n[len("compressor/"):]: t for n, t in tensors.items() if n.startswith("compressor/")}
            if residuals:
                self.compressor.load_residuals(residuals)
            else:
                log.warning("%s: step %s holds no top-k residuals (a delta step or a compaction anchor): they "
                            "restart from zero; resume from a writer's anchor for an exact continuation",
                            self.path, target)
                self.compressor.load_residuals({})
        return ChainWriter.open(self.path, self.model, self.optimizer, **common)

    def _make_replica(self) -> Replayer:
        tensors = {n: t.clone() for n, t in self.writer.snapshot_anchor_tensors().items()
                   if not n.startswith("compressor/")}
        groups = encode_param_groups(self.optimizer, with_params=True)
        return Replayer(self.writer.root, tensors, groups, {})

    def _wrap(self, obj: Any, name: str, after: Callable[[], None]) -> None:
        """Run ``after`` whenever ``obj.<name>()`` returns.

        A per-instance subclass overrides the method, so that nothing lands in the object's
        ``__dict__`` (schedulers put their ``__dict__`` into ``state_dict``).
        """
        cls = type(obj)

        def wrapped(this: Any, *args: Any, **kwargs: Any) -> Any:
            result = getattr(cls, name)(this, *args, **kwargs)
            after()
            return result

        obj.__class__ = type(cls.__name__, (cls,), {name: wrapped, "__module__": cls.__module__})

        def restore() -> None:
            obj.__class__ = cls

        self._unwrap.append(restore)

    # -- training-thread capture -------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = self._error
            raise LdformatError(f"{self.path}: the checkpoint writer failed: {error}") from error

    def _stage_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            # Staging only: fires once per micro-batch and before clipping/unscaling; the
            # pre-hook re-copies any gradient whose version changed since.
            if self._closed or p.grad is None:
                return
            started = time.perf_counter()
            buffers = self._stage_buffers()
            self.stager.copy(buffers.buffer(f"grad/{index}", p.grad), p.grad)
            self._staged_versions[index] = (p.grad._version, p.grad.data_ptr())
            self.stats.stall_s += time.perf_counter() - started

        return hook

    def _stage_buffers(self) -> BufferSet:
        if self._pending is not None and not self._pending.post_done:
            return self._pending.buffers
        if self._pending is not None:  # the previous step was never finalized by a wrapper
            self._finalize()
        buffers, waited = self.pool.acquire()
        self.stats.backpressure_s += waited
        self.stats.stall_s += waited
        self._pending = _Pending(step=self._step + 1, buffers=buffers, stepped=True)
        self._staged_versions = {}
        return buffers

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        started = time.perf_counter()
        self._raise_if_failed()
        if self._last_pre is not None:
            self.stats.step_times.append(started - self._last_pre)
        self._last_pre = started
        if self._pending is None or self._pending.post_done:
            self._stage_buffers()
        pending = self._pending
        if pending is None:  # unreachable: _stage_buffers always leaves a pending step
            raise RuntimeError("ldformat capture has no pending step")
        found_inf = getattr(optimizer, "found_inf", None)
        grad_scale = getattr(optimizer, "grad_scale", None)
        if found_inf is not None and float(found_inf) != 0.0:
            pending.stepped = False  # a fused optimizer skips this step (GradScaler found inf)
        else:
            self.writer.check_param_groups()
            pending.hyper = encode_param_groups(optimizer, with_params=False)
            inv_scale = _inverse_scale(grad_scale)
            if self.mode == "lowdiff":
                self._capture_topk(pending, inv_scale)
            elif self.mode == "lowdiff+":
                self._capture_dense(pending, inv_scale)
        pending.pre_end = time.perf_counter()
        self.stats.stall_s += pending.pre_end - started

    def _capture_topk(self, pending: _Pending, inv_scale: float | None) -> None:
        if self.compressor is None:
            raise UsageError("lowdiff mode needs a TopK compressor")
        if self._compress:
            self.compressor.compress_(self.model)
        for i, p in enumerate(self._params):
            if p.grad is None:
                continue
            idx = self.compressor.indices.get(self._param_names[i])
            if idx is None:
                raise UsageError(f"parameter {self._param_names[i]!r} has a gradient the TopK compressor did not "
                                 "compress this step")
            values = p.grad.detach().reshape(-1)[idx]
            if inv_scale is not None:
                values = values * inv_scale
            vbuf = pending.buffers.buffer(f"grad/{i}", values, numel=values.numel())
            ibuf = pending.buffers.buffer(f"index/{i}", idx, numel=idx.numel())
            self.stager.copy(vbuf, values)
            self.stager.copy(ibuf, idx)
            pending.tensors[f"grad/{i}"] = CapturedTensor.of(vbuf, shape=tuple(p.shape), indices=ibuf.numpy())

    def _capture_dense(self, pending: _Pending, inv_scale: float | None) -> None:
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            buf = pending.buffers.buffer(f"grad/{i}", g)
            if inv_scale is not None:
                self.stager.copy(buf, g.detach() * inv_scale)
            elif self._staged_versions.get(i) != (g._version, g.data_ptr()):
                self.stager.copy(buf, g)  # changed since staged (clipping, accumulation, unscale_)
            pending.tensors[f"grad/{i}"] = CapturedTensor.of(buf)

    def _capture_after_step(self, pending: _Pending) -> None:
        """Buffers (or the whole state for xor), RNG and data position: final after the step."""
        if self.mode == "xor":
            for name, t in self.writer.live_state_tensors().items():
                buf = pending.buffers.buffer(name, t)
                self.stager.copy(buf, t)
                pending.tensors[name] = CapturedTensor.of(buf)
        else:
            sd = self.model.state_dict(keep_vars=True)
            for e in self.writer.root.schema["model"]:
                if e["role"] == "buffer" and e["alias_of"] is None:
                    t = sd[e["name"]]
                    buf = pending.buffers.buffer(f"model/{e['name']}", t)
                    self.stager.copy(buf, t)
                    pending.tensors[f"model/{e['name']}"] = CapturedTensor.of(buf)
        pending.rng = capture_rng()
        pending.data = self._data_state()
        pending.post_done = True

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        started = time.perf_counter()
        pending = self._pending
        if pending is None or pending.post_done:
            return
        self.stats.optimizer_times.append(started - pending.pre_end)
        self._capture_after_step(pending)
        if self.scheduler is None and self.scaler is None:
            self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _after_scaler_update(self) -> None:
        started = time.perf_counter()
        if self._closed:
            return
        self._raise_if_failed()
        if self._pending is None or not self._pending.post_done:
            # GradScaler skipped the step and a non-fused optimizer's hooks never fired.
            buffers = self._stage_buffers()
            pending = self._pending
            if pending is None or pending.buffers is not buffers:
                raise RuntimeError("ldformat capture has no pending step")
            pending.stepped = False
            self._capture_after_step(pending)
        if self.scheduler is None:
            self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _after_scheduler_step(self) -> None:
        started = time.perf_counter()
        if self._closed or self._pending is None or not self._pending.post_done:
            return
        self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _finalize(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if not pending.post_done:
            self._capture_after_step(pending)
        step = pending.step
        anchor = step - self._last_anchor >= self.anchor_every
        # A step the optimizer skipped can still create its state: a fused optimizer
        # initializes it before the kernel sees GradScaler's found_inf. Replay cannot rebuild
        # that, so such a step becomes an anchor of the live state.
        state_keys = self._optimizer_state_keys()
        live_anchor = (self.mode != "xor" and self.world_size == 1 and not pending.stepped
                       and state_keys != self._state_keys)
        self._state_keys = state_keys
        anchor = anchor or live_anchor
        anchor_tensors = None
        if anchor and (self.mode == "lowdiff" or live_anchor):
            anchor_tensors = self.writer.snapshot_anchor_tensors()
            if self.world_size > 1 and self.compressor is not None:
                ranks = gather_residuals(self.compressor, self._param_names, self.process_group)
                for r, residuals in ranks.items():
                    if r > 0:
                        anchor_tensors.update({f"compressor@{r}/{n}": t for n, t in residuals.items()})
        captured = CapturedStep(
            step=step,
            stepped=pending.stepped,
            hyper=pending.hyper if pending.stepped and self.mode != "xor" else None,
            param_groups=encode_param_groups(self.optimizer, with_params=True),
            extra=self._raw_extra(pending.rng, pending.data),  # encoded by the background writer
            tensors=pending.tensors,
            anchor=anchor,
            anchor_tensors=anchor_tensors,
            owned=False,
        )
        self._last_step_bytes = sum(ct.bits.nbytes for ct in pending.tensors.values())
        self.stager.mark(pending.buffers)
        self._queue.put((captured, pending.buffers))
        self._step = step
        if anchor:
            self._last_anchor = step
        self.stats.steps += 1
        self._tune()

    def _optimizer_state_keys(self) -> frozenset[tuple[int, str]]:
        return frozenset((i, k) for i, p in enumerate(self._params) for k in self.optimizer.state.get(p, {}))

    def _raw_extra(self, rng: Any, data: Any) -> dict[str, Any]:
        """The extra state of this step as Python values (spec §19.1); copies, not live objects."""
        extra: dict[str, Any] = {"rng": rng}
        if self.scheduler is not None:
            extra["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        if data is not None:
            extra["data"] = data
        extra["policy"] = {"anchor_every": self.anchor_every, "batch_steps": self.batch_steps}
        if "inputs" in self.stats.policy:  # the measurements the wasted-time model used
            extra["policy"]["inputs"] = dict(self.stats.policy["inputs"])
        if self.user_extra:
            extra["user"] = copy.deepcopy(self.user_extra)
        return extra

    def _data_state(self) -> Any:
        return self.sampler.state_dict() if self.sampler is not None else None

    # -- policy -------------------------------------------------------------------------------
    def policy_inputs(self) -> PolicyInputs | None:
        """The measurements the policy uses, once enough steps were seen."""
        if len(self.stats.step_times) < POLICY_WARMUP_STEPS or not self.stats.optimizer_times:
            return None
        anchor_write = self._anchor_write_s
        if anchor_write is None:
            nbytes = sum(t.numel() * t.element_size() for t in self.writer.live_state_tensors().values())
            anchor_write = nbytes / 200e6  # until one is measured: a conservative 200 MB/s
        return PolicyInputs(
            step_time_s=statistics.median(list(self.stats.step_times)[-50:]),
            anchor_write_s=anchor_write,
            replay_step_s=statistics.median(list(self.stats.optimizer_times)[-50:]),
            commit_s=self.writer.last_commit_seconds or 0.005,
            mtbf_s=self.mtbf_s,
        )

    def _tune(self) -> None:
        if self.stats.step_times:
            stall = self.stats.stall_s - self._stall_accounted
            self._stall_accounted = self.stats.stall_s
            self.stats.stalls.append(stall)
            self.tuner.observe(stall, self.stats.step_times[-1])
        if not self._policy_done and (self._auto_anchor or self._auto_batch):
            inputs = self.policy_inputs()
            if inputs is not None:
                self._policy_done = True
                if self._auto_anchor:
                    self.anchor_every = optimal_anchor_every(inputs)
                if self._auto_batch:
                    per_step = self._last_step_bytes or 1
                    upper = max(1, min(256, self.max_batch_bytes // per_step))
                    self.batch_steps = optimal_batch_steps(inputs, upper=upper)
                    self.writer.batch_steps = self.batch_steps
                self.stats.policy = {"inputs": inputs.to_dict(), "anchor_every": self.anchor_every,
                                     "batch_steps": self.batch_steps}
                log.info(
                    "ldformat policy for %s: anchor_every=%d batch_steps=%d (step %.3fs, anchor write %.3fs, "
                    "replay %.4fs/step, commit %.4fs, MTBF %.1fh)", self.path, self.anchor_every, self.batch_steps,
                    inputs.step_time_s, inputs.anchor_write_s, inputs.replay_step_s, inputs.commit_s,
                    inputs.mtbf_s / 3600)
        if self.tuner.due():
            anchor_every, batch_steps, fraction = self.tuner.adjust(self.anchor_every, self.batch_steps)
            self.stats.policy["last_stall_fraction"] = fraction
            # Explicit values are kept (ranks of data-parallel lowdiff rely on anchor_every).
            anchor_every = anchor_every if self._auto_anchor else self.anchor_every
            batch_steps = batch_steps if self._auto_batch else self.batch_steps
            if (anchor_every, batch_steps) != (self.anchor_every, self.batch_steps):
                log.info("ldformat: stall %.1f%% > %.1f%%: anchor_every %d -> %d, batch_steps %d -> %d",
                         100 * fraction, 100 * self.tuner.max_stall, self.anchor_every, anchor_every,
                         self.batch_steps, batch_steps)
                self.anchor_every, self.batch_steps = anchor_every, batch_steps
                self.writer.batch_steps = batch_steps

    # -- background writer --------------------------------------------------------------------
    def _worker(self) -> None:
        cpu_start = time.thread_time()
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                break
            captured, buffers = item
            started = time.perf_counter()
            try:
                if self._error is None:
                    # JSON encoding of the extra state (RNG states...) is off the training thread.
                    captured.extra = encode(captured.extra, "extra")
                    Stager.wait(buffers)
                    commits = self.writer.commits
                    if self._replica is not None:
                        self._apply_to_replica(captured)
                    self.writer.append(captured)
                    if self.writer.commits != commits:
                        self.stats.commits += self.writer.commits - commits
                    if captured.anchor:
                        self.stats.anchors_written += 1
                        self._anchor_write_s = time.perf_counter() - started
            except BaseException as e:  # surfaced in the training thread at its next call
                self._error = e
                log.error("%s: checkpoint writer failed at step %d: %s", self.path, captured.step, e)
            finally:
                self.stats.background_wall_s += time.perf_counter() - started
                self.stats.background_cpu_s = time.thread_time() - cpu_start
                self.pool.release(buffers)
                self._queue.task_done()

    def _apply_to_replica(self, captured: CapturedStep) -> None:
        if self._replica is None:
            return
        row = {name: (ct.indices, ct.bits) for name, ct in captured.tensors.items()}
        slots = {name: SlotInfo(name=name, dtype=ct.dtype, shape=ct.shape, encoding="dense")
                 for name, ct in captured.tensors.items()}
        entry = StepEntry(step=captured.step, base=captured.step - 1, row=0, stepped=captured.stepped,
                          hyper=captured.hyper, param_groups=captured.param_groups, extra=captured.extra)
        self._replica.apply_grad_step(entry, row, slots, f"{self.path} replica (step {captured.step})")
        if captured.anchor and captured.anchor_tensors is not None:  # a live snapshot: re-seed the replica
            self._replica = Replayer(self.writer.root, {n: t.clone() for n, t in captured.anchor_tensors.items()},
                                     captured.param_groups, captured.extra)
        elif captured.anchor:
            self._replica.sync_optimizer_tensors()
            captured.anchor_tensors = {n: t.detach() for n, t in self._replica.tensors.items()}

    # -- public control -----------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The last captured step (queued; see :attr:`durable_step`)."""
        return self._step

    @property
    def durable_step(self) -> int | None:
        return self.writer.durable_step

    def flush(self) -> int | None:
        """Wait for every queued step, commit, and return the last durable step."""
        if self._pending is not None and self._pending.post_done:
            self._finalize()
        self._queue.join()
        self._raise_if_failed()
        return self.writer.commit()

    def recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """``lowdiff+``: restore the live objects from the in-memory replica (no storage read).

        Returns the step restored. The replica equals the chain's state at that step.
        """
        if self._replica is None:
            raise UsageError("recover() needs mode='lowdiff+' (the only mode with an in-memory replica)")
        if self._pending is not None and self._pending.post_done:
            self._finalize()
        self._queue.join()
        self._raise_if_failed()
        state = self._replica.result(self._step)
        model.load_state_dict(state["model"])
        # Optimizer.load_state_dict keeps the tensors it is given: hand it copies, or the
        # live optimizer and the replica would share (and both step) the same state.
        optimizer.load_state_dict({
            "state": {i: {k: v.clone() for k, v in st.items()} for i, st in state["optimizer"]["state"].items()},
            "param_groups": state["optimizer"]["param_groups"],
        })
        return self._step

    def close(self) -> int | None:
        """Flush and commit everything, stop the background thread, remove every hook."""
        if self._closed:
            return self.writer.durable_step
        try:
            if self._error is None and self._pending is not None and (
                self._pending.post_done or self._pending.hyper is not None
            ):
                self._finalize()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            for h in self._handles:
                h.remove()
            for restore in reversed(self._unwrap):
                restore()
            _open_checkpointers.discard(self)
        if self._error is not None:
            self.writer.abort()
            self._raise_if_failed()
        return self.writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _world_size(group: Any) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def gather_residuals(topk: TopK, names: list[str], group: Any) -> dict[int, dict[str, torch.Tensor]]:
    """All-gather every rank's top-k residuals (a collective: every rank must call it)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(world)}
    for name in dict.fromkeys(names):
        residual = topk.residuals.get(name)
        if residual is None:
            continue
        parts = [torch.empty_like(residual) for _ in range(world)]
        dist.all_gather(parts, residual.contiguous(), group=group)
        for r, t in enumerate(parts):
            out[r][name] = t.to("cpu", copy=True)
    return out


class ResidualPeer:
    """On ranks other than 0: hand this rank's top-k residuals to rank 0's anchors.

    Rank 0 runs a :class:`Checkpointer` (mode ``lowdiff``, an integer ``anchor_every``);
    every other rank runs a ResidualPeer with the same ``anchor_every`` and start ``step``,
    so that both sides join the same all-gather at every anchor step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: TopK, *, anchor_every: int,
                 model: torch.nn.Module, step: int = 0, process_group: Any = None, scaler: Any = None) -> None:
        self.compressor = compressor
        self.anchor_every = _positive(anchor_every, "anchor_every")
        self.step = step
        self.process_group = process_group
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), name)
        self._names = [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
        self._last_anchor = step
        self._stepped = False
        self._handle = optimizer.register_step_post_hook(self._post_hook)
        self._scaler = scaler
        self._scaler_class = type(scaler) if scaler is not None else None
        if scaler is not None:
            # Count steps like the Checkpointer: one per scaler.update(), skipped or not.
            cls = type(scaler)
            peer = self

            def update(this: Any, *args: Any, **kwargs: Any) -> Any:
                result = cls.update(this, *args, **kwargs)
                peer._count_step()
                return result

            scaler.__class__ = type(cls.__name__, (cls,), {"update": update, "__module__": cls.__module__})

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._scaler is None:
            self._count_step()

    def _count_step(self) -> None:
        self.step += 1
        if self.step - self._last_anchor >= self.anchor_every:
            gather_residuals(self.compressor, self._names, self.process_group)
            self._last_anchor = self.step

    def close(self) -> None:
        self._handle.remove()
        if self._scaler is not None and self._scaler_class is not None:
            self._scaler.__class__ = self._scaler_class


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer or 'auto', got {value!r}")
    return value


def _inverse_scale(grad_scale: torch.Tensor | None) -> float | None:
    if grad_scale is None:
        return None
    scale = float(grad_scale)
    mantissa, _ = math.frexp(scale)
    if mantissa != 0.5:
        raise UnsupportedStateError(
            f"GradScaler scale {scale} is not a power of two; exact capture needs power-of-two scales "
            "(the default init_scale, growth_factor and backoff_factor are)"
        )
    return 1.0 / scale


_open_checkpointers: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _close_at_exit() -> None:
    # Interpreter exit flushes a partial batch rather than dropping it.
    for ck in list(_open_checkpointers):
        try:
            ck.close()
        except Exception as e:  # nothing to raise to at exit
            log.error("ldformat: closing %s at exit failed: %s", ck.path, e)


# Interpreter exit first runs threading's exit hooks, among them the one that makes every
# ThreadPoolExecutor refuse new work (zarr encodes through one), then the atexit handlers.
# Flush among the former, before that hook: those run in reverse order of registration.
import concurrent.futures.thread  # noqa: E402,F401  (registers its hook before ours)

if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]
else:  # pragma: no cover
    atexit.register(_close_at_exit)
