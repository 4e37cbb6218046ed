"""accelerate: the objects ``accelerator.prepare`` returns work with ``Checkpointer`` as they are
(README "Use with accelerate", run as written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from paths import REPO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ldformat
from ldformat.format.state import bits_view

accelerate = pytest.importorskip("accelerate")


def readme_snippet(section: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert section in text, f"the README lost its section {section!r}"
    return text[text.index(section):].split("```python\n", 1)[1].split("```", 1)[0]


def test_prepared_objects_checkpoint_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)),
                        batch_size=8, generator=torch.Generator().manual_seed(2))
    accelerator = accelerate.Accelerator(cpu=True)
    scope: dict[str, Any] = {"accelerator": accelerator, "model": model, "optimizer": optimizer,
                             "loader": loader, "scheduler": scheduler, "ldformat": ldformat}
    exec(readme_snippet("## Use with accelerate"), scope)
    ck, prepared_opt, prepared_sched = scope["ck"], scope["optimizer"], scope["scheduler"]
    assert type(prepared_opt).__name__ == "AcceleratedOptimizer"
    assert ck.optimizer is optimizer and ck.scheduler is scheduler  # the objects underneath
    live = {}
    for step, (x, y) in enumerate(scope["loader"], start=1):
        prepared_opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(scope["model"](x), y))
        prepared_opt.step()
        prepared_sched.step()
        live[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ck.close()
    reader = ldformat.ChainReader("runs/chain")
    assert reader.latest_step == len(live) == 8
    for step, state in live.items():
        got = reader.materialize(step)
        assert sorted(got["model"]) == sorted(state)  # no module. / _orig_mod. prefixes
        for name, t in state.items():
            assert torch.equal(bits_view(t), bits_view(got["model"][name])), (step, name)
    assert reader.materialize(8)["extra"]["scheduler"]["last_epoch"] == scheduler.last_epoch
