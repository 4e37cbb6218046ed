"""The host-memory budget (docs/capture-runtime.md "Host memory"): the staging buffers of every
step in flight never take more than ``max_host_bytes`` together; fewer steps wait for the
writer when ``queue_depth + 1`` sets do not fit, and every committed step stays bit-exact; a
state of which one staging set does not fit is refused before anything is written."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
from ldformat import CaptureOptions, ChainReader, UsageError
from ldformat.capture.staging import BufferPool
from ldformat.capture.tuning import default_max_host_bytes, staging_set_bytes


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    pass


@pytest.fixture(autouse=True)
def _close_leftover_checkpointers(close_leftover_checkpointers: None) -> None:
    pass


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


def test_a_state_larger_than_the_budget_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, opt = objects()
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied weight counts once
    xor = staging_set_bytes("xor", model, opt, pin=False)
    grads = staging_set_bytes("lowdiff+", model, opt, pin=False)
    assert xor > 3 * params > grads  # AdamW's two moments, not created yet, count
    for budget in (1, params, xor - 1):  # the last one holds the state as it is now, not after step 1
        with pytest.raises(UsageError, match=rf"takes {xor} bytes of host memory .*more than "
                                             rf"max_host_bytes={budget}; give .*at least {xor}.*lowdiff\+"):
            ldformat.Checkpointer(tmp_path / "xor", model, opt, options=CaptureOptions(max_host_bytes=budget))
        assert not (tmp_path / "xor").exists()
    with pytest.raises(UsageError, match=rf"takes {grads} bytes .*the gradients and buffers"):
        ldformat.Checkpointer(tmp_path / "grads", model, opt, mode="lowdiff+",
                              options=CaptureOptions(max_host_bytes=grads - 1))
    assert not (tmp_path / "grads").exists()
    # What the error suggests fits: the gradient mode stages less; one xor set fits exactly.
    ck = ldformat.Checkpointer(tmp_path / "grads", model, opt, mode="lowdiff+",
                               options=CaptureOptions(max_host_bytes=xor - 1))
    train_step(model, opt, 1)
    ck.close()
    assert ck.stats.host_bytes_peak <= xor - 1
    ck = ldformat.Checkpointer(tmp_path / "xor", model, opt, options=CaptureOptions(max_host_bytes=xor))
    for step in range(2, 5):
        train_step(model, opt, step)
    ck.close()
    assert 0 < ck.stats.host_bytes_peak <= xor and ck.stats.staging_sets == 1
    assert_state_bits_equal(ChainReader(tmp_path / "xor").materialize(3), snapshot(model, opt), "xor, 3 steps on")


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
