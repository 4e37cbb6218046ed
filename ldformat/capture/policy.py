"""Anchor interval and batch size from a wasted-time model (docs/capture-runtime.md "Anchor interval and batch size").

LowDiff (section V-C, Eq. 8-10) models the time wasted per failure-free run plus recovery. With
exact per-step replay we never sum gradients per batch, so the model changes: replay cost
depends on how many deltas follow the anchor, not on the batch size, while every commit has
a fixed cost (fsync) and a failure loses half a batch of steps on average. Per training step:

    wasted(A, b) =  S/W / A                      anchor write, amortized over A steps
                  + c / b                        one commit per b steps
                  + (tau / M) * ( R_F            a failure every M/tau steps costs: load anchor
                                 + r * (A-1)/2   replay half an interval on average
                                 + tau * b / 2 ) and redo half a batch

with S/W the anchor write time, c the commit cost, tau the step time, M the MTBF, R_F the
anchor load time and r the replay cost per step. Setting the partial derivatives to zero
gives two independent optima:

    A* = sqrt(2 * (S/W) * M / (tau * r))        b* = sqrt(2 * c * M) / tau

CheckFreq-style adaptation then keeps the measured training-thread stall under a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class PolicyInputs:
    """Measured quantities, all in seconds (``mtbf_s`` too)."""

    step_time_s: float
    anchor_write_s: float
    replay_step_s: float
    commit_s: float
    mtbf_s: float
    anchor_load_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def wasted_time_per_step(i: PolicyInputs, anchor_every: float, batch_steps: float) -> float:
    """The model above: expected seconds lost per training step."""
    steady = i.anchor_write_s / anchor_every + i.commit_s / batch_steps
    recovery = i.anchor_load_s + i.replay_step_s * (anchor_every - 1) / 2 + i.step_time_s * batch_steps / 2
    return steady + i.step_time_s / i.mtbf_s * recovery


def optimal_anchor_every(i: PolicyInputs, *, lower: int = 1, upper: int = 100_000) -> int:
    if i.replay_step_s <= 0 or i.step_time_s <= 0:
        return upper
    a = math.sqrt(2 * i.anchor_write_s * i.mtbf_s / (i.step_time_s * i.replay_step_s))
    return _best_integer(lambda x: wasted_time_per_step(i, x, 1), a, lower, upper)


def optimal_batch_steps(i: PolicyInputs, *, lower: int = 1, upper: int = 256) -> int:
    if i.step_time_s <= 0:
        return lower
    b = math.sqrt(2 * i.commit_s * i.mtbf_s) / i.step_time_s
    return _best_integer(lambda x: wasted_time_per_step(i, 1, x), b, lower, upper)


def _best_integer(cost: Callable[[float], float], x: float, lower: int, upper: int) -> int:
    """The better of floor and ceil of the continuous optimum, clamped."""
    lo = min(max(int(math.floor(x)), lower), upper)
    hi = min(max(int(math.ceil(x)), lower), upper)
    return lo if cost(lo) <= cost(hi) else hi


@dataclass
class AdaptiveTuner:
    """Keeps the training-thread stall under ``max_stall`` (CheckFreq, section 4.3, Algorithm 1).

    Every ``window`` steps it compares the measured stall fraction with the bound; above it,
    anchors and commits are spread out (doubling both) until the stall fits or the limits
    are reached. It never tightens below what the wasted-time model chose.
    """

    max_stall: float
    window: int = 20
    max_anchor_every: int = 100_000
    max_batch_steps: int = 256
    _stall: float = 0.0
    _time: float = 0.0
    _steps: int = 0
    history: list[dict[str, object]] | None = None

    def observe(self, stall_s: float, step_s: float) -> None:
        self._stall += stall_s
        self._time += step_s
        self._steps += 1

    def due(self) -> bool:
        return self._steps >= self.window

    def adjust(self, anchor_every: int, batch_steps: int) -> tuple[int, int, float]:
        """Return (anchor_every, batch_steps, measured stall fraction) and reset the window."""
        fraction = self._stall / self._time if self._time > 0 else 0.0
        self._stall = self._time = 0.0
        self._steps = 0
        if fraction > self.max_stall:
            anchor_every = min(anchor_every * 2, self.max_anchor_every)
            batch_steps = min(batch_steps * 2, self.max_batch_steps)
        return anchor_every, batch_steps, fraction
