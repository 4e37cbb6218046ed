"""Data parallelism in ``xor`` and ``lowdiff+``: every rank constructs a Checkpointer, the
replicated state is recorded once, by rank 0, and every step materializes bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ldformat
from ldformat.state import bits_view

WORKER = Path(__file__).parent / "ddp_replicated_worker.py"

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("mode", ["xor", "lowdiff+"])
def test_every_rank_constructs_and_rank_0_records_once(tmp_path: Path, mode: str) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
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
