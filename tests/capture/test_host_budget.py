"""The host-memory budget (docs/capture-runtime.md "Host memory"): the staging buffers of every
step in flight never take more than ``max_host_bytes`` together; fewer steps wait for the
writer when ``queue_depth + 1`` sets do not fit, and every committed step stays bit-exact; an
``xor`` state of which one staging set does not fit is captured in pieces, within the budget;
a tensor larger than the budget, or a gradient mode's set, is refused before anything is written."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, snapshot, train_step
from torch import nn

import ldformat
from ldformat import CaptureOptions, ChainReader, UsageError
from ldformat.capture.staging import BufferPool
from ldformat.capture.tuning import default_max_host_bytes, staging_set_bytes, xor_staged_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread", "close_leftover_checkpointers")


def objects() -> tuple[TinyNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("mode", ["xor", "lowdiff+"])
def test_budget_for_fewer_sets_than_the_queue_holds_and_steps_stay_exact(
        tmp_path: Path, mode: Any, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "chain"
    model, opt = objects()
    one = staging_set_bytes(mode, model, opt, pin=False)
    budget = 2 * one + one // 2  # two sets fit, not the three of queue_depth=2
    refs: dict[int, Any] = {0: snapshot(model, opt)}
    with caplog.at_level(logging.INFO, logger="ldformat.capture"):
        ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=5, batch_steps=3,
                                   options=CaptureOptions(queue_depth=2, max_host_bytes=budget, capture_every=1))
    assert f"2 staging set(s) of {one} bytes fit max_host_bytes={budget}" in caplog.text
    assert ck.stats.staging_sets == 2 and ck.stats.max_host_bytes == budget
    for step in range(1, 13):
        train_step(model, opt, step)
        refs[step] = snapshot(model, opt)
        assert ck.stats.host_bytes <= budget
    ck.close()
    peak = ck.stats.host_bytes_peak
    # The budget held, and both sets were used: more than one set's bytes were allocated at once.
    assert one < peak <= budget, (peak, one, budget)
    assert ck.stats.to_dict()["host_bytes_peak"] == peak
    reader = ChainReader(path)
    assert reader.steps == list(range(13))
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"{mode} step {step}")
    assert ldformat.validate(path).ok

    # Resume and train on: bit-exact with the reference run.
    model2, opt2 = objects()
    assert ldformat.resume(path, model2, opt2, step=7) == 7
    for step in range(8, 13):
        train_step(model2, opt2, step)
    assert_state_bits_equal(snapshot(model2, opt2), refs[12], f"{mode} resumed at 7, step 12")


def pieces_budget(model: TinyNet, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """A budget that one xor set does not fit but every tensor does, beside the buffers; and one set's bytes."""
    staged = xor_staged_tensors(model, opt, pin=False)
    one = staging_set_bytes("xor", model, opt, pin=False)
    assert one == sum(t.nbytes for t in staged)
    besides = sum(t.nbytes for t in staged if t.buffer)
    largest = max(t.nbytes for t in staged if not t.buffer)
    budget = besides + largest + 100  # the largest tensor and a small one: several pieces a step
    assert budget < one // 2
    return budget, one


def train_scaled(model: TinyNet, opt: torch.optim.Optimizer, sched: Any, scaler: Any, step: int) -> None:
    model.train()
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    if step == 4:  # GradScaler skips this step
        grad = model.hidden.weight.grad
        assert grad is not None
        grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    sched.step()


