"""Data parallelism in ``xor`` and ``lowdiff+``: every rank constructs a Checkpointer, the
replicated state is recorded once, by rank 0, and every step materializes bit for bit; every
rank's RNG state and data position are recorded with each step (``extra.ranks``) and
``resume(rank=r)`` restores rank ``r``'s own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_replicated_worker import Position
from paths import SUPPORT
from ports import gloo_env

import ldformat
from ldformat.format.state import bits_view

WORKER = SUPPORT / "ddp_replicated_worker.py"

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.procs,
]


@pytest.mark.parametrize("mode", ["xor", "lowdiff+", "xor/epoch"])
def test_every_rank_constructs_and_rank_0_records_once(tmp_path: Path, mode: str) -> None:
    env = gloo_env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(tmp_path), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert "rank 0 closed 7" in outputs[0] and "rank 1 closed None" in outputs[1]
    assert sorted(os.listdir(tmp_path / "chain")) == sorted(["anchors", "deltas", "ldformat.json", "lock", "log"])
    live = torch.load(tmp_path / "live.pt", weights_only=False)
    reader = ldformat.ChainReader(tmp_path / "chain")
    assert reader.steps == list(range(8))
    for step in range(1, 8):
        got = reader.materialize(step)
        model, optimizer = live[step - 1]
        for k, v in model.items():
            assert torch.equal(bits_view(got["model"][k]), bits_view(v)), (step, k)
        for i, state in optimizer["state"].items():
            for key, v in state.items():
                assert torch.equal(bits_view(got["optimizer"]["state"][i][key].contiguous()),
                                   bits_view(v.contiguous())), (step, i, key)
    assert ldformat.validate(tmp_path / "chain").ok
    own = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(own[0][7][0], own[1][7][0])  # the ranks' dropout streams differ
    for step in range(8):
        extra = reader.materialize(step)["extra"]
        assert torch.equal(extra["rng"]["torch"], own[0][step][0]) and extra["data"] == own[0][step][1], step
        assert sorted(extra["ranks"]) == ["1"], step
        assert torch.equal(extra["ranks"]["1"]["rng"]["torch"], own[1][step][0]), step
        assert extra["ranks"]["1"]["data"] == own[1][step][1], step
    saved = torch.get_rng_state()
    try:
        for rank in (0, 1):
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
            position = Position(-1)
            step = ldformat.resume(tmp_path / "chain", model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   data=position, rank=rank)
            assert step == 7
            assert torch.equal(torch.get_rng_state(), own[rank][7][0]) and position.state_dict() == own[rank][7][1]
    finally:
        torch.set_rng_state(saved)
