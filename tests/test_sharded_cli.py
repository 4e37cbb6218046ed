"""``ldtools`` on sharded chains (spec §20): info, log, validate, materialize (.pt, .safetensors,
DCP) work on the whole chain; compact and truncate refuse it, and one rank's chain alone."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ldformat
from ldformat.state import bits_view
from ldtools.cli import cli

WORKER = Path(__file__).parent / "sharded_crash_worker.py"
STEPS = 6

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 FSDP2 xor chain of STEPS steps."""
    out = tmp_path_factory.mktemp("sharded-cli")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(out), str(STEPS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return out / "chain"


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "lock" not in p.parts}


def test_info_and_log(chain: Path) -> None:
    result = invoke("info", chain)
    assert result.exit_code == 0, result.output
    assert "sharded, format 1.3, kind state.xor" in result.output and "ranks        2, mesh [2]" in result.output
    data = json.loads(invoke("info", chain, "--json").output)
    assert (data["world_size"], data["steps"], data["latest_step"]) == (2, STEPS + 1, STEPS)
    assert data["pending_steps"] == [] and len(data["bytes_per_rank"]) == 2
    log = invoke("log", chain)
    assert log.exit_code == 0 and log.output.splitlines()[0].split() == ["SEQ", "TIME", "STEP", "WRITER"]
    rows = json.loads(invoke("log", chain, "--json").output)
    assert rows[0]["seq"] == 1 and rows[0]["step"] == 0 and rows[-1]["step"] == STEPS
    assert invoke("validate", chain).exit_code == 0


def test_materialize_pt_and_safetensors(chain: Path, tmp_path: Path) -> None:
    import safetensors.torch

    want = ldformat.open_reader(chain).materialize(4)
    assert invoke("materialize", chain, "--step", 4, "-o", tmp_path / "s.pt").exit_code == 0
    got = torch.load(tmp_path / "s.pt", weights_only=True)
    assert list(got["model"]) == list(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(bits_view(got["model"][k]), bits_view(v)), k
    assert len(got["rank_extra"]) == 2
    assert invoke("materialize", chain, "--step", 4, "-o", tmp_path / "s.safetensors").exit_code == 0
    flat = safetensors.torch.load_file(tmp_path / "s.safetensors")
    assert all(torch.equal(bits_view(flat[k]), bits_view(want["model"][k])) for k in flat)


def test_dcp_export_of_an_ordinary_chain_loads_without_a_process_group(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    with ldformat.ChainWriter.create(tmp_path / "chain", model, opt, kind="state.xor") as writer:
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            writer.record_step(step)
    result = invoke("materialize", tmp_path / "chain", "--format", "dcp", "-o", tmp_path / "dcp")
    assert result.exit_code == 0, result.output
    fresh, fresh_opt = build()
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_opt.step()  # the optimizer state must exist for get_optimizer_state_dict to name it
    sd = {"model": get_model_state_dict(fresh), "optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optimizer"])
    for k, v in model.state_dict().items():
        assert torch.equal(bits_view(fresh.state_dict()[k]), bits_view(v)), k
    for i, state in opt.state_dict()["state"].items():
        for key, v in state.items():
            assert torch.equal(bits_view(fresh_opt.state_dict()["state"][i][key]), bits_view(v)), (i, key)
    again = invoke("materialize", tmp_path / "chain", "--format", "dcp", "-o", tmp_path / "dcp")
    assert again.exit_code == 2 and "not an empty directory" in again.output


def test_compact_and_truncate_refuse_the_chain_and_a_rank_chain(chain: Path) -> None:
    before = digest(chain)
    for target in (chain, chain / "ranks" / "00000"):
        for args in (("compact", target, "--keep-last", "2"), ("truncate", target, "--after", "2", "--yes")):
            result = invoke(*args)
            assert result.exit_code == 2, (args, result.output)
            assert "sharded chain" in result.output and "Traceback" not in result.output
        with pytest.raises(ldformat.UsageError):
            ldformat.compact(target, keep_last=2)
        with pytest.raises(ldformat.UsageError):
            ldformat.truncate(target, 2)
    assert digest(chain) == before
