"""``ldtools info CHAIN --mirror URL``: how far a replica lags behind its chain."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from click.testing import CliRunner
from models import TinyNet, train_step

import ldformat
from ldformat import ChainWriter
from ldtools.cli import cli


def _chain(path: Path, steps: range, create: bool = True) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not create:
        ldformat.ChainReader(path).load_into(model, optimizer)
    open_ = ChainWriter.create if create else ChainWriter.open
    kwargs = {"kind": "state.xor"} if create else {}
    with open_(path, model, optimizer, batch_steps=1, **kwargs) as writer:  # type: ignore[operator]
        for step in steps:
            train_step(model, optimizer, step)
            writer.record_step(step)


def _info(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["info", *args])
    return result.exit_code, result.output


def test_info_reports_the_mirror_lag(tmp_path: Path) -> None:
    chain, mirror = tmp_path / "chain", "memory://info-mirror-lag"
    _chain(chain, range(1, 4))
    ldformat.sync(chain, mirror)
    code, out = _info(str(chain), "--mirror", mirror)
    assert code == 0, out
    assert "up to date (step 3)" in out

    _chain(chain, range(4, 7), create=False)
    time.sleep(0.05)
    code, out = _info(str(chain), "--mirror", mirror, "--json")
    assert code == 0, out
    lag = json.loads(out)["mirror"]
    assert lag["mirror_latest_step"] == 3 and lag["lag_steps"] == 3 and lag["lag_records"] >= 3
    assert lag["lag_seconds"] >= 0.05
    code, out = _info(str(chain), "--mirror", mirror)
    assert "3 steps" in out and "behind (at step 3" in out and "ldtools sync" in out

    ldformat.sync(chain, mirror)
    assert json.loads(_info(str(chain), "--mirror", mirror, "--json")[1])["mirror"]["lag_records"] == 0


def test_info_refuses_a_mirror_of_another_chain(tmp_path: Path) -> None:
    _chain(tmp_path / "a", range(1, 2))
    _chain(tmp_path / "b", range(1, 2))
    code, out = _info(str(tmp_path / "a"), "--mirror", str(tmp_path / "b"))
    assert code != 0 and "not a replica of" in out
