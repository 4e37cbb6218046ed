"""The capture policy (docs/capture-runtime.md "Anchor interval and batch size"): model, optima, tuner."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
from ldformat.capture.policy import (
    AdaptiveTuner,
    PolicyInputs,
    optimal_anchor_every,
    optimal_batch_steps,
    wasted_time_per_step,
)
from ldformat.stores import LocalStore

ANCHOR_UPPER = 100_000  # the defaults of optimal_anchor_every / optimal_batch_steps
BATCH_UPPER = 256


def _inputs(**kw: float) -> PolicyInputs:
    base = {"step_time_s": 0.2, "anchor_write_s": 30.0, "replay_step_s": 0.05, "commit_s": 0.05,
            "mtbf_s": 4 * 3600.0, "anchor_load_s": 20.0}
    base.update(kw)
    return PolicyInputs(**base)


def _waste(i: PolicyInputs, anchor_every: Any, batch_steps: Any) -> Any:
    """wasted_time_per_step, also on numpy arrays (it is plain arithmetic)."""
    return wasted_time_per_step(i, anchor_every, batch_steps)


def _near_minimum(value: float, minimum: float) -> bool:
    return value <= minimum + 1e-12 * abs(minimum)


def _continuous_a(i: PolicyInputs) -> float:
    return math.sqrt(2 * i.anchor_write_s * i.mtbf_s / (i.step_time_s * i.replay_step_s))


def _continuous_b(i: PolicyInputs) -> float:
    return math.sqrt(2 * i.commit_s * i.mtbf_s) / i.step_time_s


def _clamped_neighbours(x: float, lower: int, upper: int) -> set[int]:
    return {min(max(math.floor(x), lower), upper), min(max(math.ceil(x), lower), upper)}


# -- the wasted-time model --------------------------------------------------------------------
def test_wasted_time_matches_hand_computation() -> None:
    i = PolicyInputs(step_time_s=0.5, anchor_write_s=4.0, replay_step_s=0.1, commit_s=0.02, mtbf_s=3600.0,
                     anchor_load_s=2.0)
    # steady: 4/10 + 0.02/4 = 0.405; recovery: 2 + 0.1*9/2 + 0.5*4/2 = 3.45; 0.405 + 0.5/3600*3.45
    assert wasted_time_per_step(i, 10, 4) == pytest.approx(0.405 + 0.5 / 3600 * 3.45, rel=1e-14)
    assert wasted_time_per_step(i, 10, 4) == pytest.approx(0.40547916666666667, rel=1e-14)
    # A = b = 1: one anchor and one commit per step, nothing to replay.
    assert wasted_time_per_step(i, 1, 1) == pytest.approx(4.0 + 0.02 + 0.5 / 3600 * (2.0 + 0.25), rel=1e-14)
    # anchor_load_s defaults to zero.
    j = dataclasses.replace(i, anchor_load_s=0.0)
    assert PolicyInputs(step_time_s=0.5, anchor_write_s=4.0, replay_step_s=0.1, commit_s=0.02,
                        mtbf_s=3600.0) == j
    assert wasted_time_per_step(j, 7, 3) == pytest.approx(
        4.0 / 7 + 0.02 / 3 + 0.5 / 3600 * (0.1 * 6 / 2 + 0.5 * 3 / 2), rel=1e-14)
    assert i.to_dict() == {"step_time_s": 0.5, "anchor_write_s": 4.0, "replay_step_s": 0.1, "commit_s": 0.02,
                           "mtbf_s": 3600.0, "anchor_load_s": 2.0}


def _log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


policy_inputs = st.builds(
    PolicyInputs,
    step_time_s=_log_uniform(1e-3, 10.0),
    anchor_write_s=_log_uniform(1e-3, 300.0),
    replay_step_s=_log_uniform(1e-5, 1.0),
    commit_s=_log_uniform(1e-5, 1.0),
    mtbf_s=_log_uniform(60.0, 30 * 24 * 3600.0),
    anchor_load_s=_log_uniform(1e-3, 300.0),
)


@settings(max_examples=150, deadline=None)
@given(policy_inputs)
def test_optima_are_the_closed_forms_and_integer_minima(i: PolicyInputs) -> None:
    a_star, b_star = optimal_anchor_every(i), optimal_batch_steps(i)
    assert a_star in _clamped_neighbours(_continuous_a(i), 1, ANCHOR_UPPER)
    assert b_star in _clamped_neighbours(_continuous_b(i), 1, BATCH_UPPER)

    # Brute force over every admissible integer, one axis at a time ...
    a_all = np.arange(1, ANCHOR_UPPER + 1, dtype=np.float64)
    b_all = np.arange(1, BATCH_UPPER + 1, dtype=np.float64)
    cost_a = _waste(i, a_all, b_star)
    cost_b = _waste(i, a_star, b_all)
    assert _near_minimum(wasted_time_per_step(i, a_star, b_star), float(cost_a.min()))
    assert _near_minimum(wasted_time_per_step(i, a_star, b_star), float(cost_b.min()))
    # ... and jointly around the optimum (the model is separable, so this is the 2-D minimum).
    window = a_all[max(0, a_star - 300): a_star + 300]
    grid = _waste(i, window[:, None], b_all[None, :])
    assert _near_minimum(wasted_time_per_step(i, a_star, b_star), float(grid.min()))


@settings(max_examples=60, deadline=None)
@given(policy_inputs, st.integers(1, 50), st.integers(0, 50))
def test_optima_respect_bounds(i: PolicyInputs, lower: int, width: int) -> None:
    upper = lower + width
    a = optimal_anchor_every(i, lower=lower, upper=upper)
    b = optimal_batch_steps(i, lower=lower, upper=upper)
    assert lower <= a <= upper and lower <= b <= upper
    xs = np.arange(lower, upper + 1, dtype=np.float64)  # convex in each variable: the clamp is the minimum
    assert _near_minimum(wasted_time_per_step(i, a, 1), float(_waste(i, xs, 1).min()))
    assert _near_minimum(wasted_time_per_step(i, 1, b), float(_waste(i, 1, xs).min()))


def test_degenerate_inputs() -> None:
    assert optimal_anchor_every(_inputs(replay_step_s=0.0)) == ANCHOR_UPPER  # free replay: never anchor
    assert optimal_anchor_every(_inputs(replay_step_s=0.0), upper=77) == 77
    assert optimal_anchor_every(_inputs(step_time_s=0.0)) == ANCHOR_UPPER
    assert optimal_batch_steps(_inputs(step_time_s=0.0)) == 1
    assert optimal_batch_steps(_inputs(step_time_s=0.0), lower=3) == 3
    assert optimal_anchor_every(_inputs(anchor_write_s=0.0)) == 1  # free anchors: every step
    assert optimal_batch_steps(_inputs(commit_s=0.0)) == 1  # free commits: every step
    assert optimal_anchor_every(_inputs(anchor_write_s=1e9)) == ANCHOR_UPPER
    assert optimal_batch_steps(_inputs(commit_s=1e9)) == BATCH_UPPER


def test_known_values() -> None:
    i = _inputs()  # A* = sqrt(2*30*14400/(0.2*0.05)) = 9295.16..., b* = sqrt(2*0.05*14400)/0.2 = 189.73...
    assert _continuous_a(i) == pytest.approx(9295.1600308978, rel=1e-12)
    assert optimal_anchor_every(i) == 9295
    assert optimal_batch_steps(i) == 190


def _values(key: str, factors: Iterable[float], **kw: float) -> tuple[list[int], list[int]]:
    base = _inputs(**kw)
    scaled = [dataclasses.replace(base, **{key: getattr(base, key) * f}) for f in factors]
    return [optimal_anchor_every(i) for i in scaled], [optimal_batch_steps(i) for i in scaled]


def test_monotonicity() -> None:
    factors = [2.0**k for k in range(-6, 7)]
    a, b = _values("mtbf_s", factors, commit_s=0.002, anchor_write_s=0.5)
    assert a == sorted(a) and b == sorted(b)  # longer MTBF: rarer anchors, longer batches
    assert a[0] < a[-1] and b[0] < b[-1]
    a, _ = _values("replay_step_s", factors, anchor_write_s=0.5)
    assert a == sorted(a, reverse=True) and a[0] > a[-1]  # costlier replay: more anchors
    a, _ = _values("anchor_write_s", factors, anchor_write_s=0.5)
    assert a == sorted(a) and a[0] < a[-1]  # costlier anchors: rarer anchors
    _, b = _values("commit_s", factors, commit_s=0.002)
    assert b == sorted(b) and b[0] < b[-1]  # costlier commits: longer batches
    a, b = _values("step_time_s", factors, commit_s=0.002, anchor_write_s=0.5)
    assert a == sorted(a, reverse=True) and b == sorted(b, reverse=True)
    # Closed forms: 4x the MTBF doubles both (away from the clamps).
    i = _inputs(anchor_write_s=0.5, commit_s=0.002)
    j = dataclasses.replace(i, mtbf_s=4 * i.mtbf_s)
    assert abs(optimal_anchor_every(j) - 2 * _continuous_a(i)) <= 1
    assert abs(optimal_batch_steps(j) - 2 * _continuous_b(i)) <= 1


@settings(max_examples=100, deadline=None)
@given(policy_inputs, _log_uniform(1.0, 1e3))
def test_monotonicity_property(i: PolicyInputs, k: float) -> None:
    longer = dataclasses.replace(i, mtbf_s=i.mtbf_s * k)
    assert optimal_anchor_every(longer) >= optimal_anchor_every(i)
    assert optimal_batch_steps(longer) >= optimal_batch_steps(i)
    costlier = dataclasses.replace(i, replay_step_s=i.replay_step_s * k)
    assert optimal_anchor_every(costlier) <= optimal_anchor_every(i)


# -- LowDiff's Eq. 8-10 -------------------------------------------------------------------------
def lowdiff_eq8(f: Any, b: Any, *, N: float, T: float, M: float, S: float, W: float, R_F: float, R_D: float,
                batched_merge: bool = True) -> Any:
    """LowDiff §V-C Eq. 8, time measured in training steps.

    ``1/f`` is the full-checkpoint interval and ``b`` the batching size, both in steps; a
    failure (every ``M``) loads a full checkpoint (``R_F``), merges half of the
    ``1/(f*b)`` batched differentials on average (``R_D`` each) and redoes half a batch.
    ``batched_merge=False`` removes the batch effect from the merge count: one merge per
    step, ``1/2 (1/f - 1)`` of them.
    """
    merges = 1 / (f * b) if batched_merge else 1 / f
    return N * T / M * (b / 2 + (R_F + R_D / 2 * (merges - 1))) + N * T * S * f / W


def lowdiff_eq10(*, M: float, S: float, W: float, R_D: float) -> tuple[float, float]:
    return (R_D * W**2 / (4 * S**2 * M**2)) ** (1 / 3), (2 * S * R_D * M / W) ** (1 / 3)


PAPER_CASES: list[dict[str, Any]] = [
    {"N": 8, "T": 1e5, "M": 5e4, "S": 40.0, "W": 2.0, "R_F": 30.0, "R_D": 0.5},
    {"N": 1, "T": 1.0, "M": 1e3, "S": 1.0, "W": 1.0, "R_F": 0.0, "R_D": 0.01},
    {"N": 64, "T": 3e6, "M": 2e5, "S": 350.0, "W": 5.0, "R_F": 120.0, "R_D": 2.0},
]


@pytest.mark.parametrize("p", PAPER_CASES)
def test_lowdiff_eq10_minimizes_eq8(p: dict[str, Any]) -> None:
    f_star, b_star = lowdiff_eq10(M=p["M"], S=p["S"], W=p["W"], R_D=p["R_D"])
    # Eq. 9: both partial derivatives vanish there.
    N, T, M, S, W, R_D = p["N"], p["T"], p["M"], p["S"], p["W"], p["R_D"]
    assert N * S * T / W - N * T * R_D / (2 * f_star**2 * M * b_star) == pytest.approx(0, abs=1e-9 * N * S * T / W)
    assert 0.5 - R_D / (2 * b_star**2 * f_star) == pytest.approx(0, abs=1e-12)
    # And it is the minimum over a log grid of (f, b) around it (Eq. 8 is convex in log f, log b).
    best = lowdiff_eq8(f_star, b_star, **p)
    u = np.linspace(-4, 4, 161)
    grid = lowdiff_eq8(f_star * np.exp(u)[:, None], b_star * np.exp(u)[None, :], **p)
    assert _near_minimum(best, float(grid.min()))
    assert grid.min() >= best * (1 - 1e-12)


@pytest.mark.parametrize("tau", [1.0, 0.25, 3.0])
@pytest.mark.parametrize("p", PAPER_CASES)
def test_our_model_is_eq8_without_the_batch_effect(p: dict[str, Any], tau: float) -> None:
    """Our model is LowDiff's Eq. 8 with the batch effect on replay removed.

    LowDiff sums the gradients of a batch and merges each batch into the full checkpoint
    as one operation, so recovery merges ``1/2 (1/(f b) - 1)`` batches and a larger ``b``
    makes replay cheaper: Eq. 10 couples the optimal ``f*`` to ``b*``. We never sum
    gradients per batch (summing reorders floating-point additions and would break exact
    replay), so recovery replays every step after the anchor, ``(A-1)/2`` on average,
    whatever ``b`` is. Our model adds a fixed cost ``c`` per commit (fsync), which is what
    ``b`` trades against the half batch lost by a failure.

    With ``c = 0``, ``A = 1/f``, one step lasting ``tau`` and the paper's quantities in
    steps (its ``S/W``, ``M``, ``R_F``, ``R_D`` divided by ``tau``), our per-step waste is
    ``tau / (N T)`` times Eq. 8 with one merge per step. Hence the paper's optimal ``f``
    without the batch effect (Eq. 9's first line with ``b`` = 1 in the merge term,
    ``f = sqrt(R_D W / (2 M S))``) is exactly ``1/A*`` of our closed form.
    """
    S_W, M, R_F, r = p["S"] / p["W"], p["M"], p["R_F"], p["R_D"]
    # Ours, in seconds; the paper's, in steps of tau seconds.
    ours = PolicyInputs(step_time_s=tau, anchor_write_s=S_W * tau, replay_step_s=r * tau, commit_s=0.0,
                        mtbf_s=M * tau, anchor_load_s=R_F * tau)
    paper: dict[str, Any] = {"N": p["N"], "T": p["T"], "M": M, "S": S_W, "W": 1.0, "R_F": R_F, "R_D": r,
                             "batched_merge": False}
    for a in [1, 2, 7, 100, 12345]:
        for b in [1, 3, 64]:
            assert wasted_time_per_step(ours, a, b) == pytest.approx(
                tau / (p["N"] * p["T"]) * lowdiff_eq8(1 / a, b, **paper), rel=1e-12)

    f_paper = math.sqrt(r * 1.0 / (2 * M * S_W))  # Eq. 9, first line, with the batch effect removed
    assert 1 / f_paper == pytest.approx(_continuous_a(ours), rel=1e-12)
    a_star = optimal_anchor_every(ours)
    assert a_star in _clamped_neighbours(1 / f_paper, 1, ANCHOR_UPPER)

    # Numerically: our A* minimizes both our model and batch-free Eq. 8 over integer intervals,
    # and (unlike LowDiff's) it does not move with the batch size.
    intervals = np.arange(1, 3 * a_star + 10, dtype=np.float64)
    for b in [1, 4, 64]:
        assert _near_minimum(wasted_time_per_step(ours, a_star, b),
                             float(_waste(ours, intervals, b).min()))
        eq8 = lowdiff_eq8(1 / intervals, b, **paper)
        assert _near_minimum(float(lowdiff_eq8(1 / a_star, b, **paper)), float(eq8.min()))
    # With the batch effect (Eq. 8 as published) the best interval at a fixed b grows like sqrt(b).
    published = {k: v for k, v in paper.items() if k != "batched_merge"}
    best_at = {b: int(intervals[np.argmin(lowdiff_eq8(1 / intervals, b, **published))]) for b in [1, 4]}
    assert best_at[1] == a_star or abs(best_at[1] - 1 / f_paper) <= 1
    if 2 * (a_star + 1) < intervals[-1]:
        assert best_at[4] > best_at[1]


def test_eq10_batch_size_is_not_ours() -> None:
    # LowDiff's b* comes from merges saved per batch; ours from the commit cost alone.
    p = PAPER_CASES[0]
    _, b_paper = lowdiff_eq10(M=p["M"], S=p["S"], W=p["W"], R_D=p["R_D"])
    no_commit_cost = PolicyInputs(step_time_s=1.0, anchor_write_s=p["S"] / p["W"], replay_step_s=p["R_D"],
                                  commit_s=0.0, mtbf_s=p["M"], anchor_load_s=p["R_F"])
    assert b_paper > 10 and optimal_batch_steps(no_commit_cost) == 1


# -- the adaptive tuner ----------------------------------------------------------------------------
def _window(tuner: AdaptiveTuner, stall: float, step: float) -> None:
    for _ in range(tuner.window):
        assert not tuner.due()
        tuner.observe(stall, step)
    assert tuner.due()


def test_tuner_doubles_above_bound_up_to_limits() -> None:
    tuner = AdaptiveTuner(max_stall=0.05, window=4, max_anchor_every=20, max_batch_steps=12)
    a, b = 3, 2
    seen = []
    for _ in range(5):
        _window(tuner, stall=0.01, step=0.1)  # 10% > 5%
        a, b, fraction = tuner.adjust(a, b)
        assert fraction == pytest.approx(0.1)
        assert not tuner.due()
        seen.append((a, b))
    assert seen == [(6, 4), (12, 8), (20, 12), (20, 12), (20, 12)]


def test_tuner_leaves_values_at_or_below_bound() -> None:
    tuner = AdaptiveTuner(max_stall=0.05, window=3)
    _window(tuner, stall=0.001, step=0.1)
    assert tuner.adjust(7, 5) == (7, 5, pytest.approx(0.01))
    _window(tuner, stall=0.005, step=0.1)  # exactly at the bound: not above it
    a, b, fraction = tuner.adjust(7, 5)
    assert (a, b) == (7, 5) and fraction == pytest.approx(0.05)
    assert tuner.adjust(7, 5) == (7, 5, 0.0)  # an empty window measures nothing
    # The window is reset by adjust: a stalled window after a calm one still doubles.
    _window(tuner, stall=0.05, step=0.1)
    assert tuner.adjust(7, 5)[:2] == (14, 10)


def test_tuner_measures_the_whole_window() -> None:
    tuner = AdaptiveTuner(max_stall=0.1, window=4)
    for stall in [0.0, 0.0, 0.0, 0.2]:  # one bad step in four: 0.2 / 0.4 = 50%
        tuner.observe(stall, 0.1)
    a, b, fraction = tuner.adjust(1, 1)
    assert fraction == pytest.approx(0.5) and (a, b) == (2, 2)


# -- integration: the adaptive loop on a slow disk ----------------------------------------------
class SlowStore(LocalStore):
    """A local directory that takes ``delay`` seconds per write and per sync."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(root)
        self.delay = delay

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        time.sleep(self.delay)
        super().write(path, data)

    def sync(self, paths: Iterable[str]) -> None:
        time.sleep(self.delay)
        super().sync(paths)


