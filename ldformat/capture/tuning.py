"""The anchor interval and batch size in force, measured and retuned.

:mod:`.policy` holds the wasted-time model (docs/capture-runtime.md
"Anchor interval and batch size"); this module feeds it while the runtime runs. It keeps what
the runtime measured (:class:`CaptureStats`, including the stall of docs/capture-runtime.md
"Pipeline"), chooses ``"auto"`` values once, after :data:`POLICY_WARMUP_STEPS` step
intervals, and doubles both values when the training thread stalls more than ``max_stall``.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import UsageError
from ..format.dtensors import local
from .policy import AdaptiveTuner, PolicyInputs, optimal_anchor_every, optimal_batch_steps
from .staging import host_bytes
from .stats import CaptureStats

if TYPE_CHECKING:
    from ..chain.writer import ChainWriter
    from .cadence import Cadence


log = logging.getLogger("ldformat.capture")


DEFAULT_ANCHOR_EVERY = 100  # in force until the policy has run


DEFAULT_BATCH_STEPS = 4


POLICY_WARMUP_STEPS = 8


ASSUMED_ANCHOR_BYTES_PER_S = 200e6  # anchor write speed until one is measured (conservative)


ASSUMED_COMMIT_S = 0.005  # commit cost until one is measured


MEDIAN_OF_STEPS = 50  # the policy reads medians over this many of the latest steps


MAX_AUTO_BATCH_STEPS = 256


DEFAULT_MAX_LOST_S = 60.0  # seconds of training an automatic batch_steps may put at risk


Interval = int | Literal["auto"]


def check_budget(max_bytes: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 each_rank: bool = False) -> None:
    """Refuse a ``max_bytes`` that cannot hold two anchors of the current state (before training);
    ``each_rank``: it is one rank's share of the budget, for that rank's local shards."""
    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    state = sum(size(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    state += sum(size(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    if not isinstance(max_bytes, int) or max_bytes < 2 * state:
        what = f"max_bytes={max_bytes!r}" if not each_rank else (
            f"this rank's share of max_bytes ({max_bytes!r} bytes, the budget divided by the world size)")
        raise UsageError(f"{what} cannot hold two anchors of the current state ({state} bytes "
                         f"each, without the optimizer state it has yet to create); give at least {2 * state}"
                         f"{' per rank' if each_rank else ''}, better several times more")


#: The share of this machine's memory (physical, or the container's limit when lower) that the
#: staging buffers of one machine's processes may take by default: the rest is training's
#: own (the data loader, the model's host copies) and the writer's XOR base, another copy
#: of the state outside the budget.
DEFAULT_HOST_FRACTION = 0.25


FALLBACK_HOST_BYTES = 8 << 30  # when the machine's memory cannot be read


#: Per-parameter state an optimizer creates at its first step, in multiples of the parameter's
#: bytes, for the classes that create it lazily; any other class is assumed to keep Adam's 2.
LAZY_STATE = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2, "ASGD": 1,
              "RMSprop": 1, "SGD": 0, "Adagrad": 1, "SparseAdam": 2, "LBFGS": 0,
              # Widely used classes outside torch.optim that keep more than Adam's two (timm's names).
              "Adan": 4, "MADGRAD": 3, "Mars": 3}


SCALAR_STATE_BYTES = 64  # a parameter's scalar state tensors (``step``, ...): a few small buffers


def machine_memory() -> int | None:
    """This machine's memory in bytes, or the container's limit (cgroup) when lower; None if unknown."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not on every platform
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            total = int(text) if total is None else min(total, int(text))
        break
    return total if total is not None and total > 0 else None


