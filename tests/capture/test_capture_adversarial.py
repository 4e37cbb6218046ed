"""Adversarial checks of the host-memory budget (docs/capture-runtime.md "Host memory") and the
capture cadence (docs/capture-runtime.md "Bounded cost"): estimates that must never fall short,
a pool shared by the training thread and the writer, refusals after training started, and the
cadence fed timings that no real clock gives."""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, snapshot

import ldformat
from ldformat import CaptureOptions, ChainReader, LdformatError, UsageError
from ldformat.capture import cadence as cadence_module
from ldformat.capture.cadence import Cadence
from ldformat.capture.staging import BufferPool, host_bytes
from ldformat.capture.tuning import staging_set_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread", "close_leftover_checkpointers")


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    model.train()
    x, y = batch(n)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.step()


def assert_bits_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """:func:`assert_state_bits_equal`, with non-tensor optimizer state (timm's int ``step``) compared by value."""
    def split(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, dict[str, Any]]]:
        tensors, others = {}, {}
        for i, st in sd["optimizer"]["state"].items():
            tensors[i] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
            others[i] = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        return {**sd, "optimizer": {**sd["optimizer"], "state": tensors}}, others

    got_tensors, got_others = split(got)
    want_tensors, want_others = split(want)
    assert got_others == want_others, where
    assert_state_bits_equal(got_tensors, want_tensors, where)


