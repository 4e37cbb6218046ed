"""The capture interval (docs/capture-runtime.md "Bounded cost"): a state.xor chain that holds
every k-th step is exact at every step it holds, resumes exactly, validates, and names the
nearest steps for one it does not hold; an automatic k rises when checkpointing costs more
than its budget (a slowed store) and falls back when it recovers; slow steps keep k = 1."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, snapshot
from torch import nn

import ldformat
from ldformat import CaptureOptions, ChainReader, StepNotFoundError, UsageError
from ldformat.capture import cadence
from ldformat.stores import LocalStore
from ldformat.stores.faults import FaultyStore

pytestmark = pytest.mark.usefixtures("one_torch_thread", "close_leftover_checkpointers")


OPTIMIZERS: dict[str, Any] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
}
SKIPPED = {5, 9}  # GradScaler skips these (an inf gradient)


def train(model: TinyNet, opt: torch.optim.Optimizer, sched: Any, scaler: Any, steps: range,
          refs: dict[int, Any] | None = None, ck: ldformat.Checkpointer | None = None) -> None:
    for step in steps:
        model.train()
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        if ck is not None:
            ck.log(loss=loss, step=step)
        scaler.scale(loss).backward()
        if step in SKIPPED:
            grad = model.hidden.weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        sched.step()
        if refs is not None:
            refs[step] = {**snapshot(model, opt), "scheduler": sched.state_dict(), "scaler": scaler.state_dict()}


def objects(name: str) -> tuple[TinyNet, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    return model, opt, sched, scaler


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_third_step_is_exact_and_resumes_exactly(tmp_path: Path, name: str) -> None:
    path = tmp_path / "chain"
    model, opt, sched, scaler = objects(name)
    refs: dict[int, Any] = {0: {**snapshot(model, opt), "scheduler": sched.state_dict(),
                                "scaler": scaler.state_dict()}}
    ck = ldformat.Checkpointer(path, model, opt, scheduler=sched, scaler=scaler, anchor_every=7, batch_steps=2,
                               options=CaptureOptions(capture_every=3))
    train(model, opt, sched, scaler, range(1, 15), refs, ck)
    assert ck.capture_every == 3 and ck.stats.steps == 14
    ck.close()  # the live state (step 14) is captured: the chain ends where training did
    reader = ChainReader(path)
    assert reader.steps == [0, 3, 6, 9, 12, 14]
    for step, (_, entry) in reader.state.deltas.items():  # each delta spans the steps that were not captured
        assert entry.base == max(s for s in reader.steps if s < step)
    for step in reader.steps:
        got = reader.materialize(step)
        assert_state_bits_equal(got, refs[step], f"{name} step {step}")
        assert got["extra"]["scheduler"] == refs[step]["scheduler"]
        assert got["extra"]["scaler"] == refs[step]["scaler"]
        assert step == 0 or got["extra"]["policy"]["capture_every"] == 3
        if step:  # the scalars logged for the step, and its learning rate (close() captured step 14)
            assert got["extra"]["scalars"]["step"] == step and "loss" in got["extra"]["scalars"]
            assert step in SKIPPED or "lr" in got["extra"]["scalars"], got["extra"]["scalars"]
    assert ldformat.validate(path).ok
    with pytest.raises(StepNotFoundError, match=r"step 4 is not in the chain.*nearest committed steps are 3 and 6"):
        reader.materialize(4)
    if name == "adamw":  # what ldtools shows of it
        from click.testing import CliRunner

        from ldtools.cli import cli
        info = CliRunner().invoke(cli, ["info", str(path)])
        assert info.exit_code == 0, info.output
        assert "capture      every 3 steps" in info.output and "overhead budget 3.5 %" in info.output, info.output
        log = CliRunner().invoke(cli, ["log", str(path)])
        assert log.exit_code == 0 and "steps)" in log.output, log.output
        out = str(tmp_path / "x.safetensors")
        missing = CliRunner().invoke(cli, ["materialize", str(path), "--step", "4", "-o", out])
        assert missing.exit_code != 0 and "nearest committed steps are 3 and 6" in missing.output, missing.output

    # Resume from a captured step in the middle and train on: bit-exact with the reference run.
    model2, opt2, sched2, scaler2 = objects(name)
    with pytest.raises(StepNotFoundError, match="nearest committed steps are 6 and 9"):
        ldformat.resume(path, model2, opt2, scheduler=sched2, scaler=scaler2, step=8)
    assert ldformat.resume(path, model2, opt2, scheduler=sched2, scaler=scaler2, step=9) == 9
    train(model2, opt2, sched2, scaler2, range(10, 15))
    assert_state_bits_equal(snapshot(model2, opt2), refs[14], f"{name} resumed at 9, step 14")


def test_options_are_checked_and_given_one_way(tmp_path: Path) -> None:
    model, opt, _, _ = objects("adam")
    with pytest.raises(UsageError, match="max_overhead"):
        CaptureOptions(max_overhead=0)
    with pytest.raises(UsageError, match="capture_every"):
        CaptureOptions(capture_every=0)
    with pytest.raises(UsageError, match="batch_steps is given both"):
        ldformat.Checkpointer(tmp_path / "a", model, opt, batch_steps=3, options=CaptureOptions(batch_steps=4))
    with pytest.raises(UsageError, match="only mode 'xor'"):
        ldformat.Checkpointer(tmp_path / "b", model, opt, mode="lowdiff+", options=CaptureOptions(capture_every=2))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything is written
    ck = ldformat.Checkpointer(tmp_path / "c", model, opt, options=CaptureOptions(batch_steps=5))
    assert ck.batch_steps == 5
    ck.close()


def run_adaptive(path: Path, store: FaultyStore, phases: list[tuple[int, float]], budget: float) -> list[int]:
    """Train TinyNet through ``phases`` of (steps, seconds a store write is slowed by); returns
    the k in force after each step. A sample of the committed steps is checked to be exact."""
    model, opt, _, _ = objects("adamw")
    refs = {0: snapshot(model, opt)}
    ck = ldformat.Checkpointer(path, model, opt, store=store, options=CaptureOptions(max_overhead=budget))
    ks: list[int] = []
    step = 0
    for steps, slowed in phases:
        store.clear()
        if slowed:
            store.stall(["write", "write_parts"], slowed)
        for _ in range(steps):
            step += 1
            x, y = batch(step)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            time.sleep(0.01)  # the compute a real step would do
            opt.step()
            refs[step] = snapshot(model, opt)
            ks.append(ck.capture_every)
    store.clear()
    ck.close()
    reader = ChainReader(path, store=store)
    assert reader.steps[-1] == step
    for s in reader.steps[::40] + reader.steps[-2:]:  # a sample: each materialize replays from step 0
        assert_state_bits_equal(reader.materialize(s), refs[s], f"step {s}")
    return ks


def test_interval_rises_on_a_slow_store_and_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "WINDOW_S", 0.4)
    monkeypatch.setattr(cadence, "WARMUP_S", 0.0)
    monkeypatch.setattr(cadence, "LOWER_AFTER", 1)  # the hysteresis has its own test; a few hundred steps here
    store = FaultyStore(LocalStore(tmp_path / "chain"))
    ks = run_adaptive(tmp_path / "chain", store, [(30, 0.0), (60, 0.1), (200, 0.0)], budget=1.0)
    slow = max(ks)
    assert slow >= 8, f"a store 0.1 s slower per write must spread the captures out: k {ks[::10]}"
    assert ks[-1] <= slow // 4, f"k must fall back once the store recovers: k {ks[::10]}"


def test_slow_steps_keep_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "WINDOW_S", 0.4)
    monkeypatch.setattr(cadence, "WARMUP_S", 0.0)
    path = tmp_path / "chain"
    model, opt, _, _ = objects("adamw")
    ck = ldformat.Checkpointer(path, model, opt)
    ks = []
    for step in range(1, 15):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.5)  # a slow step: capturing this small state costs far less than 3.5 % of it
        opt.step()
        ks.append(ck.capture_every)
    assert set(ks) == {1} and ck.stats.overhead is not None and ck.stats.overhead <= 0.035
    assert ck.stats.seconds_at_risk < 30
    ck.close()
    # At most one probe of the step time without checkpointing: a few consecutive steps not captured.
    missing = sorted(set(range(15)) - set(ChainReader(path).steps))
    assert len(missing) <= cadence.PROBE_STEPS and missing == list(range(missing[0], missing[0] + len(missing))) \
        if missing else True, missing


def test_gradient_mode_over_budget_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cadence, "WINDOW_S", 0.2)
    monkeypatch.setattr(cadence, "WARMUP_S", 0.0)
    model, opt, _, _ = objects("adamw")
    ck = ldformat.Checkpointer(tmp_path / "chain", model, opt, mode="lowdiff+",
                               options=CaptureOptions(max_overhead=1e-6))  # no capture fits this budget
    with caplog.at_level("WARNING", logger="ldformat.capture"):
        for step in range(1, 41):
            x, y = batch(step)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            time.sleep(0.01)
            opt.step()
    ck.close()
    warnings = [r.getMessage() for r in caplog.records if "over the" in r.getMessage()]
    assert len(warnings) == 1 and "mode='xor'" in warnings[0], warnings
    assert ChainReader(tmp_path / "chain").steps == list(range(41))  # a gradient mode still records every step


class Clock:
    """A monotonic clock the simulated steps advance (the cadence's decisions, without timing noise)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class Simulated:
    """Step intervals as the runtime reports them to a :class:`cadence.Cadence`, from a model of
    the training: steps of ``tau0`` seconds, a capture that stalls the training thread ``stall``
    seconds and keeps the background writer busy ``busy`` CPU seconds on a spare core (it does
    not slow the steps), and pauses between steps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, every: int, budget: float = 0.035) -> None:
        self.clock = Clock()
        monkeypatch.setattr(cadence, "time", self.clock)
        self.c = cadence.Cadence(CaptureOptions(max_overhead=budget), adaptive=True, last_captured=0,
                                 max_lost_s=1e9)
        self.c.every = every
        self.step, self.stall_s, self.busy_s, self.after = 0, 0.0, 0.0, False
        self.started = False
        self.ks: list[int] = []

    def run(self, steps: int, tau0: float, stall: float, busy: float = 0.0, pause_every: int = 0,
            pause_s: float = 0.0) -> list[int]:
        """The k in force after each of these steps."""
        before = len(self.ks)
        for _ in range(steps):
            seconds = tau0 + (stall if self.after else 0.0)
            if self.after:
                self.stall_s += stall
                self.busy_s += busy
            elif pause_every and self.step % pause_every == 0:
                seconds += pause_s  # an evaluation after an uncaptured step: no checkpointing work in it
            if self.started:
                self.clock.now += seconds
                self.c.interval(seconds, after_capture=self.after, clean=not self.after,
                                stall_s=self.stall_s, background_s=self.busy_s)
            self.started = True
            self.step += 1
            self.after = self.c.due(self.step)
            if self.after:
                self.c.captured(self.step)
            self.ks.append(self.c.every)
        return self.ks[before:]


def test_a_large_interval_falls_back_when_captures_are_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures far apart (200 s, beyond the longest window): their cost is still measured, and k falls."""
    sim = Simulated(monkeypatch, every=2000)
    ks = sim.run(20_000, tau0=0.1, stall=0.001)  # 200 s between captures, each costing 1 % of a step
    assert ks[-1] == 1, f"k must fall back to 1: {sorted(set(ks), reverse=True)}"
    assert sim.c.overhead is not None and sim.c.overhead <= 0.035


def test_one_quiet_window_does_not_undo_a_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raised at once; lowered only when several windows in a row agree."""
    sim = Simulated(monkeypatch, every=1)
    ks = sim.run(400, tau0=0.01, stall=0.05)  # a capture costs 5 steps: 500 % at k = 1
    raised = ks[-1]
    assert raised >= int(0.05 / (0.035 * 0.01)), ks[::20]
    decisions = sim.c.decisions
    sim.run(1, tau0=0.01, stall=0.0)
    while sim.c.decisions == decisions:  # one window of free captures
        sim.run(1, tau0=0.01, stall=0.0)
    assert sim.c.every == raised, "one quiet window lowered k"
    ks = sim.run(raised * 2 * (cadence.LOWER_AFTER + 2), tau0=0.01, stall=0.0)
    assert ks[-1] <= raised // 4, f"k stays at {ks[-1]} although captures are free"


def test_pauses_between_steps_are_not_a_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A background writer busy on a spare core and evaluations between steps: the cost is the stall."""
    monkeypatch.setattr(cadence, "WARMUP_S", 0.0)
    sim = Simulated(monkeypatch, every=4)
    # A 2 % stall at k = 4, where it stays; the background's CPU time, if it all came out of training, 14.5 %.
    ks = sim.run(2_000, tau0=0.1, stall=0.008, busy=0.05, pause_every=50, pause_s=30.0)
    assert max(ks) == 4 and ks[-1] <= 4, f"a pause was taken for checkpointing's cost: k {sorted(set(ks))}"


def test_one_costly_capture_does_not_push_captures_hours_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk stall makes one capture cost 5 s: k rises (by RAISE_MAX at most) and comes back."""
    monkeypatch.setattr(cadence, "WARMUP_S", 0.0)
    sim = Simulated(monkeypatch, every=4)
    steady = sim.run(1_000, tau0=0.1, stall=0.008)[-1]  # 2 % at k = 4 (test_pauses_between_steps...)
    assert steady == 4
    spike = sim.run(8, tau0=0.1, stall=5.0)  # two captures stall 5 s each
    ks = sim.run(1_000, tau0=0.1, stall=0.008)  # 100 s of training
    assert max(spike + ks) <= 4 * cadence.RAISE_MAX, f"k {sorted(set(spike + ks))}"
    assert max(spike + ks) > 4, "the costly captures must raise k"
    assert ks[-1] == 4, f"k must come back within 100 s once captures are cheap again: {sorted(set(ks))}"
