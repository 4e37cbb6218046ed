"""The lazy snapshot (docs/capture-runtime.md "Lazy snapshot"): an xor step's parameters and
optimizer state are copied while the next step runs. An in-place change of a parameter, an
optimizer state tensor or a BatchNorm buffer at any point between two steps never gives a
wrong checkpoint: every committed step is bit-exact with the live state when its
``optimizer.step()`` returned, and a step whose snapshot a change invalidated is dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, snapshot
from torch import nn

import ldformat
from ldformat import CaptureOptions, ChainReader

EDITED_STEP = 3
POINTS = ["after-step", "after-zero-grad", "after-forward", "after-backward"]
TARGETS = ["parameter", "optimizer-state", "batchnorm-buffer"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    pass


def on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    model = {k: v.cpu() for k, v in state["model"].items()}
    opt = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
           for i, s in state["optimizer"]["state"].items()}
    return {"model": model, "optimizer": {"state": opt, "param_groups": state["optimizer"]["param_groups"]}}


def edit(model: TinyNet, opt: torch.optim.Optimizer, target: str) -> None:
    with torch.no_grad():
        if target == "parameter":
            model.hidden.weight.mul_(0.5)
        elif target == "optimizer-state":
            opt.state[model.hidden.weight]["exp_avg"].add_(1.0)
        else:
            model.norm.running_mean.add_(1.0)


def run(path: Path, device: str, target: str | None, point: str | None, steps: int = 6
        ) -> tuple[ldformat.Checkpointer, dict[int, Any]]:
    torch.manual_seed(0)
    model = TinyNet().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    refs = {0: on_cpu(snapshot(model, opt))}
    ck = ldformat.Checkpointer(path, model, opt, options=CaptureOptions(capture_every=1, lazy_snapshot=True))
    for step in range(1, steps + 1):
        now = step - 1 == EDITED_STEP and target is not None  # edits the window after EDITED_STEP
        x, y = (t.to(device) for t in batch(step))
        opt.zero_grad(set_to_none=True)
        if now and point == "after-zero-grad":
            edit(model, opt, target)
        loss = nn.functional.cross_entropy(model(x), y)
        if now and point == "after-forward":
            edit(model, opt, target)
        loss.backward()
        if now and point == "after-backward":
            edit(model, opt, target)
        opt.step()
        refs[step] = on_cpu(snapshot(model, opt))  # the state when optimizer.step() returned
        if step == EDITED_STEP and target is not None and point == "after-step":
            edit(model, opt, target)
    ck.close()
    return ck, refs


# Between forward and backward autograd itself refuses a change of what backward needs.
CASES = [(t, p) for t in TARGETS for p in POINTS if not (p == "after-forward" and t != "optimizer-state")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("target", "point"), CASES)
def test_changes_in_place_between_steps_never_give_a_wrong_checkpoint(tmp_path: Path, device: str, target: str,
                                                                       point: str) -> None:
    ck, refs = run(tmp_path / "chain", device, target, point)
    reader = ChainReader(tmp_path / "chain")
    # A parameter or optimizer state changed inside the window invalidates that step's snapshot;
    # a buffer is copied before the step ends, so its change belongs to the next step.
    dropped = [EDITED_STEP] if target != "batchnorm-buffer" else []
    assert ck._lazy.dropped == dropped
    assert reader.steps == [s for s in range(7) if s not in dropped]
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"{target} {point} step {step}")
    assert ldformat.validate(tmp_path / "chain").ok


@pytest.mark.parametrize("device", DEVICES)
def test_without_changes_every_step_is_copied_lazily_and_exact(tmp_path: Path, device: str) -> None:
    ck, refs = run(tmp_path / "chain", device, None, None)
    assert ck._lazy.dropped == [] and ck._lazy.enabled
    reader = ChainReader(tmp_path / "chain")
    assert reader.steps == list(range(7))
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
