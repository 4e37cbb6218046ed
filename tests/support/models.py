"""Small models and training loops shared by the tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    """Embedding + BatchNorm + tied output head + a parameter that never gets a gradient."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Parameter(torch.randn(3))  # optimized but never receives a gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.relu(self.hidden(h))
        h = self.norm(h)
        return self.head(h)


def batch(step: int, vocab: int = 32, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (n,), generator=g)
    y = torch.randint(0, vocab, (n,), generator=g)
    return x, y


def bits(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of the live state, in the shape ChainReader.materialize returns."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    osd = optimizer.state_dict()
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in osd["state"].items()}
    import copy

    return {"model": sd, "optimizer": {"state": state, "param_groups": copy.deepcopy(osd["param_groups"])}}


def assert_state_bits_equal(got: dict[str, Any], want: dict[str, Any], where: str = "") -> None:
    assert list(got["model"]) == list(want["model"]), where
    for k, v in want["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape, f"{where} model {k}"
        assert torch.equal(bits(g), bits(v)), f"{where} model {k} differs in bits"
    gs, ws = got["optimizer"]["state"], want["optimizer"]["state"]
    assert sorted(gs) == sorted(ws), f"{where} optimizer state params {sorted(gs)} != {sorted(ws)}"
    for i in ws:
        assert sorted(gs[i]) == sorted(ws[i]), f"{where} optimizer state keys of {i}"
        for key, v in ws[i].items():
            g = gs[i][key]
            assert g.dtype == v.dtype and g.shape == v.shape, f"{where} optimizer {i}/{key}"
            assert torch.equal(bits(g), bits(v)), f"{where} optimizer {i}/{key} differs in bits"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], f"{where} param_groups"


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
               compress: Callable[[nn.Module], None] | None = None,
               scheduler: Any = None, manual_lr: bool = False) -> float:
    model.train()
    x, y = batch(step)
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if compress is not None:
        compress(model)
    if manual_lr:
        for g in optimizer.param_groups:
            g["lr"] = 0.01 / (1 + 0.1 * step)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(loss.detach())


#: The CLI tests' common chain (the ``chain`` fixture of tests/conftest.py): steps and anchor interval.
GRAD_CHAIN_STEPS = 12
GRAD_CHAIN_ANCHOR_EVERY = 10


def build_grad_chain(path: Any, steps: int = GRAD_CHAIN_STEPS, anchor_every: int = GRAD_CHAIN_ANCHOR_EVERY) -> Any:
    """A grad.dense chain of TinyNet + AdamW with ``steps`` steps, batches of 4 steps and an
    anchor every ``anchor_every`` steps (the CLI tests' common chain); returns ``path``."""
    from ldformat import ChainWriter

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with ChainWriter.create(path, model, opt, kind="grad.dense", batch_steps=4, anchor_every=anchor_every) as w:
        for step in range(1, steps + 1):
            train_step(model, opt, step)
            w.record_step(step)
    return path
