"""The optimizer's ``state_dict()`` round trip is structurally exact (spec §8.2): Python values,
``None``, empty per-parameter states, global state, extra top-level entries, tensors nested in
containers, tensor and dtype hyperparameters."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import ldformat
from ldformat.format.state import bits_view


class Quirky(torch.optim.Optimizer):
    """An optimizer whose state holds everything optimizers are seen to keep."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.99), "scale": torch.tensor(0.5),
                                  "dtype": torch.float32, "flag": True, "name": "q"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.state["k"] = self.state.get("k", 0) + 1  # global, not a parameter's
        for group in self.param_groups:
            for j, p in enumerate(group["params"]):
                state = self.state[p]
                if j == 1:
                    continue  # an empty per-parameter state
                if p.grad is None:
                    continue
                if not state:
                    state["count"] = 0
                    state["comp"] = None
                    state["history"] = [torch.zeros_like(p), (1.5, False)]
                    state["ema"] = torch.zeros_like(p)
                state["count"] += 1
                state["ema"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["history"][0].add_(p.grad)
                state["comp"] = None if state["count"] % 2 else float(state["count"])
                p.add_(state["ema"], alpha=-group["lr"] * float(group["scale"]))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["magma"] = {"seen": int(self.state.get("k", 0)), "norm": torch.tensor([1.0, -0.0])}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict.pop("magma")
        super().load_state_dict(state_dict)


def assert_same(live: Any, stored: Any, where: str = "") -> None:
    assert type(live) is type(stored), f"{where}: {type(live).__name__} vs {type(stored).__name__}"
    if isinstance(live, torch.Tensor):
        assert live.dtype == stored.dtype and live.shape == stored.shape, where
        assert torch.equal(bits_view(live.contiguous()), bits_view(stored.contiguous())), where
    elif isinstance(live, dict):
        assert list(map(repr, sorted(live, key=repr))) == list(map(repr, sorted(stored, key=repr))), where
        for k in live:
            assert_same(live[k], stored[k], f"{where}.{k}")
    elif isinstance(live, (list, tuple)):
        assert len(live) == len(stored), where
        for j, (a, b) in enumerate(zip(live, stored, strict=True)):
            assert_same(a, b, f"{where}[{j}]")
    else:
        assert live == stored or (live != live and stored != stored), f"{where}: {live!r} vs {stored!r}"


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    return model, Quirky(model.parameters())


def train(path: Path, steps: int, **kwargs: Any) -> list[dict[str, Any]]:
    model, optimizer = make()
    ck = ldformat.Checkpointer(path, model, optimizer, **kwargs)
    seen = []
    for s in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(s))
        model(x).square().mean().backward()
        optimizer.step()
        seen.append({"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())})
    ck.close()
    return seen


def record_run(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
               **kwargs: Any) -> list[dict[str, Any]]:
    """``steps`` steps on a fixed batch with a Checkpointer; the live optimizer state after each."""
    ck = ldformat.Checkpointer(path, model, optimizer, **kwargs)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        seen.append(copy.deepcopy(optimizer.state_dict()))
    ck.close()
    return seen


def test_xor_round_trip_is_structurally_exact(tmp_path: Path) -> None:
    seen = train(tmp_path / "chain", 7, mode="xor", anchor_every=4, batch_steps=2)
    reader = ldformat.ChainReader(tmp_path / "chain")
    assert reader.steps == list(range(8))
    for step, live in enumerate(seen, start=1):
        state = reader.materialize(step)
        assert_same(live["optimizer"], state["optimizer"], f"step {step} optimizer")
        assert_same(dict(live["model"]), dict(state["model"]), f"step {step} model")
    assert ldformat.validate(tmp_path / "chain").ok


def test_reopened_xor_chain_stays_exact(tmp_path: Path) -> None:
    """A writer re-opening the chain XORs against the chain's own tensors, structure included."""
    path = tmp_path / "chain"
    train(path, 3, mode="xor", anchor_every=100, batch_steps=1)
    model, optimizer = make()
    assert ldformat.resume(path, model, optimizer) == 3
    ck = ldformat.Checkpointer(path, model, optimizer, mode="xor", anchor_every=100, batch_steps=1)
    optimizer.zero_grad()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(3))).square().mean().backward()
    optimizer.step()
    expected = copy.deepcopy(optimizer.state_dict())
    ck.close()
    assert_same(expected, ldformat.ChainReader(path).materialize(4)["optimizer"], "step 4")
    ldformat.compact(path, max_replay=2)
    assert_same(expected, ldformat.ChainReader(path).materialize(4)["optimizer"], "step 4 after compact")
    assert ldformat.validate(path).ok


