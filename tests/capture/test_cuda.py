"""Training on a CUDA device: the capture runtime's GPU path and replay on the recording device.

What is checked, bit for bit (integer views) against the live state at every step:

1. ``Checkpointer`` in every mode, with Adam (foreach), fused AdamW and SGD with Nesterov
   momentum, on a model with a BatchNorm buffer and tied weights living on the GPU: the
   pinned buffers and side-stream copies (and, for ``lowdiff+``, gradients staged during
   backward). Gradient chains are replayed on the GPU (``replay_device="cuda"``, spec
   §11.8); ``state.xor`` chains on the CPU, where they are exact too.
2. GradScaler on the GPU with skipped steps (fused and foreach optimizers).
3. ``resume`` on the GPU from a delta step replays on the GPU and restores the live state.
4. ``ldtools materialize --replay-device cuda``.

Without CUDA these tests are skipped; what runs everywhere is the CPU side of the option: the
environment warning and the refusal of a device torch cannot use.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from bitwise import assert_same
from click.testing import CliRunner
from models import TinyNet, batch
from torch import nn

import ldformat
from ldformat import ChainReader, ReplayEnvironmentWarning
from ldformat.capture.staging import Stager
from ldformat.format.environment import differences
from ldtools.cli import cli

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
MODES = ("lowdiff", "lowdiff+", "xor")
STEPS = 11


@pytest.fixture(autouse=True)
def _close_leftover_checkpointers(close_leftover_checkpointers: None) -> None:
    """tests/conftest.py: a failed test leaves no hooks, writer threads or locks behind."""


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if name == "sgd-nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    raise AssertionError(name)


def on_cpu(state: Any) -> Any:
    """A deep copy of a state dict with every tensor on the CPU (the form materialize returns)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    if isinstance(state, tuple):
        return tuple(on_cpu(v) for v in state)
    return state


def live(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": on_cpu(dict(model.state_dict())), "optimizer": on_cpu(opt.state_dict())}


def cuda_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, scaler: Any = None,
              poison: bool = False) -> None:
    model.train()
    x, y = (t.cuda() for t in batch(step))
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    if poison:
        grad = model.hidden.weight.grad
        assert grad is not None
        grad[0, 0] = float("inf")  # GradScaler skips this step
    scaler.step(opt)
    scaler.update()


def assert_materializes(path: Path, refs: dict[int, dict[str, Any]], label: str, replay_device: str | None) -> None:
    reader = ChainReader(path, replay_device=replay_device)
    assert reader.steps == sorted(refs), f"{label}: steps {reader.steps}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayEnvironmentWarning)  # replay on the recording device: no warning
        for step in reader.steps:
            got = reader.materialize(step)
            assert_same({"model": dict(got["model"]), "optimizer": got["optimizer"]}, refs[step],
                        f"{label} step {step}")
    report = ldformat.validate(path)
    assert report.ok, f"{label}: {report.problems}"


def record(tmp_path: Path, mode: str, optimizer: str, *, scaler: bool = False,
           skipped: frozenset[int] = frozenset()) -> tuple[Path, dict[int, dict[str, Any]]]:
    torch.manual_seed(0)
    model = TinyNet().cuda()
    opt = make_optimizer(optimizer, model.parameters())
    grad_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=2) if scaler else None
    path = tmp_path / f"chain-{mode}-{optimizer}"
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=4, batch_steps=3, topk_ratio=0.2,
                               scaler=grad_scaler)
    refs = {0: live(model, opt)}
    for step in range(1, STEPS):
        cuda_step(model, opt, step, grad_scaler, poison=step in skipped)
        refs[step] = live(model, opt)
    ck.close()
    return path, refs


# -- 1. every mode, several optimizers ------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("optimizer", ["adam", "adamw-fused", "sgd-nesterov"])
@pytest.mark.parametrize("mode", MODES)
def test_every_step_materializes_to_the_live_gpu_state(tmp_path: Path, mode: str, optimizer: str) -> None:
    path, refs = record(tmp_path, mode, optimizer)
    env = ChainReader(path).root.environment
    assert env["device"] == "cuda"
    assert_materializes(path, refs, f"{mode} {optimizer}", "cuda" if mode != "xor" else None)


@needs_cuda
def test_staging_buffers_are_pinned(tmp_path: Path) -> None:
    model = TinyNet().cuda()
    opt = make_optimizer("adam", model.parameters())
    ck = ldformat.Checkpointer(tmp_path / "chain", model, opt, mode="lowdiff+", anchor_every=4, batch_steps=2)
    cuda_step(model, opt, 1)
    cuda_step(model, opt, 2)
    ck.flush()
    pinned = [buf.is_pinned() for bs in list(ck.pool._free.queue) for buf in bs.tensors.values()]
    ck.close()
    assert pinned and all(pinned)


