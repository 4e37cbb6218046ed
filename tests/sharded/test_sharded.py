"""Sharded training chains: FSDP2, tensor parallel and 2-D (FSDP x TP) under gloo on CPU.

Every rank of a run records the same chain with an ``ldformat.Checkpointer``; the workers
(tests/support/sharded_train.py) gather the full live state after every step with
``get_state_dict(full_state_dict=True)`` and save it, and the checks run here:

* ``open_reader(path).materialize(step)`` equals the gathered live state bit for bit, for every
  step of every chain (world 1, 2 and 4; FSDP2 with uneven and empty shards, TP, 2-D; modes
  ``xor``, ``lowdiff``, ``lowdiff+``);
* ``ldformat.resume`` at another world size or mesh (2->1, 1->2, 2->4, FSDP->TP, TP->FSDP,
  FSDP->2-D) restores exactly the gathered state of the original run, and training on from it
  matches a reference that loads that gathered state with ``set_state_dict``;
* ``ldtools materialize`` (a ``.pt`` file, and ``--format dcp`` loaded on other meshes) and
  ``ldformat.validate`` / ``ldtools validate``.

Launching workers costs the import of torch, so each world size runs one launch that executes
many runs one after another (a fresh model and chain each); the launches are module fixtures.
A run that fails in a worker fails only its own tests: the launch goes on with the next run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import launching
import numpy as np
import pytest
import torch
from clirun import invoke
from launching import Launch
from paths import SUPPORT
from sharded_state import assert_same, index_layout, state_diffs

import ldformat
from ldformat.errors import UsageError

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

WORKER = SUPPORT / "sharded_train.py"
STEPS = 10  # steps of every recorded chain (anchor_every=4: anchors at 0, 4, 8; step 10 is a delta)
MORE = 3  # steps trained on after a resume or a load
MID = 6  # a delta step in the middle of a chain
WORKER_ARGS: list[str] = []  # extra worker arguments (--no-checkpoint checks the harness alone)


# -- the runs --------------------------------------------------------------------------------------
def chain_run(name: str, layout: str, mode: str, optim: str, *, snapshots: bool = False) -> dict[str, Any]:
    """``snapshots``: every rank chain writes a segmented snapshot after every second record."""
    run = {"name": name, "layout": layout, "mode": mode, "optim": optim, "steps": STEPS, "chain": name}
    return {**run, "snapshots": "eager"} if snapshots else run


def resume_pair(name: str, layout: str, optim: str, src: Path, src_run: str,
                step: int = STEPS) -> list[dict[str, Any]]:
    """A run resumed with ldformat.resume from ``src/src_run`` and its reference, which loads the
    original run's gathered full state at ``step`` with set_state_dict."""
    resumed = {"name": name, "layout": layout, "optim": optim, "steps": MORE, "resume": str(src / src_run)}
    if step != STEPS:
        resumed["resume_step"] = step
    return [resumed, {"name": f"ref-{name}", "layout": layout, "optim": optim, "steps": MORE,
                      "load": str(src / f"{src_run}.rank0.pt"), "load_step": step}]


def dcp_pair(name: str, layout: str, optim: str, export: Path | None, src: Path, src_run: str) -> list[dict[str, Any]]:
    """A run that loads the ``ldtools materialize --format dcp`` export, and its reference."""
    ref = {"name": f"ref-{name}", "layout": layout, "optim": optim, "steps": MORE,
           "load": str(src / f"{src_run}.rank0.pt"), "load_step": MID}
    if export is None:  # the export failed: test_dcp_export_loads_on_another_mesh reports why
        return [ref]
    return [{"name": name, "layout": layout, "optim": optim, "steps": MORE, "dcp": str(export), "load_step": MID}, ref]