ADJUST_LINE = re.compile(r"stall ([\d.]+)% > ([\d.]+)%: anchor_every (\d+) -> (\d+), batch_steps (\d+) -> (\d+)")


@pytest.mark.parametrize("mode", ["xor", "lowdiff+"])
def test_adaptive_loop_on_slow_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    caplog.set_level(logging.INFO, logger="ldformat.capture")
    steps, window, max_stall = 40, 8, 0.01
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    path = tmp_path / "chain"
    # An MTBF of a few seconds keeps the model's choices far from the clamps, so that the
    # tuner's doubling is visible.
    # Every step (capture_every=1): this is the stall tuner's test; the capture interval has its own.
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every="auto", batch_steps="auto",
                               max_stall=max_stall, mtbf_hours=2 / 3600, store=SlowStore(path, 0.004),
                               options=ldformat.CaptureOptions(capture_every=1))
    ck.tuner.window = window
    refs = {0: snapshot(model, opt)}
    try:
        for step in range(1, steps + 1):
            train_step(model, opt, step)
            refs[step] = snapshot(model, opt)
    finally:
        ck.close()

    # The policy ran on measured inputs, and chose what the model says for them.
    policy = ck.stats.policy
    assert set(policy["inputs"]) == {f.name for f in dataclasses.fields(PolicyInputs)}
    inputs = PolicyInputs(**policy["inputs"])
    assert inputs.mtbf_s == pytest.approx(2.0)
    assert inputs.step_time_s > 0 and inputs.anchor_write_s > 0 and inputs.replay_step_s > 0
    assert inputs.commit_s >= 0.004  # every commit syncs at least once on this disk
    assert policy["anchor_every"] == optimal_anchor_every(inputs)
    # Commits: the fewest steps whose commit cost fits a quarter of the 3.5 % budget (docs/capture-runtime.md).
    assert policy["batch_steps"] == ck.cadence.batch_steps(inputs.commit_s, inputs.step_time_s, 256)
    assert policy["anchor_every"] < ck.tuner.max_anchor_every
    # The commit share depends on the measured commit and step times, which a loaded machine can push
    # to the clamp; the doubling below is then checked against the clamp.
    assert policy["batch_steps"] <= ck.tuner.max_batch_steps
    messages = [r.getMessage() for r in caplog.records if r.name == "ldformat.capture"]
    chosen = [m for m in messages if m.startswith("ldformat policy for")]
    assert len(chosen) == 1
    assert f"anchor_every={policy['anchor_every']} batch_steps={policy['batch_steps']}" in chosen[0]

    # The slow disk stalls training above the bound: the tuner spread anchors and commits out.
    adjustments = [tuple(float(x) for x in m.groups()) for m in map(ADJUST_LINE.search, messages) if m]
    assert adjustments, messages
    a, b = policy["anchor_every"], policy["batch_steps"]
    for stall, bound, a_old, a_new, b_old, b_new in adjustments:
        assert stall > bound == pytest.approx(100 * max_stall)
        assert (a_old, b_old) == (a, b)
        a, b = min(2 * a, ck.tuner.max_anchor_every), min(2 * b, ck.tuner.max_batch_steps)
        assert (a_new, b_new) == (a, b)
    assert (ck.anchor_every, ck.batch_steps) == (a, b)
    assert ck.anchor_every > policy["anchor_every"]
    assert ck.batch_steps > policy["batch_steps"] or ck.batch_steps == ck.tuner.max_batch_steps
    assert ck.writer.batch_steps == ck.batch_steps
    assert policy["last_stall_fraction"] > max_stall

    # Each step records the values in force when it was captured; the last ones are the raised ones.
    reader = ldformat.ChainReader(path)
    assert reader.steps == list(range(steps + 1))
    latest = reader.materialize(steps)
    cadence = {"capture_every": 1, "max_overhead": 0.035}
    measured = {"measured_overhead", "step_time_s"}  # once the runtime has measured them (after 10 s)
    recorded = {k: v for k, v in latest["extra"]["policy"].items() if k not in measured}
    assert recorded == {"anchor_every": ck.anchor_every, "batch_steps": ck.batch_steps,
                        "max_lost_s": 60.0, "inputs": ck.stats.policy["inputs"], **cadence}
    assert reader.materialize(1)["extra"]["policy"] == {"anchor_every": 100, "batch_steps": 4,  # the defaults
                                                        "max_lost_s": 60.0, **cadence}
    assert max(e.rows for e in reader.state.delta_entries()) > 4  # batches grew past the default

    # And the chain is still exact.
    assert_state_bits_equal(latest, refs[steps], f"{mode} latest step")
    for step in reader.anchors + [steps // 2]:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"{mode} step {step}")


def test_policy_choice_is_visible_in_ldtools_info(tmp_path: Path) -> None:
    """The chosen interval, batch size and the measurements behind them reach `ldtools info`."""
    import json

    from click.testing import CliRunner

    from ldtools.cli import cli

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, mode="xor", anchor_every="auto", batch_steps="auto")
    for step in range(1, 13):
        train_step(model, opt, step)
    ck.close()
    result = CliRunner().invoke(cli, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    policy = json.loads(result.output)["capture_policy"]
    assert policy["anchor_every"] == ck.anchor_every and policy["batch_steps"] == ck.batch_steps
    assert set(policy["inputs"]) >= {"step_time_s", "anchor_write_s", "replay_step_s", "commit_s", "mtbf_s"}
    text = CliRunner().invoke(cli, ["info", str(path)]).output
    assert f"anchor_every={ck.anchor_every}" in text and "MTBF 24.0h" in text


def test_max_lost_s_bounds_the_automatic_batch(tmp_path: Path) -> None:
    """However long the MTBF and slow the commits, an automatic batch never holds more than
    ``max_lost_s`` seconds of measured steps, even after the stall tuner widens it."""
    from ldformat.capture.stats import CaptureStats
    from ldformat.capture.tuning import Tuning

    class Writer:
        path = "chain"
        batch_steps = 4
        last_commit_seconds = 5.0  # a slow store: the model wants huge batches

        def live_state_tensors(self) -> dict[str, torch.Tensor]:
            return {"model/w": torch.zeros(10)}

    stats = CaptureStats()
    tuning = Tuning("auto", "auto", stats=stats, max_stall=0.0, mtbf_s=1e9, max_batch_bytes=1 << 40, max_lost_s=3.0)
    writer = Writer()
    for _ in range(40):
        stats.step_times.append(0.5)
        stats.optimizer_times.append(0.01)
        stats.stall_s += 0.1  # far above max_stall: the tuner widens every window
        tuning.after_step(writer, 1)  # type: ignore[arg-type]
    assert optimal_batch_steps(PolicyInputs(**stats.policy["inputs"])) > 6  # what the model alone picks
    assert tuning.batch_steps == writer.batch_steps == 6  # 3 s / 0.5 s per step
    assert tuning.extra()["max_lost_s"] == 3.0
    with pytest.raises(ldformat.UsageError, match="max_lost_s"):
        Tuning("auto", "auto", stats=CaptureStats(), max_stall=0.1, mtbf_s=1.0, max_batch_bytes=1, max_lost_s=0)


def test_max_bytes_is_kept_by_live_retention(tmp_path: Path) -> None:
    """With a disk budget the writer drops the steps before its newest anchor after commits:
    the chain stays within the budget, and every step it keeps materializes exactly."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    path = tmp_path / "chain"
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    budget = 8 * state_bytes  # room for two full anchors (model + Adam's two moments) and a few deltas
    ck = ldformat.Checkpointer(path, model, opt, mode="xor", anchor_every=4, batch_steps=1, max_bytes=budget)
    refs = {}
    sizes = []
    for step in range(1, 15):
        train_step(model, opt, step)
        refs[step] = snapshot(model, opt)
        ck.flush()
        sizes.append(ldformat.ChainReader(path).state.referenced_bytes())
    ck.close()
    reader = ldformat.ChainReader(path)
    assert max(sizes) <= budget, sizes
    assert reader.steps[0] == max(a for a in reader.anchors if a <= 14) and reader.steps[-1] == 14
    assert 1 in ck.writer.retained and 0 in ck.writer.retained
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
    assert ldformat.validate(path).ok
    assert reader.materialize(14)["extra"]["policy"]["max_bytes"] == budget
    from click.testing import CliRunner

    from ldtools.cli import cli

    text = CliRunner().invoke(cli, ["info", str(path)]).output
    assert "max_lost_s" in text and "max_bytes" in text, text


def test_max_bytes_too_small_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(ldformat.UsageError, match="two anchors"):
        ldformat.Checkpointer(tmp_path / "chain", model, opt, max_bytes=100)
    assert not (tmp_path / "chain").exists()
