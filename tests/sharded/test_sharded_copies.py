"""Copy ranks (format 1.4, spec §20.2 ``copies``): HSDP, 2 replicas x 2 shards, under gloo on CPU.

FSDP2 ``fully_shard`` on a 2-D mesh ``("replicate", "shard")`` places every parameter
(Replicate(), Shard(0)): ranks 2 and 3 hold exactly ranks 0 and 1's blocks. The writer makes
them copy ranks: ``sharded.json`` says ``"format_version": "1.4"``, ``"copies": {"2": 0, "3": 1}``,
ranks 2 and 3 write no rank chain, and rank chain 0 records their own RNG states and data
positions in ``extra["ranks"]``. The workers (tests/support/sharded_copies_job.py) gather the full live
state after every step with ``get_state_dict(full_state_dict=True)`` and record each rank's
torch RNG state, data position and local shards; the checks run here:

* every committed step of an ``xor``, a ``lowdiff`` and a ``lowdiff+`` chain materializes to the
  live state bit for bit (``open_reader``, ``ldtools materialize``), and the chains validate
  (``ldformat.validate``, ``ldtools validate``, ``--deep``);
* rank chain 0's ``extra["ranks"]`` holds ranks 2 and 3's RNG states and data positions at every
  step, and ``ShardedReader.materialize(step)["rank_extra"]`` gives every rank its own;
* ``ldformat.resume`` at the recording layout (world 4 HSDP) gives every rank, copy ranks
  included, the model and optimizer state, its own torch RNG state and its own data position of
  the step; training on from there repeats the recorded run bit for bit (dropout included);
  a ``lowdiff`` chain truncated to an anchor, resumed and recorded on into with a new
  Checkpointer repeats it too, copy ranks' top-k residuals included;
* ``ldformat.resume`` at world 2, plain FSDP2 (1-D mesh), restores the gathered state exactly,
  and training on from it matches a reference that loads the gathered full state with
  ``set_state_dict``; the RNG states are left alone (they do not map between world sizes);
* ``ldtools truncate`` and ``ldtools compact`` keep the chain a valid, bit-exact copy-rank chain.

Two launches (world 4, then world 2) run every worker-side step; each is bounded in time and
its processes are killed on every way out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import launching
import pytest
import torch
from bitwise import bits
from clirun import invoke
from paths import SUPPORT
from sharded_state import assert_same, index_layout, state_diffs

import ldformat

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.procs,
]

WORKER = SUPPORT / "sharded_copies_job.py"
STEPS = 6  # anchor_every=3, batch_steps=2: anchors at 0, 3, 6; deltas 1-2, 4-5
MORE = 2  # steps trained on after the resume at world 2
MODES = {"xor": "xor", "lowdiff": "lowdiff", "lowdiffp": "lowdiff+"}  # run/chain key -> Checkpointer mode
COPIES = {"2": 0, "3": 1}
W4_TIMEOUT = 240.0
W2_TIMEOUT = 150.0

#: Resumes at the recording layout: run -> (chain key, step). The ``reopen`` runs truncate a copy of
#: the lowdiff chain after anchor 3, resume it and record on into it with a new Checkpointer (lowdiff's
#: Checkpointer feeds the optimizer top-k compressed gradients, so only a recorded continuation
#: repeats the run): ``reopen-lowdiff`` as README says (``resume(exact=True)``, then a Checkpointer),
#: ``reopen-lowdiff-topk`` with one ``TopK`` handed to both ``resume`` and the Checkpointer.
SAME_LAYOUT = {"resume-xor": ("xor", 4), "resume-lowdiffp": ("lowdiffp", 5), "reopen-lowdiff": ("lowdiff", 3),
               "reopen-lowdiff-topk": ("lowdiff", 3)}
REOPENED = {"reopen-lowdiff": "hsdp-lowdiff-again", "reopen-lowdiff-topk": "hsdp-lowdiff-topk"}  # run -> chain


def w4_runs() -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = [{"name": f"train-{key}", "kind": "train", "layout": "hsdp", "mode": mode,
                                   "chain": f"hsdp-{key}", "steps": STEPS} for key, mode in MODES.items()]
    runs += [{"name": "resume-xor", "kind": "resume", "layout": "hsdp", "chain": "hsdp-xor", "step": 4,
              "until": STEPS},
             {"name": "resume-lowdiffp", "kind": "resume", "layout": "hsdp", "chain": "hsdp-lowdiffp", "step": 5,
              "until": STEPS}]
    runs += [{"name": run, "kind": "reopen", "layout": "hsdp", "mode": "lowdiff", "src": "hsdp-lowdiff",
              "chain": chain, "step": 3, "until": STEPS, "topk": run.endswith("-topk")}
             for run, chain in REOPENED.items()]
    return runs


def w2_runs(src: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for key in MODES:
        runs += [{"name": f"r42-{key}", "kind": "resume", "layout": "fsdp", "chain": str(src / f"hsdp-{key}"),
                  "until": STEPS + MORE, "reseed": True},
                 {"name": f"ref42-{key}", "kind": "load", "layout": "fsdp", "load": str(src / f"train-{key}.rank0.pt"),
                  "step": STEPS, "until": STEPS + MORE, "reseed": True}]
    return runs


# -- launching (tests/support/launching.py) ------------------------------------------------------------------
class Launch(launching.Launch):
    """The outputs of one launch's runs: ``outdir/<run>.rank<R>.pt`` per run and rank (start,
    steps gathered, rng, data, local)."""

    def chain(self, key: str) -> Path:
        """The chain that ``train-<key>`` recorded (``key`` of MODES), or that a ``reopen`` run recorded on
        into (``key`` of REOPENED)."""
        if key in REOPENED:
            self.record(key)
            return self.outdir / REOPENED[key]
        self.record(f"train-{key}")
        return self.outdir / f"hsdp-{key}"


def launch(outdir: Path, world: int, runs: list[dict[str, Any]], timeout: float) -> Launch:
    """Run ``runs`` in order on ``world`` workers. A run that fails is recorded, and the workers are
    started once more for the runs after it (a lost race for the port is retried too)."""
    result = launching.launch(WORKER, outdir, world, runs, timeout, attempts=3, stop_on_timeout=True, make=Launch)
    assert isinstance(result, Launch)
    return result


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 4 HSDP: a chain per mode, then resumes at the same layout."""
    return launch(tmp_path_factory.mktemp("copies-w4"), 4, w4_runs(), W4_TIMEOUT)