def default_max_host_bytes() -> int:
    """The staging budget without ``max_host_bytes``: :data:`DEFAULT_HOST_FRACTION` of the machine's
    memory, divided by ``LOCAL_WORLD_SIZE`` (set by torchrun: the processes of one job on this
    machine), or :data:`FALLBACK_HOST_BYTES` per process when the memory cannot be read."""
    total = machine_memory()
    if total is None:
        return FALLBACK_HOST_BYTES
    local_processes = os.environ.get("LOCAL_WORLD_SIZE", "")
    share = int(local_processes) if local_processes.isdigit() and int(local_processes) > 1 else 1
    return max(1, int(total * DEFAULT_HOST_FRACTION) // share)


def staging_set_bytes(mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, pin: bool,
                      topk_k: Callable[[int], int] | None = None) -> int:
    """The host bytes one buffer set of a step takes (:mod:`.staging`), as the budget counts them:
    ``xor`` the whole state, including the optimizer state not created yet (:data:`LAZY_STATE`);
    ``lowdiff+`` every gradient and the buffers; ``lowdiff`` (``topk_k``: the entries kept of a
    gradient of n) the kept values, their int64 indices and the buffers."""
    if mode == "xor":
        return sum(t.nbytes for t in xor_staged_tensors(model, optimizer, pin=pin))

    def size(t: torch.Tensor) -> int:
        t = local(t)
        return host_bytes(t.numel() * t.element_size(), pin)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    seen = {id(p) for p in params}
    total = 0
    for t in model.state_dict(keep_vars=True).values():  # tied weights: one entry
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            if not isinstance(t, torch.nn.Parameter):
                total += size(t)  # buffers
    for p in params:
        t = local(p)
        if mode == "lowdiff" and topk_k is not None:
            k = topk_k(t.numel())
            total += host_bytes(k * t.element_size(), pin) + host_bytes(k * 8, pin)
        else:
            total += size(p)
    return total


@dataclass(frozen=True)
class Staged:
    """One tensor an ``xor`` step stages, as :func:`xor_staged_tensors` estimates it."""

    what: str  # its stored name, or what it will be (optimizer state the first step creates)
    nbytes: int  # host bytes, as the budget counts them
    buffer: bool  # a model buffer: forward may change it, so it is staged when the step ends


def xor_staged_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, pin: bool) -> list[Staged]:
    """Every tensor one ``xor`` set stages: the whole state, including the optimizer state not
    created yet (:data:`LAZY_STATE`)."""
    def size(t: torch.Tensor) -> int:
        t = local(t)
        return host_bytes(t.numel() * t.element_size(), pin)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    seen = {id(p) for p in params}
    keys: dict[int, str] = {}
    out: list[Staged] = []
    for key, t in model.state_dict(keep_vars=True).items():  # tied weights: one entry
        if isinstance(t, torch.Tensor):
            keys.setdefault(id(t), f"model/{key}")
            if id(t) not in seen:
                seen.add(id(t))  # buffers, and the parameters the optimizer does not hold
                out.append(Staged(f"model/{key}", size(t), not isinstance(t, torch.nn.Parameter)))
    lazy = LAZY_STATE.get(type(optimizer).__name__, 2)
    # torch.optim keeps the state in the parameter's dtype; other classes often keep a low-precision
    # parameter's state in float32 (timm's AdaBelief, Adafactor).
    torch_class = type(optimizer).__module__.startswith("torch.optim")

    def state_size(p: torch.Tensor) -> int:
        """One state tensor like ``p``: at least float32 wide outside torch.optim (an estimate
        short of the state fails the capture at the first step, after the chain was created)."""
        t = local(p)
        width = t.element_size() if torch_class or not t.is_floating_point() else max(4, t.element_size())
        return host_bytes(t.numel() * width, pin)

    for group in optimizer.param_groups:
        extra = lazy + int(bool(group.get("amsgrad")) or bool(group.get("centered")))
        if type(optimizer).__name__ == "SGD" and group.get("momentum"):
            extra = 1
        if type(optimizer).__name__ == "RMSprop" and group.get("momentum"):
            extra += 1
        for p in group["params"]:
            name = keys.get(id(p), "a parameter")
            out.append(Staged(name, size(p), False))
            state = optimizer.state.get(p)
            if state:
                out += [Staged(f"the optimizer's {k!r} of {name}", size(v), False)
                        for k, v in state.items() if isinstance(v, torch.Tensor)]
            elif extra:  # created at the first step: estimated, the runtime's pool still holds to the budget
                out += [Staged(f"the optimizer state of {name}", state_size(p), False)] * extra
                out.append(Staged(f"the optimizer's scalar state of {name}", SCALAR_STATE_BYTES, False))
    return out


def positive_interval(value: object, name: str) -> int:
    """``value`` as a positive integer, else :class:`UsageError` naming ``name``."""
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer or 'auto', got {value!r}")
    return value


