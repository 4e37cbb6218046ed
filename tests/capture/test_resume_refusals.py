"""``resume`` refuses what cannot continue training, before it loads anything.

- A chain recorded with one optimizer class, resumed into another (SGD into AdamW): a
  ``UsageError`` naming both classes, and the live model and optimizer are untouched (before,
  the state loaded and the next ``optimizer.step()`` raised ``KeyError: 'betas'``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
from ldformat.errors import UsageError


def test_resume_into_another_optimizer_class_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = ldformat.Checkpointer(tmp_path / "chain", model, sgd, batch_steps=2)
    for s in range(1, 4):
        train_step(model, sgd, s)
    assert ck.close() == 3

    torch.manual_seed(1)
    other = TinyNet()
    adamw = torch.optim.AdamW(other.parameters(), lr=0.01)
    before = snapshot(other, adamw)
    with pytest.raises(UsageError) as info:
        ldformat.resume(tmp_path / "chain", other, adamw)
    message = str(info.value)
    assert "torch.optim.SGD" in message and "torch.optim.AdamW" in message and "nothing was loaded" in message
    assert_state_bits_equal(snapshot(other, adamw), before, "untouched by the refused resume")
    # The right class resumes.
    again = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert ldformat.resume(tmp_path / "chain", other, again) == 3