@pytest.fixture(scope="module")
def w2(w4: Launch, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 2 plain FSDP2: each HSDP chain resumed, and its set_state_dict reference."""
    return launch(tmp_path_factory.mktemp("copies-w2"), 2, w2_runs(w4.outdir), W2_TIMEOUT)


# -- comparing ---------------------------------------------------------------------------------------
def gathered(launch: Launch, name: str, step: int, rank: int = 0) -> dict[str, Any]:
    return index_layout(launch.record(name, rank)["steps"][step])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_chain_matches(path: Path, launch: Launch, run: str, steps: list[int]) -> None:
    reader = ldformat.open_reader(path)
    assert isinstance(reader, ldformat.ShardedReader)
    assert reader.steps == steps, reader.steps
    problems = []
    for step in reader.steps:
        got = reader.materialize(step)
        assert got["step"] == step
        problems += [f"step {step}: {d}" for d in state_diffs(got, gathered(launch, run, step))]
    assert not problems, f"{path.name}: the chain differs from the live run:\n  " + "\n  ".join(problems[:30])


def assert_copy_layout(path: Path) -> None:
    root = json.loads((path / "sharded.json").read_text())
    assert root["format_version"] == "1.4", root["format_version"]
    assert root.get("copies") == COPIES, root.get("copies")
    assert root["world_size"] == 4
    assert root["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    ranks = sorted(p.name for p in (path / "ranks").iterdir())
    assert ranks == ["00000", "00001"], f"rank chains {ranks}: copy ranks 2 and 3 must write none"
    assert not (path / "ranks" / "00002").exists() and not (path / "ranks" / "00003").exists()


# -- the harness itself ------------------------------------------------------------------------------
def test_every_run_completed(w4: Launch, w2: Launch) -> None:
    """Every run of both launches completed (the tests of a failed run show its workers' output)."""
    failed = {f"world {lc.world} {name}": text.strip().splitlines()[-3:]
              for lc in (w4, w2) for name, text in lc.failed.items()}
    assert not failed, f"failed runs (launch seconds {w4.seconds:.1f}, {w2.seconds:.1f}): {failed}"


@pytest.mark.parametrize("key", list(MODES))
def test_harness_replicas_hold_the_same_blocks(w4: Launch, key: str) -> None:
    """What makes 2 and 3 copy ranks: their local shards are ranks 0 and 1's, bit for bit, at every
    step; rank 1 (and 3) holds the empty shard of ``gain``; every rank gathers the same full state;
    the ranks' RNG streams differ (dropout draws from each rank's own), and training moved the state."""
    run = f"train-{key}"
    records = [w4.record(run, r) for r in range(4)]
    assert sorted(records[0]["steps"]) == list(range(STEPS + 1))
    assert [tuple(rec["local"][STEPS]["embed.weight"].shape) for rec in records] == [(7, 6), (6, 6), (7, 6), (6, 6)]
    assert [tuple(rec["local"][STEPS]["gain"].shape) for rec in records] == [(1,), (0,), (1,), (0,)]
    for step in range(STEPS + 1):
        for copy, src in ((2, 0), (3, 1)):
            mine, theirs = records[copy]["local"][step], records[src]["local"][step]
            assert sorted(mine) == sorted(theirs)
            for name in theirs:
                assert same_bits(mine[name], theirs[name]), f"step {step}: rank {copy}'s {name} is not rank {src}'s"
        for rank in range(1, 4):
            assert_same(gathered(w4, run, step, rank), gathered(w4, run, step), f"{run} rank {rank} step {step}")
    rng = [rec["rng"][STEPS] for rec in records]
    assert all(not torch.equal(rng[a], rng[b]) for a in range(4) for b in range(a + 1, 4)), "RNG streams coincide"
    assert not same_bits(records[0]["steps"][0]["model"]["up.weight"], records[0]["steps"][STEPS]["model"]["up.weight"])


# -- 1: the copy-rank layout; every step materializes; the chains validate ----------------------------
@pytest.mark.parametrize("key", list(MODES))
def test_copy_ranks_write_no_rank_chain(w4: Launch, key: str) -> None:
    path = w4.chain(key)
    assert_copy_layout(path)
    reader = ldformat.open_reader(path)
    assert isinstance(reader, ldformat.ShardedReader)
    assert sorted(reader.ranks) == [0, 1]
    assert reader.root.world_size == 4
    assert dict(reader.root.copies) == {2: 0, 3: 1}
    info = json.loads(invoke("info", path, "--json").stdout)
    assert info["format_version"] == "1.4" and info["world_size"] == 4


@pytest.mark.parametrize("key", list(MODES))
def test_every_step_materializes_bit_exact(w4: Launch, key: str) -> None:
    assert_chain_matches(w4.chain(key), w4, f"train-{key}", list(range(STEPS + 1)))


@pytest.mark.parametrize("key", list(MODES))
def test_chain_validates(w4: Launch, key: str) -> None:
    path = w4.chain(key)
    report = ldformat.validate(path)
    assert report.ok, report.problems
    invoke("validate", path)
    invoke("validate", "--deep", path)


def test_cli_materialize_in_a_fresh_process(w4: Launch, tmp_path: Path) -> None:
    """``python -m ldtools materialize`` of a delta step, in a process of its own (no process group)."""
    out = tmp_path / "full.pt"
    proc = subprocess.run([sys.executable, "-m", "ldtools", "materialize", str(w4.chain("lowdiffp")),
                           "--step", "4", "-o", str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    assert got["step"] == 4
    assert_same(got, gathered(w4, "train-lowdiffp", 4), "ldtools materialize --step 4")


# -- 2: the copy ranks' own extras, and resume at the recording layout ---------------------------------
@pytest.mark.parametrize("key", list(MODES))
def test_rank_chain_0_records_the_copy_ranks_extras(w4: Launch, key: str) -> None:
    """Rank chain 0's ``extra["ranks"]`` holds ranks 2 and 3's RNG states and data positions at every
    step (and nothing for the ranks that write their own chain); the sharded reader gives every
    rank its own ``extra``."""
    run = f"train-{key}"
    reader = ldformat.open_reader(w4.chain(key))
    assert isinstance(reader, ldformat.ShardedReader)
    for step in range(STEPS + 1):
        extra0 = reader.ranks[0].materialize(step)["extra"]
        listed = sorted(extra0.get("ranks", {}))
        assert listed == ["2", "3"], f"step {step}: extra.ranks lists {listed}"
        for rank in (2, 3):
            mine = extra0["ranks"][str(rank)]
            live = w4.record(run, rank)
            assert torch.equal(mine["rng"]["torch"], live["rng"][step]), f"step {step}: rank {rank}'s RNG state"
            assert mine["data"] == live["data"][step], f"step {step}: rank {rank}'s data position"
        state = reader.materialize(step)
        assert len(state["rank_extra"]) == 4
        for rank in range(4):
            live = w4.record(run, rank)
            own = state["rank_extra"][rank]
            assert torch.equal(own["rng"]["torch"], live["rng"][step]), f"step {step}: rank_extra[{rank}] RNG state"
            assert own["data"] == live["data"][step], f"step {step}: rank_extra[{rank}] data position"
            of_rank = reader.extra_of(rank, step)
            assert of_rank is not None and torch.equal(of_rank["rng"]["torch"], live["rng"][step]), (step, rank)
        assert torch.equal(state["extra"]["rng"]["torch"], w4.record(run, 0)["rng"][step])


@pytest.mark.parametrize("run", list(SAME_LAYOUT))
def test_resume_at_the_recording_layout_restores_every_rank(w4: Launch, run: str) -> None:
    """Each rank, copy ranks included, gets the step's model and optimizer state, its own torch RNG
    state and its own data position back; training on repeats the recorded run bit for bit."""
    key, step = SAME_LAYOUT[run]
    live = f"train-{key}"
    for s in range(step, STEPS + 1):  # first the copy invariant: a copy rank holds its source's blocks
        for copy, src in ((2, 0), (3, 1)):
            mine, theirs = w4.record(run, copy)["local"][s], w4.record(run, src)["local"][s]
            differ = sorted(n for n in theirs if not same_bits(mine[n], theirs[n]))
            assert not differ, (f"{run}: at step {s}, after resuming at step {step}, copy rank {copy} no longer holds "
                                f"rank {src}'s blocks: {differ}")
    for rank in range(4):
        got = w4.record(run, rank)
        want = w4.record(live, rank)
        assert got["start"] == step, f"rank {rank}: resume returned {got['start']}, want {step}"
        assert torch.equal(got["rng_after_resume"], want["rng"][step]), f"rank {rank}'s RNG state after resume"
        assert got["data_after_resume"] == want["data"][step], f"rank {rank}'s data position after resume"
        for s in range(step, STEPS + 1):
            assert_same(gathered(w4, run, s, rank), gathered(w4, live, s, rank), f"{run} rank {rank} at step {s}")
            for name, t in want["local"][s].items():
                assert same_bits(got["local"][s][name], t), f"{run} rank {rank} step {s}: local {name}"
            assert torch.equal(got["rng"][s], want["rng"][s]), f"{run} rank {rank} step {s}: RNG state"
            assert got["data"][s] == want["data"][s], f"{run} rank {rank} step {s}: data position"


@pytest.mark.parametrize("run", list(REOPENED))
def test_reopened_lowdiff_chain_records_on_with_its_copies(w4: Launch, run: str) -> None:
    """The lowdiff chain truncated after anchor 3 and recorded on into at world 4 HSDP: the same
    copies, no rank chain for the copy ranks, every step the recorded run's, and valid."""
    path = w4.chain(run)
    assert w4.record(run, 0)["closed"] == STEPS
    assert_copy_layout(path)
    assert_chain_matches(path, w4, "train-lowdiff", list(range(STEPS + 1)))
    reader = ldformat.open_reader(path)
    assert isinstance(reader, ldformat.ShardedReader)
    for step in range(STEPS + 1):
        ranks = reader.ranks[0].materialize(step)["extra"]["ranks"]
        for rank in (2, 3):
            assert torch.equal(ranks[str(rank)]["rng"]["torch"], w4.record("train-lowdiff", rank)["rng"][step])
    invoke("validate", "--deep", path)


# -- 3: resume at world 2, plain FSDP2 --------------------------------------------------------------------
@pytest.mark.parametrize("key", list(MODES))
def test_resume_at_world_2_fsdp_then_train_on(w4: Launch, w2: Launch, key: str) -> None:
    want = gathered(w4, f"train-{key}", STEPS)
    for rank in range(2):
        ref = w2.record(f"ref42-{key}", rank)
        assert ref["start"] == STEPS
        assert_same(gathered(w2, f"ref42-{key}", STEPS, rank), want, f"reference rank {rank} (harness)")
    for rank in range(2):
        got = w2.record(f"r42-{key}", rank)
        assert got["start"] == STEPS, f"rank {rank}: resume returned {got['start']}, want {STEPS}"
        assert_same(gathered(w2, f"r42-{key}", STEPS, rank), want, f"rank {rank} right after resume at world 2")
        # RNG states and data positions are per rank and do not map between world sizes (spec §20.6).
        assert torch.equal(got["rng_after_resume"], got["rng_before"]), f"rank {rank}: resume changed the RNG state"
        assert got["data_after_resume"] == {"rank": -1, "seen": 0}, f"rank {rank}: {got['data_after_resume']}"
        for s in range(STEPS + 1, STEPS + MORE + 1):
            assert_same(gathered(w2, f"r42-{key}", s, rank), gathered(w2, f"ref42-{key}", s, rank),
                        f"rank {rank} at step {s}, trained on after the resume")


# -- 4: truncate and compact ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(MODES))
def test_truncate_and_compact(w4: Launch, tmp_path: Path, key: str) -> None:
    chain = tmp_path / f"hsdp-{key}"
    shutil.copytree(w4.chain(key), chain)
    run = f"train-{key}"
    invoke("truncate", chain, "--after", 5, "--yes")
    assert_chain_matches(chain, w4, run, list(range(6)))
    invoke("validate", chain)
    invoke("compact", chain, "--max-replay", 1)
    assert_chain_matches(chain, w4, run, list(range(6)))
    invoke("compact", chain, "--keep-last", 3, "--yes")
    assert_chain_matches(chain, w4, run, [3, 4, 5])
    report = ldformat.validate(chain, deep=True)
    assert report.ok, report.problems
    invoke("validate", chain)
    assert_copy_layout(chain)
