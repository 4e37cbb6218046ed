"""Bit-exact replay against live training (spec §11.8 "Exactness"): every step, several optimizers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True, amsgrad=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
}
KINDS = ["grad.topk", "grad.dense", "state.xor"]
STEPS = 9


def run(tmp_path: Any, kind: str, make_opt: Callable[[Any], torch.optim.Optimizer], *,
        manual_lr: bool = False, reopen_at: int | None = None, batch_steps: int = 4,
        anchor_every: int | None = None) -> tuple[str, dict[int, dict[str, Any]]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    topk = ldformat.TopK(0.2) if kind == "grad.topk" else None
    path = str(tmp_path / "chain")
    writer = ldformat.ChainWriter.create(path, model, opt, kind=kind, compressor=topk, batch_steps=batch_steps,
                                         anchor_every=anchor_every, extra={"scheduler": sched.state_dict()})
    refs = {0: snapshot(model, opt)}
    for step in range(1, STEPS + 1):
        train_step(model, opt, step, compress=topk.compress_ if topk else None, scheduler=sched,
                   manual_lr=manual_lr)
        writer.record_step(step, extra={"scheduler": sched.state_dict()})
        refs[step] = snapshot(model, opt)
        if step == reopen_at:
            writer.close()
            writer = ldformat.ChainWriter.open(path, model, opt, compressor=topk, batch_steps=batch_steps)
    writer.close()
    return path, refs


def check_all_steps(path: str, refs: dict[int, dict[str, Any]], label: str) -> None:
    reader = ldformat.ChainReader(path)
    assert reader.steps == sorted(refs)
    for step, ref in refs.items():
        got = reader.materialize(step)
        assert got["step"] == step
        assert_state_bits_equal(got, ref, f"{label} step {step}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_every_step_bit_exact_before_and_after_compact(tmp_path: Any, kind: str, opt_name: str) -> None:
    path, refs = run(tmp_path, kind, OPTIMIZERS[opt_name])
    check_all_steps(path, refs, f"{kind}/{opt_name}")
    plan = ldformat.compact(path, max_replay=2)
    assert plan.new_anchors, "a 9-step chain with one anchor needs new anchors for max_replay=2"
    check_all_steps(path, refs, f"{kind}/{opt_name} compacted")
    report = ldformat.validate(path, deep=True)
    assert report.ok, report.problems
    assert report.drift and all(d["max_ulps"] == 0 for d in report.drift)


@pytest.mark.parametrize("kind", KINDS)
def test_manual_lr_before_step_and_reopened_writer(tmp_path: Any, kind: str) -> None:
    path, refs = run(tmp_path, kind, OPTIMIZERS["adamw"], manual_lr=True, reopen_at=5, batch_steps=3)
    check_all_steps(path, refs, f"{kind} manual lr")
    # The hyperparameters used differ from the live ones after the scheduler step.
    reader = ldformat.ChainReader(path)
    _, entry = reader.state.deltas[4]
    assert entry.hyper[0]["lr"] == pytest.approx(0.01 / 1.4) if kind != "state.xor" else entry.hyper is None


@pytest.mark.parametrize("kind", KINDS)
def test_resume_into_fresh_objects_continues_bit_exact(tmp_path: Any, kind: str) -> None:
    """Materialize into new objects, keep training, and match an uninterrupted run."""
    path, refs = run(tmp_path, kind, OPTIMIZERS["adam-amsgrad"], anchor_every=6)
    resume_at = 6  # an anchor: top-k residuals are restored exactly only there
    torch.manual_seed(123)
    model = TinyNet()
    opt = OPTIMIZERS["adam-amsgrad"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    topk = ldformat.TopK(0.2) if kind == "grad.topk" else None
    loaded = ldformat.ChainReader(path).load_into(model, opt, resume_at, compressor=topk)
    sched.load_state_dict(loaded["extra"]["scheduler"])
    assert_state_bits_equal(snapshot(model, opt), refs[resume_at], "after load_into")
    for step in range(resume_at + 1, STEPS + 1):
        train_step(model, opt, step, compress=topk.compress_ if topk else None, scheduler=sched)
        assert_state_bits_equal(snapshot(model, opt), refs[step], f"resumed step {step}")


def test_two_param_groups_and_skipped_step(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD([
        {"params": [model.embed.weight, model.unused], "lr": 0.1},
        {"params": list(model.hidden.parameters()) + list(model.norm.parameters()), "lr": 0.05, "momentum": 0.9},
    ])
    path = str(tmp_path / "chain")
    refs = {0: snapshot(model, opt)}
    with ldformat.ChainWriter.create(path, model, opt, kind="grad.dense", batch_steps=2) as writer:
        for step in range(1, 6):
            if step == 3:  # a skipped step (as with GradScaler): only buffers change
                model.train()
                model(torch.randint(0, 32, (24,)))
            else:
                train_step(model, opt, step)
            writer.record_step(step)
            refs[step] = snapshot(model, opt)
    check_all_steps(path, refs, "two groups")
    reader = ldformat.ChainReader(path)
    assert reader.state.deltas[3][1].stepped is False


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_parameters(tmp_path: Any, kind: str) -> None:
    torch.manual_seed(0)
    model = TinyNet().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    topk = ldformat.TopK(0.2) if kind == "grad.topk" else None
    path = str(tmp_path / "chain")
    refs = {0: snapshot(model, opt)}
    with ldformat.ChainWriter.create(path, model, opt, kind=kind, compressor=topk) as writer:
        for step in range(1, 5):
            model.train()
            x, _ = torch.randint(0, 32, (24,)), None
            opt.zero_grad()
            model(x).float().square().mean().backward()
            if topk:
                topk.compress_(model)
            opt.step()
            writer.record_step(step)
            refs[step] = snapshot(model, opt)
    check_all_steps(path, refs, f"bf16 {kind}")


def test_tensor_hyperparameter_is_refused_by_gradient_kinds_only(tmp_path: Any) -> None:
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    with pytest.raises(ldformat.UnsupportedStateError, match="tensor"):
        ldformat.ChainWriter.create(str(tmp_path / "c"), model, opt, kind="grad.dense")
    assert not (tmp_path / "c").exists()
    writer = ldformat.ChainWriter.create(str(tmp_path / "x"), model, opt, kind="state.xor")
    for step in (1, 2):
        train_step(model, opt, step)
        writer.record_step(step)
    writer.close()
    lr = ldformat.ChainReader(tmp_path / "x").materialize(2)["optimizer"]["param_groups"][0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and float(lr) == pytest.approx(0.01)


def test_custom_optimizer_needs_xor(tmp_path: Any) -> None:
    class MySGD(torch.optim.SGD):
        pass

    model = TinyNet()
    opt = MySGD(model.parameters(), lr=0.1)
    with pytest.raises(ldformat.UnsupportedStateError, match="state.xor"):
        ldformat.ChainWriter.create(str(tmp_path / "c"), model, opt, kind="grad.dense")
    path = str(tmp_path / "x")
    refs = {0: snapshot(model, opt)}
    with ldformat.ChainWriter.create(path, model, opt, kind="state.xor") as writer:
        for step in range(1, 4):
            train_step(model, opt, step)
            writer.record_step(step)
            refs[step] = snapshot(model, opt)
    check_all_steps(path, refs, "custom optimizer xor")


def test_record_step_out_of_order_and_missing_compress(tmp_path: Any) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    topk = ldformat.TopK(0.5)
    writer = ldformat.ChainWriter.create(str(tmp_path / "c"), model, opt, kind="grad.topk", compressor=topk)
    with pytest.raises(ldformat.UsageError, match="out of order"):
        writer.record_step(2)
    train_step(model, opt, 1)  # forgot topk.compress_
    with pytest.raises(ldformat.UsageError, match="compress"):
        writer.record_step(1)
    writer.abort()


def test_batch_is_committed_early_when_it_reaches_max_batch_bytes(tmp_path: Any) -> None:
    """batch_steps bounds steps per batch; max_batch_bytes bounds the memory a batch holds."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    path = str(tmp_path / "chain")
    writer = ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=100)
    writer.max_batch_bytes = 1
    refs = {0: snapshot(model, opt)}
    for step in range(1, 5):
        train_step(model, opt, step)
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
        assert writer.durable_step == step
    writer.close()
    check_all_steps(path, refs, "byte-bounded batches")