@pytest.mark.parametrize("every", [1, 2, "auto"])
def test_a_state_larger_than_the_budget_is_captured_in_pieces_within_it(
        tmp_path: Path, every: Any, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "chain"
    model, opt = objects()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    budget, one = pieces_budget(model, opt)
    refs: dict[int, Any] = {0: snapshot(model, opt)}
    with caplog.at_level(logging.INFO, logger="ldformat.capture"):
        ck = ldformat.Checkpointer(path, model, opt, scheduler=sched, scaler=scaler, anchor_every=5, batch_steps=2,
                                   options=CaptureOptions(max_host_bytes=budget, capture_every=every))
    assert f"takes {one} bytes, more than max_host_bytes={budget}: each step is captured in pieces" in caplog.text
    assert ck.stats.pieces and ck.stats.staging_sets == 1 and not ck.writer.predict_state
    for step in range(1, 13):
        train_scaled(model, opt, sched, scaler, step)
        refs[step] = snapshot(model, opt)
        assert ck.stats.host_bytes_peak <= budget
    ck.close()
    peak = ck.stats.host_bytes_peak
    assert 0 < peak <= budget < one, (peak, budget, one)
    reader = ChainReader(path)
    assert reader.steps[-1] == 12 and len(reader.steps) > 2
    if every == 1:
        assert reader.steps == list(range(13))
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"every={every}, step {step}")
    assert ldformat.validate(path).ok

    # Resume from a step in the middle and train on: bit-exact with the reference run.
    middle = reader.steps[len(reader.steps) // 2]
    model2, opt2 = objects()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    assert ldformat.resume(path, model2, opt2, scheduler=sched2, scaler=scaler2, step=middle) == middle
    for step in range(middle + 1, 13):
        train_scaled(model2, opt2, sched2, scaler2, step)
    assert_state_bits_equal(snapshot(model2, opt2), refs[12], f"every={every}, resumed at {middle}, step 12")


def test_a_chain_reopened_in_pieces_continues_exactly(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    model, opt = objects()
    refs: dict[int, Any] = {0: snapshot(model, opt)}
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=50, batch_steps=3,
                               options=CaptureOptions(capture_every=1))  # Adam prediction on
    for step in range(1, 5):
        train_step(model, opt, step)
        refs[step] = snapshot(model, opt)
    ck.close()
    budget, _ = pieces_budget(model, opt)
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=50, batch_steps=3,
                               options=CaptureOptions(max_host_bytes=budget, capture_every=1))
    assert ck.stats.pieces
    for step in range(5, 10):
        train_step(model, opt, step)
        refs[step] = snapshot(model, opt)
    ck.close()
    assert ck.stats.host_bytes_peak <= budget
    reader = ChainReader(path)
    assert reader.steps == list(range(10))
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
    assert ldformat.validate(path).ok


def test_a_tensor_larger_than_the_budget_and_gradient_modes_over_it_are_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    model, opt = objects()
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied weight counts once
    xor = staging_set_bytes("xor", model, opt, pin=False)
    grads = staging_set_bytes("lowdiff+", model, opt, pin=False)
    assert xor > 3 * params > grads  # AdamW's two moments, not created yet, count
    embed = model.embed.weight.numel() * 4  # the largest tensor, and the optimizer state its first step creates
    for budget in (1, embed - 1):
        with pytest.raises(UsageError, match=rf"model/embed.weight takes {embed} bytes of host memory, more than "
                                             rf"max_host_bytes={budget}: .*in pieces.*at least {embed}"):
            ldformat.Checkpointer(tmp_path / "xor", model, opt, options=CaptureOptions(max_host_bytes=budget))
        assert not (tmp_path / "xor").exists()
    buffers = sum(t.nbytes for t in xor_staged_tensors(model, opt, pin=False) if t.buffer)
    with pytest.raises(UsageError, match=rf"the model's buffers \({buffers} bytes.*model/embed.weight \({embed} "
                                         rf"bytes\).*at least {buffers + embed}"):
        ldformat.Checkpointer(tmp_path / "xor", model, opt, options=CaptureOptions(max_host_bytes=embed))
    assert not (tmp_path / "xor").exists()
    for mode, budget in (("lowdiff+", grads - 1), ("lowdiff", 1)):
        with pytest.raises(UsageError, match=r"takes \d+ bytes .*the gradients and buffers.*only mode 'xor' "
                                             r"captures a state in pieces"):
            ldformat.Checkpointer(tmp_path / "grads", model, opt, mode=mode,  # type: ignore[arg-type]
                                  options=CaptureOptions(max_host_bytes=budget))
        assert not (tmp_path / "grads").exists()
    # What the error suggests fits: the gradient mode stages less; one xor set fits exactly, not in pieces.
    ck = ldformat.Checkpointer(tmp_path / "grads", model, opt, mode="lowdiff+",
                               options=CaptureOptions(max_host_bytes=xor - 1))
    train_step(model, opt, 1)
    ck.close()
    assert ck.stats.host_bytes_peak <= xor - 1
    ck = ldformat.Checkpointer(tmp_path / "xor", model, opt, options=CaptureOptions(max_host_bytes=xor))
    assert not ck.stats.pieces and ck.writer.predict_state
    for step in range(2, 5):
        train_step(model, opt, step)
    ck.close()
    assert 0 < ck.stats.host_bytes_peak <= xor and ck.stats.staging_sets == 1
    assert_state_bits_equal(ChainReader(tmp_path / "xor").materialize(3), snapshot(model, opt), "xor, 3 steps on")


