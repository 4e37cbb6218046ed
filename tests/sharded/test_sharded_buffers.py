"""Buffers that differ between ranks (spec §20.2 copy ranks, §20.4 item 3, §20.7): FSDP2 does not
synchronize BatchNorm statistics, so each rank's are its own. The chain records every rank's,
validates, materializes rank 0's (as torch's full state dict does), and a resume at the same
layout gives every rank its own back. Copy ranks, which would record one replica for all, are
not made for such a model; forced, rank 0 stops at the first step with a clear error.

A world-2 launch and a world-4 launch (tests/support/sharded_bn_job.py) run every worker-side step,
bounded in time. At world 4 (HSDP, mesh 2 x 2) a copy rank is compared with its own source:
rank 3 is a copy of rank 1, whose statistics differ from rank 0's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models import bits
from paths import SUPPORT
from ports import gloo_env
from sharded_state import index_layout, state_diffs

import ldformat

WORKER = SUPPORT / "sharded_bn_job.py"
WORLD = 2
STEPS = 5
BOUND_S = 240.0

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.procs,
]


class Job:
    def __init__(self, outdir: Path, codes: list[int | None], outputs: list[str]) -> None:
        self.outdir, self.codes, self.outputs = outdir, codes, outputs

    def record(self, run: str, rank: int) -> dict[str, Any]:
        path = self.outdir / f"{run}.rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"run {run!r} left no record on rank {rank}:\n" + "\n".join(self.outputs))
        return dict(torch.load(path, weights_only=True))


def run_job(outdir: Path, world: int, runs: list[str]) -> Job:
    env = gloo_env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(outdir), *runs],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=BOUND_S)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n[killed: ran past the bound]")
    return Job(outdir, [p.returncode for p in procs], outputs)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_job(tmp_path_factory.mktemp("sharded-bn"), WORLD, ["auto", "resume", "forced"])


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_job(tmp_path_factory.mktemp("sharded-bn-hsdp"), 4, ["pairs", "stray"])


def test_replicas_with_their_own_statistics_get_no_copy_ranks(job: Job) -> None:
    root = json.loads((job.outdir / "auto" / "sharded.json").read_text())
    assert "copies" not in root, root.get("copies")
    assert sorted(p.name for p in (job.outdir / "auto" / "ranks").iterdir()) == ["00000", "00001"]
    mine = [job.record("auto", r)["buffers"][STEPS]["bn.running_mean"] for r in range(WORLD)]
    assert not torch.equal(mine[0], mine[1]), "the harness should make the ranks' statistics differ"


def test_the_chain_validates_and_materializes_rank_0s_state(job: Job) -> None:
    chain = job.outdir / "auto"
    report = ldformat.validate(chain, deep=True)
    assert report.ok, [str(p) for p in report.problems]
    reader = ldformat.open_reader(chain)
    assert isinstance(reader, ldformat.ShardedReader)
    assert reader.steps == list(range(STEPS + 1))
    problems = []
    for step in range(1, STEPS + 1):
        want = index_layout(job.record("auto", 0)["steps"][step])
        problems += [f"step {step}: {d}" for d in state_diffs(reader.materialize(step), want)]
    assert not problems, problems[:20]
    for rank in range(WORLD):  # rank chain r holds rank r's own statistics, bit for bit
        stored = reader.ranks[rank].materialize(STEPS)["model"]
        for name, value in job.record("auto", rank)["buffers"][STEPS].items():
            assert torch.equal(bits(stored[name]), bits(value)), f"rank {rank} {name}"


def test_resume_gives_every_rank_its_own_statistics(job: Job) -> None:
    for rank in range(WORLD):
        got = job.record("resume", rank)["buffers"][STEPS]
        want = job.record("auto", rank)["buffers"][STEPS]
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), f"rank {rank} {name} after resume"


def test_forced_copy_ranks_stop_at_the_first_step(job: Job) -> None:
    """With ``copy_ranks=True`` rank 1 is a copy of rank 0, whose chain cannot hold rank 1's own
    statistics: rank 0 notices at the first step and stops, naming the remedy."""
    root = json.loads((job.outdir / "forced" / "sharded.json").read_text())
    assert root["copies"] == {"1": 0}
    assert job.codes[0] != 0, job.outputs[0]
    assert "copy rank 1's unsharded tensors" in job.outputs[0], job.outputs[0]
    assert "copy_ranks=False" in job.outputs[0], job.outputs[0]
    assert "forced step 2" not in job.outputs[0]
    assert "[killed: ran past the bound]" not in "".join(job.outputs)


def test_a_copy_rank_is_compared_with_its_own_source(hsdp: Job) -> None:
    """Copy ranks 2 and 3 hold their sources' (0 and 1) statistics, and rank 1's differ from
    rank 0's: the chain records every step, exactly, and each rank chain holds its rank's own."""
    root = json.loads((hsdp.outdir / "pairs" / "sharded.json").read_text())
    assert root["copies"] == {"2": 0, "3": 1}
    mine = [hsdp.record("pairs", r)["buffers"][STEPS]["bn.running_mean"] for r in range(4)]
    assert not torch.equal(mine[0], mine[1]), "the harness should make the sources' statistics differ"
    assert torch.equal(bits(mine[1]), bits(mine[3])) and torch.equal(bits(mine[0]), bits(mine[2]))
    reader = ldformat.open_reader(hsdp.outdir / "pairs")
    assert isinstance(reader, ldformat.ShardedReader) and reader.latest_step == STEPS
    for rank in (0, 1):
        stored = reader.ranks[rank].materialize(STEPS)["model"]
        assert torch.equal(bits(stored["bn.running_mean"]), bits(mine[rank])), f"rank chain {rank}"
    problems = []
    for step in range(1, STEPS + 1):
        want = index_layout(hsdp.record("pairs", 0)["steps"][step])
        problems += [f"step {step}: {d}" for d in state_diffs(reader.materialize(step), want)]
    assert not problems, problems[:20]
    assert ldformat.validate(hsdp.outdir / "pairs").ok


def test_a_copy_rank_that_strays_from_its_source_stops_rank_0(hsdp: Job) -> None:
    """Rank 3 trains on rank 0's data, so its statistics equal rank 0's but not rank 1's, its
    source's: rank 0 stops at the first step, naming both ranks and the remedy."""
    assert hsdp.codes[0] != 0, hsdp.outputs[0]
    assert "copy rank 3's unsharded tensors" in hsdp.outputs[0], hsdp.outputs[0]
    assert "rank 1, its source" in hsdp.outputs[0] and "copy_ranks=False" in hsdp.outputs[0]
    assert "stray step 2" not in hsdp.outputs[0]
    assert "[killed: ran past the bound]" not in "".join(hsdp.outputs)