def timm_optimizer(module: str, name: str) -> type[torch.optim.Optimizer]:
    """A timm optimizer class, loaded without timm's package (which needs torchvision)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed")
    package = "_timm_optim_for_tests"
    if package not in sys.modules:
        stub = types.ModuleType(package)
        stub.__path__ = [os.path.join(list(spec.submodule_search_locations)[0], "optim")]
        sys.modules[package] = stub
    cls: type[torch.optim.Optimizer] = getattr(importlib.import_module(f"{package}.{module}"), name)
    return cls


Make = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "RMSprop centered momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "timm Lamb": lambda p: timm_optimizer("lamb", "Lamb")(p),
    "timm AdamP": lambda p: timm_optimizer("adamp", "AdamP")(p),
    "timm Adafactor": lambda p: timm_optimizer("adafactor", "Adafactor")(p),
    # More state than Adam's two moments, or float32 state for low-precision parameters: before
    # the estimate knew them, one set of their state did not fit a budget of the estimate.
    "timm Adan": lambda p: timm_optimizer("adan", "Adan")(p),
    "timm MADGRAD": lambda p: timm_optimizer("madgrad", "MADGRAD")(p),
    "timm Mars": lambda p: timm_optimizer("mars", "Mars")(p),
    "timm AdaBelief": lambda p: timm_optimizer("adabelief", "AdaBelief")(p),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_estimate_of_a_set_is_never_short(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    """A budget of exactly the estimate holds the state the first steps create, and the steps stay exact."""
    torch.manual_seed(0)
    model = TinyNet().to(dtype)
    opt = OPTIMIZERS[name](model.parameters())
    one = staging_set_bytes("xor", model, opt, pin=False)
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=10, batch_steps=2,
                               options=CaptureOptions(capture_every=1, queue_depth=0, max_host_bytes=one))
    refs = {0: snapshot(model, opt)}
    for n in (1, 2):
        step(model, opt, n)  # a short estimate fails here: one set of the state does not fit
        refs[n] = snapshot(model, opt)
    ck.close()
    assert 0 < ck.stats.host_bytes_peak <= one
    reader = ChainReader(path)
    assert reader.steps == [0, 1, 2]
    for n in reader.steps:
        assert_bits_equal(reader.materialize(n), refs[n], f"{name} {dtype} step {n}")


def test_pinned_sizes_round_up_to_a_power_of_two() -> None:
    assert [host_bytes(n, True) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]
    assert [host_bytes(n, False) for n in (0, 3, 1000, 1025)] == [0, 3, 1000, 1025]
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters())
    assert staging_set_bytes("xor", model, opt, pin=True) > staging_set_bytes("xor", model, opt, pin=False)


class Grower(torch.optim.SGD):
    """SGD with momentum whose state grows by ``grow`` tensors like each parameter from step 3 on:
    past the estimate (2x the parameters for a class it does not know), after the chain exists."""

    def __init__(self, params: Any, grow: int) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.grow = grow
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        self.steps += 1
        if self.steps >= 3:
            for group in self.param_groups:
                for p in group["params"]:
                    for i in range(self.grow):
                        extra = self.state[p].setdefault(f"extra{i}", torch.zeros_like(p))
                        extra.add_(p, alpha=0.5)
        return loss


def grower(grow: int) -> tuple[TinyNet, Grower]:
    torch.manual_seed(0)
    model = TinyNet()
    return model, Grower(model.parameters(), grow)


def test_sets_that_outgrow_the_estimate_are_retired_while_the_writer_hands_them_back(tmp_path: Path) -> None:
    model, opt = grower(2)  # momentum + 2: 3x the parameters, over the 2x estimated
    one = staging_set_bytes("xor", model, opt, pin=False)
    budget = 2 * one + one // 2  # two estimated sets fit; two grown ones do not, one does
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=4, batch_steps=2,
                               options=CaptureOptions(capture_every=1, queue_depth=2, max_host_bytes=budget))
    assert ck.stats.staging_sets == 2
    refs = {0: snapshot(model, opt)}
    for n in range(1, 9):
        step(model, opt, n)
        refs[n] = snapshot(model, opt)
        assert ck.stats.host_bytes <= budget
    ck.close()
    assert ck.pool.size == 1 and ck.stats.host_bytes_peak <= budget
    assert ck.pool.bytes == sum(s.nbytes for s in list(ck.pool._free.queue))  # nothing counted twice or lost
    reader = ChainReader(path)
    assert reader.steps == list(range(9))
    for n in reader.steps:
        assert_state_bits_equal(reader.materialize(n), refs[n], f"grown state, step {n}")


def test_close_after_a_refused_step_commits_the_steps_before_it_and_releases_the_lock(tmp_path: Path) -> None:
    """Before the fix, close() raised the refusal again before committing: the steps queued before
    it were lost and the chain stayed locked."""
    model, opt = grower(3)  # momentum + 3: 4x the parameters, one set alone exceeds the budget
    one = staging_set_bytes("xor", model, opt, pin=False)
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=100, batch_steps=10,
                               options=CaptureOptions(capture_every=1, queue_depth=0, max_host_bytes=one))
    refs = {0: snapshot(model, opt)}
    for n in (1, 2):
        step(model, opt, n)
        refs[n] = snapshot(model, opt)
    with pytest.raises(UsageError, match="one staging set of this state needs more than max_host_bytes"):
        step(model, opt, 3)
    with pytest.raises(UsageError, match="one staging set of this state needs more than max_host_bytes"):
        ck.close()  # still said, but only after the steps before it were committed
    assert ck.durable_step == 2
    reader = ChainReader(path)
    assert reader.steps == [0, 1, 2]
    for n in reader.steps:
        assert_state_bits_equal(reader.materialize(n), refs[n], f"before the refusal, step {n}")
    assert ldformat.validate(path).ok
    # The lock is released: the chain can be opened again and continued from step 2.
    model2, opt2 = grower(3)
    assert ldformat.resume(path, model2, opt2) == 2
    ldformat.Checkpointer(path, model2, opt2, step=2, options=CaptureOptions(capture_every=1)).close()


def test_a_writer_failure_while_training_waits_for_the_only_set_raises_instead_of_hanging(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one = staging_set_bytes("xor", model, opt, pin=False)
    ck = ldformat.Checkpointer(tmp_path / "chain", model, opt, anchor_every=100, batch_steps=1,
                               options=CaptureOptions(capture_every=1, queue_depth=3, max_host_bytes=one))
    assert ck.stats.staging_sets == 1
    append = ck.writer.append

    def failing_append(captured: Any, encoded: Any = None) -> None:
        if captured.step >= 2:
            time.sleep(0.3)  # training is waiting for this set meanwhile
            raise OSError("disk gone")
        append(captured, encoded=encoded)

    ck.writer.append = failing_append  # type: ignore[method-assign]
    outcome: list[BaseException | None] = []

    def train() -> None:
        try:
            for n in range(1, 6):
                step(model, opt, n)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "training hangs waiting for a staging set after the writer failed"
    assert isinstance(outcome[0], LdformatError) and "disk gone" in str(outcome[0])
    with pytest.raises(LdformatError, match="disk gone"):
        ck.close()
    # The lock is released: the chain opens again, at its last durable step.
    model2 = TinyNet()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    resumed = ldformat.resume(tmp_path / "chain", model2, opt2)
    assert resumed == ck.durable_step == 1
    ldformat.Checkpointer(tmp_path / "chain", model2, opt2, step=resumed).close()


def test_the_pool_under_a_racing_writer_keeps_its_accounts() -> None:
    """Training allocates buffers of changing sizes while a writer thread hands sets back at random:
    no deadlock, never over the budget, and the bytes counted are those of the sets' buffers."""
    rng = random.Random(0)
    pool = BufferPool(3, pin=False, max_bytes=4000)
    handed: list[Any] = []
    lock = threading.Lock()
    done = threading.Event()
    over: list[int] = []

    def writer() -> None:
        while not done.is_set() or handed:
            with lock:
                item = handed.pop(0) if handed else None
            if item is None:
                time.sleep(0.0005)
                continue
            time.sleep(rng.random() * 0.002)
            pool.release(item)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    for i in range(300):
        buffers, _ = pool.acquire()
        for name in ("a", "b"):
            size = rng.choice((50, 100, 200, 300))  # a set of at most 2400 bytes: one always fits alone
            buffers.buffer(name, torch.empty(size, dtype=torch.float32))
            if pool.bytes > 4000:
                over.append(pool.bytes)
        assert buffers.nbytes == sum(t.numel() * t.element_size() for t in buffers.tensors.values()), i
        with lock:
            handed.append(buffers)
    done.set()
    thread.join(30)
    assert not thread.is_alive(), "the writer never drained"
    assert not over and pool.peak <= 4000
    sets = list(pool._free.queue)
    assert len(sets) == pool.size >= 1
    assert pool.bytes == sum(s.nbytes for s in sets) == sum(
        t.numel() * t.element_size() for s in sets for t in s.tensors.values())