def test_empty_per_parameter_state_survives_gradient_replay(tmp_path: Path) -> None:
    """SGD without momentum keeps an empty dict per parameter: lowdiff+ anchors and replay keep it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = record_run(tmp_path / "chain", model, optimizer, 5, mode="lowdiff+", anchor_every=3, batch_steps=1)
    reader = ldformat.ChainReader(tmp_path / "chain")
    for step, live in enumerate(seen, start=1):
        assert_same(live, reader.materialize(step)["optimizer"], f"step {step}")


def test_a_dangling_reference_is_caught_by_validate(tmp_path: Path) -> None:
    from ldformat.format.optstate import check_structure

    with pytest.raises(ldformat.CorruptChainError, match="references"):
        check_structure({"state": {"$items": [[0, {"h": {"$ref": "optimizer/ref/state/0/h"}}]]}}, set(), 2, "x")
    with pytest.raises(ldformat.CorruptChainError, match="'state', 'top' and 'absent'"):
        check_structure({"other": {}}, set(), 2, "x")
    with pytest.raises(ldformat.CorruptChainError, match="has state tensors"):
        check_structure({"state": {"$items": [[0, 5]]}}, {"optimizer/0/exp_avg"}, 2, "x")


def test_unstorable_state_is_refused_with_its_location(tmp_path: Path) -> None:
    from collections import deque

    from ldformat.format.optstate import split_state

    with pytest.raises(ldformat.UnsupportedStateError, match="deque"):
        split_state({"state": {0: {"window": deque([1, 2])}}, "param_groups": []}, 1)
    with pytest.raises(ldformat.UnsupportedStateError, match="dense"):
        split_state({"state": {0: {"s": torch.eye(2).to_sparse()}}, "param_groups": []}, 1)


def test_unstorable_state_is_refused_before_training(tmp_path: Path) -> None:
    """A fresh optimizer whose first step would create state the format cannot hold is refused
    by the constructor, leaving no chain and no lock, and without moving the user's RNG."""
    from collections import deque

    class Windowed(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            torch.rand(3)  # draws from the global generator, as some optimizers do
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("window", deque(maxlen=3)).append(1.0)
            return super().step(closure)

    model = torch.nn.Linear(4, 2)
    optimizer = Windowed(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(ldformat.UnsupportedStateError, match="deque"):
        ldformat.Checkpointer(tmp_path / "chain", model, optimizer)
    assert not (tmp_path / "chain").exists()
    assert torch.equal(torch.get_rng_state(), before)
    assert not optimizer.state  # the live optimizer never stepped


def test_cli_outputs_keep_the_structure(tmp_path: Path) -> None:
    """``materialize -o x.pt`` loads with ``weights_only=True`` and equals the live state_dict;
    ``.safetensors --with-optimizer`` keeps the structure in its metadata."""
    import json

    import safetensors
    from click.testing import CliRunner

    from ldtools.cli import cli

    seen = train(tmp_path / "chain", 3, mode="xor", batch_steps=1)
    out = tmp_path / "s3.pt"
    result = CliRunner().invoke(cli, ["materialize", str(tmp_path / "chain"), "--step", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    loaded = torch.load(out, weights_only=True)
    assert_same(seen[2]["optimizer"], loaded["optimizer"], "pt optimizer")
    st = tmp_path / "s3.safetensors"
    result = CliRunner().invoke(cli, ["materialize", str(tmp_path / "chain"), "--step", "3", "--with-optimizer",
                                      "-o", str(st)])
    assert result.exit_code == 0, result.output
    with safetensors.safe_open(str(st), "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    structure = json.loads(meta["optimizer.structure"])
    assert set(structure) == {"state", "top"}
    assert "optimizer.ref/state/0/history/0" in names and "optimizer.state.0.ema" in names


def test_subclass_calling_super_step_is_one_step(tmp_path: Path) -> None:
    """torch fires the step hooks for the subclass's step and again for ``super().step()``:
    only the outer call is a training step, so every step materializes the live state."""

    class Scaled(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(0.999)  # work after the inner step, inside the outer one
            return loss

    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # SGD.step is now hooked as well
    for api in ("Checkpointer", "ChainWriter"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = Scaled(model.parameters(), lr=0.1, momentum=0.9)
        path = tmp_path / api
        if api == "Checkpointer":
            ck: Any = ldformat.Checkpointer(path, model, optimizer, mode="xor", batch_steps=1)
        else:
            ck = ldformat.ChainWriter.create(path, model, optimizer, kind="state.xor", batch_steps=1)
        seen = []
        for step in range(1, 5):
            optimizer.zero_grad()
            model(torch.ones(3, 4)).square().sum().backward()
            optimizer.step()
            if api == "ChainWriter":
                ck.record_step(step)  # refused if the hooks had counted two steps
            seen.append(copy.deepcopy(model.state_dict()))
        ck.close()
        reader = ldformat.ChainReader(path)
        assert reader.steps == [0, 1, 2, 3, 4]
        for step, live in enumerate(seen, start=1):
            assert_same(dict(live), dict(reader.materialize(step)["model"]), f"{api} step {step}")


def test_enum_values_are_refused_not_flattened(tmp_path: Path) -> None:
    import enum

    class Norm(enum.IntEnum):
        SPECTRAL = 1

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["norm"] = Norm.SPECTRAL
    with pytest.raises(ldformat.UnsupportedStateError, match="enum"):
        ldformat.Checkpointer(tmp_path / "chain", model, optimizer)
    assert not (tmp_path / "chain").exists()


def test_an_optimizer_holding_another_is_not_unwrapped(tmp_path: Path) -> None:
    """Only framework wrappers are unwrapped: an optimizer that keeps another one as an
    attribute (Magma over AdamW, Lookahead) is itself the training's optimizer."""
    from ldformat.capture.unwrap import unwrap_optimizer

    class Holding(torch.optim.SGD):
        def __init__(self, params: Any) -> None:
            params = list(params)
            super().__init__(params, lr=0.1)
            self.optimizer = torch.optim.AdamW(params)

    optimizer = Holding(torch.nn.Linear(2, 2).parameters())
    assert unwrap_optimizer(optimizer) is optimizer


def test_unsigned_float8_and_complex64_state_round_trip(tmp_path: Path) -> None:
    """Format 1.2 dtypes (spec §5.6.4): bit-exact through xor deltas, anchors, compaction and
    validate --deep."""

    class Odd(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    if "c" not in st:
                        st["c"] = torch.zeros(p.shape, dtype=torch.complex64)
                        st["u"] = torch.zeros(p.shape, dtype=torch.uint32)
                    st["c"] += torch.complex(p.float(), -p.float())
                    st["u"] = (st["u"].to(torch.int64) + 3).to(torch.uint32)
                    st["f8"] = (p * 2).to(torch.float8_e4m3fn)
                    st["u64"] = torch.full((2,), 2**63 + 5, dtype=torch.uint64)
            return loss

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = Odd(model.parameters(), lr=0.1)
    path = tmp_path / "chain"
    seen = record_run(path, model, optimizer, 5, batch_steps=2, anchor_every=3)
    reader = ldformat.ChainReader(path)
    for step, live in enumerate(seen, start=1):
        assert_same(live, reader.materialize(step)["optimizer"], f"step {step}")
    assert ldformat.validate(path, deep=True).ok
    ldformat.compact(path, max_replay=1)
    assert_same(seen[-1], ldformat.ChainReader(path).materialize(5)["optimizer"], "after compact")
    assert ldformat.validate(path, deep=True).ok