W2_CHAINS = [
    chain_run("fsdp-xor", "fsdp", "xor", "sgd", snapshots=True),
    chain_run("fsdp-lowdiff", "fsdp", "lowdiff", "adamw", snapshots=True),
    chain_run("fsdp-lowdiffp", "fsdp", "lowdiff+", "adamw"),
    chain_run("tp-xor", "tp", "xor", "adamw"),
    chain_run("tp-lowdiff", "tp", "lowdiff", "adam"),
    chain_run("tp-lowdiffp", "tp", "lowdiff+", "adamw", snapshots=True),
    chain_run("fsdpmp-xor", "fsdp-mp", "xor", "adamw"),  # MixedPrecisionPolicy(bf16 params, fp32 reduce)
    chain_run("fsdpmp-lowdiffp", "fsdp-mp", "lowdiff+", "adamw"),
]
#: A chain with a disk budget (live retention per rank chain), checked on its own. Rank 0 makes no
#: global commit before close, so every rank's last commits come before the one that lets it drop
#: history: the last retention pass must wait for it.
BUDGET_RUN = {**chain_run("fsdp-budget", "fsdp", "xor", "adamw", snapshots=True), "max_bytes": 2 * 24_000,
              "lagging_commits": True}
W4_CHAINS = [
    chain_run("fsdp4-xor", "fsdp", "xor", "adam"),
    chain_run("2d-xor", "2d", "xor", "sgd"),
    chain_run("2d-lowdiffp", "2d", "lowdiff+", "adamw"),
    # HSDP, 2 replicas of 2 shards: ranks 2 and 3 are copy ranks and write no chain (spec §20.2)
    chain_run("hsdp-lowdiff", "hsdp", "lowdiff", "adamw"),
    chain_run("hsdp-lowdiffp", "hsdp", "lowdiff+", "adam"),
]
#: An HSDP chain that a second run opens again after a resume and appends MORE steps to.
HSDP_REOPENED = [chain_run("hsdp-xor", "hsdp", "xor", "adamw", snapshots=True),
                 {"name": "hsdp-xor-more", "layout": "hsdp", "optim": "adamw", "steps": MORE, "mode": "xor",
                  "chain": "hsdp-xor", "snapshots": "eager"}]
W1_CHAINS = [chain_run("fsdp1-xor", "fsdp", "xor", "adamw")]


# -- launching (tests/support/launching.py) ------------------------------------------------------------------
def launch(outdir: Path, world: int, runs: list[dict[str, Any]], timeout: float) -> Launch:
    """Run ``runs`` in order on ``world`` workers. A run that fails is recorded and skipped, and
    the workers are started again for the runs after it (a lost race for the port is retried)."""
    return launching.launch(WORKER, outdir, world, runs, timeout, attempts=len(runs) + 3, stop_on_timeout=False,
                            args=WORKER_ARGS)


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 2: a chain per layout (FSDP2, TP) and mode."""
    outdir = tmp_path_factory.mktemp("sharded-w2")
    return launch(outdir, 2, [*W2_CHAINS, BUDGET_RUN], timeout=240)


@dataclass
class Export:
    path: Path | None
    error: str = ""


@pytest.fixture(scope="module")
def dcp_export(w2: Launch, tmp_path_factory: pytest.TempPathFactory) -> Export:
    """``ldtools materialize --format dcp`` of the world-2 FSDP xor chain at step MID."""
    out = tmp_path_factory.mktemp("sharded-dcp") / "step6"
    if "fsdp-xor" in w2.failed:
        return Export(None, "the fsdp-xor chain was not written")
    result = invoke("materialize", w2.outdir / "fsdp-xor", "--step", MID, "--format", "dcp", "-o", out, code=None)
    if result.exit_code != 0 or not out.is_dir():
        return Export(None, f"exit {result.exit_code}, exception {result.exception!r}:\n{result.output}")
    return Export(out)


@pytest.fixture(scope="module")
def w1(w2: Launch, dcp_export: Export, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 1: a chain for 1->2; resumes 2->1 (FSDP on one rank, and a plain model); the DCP export."""
    outdir = tmp_path_factory.mktemp("sharded-w1")
    runs = [*W1_CHAINS,
            *resume_pair("r21-fsdp", "fsdp", "sgd", w2.outdir, "fsdp-xor"),
            *resume_pair("r21-plain", "plain", "sgd", w2.outdir, "fsdp-xor"),
            *resume_pair("r21-tp-step6", "fsdp", "adam", w2.outdir, "tp-lowdiff", step=MID),
            *dcp_pair("dcp-w1", "fsdp", "sgd", dcp_export.path, w2.outdir, "fsdp-xor")]
    return launch(outdir, 1, runs, timeout=180)