def test_a_buffer_reallocated_larger_is_freed_before_its_replacement_is_charged() -> None:
    pool = BufferPool(1, pin=False, max_bytes=1000)
    buffers, _ = pool.acquire()
    buffers.buffer("x", torch.empty(100, dtype=torch.float32))  # 400
    buffers.buffer("y", torch.empty(100, dtype=torch.float32))  # 800
    buffers.buffer("x", torch.empty(150, dtype=torch.float32))  # 400 + 600: fits once the old x is freed
    assert pool.bytes == buffers.nbytes == 1000
    with pytest.raises(UsageError):
        buffers.buffer("x", torch.empty(150, dtype=torch.float64))  # 1200 with y: refused
    assert "x" not in buffers.tensors  # freed before the refusal, and no longer counted
    assert pool.bytes == buffers.nbytes == sum(t.numel() * t.element_size() for t in buffers.tensors.values())


# -- the capture cadence ---------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def drive(c: Cadence, clock: FakeClock, intervals: list[tuple[float, bool, bool, float]]) -> None:
    """Feed ``(seconds, after_capture, clean, stall)`` intervals, advancing the clock by each."""
    stall = 0.0
    for seconds, after_capture, clean, stalled in intervals:
        clock.now += max(seconds, 1.0)  # windows need WINDOW_S of wall time
        stall += stalled
        c.interval(seconds, after_capture=after_capture, clean=clean, stall_s=stall, background_s=0.0)


@pytest.mark.parametrize("seconds, stalled, clean", [(0.0, 0.0, True), (0.5, 0.5, False)],
                         ids=["timed-as-nothing", "all-stall"])
def test_the_cadence_survives_a_step_time_of_zero(monkeypatch: pytest.MonkeyPatch, seconds: float,
                                                  stalled: float, clean: bool) -> None:
    """Clean intervals timed as 0 (a coarse clock), or windows that are all stall, left nothing to
    divide by: ZeroDivisionError in the training thread's optimizer pre-hook."""
    clock = FakeClock()
    monkeypatch.setattr(cadence_module, "time", clock)
    c = Cadence(CaptureOptions(), adaptive=True, last_captured=0, max_lost_s=60.0)
    drive(c, clock, [(seconds, True, clean, stalled)] * 40)
    assert c.every >= 1 and (c.tau0 is None or c.tau0 > 0)
    assert c.overhead is None or c.overhead >= 0


def test_the_cadence_raises_k_on_one_costly_window_and_lowers_it_only_after_three_cheap_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(cadence_module, "time", clock)
    c = Cadence(CaptureOptions(max_overhead=0.05), adaptive=True, last_captured=0, max_lost_s=1e9)
    # Warm-up, then a baseline of clean 1 s steps and captures that stall 0.5 s each.
    drive(c, clock, [(1.0, False, True, 0.0)] * 12)
    drive(c, clock, [(1.5, True, False, 0.5), (1.0, False, True, 0.0)] * 6)
    raised = c.every
    assert raised > 1, "a capture costing 50 % of a step was kept at k = 1"
    # Captures now cost nothing: k comes down, but not on the first cheap window.
    decisions = c.decisions
    window = [(1.0, True, False, 0.0)] + [(1.0, False, True, 0.0)] * 3
    while c.decisions == decisions:
        drive(c, clock, window)
    assert c.every == raised, "k lowered on one quiet window"
    for _ in range(200):
        if c.every < raised:
            break
        drive(c, clock, window)
    assert c.every < raised, "k stuck after the cost went away"
