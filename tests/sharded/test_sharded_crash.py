"""Sharded chains survive a rank killed at any point, and a rank that cannot write (spec §20.3).

Two FSDP2 ranks (gloo, CPU) checkpoint every step in ``xor`` mode. One of them is SIGKILLed
at a random moment. The survivor must exit with an error within a bound (its next
collective fails, and rank 0's close waits at most ``commit_timeout`` for the dead rank);
the chain must validate; every committed step must equal the uninterrupted run bit for bit;
and a relaunched job resumes from the newest committed step and trains on exactly like the
uninterrupted run. A rank whose object writes fail (a full disk) never lets rank 0 commit a
step it does not hold.

Run the workers directly: ``python sharded_crash_worker.py RANK WORLD OUTDIR STEPS``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from paths import SUPPORT
from ports import gloo_env

import ldformat
from ldformat.format.state import bits_view

WORKER = SUPPORT / "sharded_crash_worker.py"
WORLD = 2
STEPS = 24
EXIT_BOUND_S = 60.0  # the survivor's collective times out after 30 s; rank 0 waits 10 s more at most
RUN_BOUND_S = 240.0

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.procs,
]


def _start(outdir: Path, steps: int, *flags: str, rank_flags: dict[int, list[str]] | None = None
           ) -> list[subprocess.Popen[str]]:
    env = gloo_env()  # with the worker's directory on PYTHONPATH
    procs = []
    for rank in range(WORLD):
        extra = (rank_flags or {}).get(rank, [])
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD), str(outdir), str(steps),
                                       *flags, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]], bound_s: float) -> tuple[list[int], list[str]]:
    """Wait for every process at most ``bound_s``; kill what is left (and fail the caller's check)."""
    deadline = time.monotonic() + bound_s
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n[killed: ran past the bound]"
        outputs.append(out)
    return [p.returncode for p in procs], outputs


def _run(outdir: Path, steps: int, *flags: str, **kw: Any) -> list[str]:
    codes, outputs = _finish(_start(outdir, steps, *flags, **kw), RUN_BOUND_S)
    assert codes == [0] * WORLD, "\n".join(f"--- rank {r} (exit {c}) ---\n{o}" for r, (c, o)
                                           in enumerate(zip(codes, outputs, strict=True)))
    return outputs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The gathered full state after every step of the uninterrupted run (index 0 is step 1)."""
    outdir = tmp_path_factory.mktemp("reference")
    _run(outdir, STEPS, "--reference")
    states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = torch.load(outdir / "reference.pt",
                                                                                weights_only=False)
    return states


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits_view(a.contiguous()),
                                                                     bits_view(b.contiguous()))


def assert_equals_reference(state: dict[str, Any], ref: tuple[dict[str, torch.Tensor], dict[str, Any]],
                            names: list[str], where: str) -> None:
    model, optimizer = ref
    for k, v in model.items():
        assert _same(state["model"][k], v), f"{where}: model {k} differs"
    for i, name in enumerate(names):
        for key, v in optimizer["state"][name].items():
            assert _same(state["optimizer"]["state"][i][key], v), f"{where}: optimizer {name}.{key} differs"


def _check_chain(chain: Path, reference: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> int:
    report = ldformat.validate(chain)
    assert report.ok, [str(p) for p in report.problems]
    reader = ldformat.open_reader(chain)
    assert isinstance(reader, ldformat.ShardedReader)
    names = reader.ranks[0].root.schema["optimizer"]["params"]
    latest = reader.latest_step
    assert latest is not None
    for step in reader.steps:
        if step > 0:
            assert_equals_reference(reader.materialize(step), reference[step - 1], names, f"step {step}")
    return latest


def _kill_trial(outdir: Path, rng: random.Random, reference: list[Any], *, relaunch: bool) -> dict[str, Any]:
    victim = rng.randrange(WORLD)
    kill_at = rng.randrange(2, STEPS)  # after the victim printed this step, plus a random delay
    delay = rng.uniform(0.0, 0.05)
    procs = _start(outdir, STEPS)
    assert procs[victim].stdout is not None
    killed_at = None
    try:
        for line in procs[victim].stdout:
            if line.startswith("step ") and int(line.split()[1]) >= kill_at:
                time.sleep(delay)
                procs[victim].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                break
    finally:
        if killed_at is None:
            killed_at = time.monotonic()
        codes, outputs = _finish(procs, EXIT_BOUND_S)
        for p in procs:
            if p.poll() is None:
                p.kill()
    survivor = 1 - victim
    elapsed = time.monotonic() - killed_at
    assert "[killed: ran past the bound]" not in outputs[survivor], (
        f"rank {survivor} did not exit within {EXIT_BOUND_S} s of rank {victim}'s SIGKILL:\n{outputs[survivor]}")
    finished = "closed" in outputs[survivor] and codes[survivor] == 0
    latest = _check_chain(outdir / "chain", reference)
    result = {"victim": victim, "kill_at": kill_at, "survivor_exit": codes[survivor], "committed": latest,
              "finished": finished, "elapsed": round(elapsed, 1)}
    if relaunch:  # a new job resumes from the newest committed step and trains like the uninterrupted run
        _run(outdir, STEPS, "--resume")
        assert _check_chain(outdir / "chain", reference) == STEPS
    return result


def test_a_rank_killed_mid_run_loses_nothing_committed(tmp_path: Path, reference: list[Any]) -> None:
    rng = random.Random(20261123)
    results = [_kill_trial(tmp_path / f"trial{i}", rng, reference, relaunch=i == 0) for i in range(3)]
    assert all(r["committed"] >= 0 for r in results)


@pytest.mark.slow
def test_a_rank_killed_at_random_points_soak(tmp_path: Path, reference: list[Any]) -> None:
    rng = random.Random(7)
    results = [_kill_trial(tmp_path / f"trial{i}", rng, reference, relaunch=i % 5 == 0) for i in range(20)]
    print("\n".join(str(r) for r in results))


def test_a_rank_that_cannot_write_never_gets_a_step_committed(tmp_path: Path, reference: list[Any]) -> None:
    """Rank 1's disk fills up after a few objects: its Checkpointer fails, training stops at the next
    collective, and no commit record names a step rank 1 does not hold."""
    codes, outputs = _finish(_start(tmp_path, STEPS, rank_flags={1: ["--fault-after", "3"]}), EXIT_BOUND_S * 2)
    assert codes[1] != 0, outputs[1]
    assert "No space left on device" in outputs[1], outputs[1]
    assert "the checkpoint writer failed" in outputs[1], outputs[1]
    assert "did not commit step" in outputs[0], outputs[0]  # rank 0's close names the rank it waited for
    reader = ldformat.open_reader(tmp_path / "chain")
    assert isinstance(reader, ldformat.ShardedReader)
    rank1 = reader.ranks[1]
    assert reader.commit is not None and reader.commit.step in rank1.steps
    assert reader.latest_step is not None and reader.latest_step < STEPS
    _check_chain(tmp_path / "chain", reference)


def test_a_rank_that_cannot_open_its_chain_stops_every_rank_at_once(tmp_path: Path, reference: list[Any]) -> None:
    """Rank 1's very first object write fails, inside its Checkpointer's constructor: rank 0 learns
    it at the opening's last collective and stops with rank 1's reason, instead of waiting for
    the process group's timeout; nothing is committed, and the next job starts over cleanly."""
    codes, outputs = _finish(_start(tmp_path, STEPS, rank_flags={1: ["--fault-after", "0"]}), EXIT_BOUND_S)
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert "No space left on device" in outputs[1], outputs[1]
    assert "rank 1 could not open its checkpoint" in outputs[0], outputs[0]
    assert "No space left on device" in outputs[0], outputs[0]
    assert "step 1" not in outputs[0] and "step 1" not in outputs[1]  # no rank trained
    assert not (tmp_path / "chain" / "commits").exists() or not any((tmp_path / "chain" / "commits").iterdir())
    _run(tmp_path, STEPS)
    assert _check_chain(tmp_path / "chain", reference) == STEPS