@needs_cuda
@pytest.mark.parametrize("mode", ["lowdiff+", "xor"])
def test_in_place_changes_right_after_a_step_wait_for_its_staging_copies(
        tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The side-stream copies of a step finish before any later kernel changes what they read.

    The side stream spins (``torch.cuda._sleep``) before each copy, so every copy is still
    waiting when the training queues its next kernels: without the fence they would run first.
    For ``xor`` the user halves every parameter in place right after ``opt.step()`` (the chain
    records the state the step left; the halving lands in the next step's); for ``lowdiff+``
    the next ``zero_grad(set_to_none=False)`` zeroes the staged gradients in place and the next
    forward updates BatchNorm's statistics. Several buffer sets are in flight (``queue_depth=2``).
    On an H100 the ``xor`` case fails with the fence turned off (``model.3.weight`` differs at
    step 1); the ``lowdiff+`` case passed there without it, so some other wait orders that path
    today, and the case stays as a guard. Without the spin the copies rarely lose the race.
    """
    copy = Stager.copy

    def late_copy(self: Stager, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is not None and src.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(2_000_000)  # about a millisecond of GPU clock cycles
        copy(self, dst, src)

    monkeypatch.setattr(Stager, "copy", late_copy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 512)).cuda()
    opt = make_optimizer("adam", model.parameters())
    path = tmp_path / f"chain-{mode}"
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=100, batch_steps=2, queue_depth=2)
    refs = {0: live(model, opt)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = dict(model.named_parameters())
    for step in range(1, 7):
        opt.zero_grad(set_to_none=False)
        x = torch.randn(256, 512, device="cuda", generator=gen)
        model(x).square().mean().backward()
        opt.step()
        if mode == "xor":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        refs[step] = live(model, opt)
        if mode == "xor":  # the recorded state is the one the step left, before the halving
            refs[step]["model"] = {k: (v * 2 if k in params else v) for k, v in refs[step]["model"].items()}
    ck.close()
    if mode == "xor":  # halving and doubling are exact in binary floating point
        assert_materializes(path, refs, mode, None)
    else:  # gradient replay does not see the user's edits: there are none in this run
        assert_materializes(path, refs, mode, "cuda")


# -- 2. GradScaler ------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("optimizer", ["adam", "adamw-fused"])
@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_on_the_gpu_with_skipped_steps(tmp_path: Path, mode: str, optimizer: str) -> None:
    skipped = frozenset({3, 6, 7})
    path, refs = record(tmp_path, mode, optimizer, scaler=True, skipped=skipped)
    reader = ChainReader(path)
    assert {s for s in range(1, STEPS) if not reader.state.deltas[s][1].stepped} <= skipped
    assert_materializes(path, refs, f"{mode} {optimizer} + GradScaler", "cuda" if mode != "xor" else None)


# -- 3. resume --------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("mode", ["lowdiff+", "xor"])
def test_resume_on_the_gpu_from_a_delta_step(tmp_path: Path, mode: str) -> None:
    path, refs = record(tmp_path, mode, "adam")
    step = max(s for s in refs if s not in ChainReader(path).anchors)
    torch.manual_seed(1)
    model = TinyNet().cuda()
    opt = make_optimizer("adam", model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayEnvironmentWarning)
        got = ldformat.resume(path, model, opt, step=step, exact=False)
    assert got == step
    assert_same(live(model, opt), refs[step], f"{mode} resumed at {step}")
    assert all(p.device.type == "cuda" for p in model.parameters())


# -- 4. the CLI -----------------------------------------------------------------------------
@needs_cuda
def test_ldtools_materialize_replays_on_the_gpu(tmp_path: Path) -> None:
    path, refs = record(tmp_path, "lowdiff+", "adam")
    out = tmp_path / "state.pt"
    result = CliRunner().invoke(cli, ["materialize", str(path), "--step", str(STEPS - 1), "-o", str(out),
                                      "--replay-device", "cuda"])
    assert result.exit_code == 0, result.output
    got = torch.load(out, weights_only=True)
    assert_same({"model": dict(got["model"]), "optimizer": got["optimizer"]}, refs[STEPS - 1], "ldtools output")


# -- everywhere: the environment warning and the option's refusal --------------------------------
def small_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str) -> Path:
    """A gradient chain whose root says it was recorded on ``device`` (trained on the CPU)."""
    import ldformat.chain.writer as writer_module
    from ldformat.format.environment import current_environment

    monkeypatch.setattr(writer_module, "current_environment", lambda _device="cpu": current_environment(device))
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_optimizer("adam", model.parameters())
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, mode="lowdiff+", anchor_every=10, batch_steps=2)
    for step in range(1, 3):
        model.train()
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ck.close()
    return path


def test_cpu_replay_of_a_gpu_chain_warns_and_names_the_option(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = small_chain(tmp_path, monkeypatch, "cuda")
    reader = ChainReader(path)
    with pytest.warns(ReplayEnvironmentWarning) as caught:
        reader.materialize(2)
    message = str(caught[0].message)
    assert "device: recorded on 'cuda', replayed on 'cpu'" in message
    assert "replay_device='cuda'" in message and "--replay-device cuda" in message


def test_replay_on_the_recording_device_does_not_warn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = small_chain(tmp_path, monkeypatch, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayEnvironmentWarning)
        ChainReader(path, replay_device="cpu").materialize(2)


def test_differences_compare_the_cpu_only_for_cpu_replay() -> None:
    recorded = {"torch": torch.__version__, "device": "cuda", "cpu_capability": "elsewhere", "machine": "elsewhere"}
    assert differences(recorded, "cuda") == []
    assert differences(recorded, "cpu")[0] == "device: recorded on 'cuda', replayed on 'cpu'"
    assert any(d.startswith("cpu_capability") for d in differences(recorded, "cpu"))
    assert differences({"device": "cpu"}, "cuda") == ["device: recorded on 'cpu', replayed on 'cuda'"]


@pytest.mark.skipif(CUDA, reason="checks the refusal where CUDA is missing")
def test_replay_device_torch_cannot_use_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = small_chain(tmp_path, monkeypatch, "cuda")
    out = tmp_path / "out.pt"
    result = CliRunner().invoke(cli, ["materialize", str(path), "-o", str(out), "--replay-device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "--replay-device cuda: torch cannot use this device here" in result.output
    assert "Traceback" not in result.output and not out.exists()
