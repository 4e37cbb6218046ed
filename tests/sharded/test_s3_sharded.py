"""Sharded chains on S3 (spec §20, §7.7), against ``moto_server`` on 127.0.0.1 (tests/support/s3server.py);
skipped when moto, boto3 or obstore are missing.

- A world-2 FSDP2 job (tests/support/sharded_s3_job.py) writes its sharded chain directly to
  ``s3://``: every committed step read back from S3 is bit for bit the full state the job
  gathered live; ``ldtools validate`` and ``ldtools info`` read it from S3; ``ldformat.sync``
  copies it to a local directory, which reads the same.
- ``ldformat.sync`` and ``ldtools sync`` copy a local sharded chain (the golden chains) to
  ``s3://`` and back: the local copy is the original byte for byte, every step materializes
  alike from S3, and a second sync copies nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from bitwise import bits
from clirun import invoke
from paths import SUPPORT, TESTS
from ports import gloo_env

import ldformat

if TYPE_CHECKING:  # s3server is loaded as a plugin (below), not imported before it
    from s3server import MotoServer

pytest_plugins = ["s3server"]  # the fixtures moto, s3_env and s3_url

JOB = SUPPORT / "sharded_s3_job.py"
GOLDEN = TESTS / "golden" / "1.3"
WORLD = 2
STEPS = 7
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning"),
]


def same(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{tuple(got.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{where}: bits differ"


def assert_states_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Two materialized states: model and optimizer tensors bit for bit, the rest equal."""
    assert list(got["model"]) == list(want["model"]), where
    for k, v in want["model"].items():
        same(got["model"][k], v, f"{where} model {k}")
    assert sorted(got["optimizer"]["state"]) == sorted(want["optimizer"]["state"]), where
    for i, entries in want["optimizer"]["state"].items():
        for key, v in entries.items():
            if isinstance(v, torch.Tensor):
                same(got["optimizer"]["state"][i][key], v, f"{where} optimizer {i}.{key}")
            else:
                assert got["optimizer"]["state"][i][key] == v, f"{where} optimizer {i}.{key}"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], where
    assert got["step"] == want["step"], where


def assert_like_gathered(state: dict[str, Any], gathered: dict[str, Any], names: list[str], where: str) -> None:
    """A materialized state against the full state the job gathered live (optimizer by FQN):
    every model and optimizer tensor, bit for bit."""
    for k, v in gathered["model"].items():
        same(state["model"][k], v, f"{where} model {k}")
    assert sorted(gathered["optimizer"]["state"]) == sorted(names), where
    for i, name in enumerate(names):
        for key, v in gathered["optimizer"]["state"][name].items():
            same(state["optimizer"]["state"][i][key], v, f"{where} optimizer {name}.{key}")


def files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "lock" not in p.relative_to(root).parts}


def sharded(location: str | Path) -> ldformat.ShardedReader:
    reader = ldformat.open_reader(location)
    assert isinstance(reader, ldformat.ShardedReader)
    return reader


def fresh_url(tag: str) -> str:
    from s3server import BUCKET

    return f"s3://{BUCKET}/{tag}-{secrets.token_hex(6)}"


# -- a job that writes to S3 -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(s3_env: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """The chain's URL, and the full state the job gathered before and after every step."""
    url = fresh_url("sharded-job")
    out = tmp_path_factory.mktemp("s3-sharded-job")
    env = gloo_env()
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), str(WORLD), url, str(out), str(STEPS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs.append(p.communicate()[0] + f"\n(killed after {TIMEOUT_S} s)")
    assert [p.returncode for p in procs] == [0] * WORLD, "\n---\n".join(outputs)
    gathered: list[dict[str, Any]] = torch.load(out / "gathered.pt", weights_only=False)
    assert len(gathered) == STEPS + 1
    return url, gathered


@pytest.mark.procs
def test_job_writes_the_chain_to_s3_and_it_reads_back_bit_exactly(job: tuple[str, list[dict[str, Any]]],
                                                                   s3_env: MotoServer) -> None:
    from s3server import BUCKET

    url, gathered = job
    prefix = url[len(f"s3://{BUCKET}/"):]
    keys = s3_env.object_keys(BUCKET, prefix + "/")
    assert f"{prefix}/sharded.json" in keys and any(k.startswith(f"{prefix}/commits/") for k in keys)
    for r in range(WORLD):
        assert f"{prefix}/ranks/{r:05d}/ldformat.json" in keys
    reader = sharded(url)
    assert reader.world_size == WORLD and reader.steps == list(range(STEPS + 1))
    names = list(reader.ranks[0].root.schema["optimizer"]["params"])
    for step in reader.steps:
        assert_like_gathered(reader.materialize(step), gathered[step], names, f"step {step}")
    assert ldformat.validate(url).ok


@pytest.mark.procs
def test_ldtools_reads_the_chain_on_s3(job: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = job
    assert "ok: sharded chain of 2 ranks" in invoke("validate", url).stdout
    out = invoke("info", url).stdout
    assert "(sharded, format 1.3, kind state.xor)" in out and f"steps        {STEPS + 1} committed" in out
    assert f"ranks        {WORLD}" in out
    invoke("log", url)


@pytest.mark.procs
def test_sync_the_chain_from_s3_to_a_directory(job: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    url, gathered = job
    report = ldformat.sync(url, tmp_path / "local")
    assert report.sharded and report.up_to_date and report.created and report.dst_latest_step == STEPS
    reader = sharded(tmp_path / "local")
    names = list(reader.ranks[0].root.schema["optimizer"]["params"])
    assert reader.steps == list(range(STEPS + 1))
    for step in reader.steps:
        assert_like_gathered(reader.materialize(step), gathered[step], names, f"step {step}")
    assert ldformat.validate(tmp_path / "local").ok
    again = ldformat.sync(url, tmp_path / "local")
    assert (again.records_copied, again.rank_records_copied, again.objects_copied) == (0, 0, 0)


# -- a local chain to S3 and back -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sharded.state.xor", "sharded.grad.topk"])
def test_sync_a_local_chain_to_s3_and_back(name: str, s3_url: str, tmp_path: Path) -> None:
    src = GOLDEN / name / "chain"
    before = files(src)
    to_s3 = ldformat.sync(src, s3_url)
    assert to_s3.sharded and to_s3.up_to_date and to_s3.created and to_s3.objects_copied > 0
    assert to_s3.records_copied == len(list((src / "commits").glob("*.json")))
    local, remote = sharded(src), sharded(s3_url)
    assert remote.steps == local.steps and remote.anchors == local.anchors
    for step in local.steps:
        assert_states_equal(remote.materialize(step), local.materialize(step), f"{name} step {step}")
    assert ldformat.validate(s3_url).ok
    again = ldformat.sync(src, s3_url)
    assert (again.records_copied, again.rank_records_copied, again.objects_copied) == (0, 0, 0)
    back = ldformat.sync(s3_url, tmp_path / "back")
    assert back.up_to_date and back.bytes_copied == to_s3.bytes_copied
    assert files(tmp_path / "back") == files(src)
    assert files(src) == before


def test_ldtools_sync_to_s3(tmp_path: Path, s3_env: MotoServer) -> None:
    src = GOLDEN / "sharded.grad.dense" / "chain"
    url = fresh_url("ldtools-sharded")
    line = invoke("sync", src, url).stdout.strip()
    assert line.startswith("synced ") and "up to date" in line and url in line, line
    invoke("validate", url)
    line = invoke("sync", url, tmp_path / "back").stdout.strip()
    assert "up to date" in line, line
    assert files(tmp_path / "back") == files(src)