class Tuning:
    """``anchor_every`` and ``batch_steps`` in force, and the measurements that move them.

    Args:
        anchor_every, batch_steps: in steps, or ``"auto"``.
        stats: the runtime's measurements (step times, stall); :meth:`after_step` records
            the policy it chose in ``stats.policy``.
        max_stall: the stall fraction the adaptive tuner keeps.
        mtbf_s: mean time between failures, in seconds.
        max_batch_bytes: an automatic ``batch_steps`` keeps a batch's captured bytes under it.
        max_lost_s: an automatic ``batch_steps`` keeps the training at risk in a crash (the
            uncommitted batch) under this many seconds of measured step time, whatever the
            wasted-time model or the stall tuner would choose.
        max_bytes: an automatic ``anchor_every`` keeps two anchors plus the deltas between
            them within this disk budget (the writer drops older history after commits).
    """

    def __init__(self, anchor_every: Interval, batch_steps: Interval, *, stats: CaptureStats, max_stall: float,
                 mtbf_s: float, max_batch_bytes: int, max_lost_s: float = DEFAULT_MAX_LOST_S,
                 max_bytes: int | None = None) -> None:
        if not max_lost_s > 0:
            raise UsageError(f"max_lost_s must be a positive number of seconds, got {max_lost_s!r}")
        self.auto_anchor = anchor_every == "auto"
        self.auto_batch = batch_steps == "auto"
        self.anchor_every = DEFAULT_ANCHOR_EVERY if self.auto_anchor else positive_interval(anchor_every,
                                                                                            "anchor_every")
        self.batch_steps = DEFAULT_BATCH_STEPS if self.auto_batch else positive_interval(batch_steps, "batch_steps")
        self.stats = stats
        self.tuner = AdaptiveTuner(max_stall=max_stall)
        self.mtbf_s = mtbf_s
        self.max_batch_bytes = max_batch_bytes
        self.max_lost_s = max_lost_s
        self.max_bytes = max_bytes
        self._anchor_bound = 100_000
        self._step_time_s: float | None = None
        self.anchor_write_s: float | None = None  # the latest anchor write (and commit), once measured
        self._chosen = False
        self._stall_accounted = 0.0
        self.cadence: Cadence | None = None  # the capture interval, which automatic batches follow
        self._cadence_decisions = 0

    def extra(self) -> dict[str, object]:
        """The ``policy`` entry of a step's extra state (spec §19.1)."""
        policy: dict[str, object] = {"anchor_every": self.anchor_every, "batch_steps": self.batch_steps,
                                     "max_lost_s": self.max_lost_s}
        if self.max_bytes is not None:
            policy["max_bytes"] = self.max_bytes
        inputs = self.stats.policy.get("inputs")
        if isinstance(inputs, dict):  # the measurements the wasted-time model used
            policy["inputs"] = dict(inputs)
        if self.cadence is not None:
            policy.update(self.cadence.extra())
        return policy

    def inputs(self, writer: ChainWriter) -> PolicyInputs | None:
        """The measurements the policy uses, once enough steps were seen."""
        if len(self.stats.step_times) < POLICY_WARMUP_STEPS or not self.stats.optimizer_times:
            return None
        anchor_write = self.anchor_write_s
        if anchor_write is None:
            nbytes = sum(t.numel() * t.element_size() for t in writer.live_state_tensors().values())
            anchor_write = nbytes / ASSUMED_ANCHOR_BYTES_PER_S
        return PolicyInputs(
            step_time_s=statistics.median(list(self.stats.step_times)[-MEDIAN_OF_STEPS:]),
            anchor_write_s=anchor_write,
            replay_step_s=statistics.median(list(self.stats.optimizer_times)[-MEDIAN_OF_STEPS:]),
            commit_s=writer.last_commit_seconds or ASSUMED_COMMIT_S,
            mtbf_s=self.mtbf_s,
        )

    def after_step(self, writer: ChainWriter, step_bytes: int) -> None:
        """Account the step just queued (``step_bytes`` captured); choose or widen the values."""
        if self.stats.step_times:
            stall = self.stats.stall_s - self._stall_accounted
            self._stall_accounted = self.stats.stall_s
            self.stats.stalls.append(stall)
            self.tuner.observe(stall, self.stats.step_times[-1])
        if not self._chosen and (self.auto_anchor or self.auto_batch):
            inputs = self.inputs(writer)
            if inputs is not None:
                self._chosen = True
                self._choose(writer, inputs, step_bytes)
        elif self._chosen and self.auto_batch and self.cadence is not None and (
                self.cadence.decisions != self._cadence_decisions):
            self._cadence_decisions = self.cadence.decisions  # the interval may have moved: so may the batch
            inputs = self.inputs(writer)
            if inputs is not None:
                self._choose_batch(writer, inputs, step_bytes)
        if self.tuner.due():
            self._widen_on_stall(writer)

    def _choose(self, writer: ChainWriter, inputs: PolicyInputs, step_bytes: int) -> None:
        if self.auto_anchor:
            if self.max_bytes is not None:
                # Two anchors and the deltas between them must fit (captured bytes bound a delta's).
                anchor_bytes = sum(t.numel() * t.element_size() for t in writer.live_state_tensors().values())
                self._anchor_bound = max(1, (self.max_bytes - 2 * anchor_bytes) // max(1, step_bytes))
            self.anchor_every = optimal_anchor_every(inputs, upper=self._anchor_bound)
        if self.auto_batch:
            self._choose_batch(writer, inputs, step_bytes)
        self.stats.policy = {"inputs": inputs.to_dict(), "anchor_every": self.anchor_every,
                             "batch_steps": self.batch_steps}
        log.info(
            "ldformat policy for %s: anchor_every=%d batch_steps=%d (step %.3fs, anchor write %.3fs, "
            "replay %.4fs/step, commit %.4fs, MTBF %.1fh)", writer.path, self.anchor_every, self.batch_steps,
            inputs.step_time_s, inputs.anchor_write_s, inputs.replay_step_s, inputs.commit_s,
            inputs.mtbf_s / 3600)

    def _choose_batch(self, writer: ChainWriter, inputs: PolicyInputs, step_bytes: int) -> None:
        """An automatic ``batch_steps``: with a capture cadence, the fewest steps at risk whose commits
        fit its share of the overhead budget; without one, the wasted-time model's optimum."""
        self._step_time_s = inputs.step_time_s
        upper = max(1, min(MAX_AUTO_BATCH_STEPS, self.max_batch_bytes // (step_bytes or 1), self._lost_bound()))
        if self.cadence is not None:
            self.batch_steps = self.cadence.batch_steps(inputs.commit_s, self.cadence.tau0 or inputs.step_time_s,
                                                        upper)
        else:
            self.batch_steps = optimal_batch_steps(inputs, upper=upper)
        writer.batch_steps = self.batch_steps
        self.stats.policy["batch_steps"] = self.batch_steps

    def _lost_bound(self) -> int:
        """The most captured steps a batch may hold within ``max_lost_s`` of measured step time."""
        if not self._step_time_s:
            return MAX_AUTO_BATCH_STEPS
        every = self.cadence.every if self.cadence is not None else 1
        return max(1, int(self.max_lost_s / (self._step_time_s * every)))

    def _widen_on_stall(self, writer: ChainWriter) -> None:
        anchor_every, batch_steps, fraction = self.tuner.adjust(self.anchor_every, self.batch_steps)
        self.stats.policy["last_stall_fraction"] = fraction
        # Explicit values are kept (ranks of data-parallel lowdiff rely on anchor_every).
        anchor_every = min(anchor_every, max(self.anchor_every, self._anchor_bound)) if self.auto_anchor \
            else self.anchor_every
        batch_steps = min(batch_steps, max(self.batch_steps, self._lost_bound())) if self.auto_batch \
            else self.batch_steps
        if self.cadence is not None and self.cadence.adaptive:
            batch_steps = self.batch_steps  # the capture interval answers a stall; commits stay frequent
        if (anchor_every, batch_steps) != (self.anchor_every, self.batch_steps):
            log.info("ldformat: stall %.1f%% > %.1f%%: anchor_every %d -> %d, batch_steps %d -> %d",
                     100 * fraction, 100 * self.tuner.max_stall, self.anchor_every, anchor_every,
                     self.batch_steps, batch_steps)
            self.anchor_every, self.batch_steps = anchor_every, batch_steps
            writer.batch_steps = batch_steps