@pytest.fixture(scope="module")
def w2b(w1: Launch, w2: Launch, w4: Launch, dcp_export: Export, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 2 again: resumes 1->2 (FSDP, TP), FSDP->TP, HSDP at 4 -> FSDP at 2; the DCP export on a TP mesh."""
    outdir = tmp_path_factory.mktemp("sharded-w2b")
    runs = [*resume_pair("r12-fsdp", "fsdp", "adamw", w1.outdir, "fsdp1-xor"),
            *resume_pair("r42-hsdp", "fsdp", "adam", w4.outdir, "hsdp-lowdiffp"),
            *resume_pair("r12-tp", "tp", "adamw", w1.outdir, "fsdp1-xor"),
            *resume_pair("r-fsdp2tp", "tp", "adamw", w2.outdir, "fsdp-lowdiffp"),
            *dcp_pair("dcp-tp", "tp", "sgd", dcp_export.path, w2.outdir, "fsdp-xor")]
    return launch(outdir, 2, runs, timeout=240)


@pytest.fixture(scope="module")
def w4(w2: Launch, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """World 4: FSDP2 (a rank with 0 rows), 2-D and HSDP chains; resumes 2->4 (FSDP, TP->FSDP,
    FSDP->2-D) and 4->4 (HSDP, copy ranks included); an HSDP chain opened again and appended to."""
    outdir = tmp_path_factory.mktemp("sharded-w4")
    runs = [*W4_CHAINS,
            HSDP_REOPENED[0], {**HSDP_REOPENED[1], "resume": str(outdir / "hsdp-xor")},
            *resume_pair("r44-hsdp", "hsdp", "adamw", outdir, "hsdp-lowdiff"),
            *resume_pair("r24-fsdp", "fsdp", "sgd", w2.outdir, "fsdp-xor"),
            *resume_pair("r24-2d", "2d", "sgd", w2.outdir, "fsdp-xor"),
            *resume_pair("r24-tp2fsdp", "fsdp", "adamw", w2.outdir, "tp-xor")]
    return launch(outdir, 4, runs, timeout=540)


def _launch(request: pytest.FixtureRequest, name: str) -> Launch:
    value = request.getfixturevalue(name)
    assert isinstance(value, Launch)
    return value


# -- comparing ---------------------------------------------------------------------------------------
def gathered(launch: Launch, name: str, step: int, rank: int = 0) -> dict[str, Any]:
    return index_layout(launch.record(name, rank)["steps"][step])


# -- the harness itself ----------------------------------------------------------------------------------
CHAIN_CASES = [("w2", r["name"]) for r in W2_CHAINS] + [("w4", r["name"]) for r in W4_CHAINS] + \
              [("w1", r["name"]) for r in W1_CHAINS]
CHAIN_IDS = [f"{w}-{n}" for w, n in CHAIN_CASES]


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name"), CHAIN_CASES, ids=CHAIN_IDS)
def test_live_ranks_gather_the_same_state(request: pytest.FixtureRequest, world: str, name: str) -> None:
    """The gathered full state is the same on every rank, and training changed it."""
    launch = _launch(request, world)
    first = launch.record(name, 0)
    assert sorted(first["steps"]) == list(range(STEPS + 1))
    for rank in range(1, launch.world):
        for step in first["steps"]:
            assert_same(gathered(launch, name, step, rank), gathered(launch, name, step), f"rank {rank} step {step}")
    w0, w10 = first["steps"][0]["model"], first["steps"][STEPS]["model"]
    assert not torch.equal(w0["embed.weight"], w10["embed.weight"])
    assert not torch.equal(w0["calls"], w10["calls"])  # the buffer changes on every forward


@pytest.mark.procs
def test_layouts_have_uneven_and_empty_shards(w2: Launch, w4: Launch) -> None:
    """The runs shard as claimed: 97 rows -> 49/48 and 25/25/25/22, a 1-element parameter with
    empty shards, TP shards, and 2-D strided shards."""
    def local(launch: Launch, name: str, key: str) -> list[tuple[int, ...]]:
        return [tuple(launch.record(name, r)["layout"][key]["local"]) for r in range(launch.world)]

    assert local(w2, "fsdp-xor", "embed.weight") == [(49, 7), (48, 7)]
    assert local(w2, "fsdp-xor", "gain") == [(1,), (0,)]
    assert local(w4, "fsdp4-xor", "embed.weight") == [(25, 7), (25, 7), (25, 7), (22, 7)]
    assert local(w4, "fsdp4-xor", "gain") == [(1,), (0,), (0,), (0,)]
    assert local(w2, "tp-xor", "block.up.weight") == [(12, 7), (12, 7)]
    assert local(w2, "tp-xor", "block.down.weight") == [(7, 12), (7, 12)]
    assert local(w4, "2d-xor", "block.down.weight") == [(4, 12), (4, 12), (3, 12), (3, 12)]
    assert "_StridedShard" in w4.record("2d-xor")["layout"]["block.up.weight"]["placements"][0]


# -- 1, 2: every step of every chain materializes to the live state -----------------------------------
@pytest.mark.procs
@pytest.mark.parametrize(("world", "name"), CHAIN_CASES, ids=CHAIN_IDS)
def test_chain_materializes_every_step_bit_exact(request: pytest.FixtureRequest, world: str, name: str) -> None:
    launch = _launch(request, world)
    reader = ldformat.open_reader(launch.chain(name))
    assert reader.steps == list(range(STEPS + 1))
    assert reader.latest_step == STEPS
    problems = []
    for step in reader.steps:
        got = reader.materialize(step)
        assert got["step"] == step
        assert isinstance(got.get("extra", {}), dict)
        problems += [f"step {step}: {d}" for d in state_diffs(got, gathered(launch, name, step))]
    assert not problems, f"{world} {name}: the chain differs from the live run:\n  " + "\n  ".join(problems[:30])


@pytest.mark.parametrize(("world", "name"), CHAIN_CASES, ids=CHAIN_IDS)
def test_chain_validates(request: pytest.FixtureRequest, world: str, name: str) -> None:
    path = _launch(request, world).chain(name)
    report = ldformat.validate(path)
    assert report.ok, report.problems
    result = invoke("validate", path, code=None)
    assert result.exit_code == 0, f"ldtools validate: exit {result.exit_code}:\n{result.output}"


@pytest.mark.parametrize(("world", "name"), [("w2", "fsdp-lowdiffp"), ("w4", "2d-xor")])
def test_chain_validates_deep(request: pytest.FixtureRequest, world: str, name: str) -> None:
    """``--deep`` replays between the anchors and compares the bits with the stored anchors."""
    result = invoke("validate", "--deep", _launch(request, world).chain(name), code=None)
    assert result.exit_code == 0, f"ldtools validate --deep: exit {result.exit_code}:\n{result.output}"


# The flight recorder: FSDP with an empty shard and Adam's state, TP from the stored
# optimizer tensors (xor), HSDP with copy ranks.
HISTORY_CASES = [("w2", "fsdp-lowdiffp"), ("w2", "tp-xor"), ("w4", "hsdp-lowdiffp")]


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name"), HISTORY_CASES, ids=[f"{w}-{n}" for w, n in HISTORY_CASES])
def test_history_measures_the_full_live_tensors(request: pytest.FixtureRequest, world: str, name: str) -> None:
    """``step_history`` of a sharded chain replays the rank chains side by side and measures the
    full tensors (by FQN, assembled from the shards; a copy rank's from its source): every number
    of every step equals the formula applied to the gathered live state, exactly. (Every tensor
    is below torch's parallel grain: its sums are one thread's whatever the thread count.)"""
    from ldformat.export.history import group_of, step_history

    launch = _launch(request, world)
    reader = ldformat.open_reader(launch.chain(name))
    assert isinstance(reader, ldformat.ShardedReader)
    params = list(reader.ranks[0].root.schema["optimizer"]["params"])
    live = launch.record(name)["steps"]
    history = list(step_history(reader))
    assert [s.step for s in history] == list(range(STEPS + 1))

    def sq(t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t)) ** 2

    for s in history:
        state, before = live[s.step], live.get(s.step - 1)
        want: dict[str, list[float]] = {}  # numel, w^2, dw^2, v sum, v max, v numel
        for n in params:
            w = state["model"][n]
            a = want.setdefault(group_of(n, 1), [0, 0.0, 0.0, 0.0, -np.inf, 0])
            a[0] += w.numel()
            a[1] += sq(w)
            if before is not None:
                a[2] += sq(torch.sub(w, before["model"][n]))
            v = state["optimizer"]["state"].get(n, {}).get("exp_avg_sq")
            if v is not None:
                a[3] += float(v.sum())
                a[4] = max(a[4], float(v.max()))
                a[5] += v.numel()
        assert [g.name for g in s.groups] == list(want), s.step
        for g in s.groups:
            a = want[g.name]
            where = f"step {s.step} group {g.name}"
            assert (g.numel, g.weight_norm) == (a[0], np.sqrt(a[1])), where
            assert g.update_norm == (np.sqrt(a[2]) if before is not None else None), where
            assert (g.v_mean, g.v_max) == ((a[3] / a[5], a[4]) if a[5] else (None, None)), where
        assert s.weight_norm == np.sqrt(sum(a[1] for a in want.values()))
        assert s.anchor == (s.step % 4 == 0) and s.bytes > 0


# -- 3: resume at another world size or mesh ------------------------------------------------------------
RESUMES = [  # (launch of the resumed run, run, launch of the chain, chain run, step)
    ("w1", "r21-fsdp", "w2", "fsdp-xor", STEPS),
    ("w1", "r21-plain", "w2", "fsdp-xor", STEPS),
    ("w1", "r21-tp-step6", "w2", "tp-lowdiff", MID),
    ("w2b", "r12-fsdp", "w1", "fsdp1-xor", STEPS),
    ("w2b", "r12-tp", "w1", "fsdp1-xor", STEPS),
    ("w2b", "r-fsdp2tp", "w2", "fsdp-lowdiffp", STEPS),
    ("w4", "r24-fsdp", "w2", "fsdp-xor", STEPS),
    ("w4", "r24-2d", "w2", "fsdp-xor", STEPS),
    ("w4", "r24-tp2fsdp", "w2", "tp-xor", STEPS),
    ("w4", "r44-hsdp", "w4", "hsdp-lowdiff", STEPS),
    ("w2b", "r42-hsdp", "w4", "hsdp-lowdiffp", STEPS),
]


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name", "src_world", "src", "step"), RESUMES, ids=[r[1] for r in RESUMES])
def test_resume_on_another_mesh_then_train_on(request: pytest.FixtureRequest, world: str, name: str,
                                              src_world: str, src: str, step: int) -> None:
    launch, origin = _launch(request, world), _launch(request, src_world)
    want = gathered(origin, src, step)
    for rank in range(launch.world):
        ref = launch.record(f"ref-{name}", rank)
        assert ref["start"] == step
        assert_same(gathered(launch, f"ref-{name}", step, rank), want, f"reference rank {rank} (harness)")
    for rank in range(launch.world):
        got = launch.record(name, rank)
        assert got["start"] == step, f"rank {rank}: resume returned {got['start']}, want {step}"
        assert_same(gathered(launch, name, step, rank), want, f"rank {rank} right after resume at step {step}")
        for s in range(step + 1, step + MORE + 1):
            assert_same(gathered(launch, name, s, rank), gathered(launch, f"ref-{name}", s, rank),
                        f"rank {rank} at step {s}, trained on after the resume")


@pytest.fixture
def keep_rng() -> Iterator[None]:
    """resume() restores the chain's RNG states into this process: put ours back."""
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


def _plain(optim: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from sharded_train import ShardNet, make_optimizer

    torch.manual_seed(0)
    model = ShardNet()
    return model, make_optimizer(model, optim)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    import copy

    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    from sharded_train import batch

    x, y = batch(step, 0)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _train_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> list[dict[str, Any]]:
    out = []
    for s in range(step + 1, step + MORE + 1):
        _train(model, optimizer, s)
        out.append(_snapshot(model, optimizer))
    return out


@pytest.mark.procs
@pytest.mark.parametrize(("src", "optim"), [("fsdp-xor", "sgd"), ("tp-lowdiffp", "adamw")])
@pytest.mark.usefixtures("keep_rng")
def test_resume_plain_model_without_process_group(w2: Launch, src: str, optim: str) -> None:
    """A sharded chain resumes into an ordinary model in a process with no process group."""
    model, opt = _plain(optim)
    step = ldformat.resume(w2.chain(src), model, opt)
    assert step == STEPS
    want = gathered(w2, src, STEPS)
    assert_same(_snapshot(model, opt), want, "right after resume")
    ref_model, ref_opt = _plain(optim)
    ref_model.load_state_dict(want["model"])
    ref_opt.load_state_dict(want["optimizer"])
    for s, (got, ref) in enumerate(zip(_train_on(model, opt, step), _train_on(ref_model, ref_opt, step),
                                       strict=True), start=step + 1):
        assert_same(got, ref, f"step {s}, trained on after the resume")


@pytest.mark.procs
@pytest.mark.usefixtures("keep_rng")
def test_checkpointing_a_plain_run_into_the_sharded_path_says_why(w2: Launch, tmp_path: Path) -> None:
    """After resuming a sharded chain at world size 1, checkpointing back into its path is
    refused with the reason (the layout changed) and what to do, and changes nothing."""
    chain = Path(w2.chain("fsdp-xor"))
    copy = tmp_path / "chain"
    shutil.copytree(chain, copy)
    model, opt = _plain("sgd")
    step = ldformat.resume(copy, model, opt)
    before = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    with pytest.raises(UsageError) as info:
        ldformat.Checkpointer(copy, model, opt, step=step, mode="xor")
    message = str(info.value)
    assert "holds a sharded chain" in message and "new path" in message and "ldformat.resume" in message
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == before


# -- 4: ldtools materialize ---------------------------------------------------------------------------
@pytest.mark.procs
def test_cli_materialize_pt_in_a_fresh_process(w2: Launch, tmp_path: Path) -> None:
    """``python -m ldtools materialize`` in a process of its own, no process group."""
    out = tmp_path / "full.pt"
    proc = subprocess.run([sys.executable, "-m", "ldtools", "materialize", str(w2.chain("fsdp-xor")),
                           "--step", str(MID), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    assert got["step"] == MID
    assert_same(got, gathered(w2, "fsdp-xor", MID), f"ldtools materialize --step {MID}")


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name", "step"),
                         [("w2", "tp-lowdiff", None), ("w2", "fsdp-lowdiffp", 3), ("w4", "2d-xor", MID),
                          ("w4", "fsdp4-xor", None), ("w1", "fsdp1-xor", MID)])
def test_cli_materialize_pt(request: pytest.FixtureRequest, tmp_path: Path, world: str, name: str,
                            step: int | None) -> None:
    launch = _launch(request, world)
    out = tmp_path / "full.pt"
    args = ["materialize", launch.chain(name), "-o", out] + ([] if step is None else ["--step", step])
    result = invoke(*args, code=None)
    assert result.exit_code == 0, f"exit {result.exit_code}, {result.exception!r}:\n{result.output}"
    got = torch.load(out, weights_only=True)
    want_step = STEPS if step is None else step
    assert got["step"] == want_step
    assert_same(got, gathered(launch, name, want_step), f"ldtools materialize {name} step {want_step}")


DCP_LOADS = [("w1", "dcp-w1"), ("w2b", "dcp-tp")]


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name"), DCP_LOADS, ids=[n for _, n in DCP_LOADS])
def test_dcp_export_loads_on_another_mesh(request: pytest.FixtureRequest, dcp_export: Export, w2: Launch,
                                          world: str, name: str) -> None:
    """Written at world 2 FSDP, loaded with dcp.load at world 1 FSDP and at world 2 TP."""
    assert dcp_export.path is not None, f"ldtools materialize --format dcp failed: {dcp_export.error}"
    launch = _launch(request, world)
    want = gathered(w2, "fsdp-xor", MID)
    for rank in range(launch.world):
        assert_same(gathered(launch, f"ref-{name}", MID, rank), want, f"reference rank {rank} (harness)")
        assert_same(gathered(launch, name, MID, rank), want, f"rank {rank} right after dcp.load")
        for s in range(MID + 1, MID + MORE + 1):
            assert_same(gathered(launch, name, s, rank), gathered(launch, f"ref-{name}", s, rank),
                        f"rank {rank} at step {s}, trained on after dcp.load")


@pytest.mark.procs
def test_dcp_export_loads_without_process_group(dcp_export: Export, w2: Launch) -> None:
    """The DCP export into an ordinary model in this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    assert dcp_export.path is not None, f"ldtools materialize --format dcp failed: {dcp_export.error}"
    model, opt = _plain("sgd")
    sd: dict[str, Any] = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=dcp_export.path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optimizer"])
    assert_same(_snapshot(model, opt), gathered(w2, "fsdp-xor", MID), "after dcp.load")


@pytest.mark.procs
def test_a_disk_budget_drops_history_per_rank_and_keeps_the_newest_committed_step(w2: Launch) -> None:
    """``max_bytes`` on a sharded model: each rank chain keeps within its share by dropping
    the steps before its newest anchor at or below the newest commit record's step, so the
    chain keeps its latest steps, every one exact, and validates."""
    path = w2.chain("fsdp-budget")
    reader = ldformat.open_reader(path)
    assert isinstance(reader, ldformat.ShardedReader)
    assert reader.latest_step == STEPS
    assert reader.steps[0] > 0, f"nothing was dropped: {reader.steps}"
    assert reader.steps == list(range(reader.steps[0], STEPS + 1))
    share = BUDGET_RUN["max_bytes"] // 2
    for rank in reader.ranks.values():
        assert rank.steps[0] in rank.anchors
        assert rank.state.referenced_bytes() <= share, (rank.path, rank.state.referenced_bytes(), share)
    problems = []
    for step in reader.steps:
        want = gathered(w2, "fsdp-budget", step)
        problems += [f"step {step}: {d}" for d in state_diffs(reader.materialize(step), want)]
    assert not problems, problems[:20]
    assert ldformat.validate(path).ok


@pytest.mark.procs
@pytest.mark.parametrize(("world", "name"), [("w2", "fsdp-xor"), ("w2", "fsdp-lowdiff"), ("w2", "tp-lowdiffp"),
                                             ("w2", "fsdp-budget"), ("w4", "hsdp-xor")])
def test_rank_chains_hold_segmented_snapshots(request: pytest.FixtureRequest, world: str, name: str) -> None:
    """Rank chains are 1.5 chains: with a snapshot policy, each one's newest snapshot references
    segment objects (spec §7.9), which the exactness and validation tests above then read."""
    launch: Launch = request.getfixturevalue(world)
    reader = ldformat.open_reader(launch.chain(name))
    assert isinstance(reader, ldformat.ShardedReader)
    for rank in reader.ranks.values():
        assert rank.root.format_version == ldformat.FORMAT_VERSION
        assert rank.state.segments, f"{rank.path}: no segmented snapshot"
        assert {g.object.path for g in rank.state.segments} <= set(rank.store.list("segments"))


@pytest.mark.procs
def test_every_run_completed(w1: Launch, w2: Launch, w2b: Launch, w4: Launch) -> None:
    """Every run of every launch completed (the tests of a failed run show its workers' output)."""
    failed = {f"world {launch.world} {name}": text.strip().splitlines()[-3:]
              for launch in (w1, w2, w2b, w4) for name, text in launch.failed.items()}
    seconds = {f"world {launch.world}": round(launch.seconds, 1) for launch in (w1, w2, w2b, w4)}
    assert not failed, f"failed runs (launch seconds {seconds}): {failed}"


# -- HSDP: copy ranks (spec §20.2 ``copies``, format 1.4) ---------------------------------------------
HSDP_CHAINS = ["hsdp-lowdiff", "hsdp-lowdiffp", "hsdp-xor"]


@pytest.mark.procs
@pytest.mark.parametrize("name", HSDP_CHAINS)
def test_hsdp_replicas_are_written_once(w4: Launch, name: str) -> None:
    """Ranks 2 and 3 hold ranks 0 and 1's blocks: they are copy ranks and write nothing."""
    root = json.loads((w4.chain(name) / "sharded.json").read_text())
    assert root["format_version"] == "1.4" and root["copies"] == {"2": 0, "3": 1}
    assert root["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    assert sorted(p.name for p in (w4.chain(name) / "ranks").iterdir()) == ["00000", "00001"]
    reader = ldformat.open_reader(w4.chain(name))
    assert isinstance(reader, ldformat.ShardedReader) and list(reader.ranks) == [0, 1]
    for step in (MID, STEPS):  # rank chain 0 records the copy ranks' own RNG states
        state = reader.materialize(step)
        for rank in (2, 3):
            mine = state["rank_extra"][rank]["rng"]["torch"]
            assert torch.equal(mine, w4.record(name, rank)["rng"][step]), f"rank {rank} step {step}"


@pytest.mark.procs
def test_hsdp_resume_restores_every_rank_its_own_rng(w4: Launch) -> None:
    """At the recording layout each rank, copy ranks included, gets its own RNG state back."""
    states = [w4.record("hsdp-lowdiff", rank)["rng"][STEPS] for rank in range(4)]
    assert not torch.equal(states[0], states[2]) and not torch.equal(states[1], states[3])
    for rank in range(4):
        got = w4.record("r44-hsdp", rank)
        assert got["start"] == STEPS
        assert torch.equal(got["rng"][STEPS], states[rank]), f"rank {rank}'s RNG state after resume"


@pytest.mark.procs
def test_hsdp_chain_opened_again_and_appended(w4: Launch) -> None:
    """A second HSDP job resumes the chain at its last step and appends to it with the same copies."""
    assert w4.record("hsdp-xor-more", 0)["start"] == STEPS
    reader = ldformat.open_reader(w4.chain("hsdp-xor"))
    assert reader.steps == list(range(STEPS + MORE + 1))
    problems = []
    for step in reader.steps:
        want = gathered(w4, "hsdp-xor" if step <= STEPS else "hsdp-xor-more", step)
        problems += [f"step {step}: {d}" for d in state_diffs(reader.materialize(step), want)]
    assert not problems, "\n".join(problems[:30])
    assert ldformat.validate(w4.chain("hsdp-xor"), deep=True).ok


@pytest.mark.procs
def test_hsdp_truncate_and_compact(w4: Launch, tmp_path: Path) -> None:
    chain = tmp_path / "hsdp"
    shutil.copytree(w4.chain("hsdp-lowdiffp"), chain)
    result = invoke("truncate", chain, "--after", MID, "--yes", code=None)
    assert result.exit_code == 0, result.output
    result = invoke("compact", chain, "--keep-last", 3, "--yes", code=None)
    assert result.exit_code == 0, result.output
    reader = ldformat.open_reader(chain)
    assert reader.steps[-1] == MID and len(reader.steps) == 3
    for step in reader.steps:
        assert not state_diffs(reader.materialize(step), gathered(w4, "hsdp-lowdiffp", step)), step
    invoke("validate", chain)
    assert sorted(p.name for p in (chain / "ranks").iterdir()) == ["00000", "00001"]