def gate_the_reader(ck: ldformat.Checkpointer) -> tuple[threading.Event, threading.Event]:
    """Make the writer wait before it reads a step's pieces: ``reading`` is set when it is about
    to read, and it reads once ``release`` is set."""
    reading, release = threading.Event(), threading.Event()
    real = ck._piece_reader

    def gated(*args: Any) -> Any:
        read = real(*args)

        def wait_then_read(order: list[str]) -> Any:
            reading.set()
            release.wait(10)
            yield from read(order)

        return wait_then_read

    ck._piece_reader = gated  # type: ignore[method-assign]
    return reading, release


def step_2_waits_to_be_read(path: Path) -> tuple[ldformat.Checkpointer, TinyNet, torch.optim.Optimizer,
                                                  threading.Event]:
    """A chain captured in pieces, step 1 committed, step 2 trained and its writer about to read
    it, held until the returned event is set."""
    model, opt = objects()
    budget, _ = pieces_budget(model, opt)
    ck = ldformat.Checkpointer(path, model, opt, anchor_every=50, batch_steps=1,
                               options=CaptureOptions(max_host_bytes=budget, capture_every=1))
    train_step(model, opt, 1)
    ck.flush()
    reading, release = gate_the_reader(ck)
    train_step(model, opt, 2)
    assert reading.wait(10)
    return ck, model, opt, release


def test_a_change_in_place_after_the_step_fails_the_capture_in_pieces_rather_than_record_a_mix(
        tmp_path: Path) -> None:
    path = tmp_path / "chain"
    ck, model, opt, release = step_2_waits_to_be_read(path)  # the change comes before the writer reads
    with torch.no_grad():
        model.hidden.weight.mul_(0.5)  # after optimizer.step(), before the writer read it
    release.set()
    with pytest.raises(ldformat.LdformatError, match=r"model/hidden.weight changed in place after optimizer.step"):
        train_step(model, opt, 3)
    with pytest.raises(ldformat.LdformatError):
        ck.close()
    assert ChainReader(path).steps == [0, 1]


def test_bad_budgets_are_refused() -> None:
    for bad in (0, -1, True, 1.5, "8G"):
        with pytest.raises(UsageError, match="max_host_bytes must be a positive number of bytes"):
            CaptureOptions(max_host_bytes=bad)  # type: ignore[arg-type]
    assert default_max_host_bytes() > 0
    assert CaptureOptions(max_host_bytes=1 << 30).given() == {}  # not a Checkpointer keyword


def test_the_pool_retires_sets_when_a_set_outgrows_the_estimate() -> None:
    like = torch.zeros(100, dtype=torch.float32)  # 400 bytes a buffer
    pool = BufferPool(3, pin=False, max_bytes=1000)
    a, _ = pool.acquire()
    a.buffer("x", like)
    a.buffer("y", like)  # 800: set a is in flight now
    b, _ = pool.acquire()

    def hand_back() -> None:
        time.sleep(0.2)
        pool.release(a)

    writer = threading.Thread(target=hand_back)
    writer.start()
    started = time.perf_counter()
    b.buffer("x", like)  # over the budget: the free set is retired, then a once the writer hands it back
    writer.join()
    assert time.perf_counter() - started >= 0.15
    assert pool.size == 1 and pool.bytes == 400 and pool.peak <= 1000 and not a.tensors
    b.buffer("y", like)
    with pytest.raises(UsageError, match="one staging set of this state needs more than max_host_bytes=1000"):
        b.buffer("z", like)  # b alone would need 1200
    assert pool.bytes == 800 and "z" not in b.tensors
    b.buffer("y", torch.zeros(50, dtype=torch.float32))  # reallocated smaller: the old buffer is given back first
    assert pool.bytes == 600 and pool.peak == 800


def test_a_change_the_writer_cannot_see_is_judged_on_the_training_thread(tmp_path: Path) -> None:
    """The writer's own version checks run on its thread, where an in-place op the training
    thread is still inside has not moved its counter yet. Modelled here by a change through
    ``.data`` while the writer reads, whose counter moves only after the read: the training
    thread's verdict refuses the row, so the step is never committed with a mix."""
    path = tmp_path / "chain"
    ck, model, opt, release = step_2_waits_to_be_read(path)  # the change comes before the writer reads
    model.hidden.weight.data.mul_(0.5)  # no counter moves: the writer's checks pass
    release.set()
    deadline = time.monotonic() + 10
    while ck._reading is not None and not ck._reading.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with torch.no_grad():
        model.hidden.weight.add_(0.0)  # the op's counter moves after the writer's check
    with pytest.raises(ldformat.LdformatError, match=r"model/hidden.weight changed in place after optimizer.step"):
        train_step(model, opt, 3)
    with pytest.raises(ldformat.LdformatError):
        ck.close()
    assert ChainReader(path).steps == [0, 1]
