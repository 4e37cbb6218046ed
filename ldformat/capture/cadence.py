"""The capture interval: which steps to capture so that checkpointing stays within its budget.

docs/capture-runtime.md "Bounded cost" states the model. In short: the runtime times every
step interval (from one optimizer pre-hook to the next). An interval that follows an
uncaptured step and during which the background writer did nothing is *clean*: their mean,
``tau0``, is the step time without checkpointing. Over a window of intervals, the time above
``n * tau0`` is what checkpointing cost (the training thread's stall plus the slowdown the
background work inflicted; never more than the stall plus the background's CPU time, so that a
pause between steps or noise is not taken for it), ``C`` per capture. Capturing every ``k``-th step costs
``C / (k * tau0)``; the runtime keeps the smallest ``k`` for which that is within
:data:`TARGET` of the budget once it went over (CheckFreq, section 4.3, with the capture interval as the knob).
It raises ``k`` on one window over the budget (by :data:`RAISE_MAX` times at most), and lowers
it only when :data:`LOWER_AFTER` windows in a row agree (one, when captures are rarer than
:data:`MAX_WINDOW_S`). A window lasts until it holds a capture (its cost is per capture),
and an interval longer than :data:`PAUSE` steps beyond what checkpointing could have taken
of it (a pause between steps) counts as one step plus that.

Clean intervals come for free once ``k > 1``. At ``k = 1`` none exist; there the stall plus
the background writer's CPU time bounds the cost from above (the background cannot take more
of the training's time than it computes), and while that bound fits the budget nothing else is
needed. Only when it does not are :data:`PROBE_STEPS` steps left uncaptured to measure
``tau0`` (again after :data:`REPROBE_S` seconds if ``k`` is still 1).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from .options import CaptureOptions

log = logging.getLogger("ldformat.capture")

TARGET = 0.7  # k is chosen for this fraction of the budget: measurement noise must not push it over
WINDOW_S = 2.0  # a decision needs at least this much training time ...
WINDOW_STEPS = 4  # ... this many step intervals ...
WINDOW_CAPTURES = 2  # ... and this many captures (or MAX_WINDOW_S)
MAX_WINDOW_S = 30.0
WARMUP_INTERVALS = 2  # the first intervals after opening (lazy initialization) are not measured ...
WARMUP_S = 10.0  # ... nor is k moved in the first seconds of training (allocator, autotuning, caches warm up)
PROBE_STEPS = 3
REPROBE_S = 60.0
BASELINE_SAMPLES = 32
PAUSE = 3.0  # a clean interval this many times the median is a pause, not a step
LOWER_AFTER = 3  # consecutive decisions that must all find a smaller k before k is lowered ...
# ... unless captures are so far apart that waiting for three would leave minutes unprotected
RAISE_MAX = 16  # k rises at most this many times per decision: one mismeasured window (a disk stall)
#                 must not push captures hours apart, with windows (each holding a capture) as long
MAX_EVERY = 1_000_000
COMMIT_SHARE = 0.25  # the share of the budget automatic commit batches may use


@dataclass
class _Window:
    """Step intervals since the last decision."""

    started: float
    intervals: int = 0
    seconds: float = 0.0
    captures: int = 0
    stall_s: float = 0.0  # the runtime's stall counter when the window began
    background_s: float = 0.0  # the background writer's CPU seconds when the window began


@dataclass
class Cadence:
    """The capture interval ``every`` in force and the measurements that move it.

    Args:
        options: the budget (``max_overhead``), ``capture_every`` and ``max_lost_s``.
        adaptive: whether ``every`` may change (``xor``, one recording process, ``"auto"``).
        last_captured: the step of the state the chain holds when the runtime starts.
    """

    options: CaptureOptions
    adaptive: bool
    last_captured: int
    max_lost_s: float
    every: int = 1
    overhead: float | None = None  # the latest measured overhead fraction (an upper bound at k = 1 without tau0)
    cost_per_capture_s: float | None = None
    decisions: int = 0
    _baseline: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=BASELINE_SAMPLES))
    _window: _Window | None = None
    _probe_left: int = 0
    _lower: list[int] = field(default_factory=list)  # the smaller k each recent decision wanted
    _marks: tuple[float, float] = (0.0, 0.0)  # the stall and background counters at the last interval
    _seen: int = 0
    _first: float | None = None
    _warned: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.options.capture_every, int):
            self.every = self.options.capture_every

    # -- per step ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` (about to run) is captured."""
        if self._probe_left > 0:
            self._probe_left -= 1
            return False
        return step - self.last_captured >= self.every

    def captured(self, step: int) -> None:
        self.last_captured = step

    @property
    def tau0(self) -> float | None:
        """The step time without checkpointing: the mean of recent clean intervals (a mean, not a
        median: the cost is time above ``n * tau0`` summed over a window, and step times are
        skewed), leaving out those over :data:`PAUSE` times their median (a pause between steps,
        such as an evaluation, is not a step)."""
        if not self._baseline:
            return None
        seconds = [s for _, s in self._baseline]
        bound = PAUSE * statistics.median(seconds)
        mean = statistics.fmean(s for s in seconds if s <= bound)
        return mean if mean > 0 else None  # a clock too coarse to time a step measured nothing (k / tau0 divides)

    def _fresh_baseline(self, now: float) -> bool:
        return bool(self._baseline) and now - self._baseline[-1][0] <= REPROBE_S

    def interval(self, seconds: float, *, after_capture: bool, clean: bool, stall_s: float,
                 background_s: float) -> None:
        """Account one step interval (pre-hook to pre-hook). ``after_capture``: the step it
        followed was captured; ``clean``: it followed an uncaptured step and the background
        writer was idle throughout; ``stall_s``, ``background_s``: the runtime's cumulative
        stall and the background writer's CPU seconds now."""
        now = time.monotonic()
        self._seen += 1
        stalled, busy = stall_s - self._marks[0], background_s - self._marks[1]
        self._marks = (stall_s, background_s)
        if self._first is None:
            self._first = now
        if self._seen <= WARMUP_INTERVALS:
            return
        if clean:
            self._baseline.append((now, seconds))
        tau0 = self.tau0
        if tau0 is not None and seconds > PAUSE * tau0 + stalled + busy:
            # A pause between steps (an evaluation, a data stall): checkpointing can have taken at
            # most its stall and the background's CPU time of it, so only that and one step count.
            seconds = tau0 + stalled + busy
        if not self.adaptive and self._warned:
            return
        w = self._window
        if w is None:
            if now - self._first < WARMUP_S:
                return
            self._window = _Window(started=now, stall_s=stall_s, background_s=background_s)
            return
        w.intervals += 1
        w.seconds += seconds
        w.captures += after_capture
        elapsed = now - w.started
        if self._probe_left > 0 or w.intervals < WINDOW_STEPS or elapsed < WINDOW_S or (
                w.captures < WINDOW_CAPTURES and elapsed < MAX_WINDOW_S):
            return
        if self.adaptive and w.captures == 0:
            return  # the cost per capture needs a capture: the window goes on until it holds one
        self._decide(w, now, stall_s - w.stall_s, background_s - w.background_s)

    # -- decisions ------------------------------------------------------------------------------
    def _decide(self, w: _Window, now: float, stall: float, busy: float) -> None:
        budget = self.options.max_overhead
        self._window = _Window(started=now, stall_s=w.stall_s + stall, background_s=w.background_s + busy)
        if not self.adaptive:
            self._warn_if_over_budget(_relative(stall, w.seconds), stall / max(1, w.captures))
            return
        bound = _relative(stall + busy, w.seconds)  # an upper bound of the overhead, relative to tau0
        tau0 = self.tau0
        if self.every == 1 and bound <= budget:
            self.overhead, self.cost_per_capture_s = bound, None
            self.decisions += 1
            return  # fits even if the background took all of its time from training
        if tau0 is not None and self._fresh_baseline(now):
            # At most the stall plus the background's CPU time: a pause between steps (an evaluation)
            # or noise in the step time is not checkpointing's cost.
            extra = min(max(0.0, w.seconds - w.intervals * tau0), stall + busy)
        else:
            self._probe_left = PROBE_STEPS  # measure tau0 next
            log.debug("ldformat: probing the step time without checkpointing (%d steps)", PROBE_STEPS)
            if _relative(stall, w.seconds) <= budget:
                return
            # The training thread's own stall is over budget already: act on it (a lower bound of the cost).
            extra, tau0 = stall, (w.seconds - stall) / w.intervals
            if tau0 <= 0:
                return  # the window was all stall (or timed as nothing): no step time to relate a cost to
        self.overhead = extra / (w.intervals * tau0)
        self.decisions += 1
        if w.captures:
            self._adapt(extra / w.captures, tau0)

    def _adapt(self, cost: float, tau0: float) -> None:
        """Raise k at once when a capture costs more than the budget, to TARGET of it (by
        :data:`RAISE_MAX` times at most). Lower it only when :data:`LOWER_AFTER` decisions in a
        row find a smaller k within TARGET (the cost is measured, but noisy: one quiet window must
        not undo a raise), or one does when captures are :data:`MAX_WINDOW_S` apart or more; to
        the largest k they found and to a quarter at most."""
        budget = self.options.max_overhead
        self.cost_per_capture_s = cost
        wanted = max(1, min(MAX_EVERY, math.ceil(cost / (TARGET * budget * tau0))))
        every = self.every
        if cost / (self.every * tau0) > budget:
            every = min(max(wanted, self.every + 1), self.every * RAISE_MAX)
            self._lower.clear()
        elif wanted < self.every:
            self._lower.append(wanted)
            if len(self._lower) >= LOWER_AFTER or self.every * tau0 >= MAX_WINDOW_S:
                every = max(max(self._lower), self.every // 4)
                self._lower.clear()
        else:
            self._lower.clear()
        if every != self.every:
            log.info("ldformat: measured %.1f%% overhead (%.3fs per capture, %.4fs steps without checkpointing; "
                     "budget %.1f%%): capturing every %d steps instead of %d", 100 * cost / (self.every * tau0),
                     cost, tau0, 100 * budget, every, self.every)
            self.every = every
        self._warn_if_at_risk(tau0)

    def _warn_if_over_budget(self, stall_overhead: float, stall_per_step: float) -> None:
        """Every step is captured (a gradient mode, ranks, or a fixed interval): say once if the
        training thread's stall alone is over the budget (docs/capture-runtime.md "Bounded cost")."""
        self.overhead = stall_overhead
        if stall_overhead <= self.options.max_overhead or isinstance(self.options.capture_every, int):
            return  # within budget, or the user chose the interval
        self._warned = True
        log.warning(
            "ldformat: capturing every %s costs %.1f%% of training in stall alone (%.3f s per step measured), over "
            "the %.1f%% budget. This mode or setup captures every step; mode='xor' with one recording process "
            "captures every k-th step and keeps within the budget", "step" if self.every == 1 else
            f"{self.every} steps", 100 * stall_overhead, stall_per_step, 100 * self.options.max_overhead)

    def _warn_if_at_risk(self, tau0: float) -> None:
        """The budget wins over ``max_lost_s`` (docs/capture-runtime.md "Bounded cost"): say so once."""
        at_risk = self.every * tau0
        if at_risk > self.max_lost_s and not self._warned:
            self._warned = True
            log.warning(
                "ldformat: keeping checkpoint overhead within %.1f%% needs a capture every %d steps (%.1f s of "
                "training, %.3f s per capture measured), more than max_lost_s=%g s: a crash can lose up to %.1f s. "
                "Raise max_overhead, or use a faster store or more host cores, to capture more often",
                100 * self.options.max_overhead, self.every, at_risk, self.cost_per_capture_s or 0.0,
                self.max_lost_s, at_risk)

    def batch_steps(self, commit_s: float, step_s: float, upper: int) -> int:
        """Captured steps per commit: the fewest whose commit cost fits :data:`COMMIT_SHARE` of the budget."""
        seconds_between = max(self.every * step_s, 1e-9)
        wanted = math.ceil(commit_s / (COMMIT_SHARE * self.options.max_overhead * seconds_between))
        return max(1, min(upper, wanted))

    def extra(self) -> dict[str, object]:
        """The cadence members of a step's ``extra.policy`` (spec §19.1)."""
        out: dict[str, object] = {"capture_every": self.every, "max_overhead": self.options.max_overhead}
        if self.overhead is not None:
            out["measured_overhead"] = round(self.overhead, 6)
        tau0 = self.tau0
        if tau0 is not None:
            out["step_time_s"] = round(tau0, 6)
        return out


def _relative(cost: float, seconds: float) -> float:
    """``cost`` seconds out of ``seconds`` as an overhead: relative to the time without them."""
    rest = seconds - cost
    return cost / rest if rest > 0 else math.inf
