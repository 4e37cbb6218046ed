"""Data-parallel ``lowdiff``: top-k DDP comm hook, rank-0 Checkpointer, ResidualPeer (spec §14.1).

Two CPU processes (gloo) train a DDP-wrapped :class:`models.TinyNet` on different data. Each
rank compresses its gradient with its own :class:`ldformat.TopK` inside
:func:`ldformat.topk_comm_hook`; rank 0 records a ``grad.topk`` chain with a
:class:`ldformat.Checkpointer` that only reads the compressor's indices, rank 1 hands its
residuals to every anchor (docs/capture-runtime.md "Data-parallel `lowdiff`"). Two ways, each
a run: ``peer``, rank 1 runs a :class:`ldformat.ResidualPeer`; ``every``, every rank
constructs the same ``Checkpointer`` (rank 1's becomes the peer).

The workers save what they saw after every step; the checks run in the pytest process.
Run as a script (``python test_ddp.py RANK WORLD OUTDIR``) this file is one worker.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, bits, snapshot
from ports import gloo_env

import ldformat

WORLD = 2
STEPS = 10
ANCHOR_EVERY = 4
BATCH_STEPS = 2
RATIO = 0.25
TIMEOUT_S = 120  # whole run; gloo collectives time out well before

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.procs,
]


# -- worker ------------------------------------------------------------------------------------
def _worker(rank: int, world: int, outdir: Path, style: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)  # same initial weights (DDP broadcasts rank 0's anyway)
        model = TinyNet()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        # TinyNet.unused never receives a gradient: DDP needs find_unused_parameters.
        ddp = DDP(model, find_unused_parameters=True)
        topk = ldformat.TopK(RATIO)
        state = ldformat.TopKCommState(topk, model)
        ddp.register_comm_hook(state, ldformat.topk_comm_hook)  # DDP checks the hook's annotations
        direct = True
        side: Any
        if rank == 0 or style == "every":
            side = ldformat.Checkpointer(outdir / "chain", model, opt, mode="lowdiff", compressor=topk,
                                         compress=False, anchor_every=ANCHOR_EVERY, batch_steps=BATCH_STEPS)
        else:
            side = ldformat.ResidualPeer(opt, topk, anchor_every=ANCHOR_EVERY, model=model)
        records: dict[int, Any] = {0: {"state": snapshot(model, opt), "residuals": {}}}
        for step in range(1, STEPS + 1):
            ddp.train()
            x, y = batch(100 * (rank + 1) + step)  # every rank its own data
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            records[step] = {
                "state": snapshot(model, opt),
                "residuals": {n: r.clone() for n, r in topk.residuals.items()},
            }
        side.close()
        torch.save({"direct_hook": direct, "steps": records}, outdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# -- launching -----------------------------------------------------------------------------------
def _launch(outdir: Path, style: str) -> tuple[list[int | None], list[str]]:
    """Run the workers; as soon as one fails (or the time is up) kill the others."""
    env = gloo_env()
    logs = [outdir / f"rank{rank}.log" for rank in range(WORLD)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as out:  # a file, not a pipe: a chatty worker can never block on it
                procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(WORLD), str(outdir), style],
                                              env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # never leave a worker behind, whatever happened
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    return [p.returncode for p in procs], outputs


@pytest.fixture(scope="module", params=["peer", "every"])
def ddp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = ""
    for _attempt in range(3):
        outdir = tmp_path_factory.mktemp("ddp")
        codes, outputs = _launch(outdir, request.param)
        if codes == [0] * WORLD:
            return outdir
        text = "\n".join(f"--- rank {r} (exit {codes[r]}) ---\n{out}" for r, out in enumerate(outputs))
        if os.strerror(errno.EADDRINUSE).lower() not in text.lower() and "EADDRINUSE" not in text:
            break  # a real failure, not a lost race for the free port: do not retry
    pytest.fail(f"DDP workers failed (exit codes, then their output):\n{text}")


@pytest.fixture(scope="module")
def saved(ddp_run: Path) -> list[dict[str, Any]]:
    return [torch.load(ddp_run / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def records(saved: list[dict[str, Any]]) -> list[dict[int, Any]]:
    """Per rank: step -> {"state": live state after the step, "residuals": its top-k residuals}."""
    return [s["steps"] for s in saved]


# -- helpers -------------------------------------------------------------------------------------
def _params_and_optimizer(state: dict[str, Any], model_keys: set[str]) -> dict[str, Any]:
    """The state without buffers: DDP broadcasts rank 0's buffers *before* each forward, so
    after a step rank 1's BatchNorm statistics hold its own batch and legitimately differ."""
    return {"model": {k: v for k, v in state["model"].items() if k in model_keys},
            "optimizer": state["optimizer"]}


def _param_keys() -> set[str]:
    m = TinyNet()
    return {k for k in m.state_dict() if k in dict(m.named_parameters(remove_duplicate=False))}


def _assert_residuals_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, f"{where} {n}"
        assert torch.equal(bits(got[n]), bits(t)), f"{where} residual {n} differs in bits"


# -- tests ---------------------------------------------------------------------------------------
def test_topk_comm_hook_registers_directly(saved: list[dict[str, Any]]) -> None:
    assert all(s["direct_hook"] for s in saved)


def test_ranks_stay_bitwise_identical(records: list[dict[int, Any]]) -> None:
    keys = _param_keys()
    r0, r1 = records
    assert sorted(r0) == sorted(r1) == list(range(STEPS + 1))
    for step in r0:
        assert_state_bits_equal(_params_and_optimizer(r1[step]["state"], keys),
                                _params_and_optimizer(r0[step]["state"], keys), f"rank 1 vs 0 at step {step}")
    # The model trained at all, and the ranks' residuals are their own (different data).
    assert not torch.equal(r0[STEPS]["state"]["model"]["hidden.weight"], r0[0]["state"]["model"]["hidden.weight"])
    assert any(not torch.equal(r0[STEPS]["residuals"][n], r1[STEPS]["residuals"][n]) for n in r0[STEPS]["residuals"])


def test_chain_materializes_every_step_bit_exact(ddp_run: Path, records: list[dict[int, Any]]) -> None:
    keys = _param_keys()
    path = ddp_run / "chain"
    report = ldformat.validate(path)
    assert report.ok, report.problems
    reader = ldformat.ChainReader(path)
    assert reader.kind == "grad.topk"
    assert reader.steps == list(range(STEPS + 1))
    assert reader.anchors == list(range(0, STEPS + 1, ANCHOR_EVERY))
    for step in reader.steps:
        got = reader.materialize(step)
        assert got["step"] == step
        assert_state_bits_equal(got, records[0][step]["state"], f"chain vs rank 0 at step {step}")
        assert_state_bits_equal(_params_and_optimizer(got, keys),
                                _params_and_optimizer(records[1][step]["state"], keys),
                                f"chain vs rank 1 at step {step}")


def test_anchors_hold_every_ranks_residuals(ddp_run: Path, records: list[dict[int, Any]]) -> None:
    reader = ldformat.ChainReader(ddp_run / "chain")
    later = [a for a in reader.anchors if a > 0]
    assert later, "the run should have anchors after step 0"
    for a in later:
        got = reader.materialize(a)
        _assert_residuals_equal(got["compressor"], records[0][a]["residuals"], f"anchor {a} rank 0")
        assert sorted(got["compressor_ranks"]) == list(range(WORLD))
        _assert_residuals_equal(got["compressor_ranks"][0], records[0][a]["residuals"], f"anchor {a} ranks[0]")
        _assert_residuals_equal(got["compressor_ranks"][1], records[1][a]["residuals"], f"anchor {a} rank 1")
    # Delta steps carry no residuals.
    assert "compressor" not in reader.materialize(later[0] - 1)


def test_resume_exact_restores_rank1_residuals(ddp_run: Path, records: list[dict[int, Any]]) -> None:
    keys = _param_keys()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:  # resume() restores the chain's (rank 0's) RNG states into this process
        for rank in range(WORLD):
            model = TinyNet()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            topk = ldformat.TopK(RATIO)
            step = ldformat.resume(ddp_run / "chain", model, opt, compressor=topk, exact=True, rank=rank)
            last_anchor = STEPS - STEPS % ANCHOR_EVERY
            assert step == last_anchor
            _assert_residuals_equal(topk.residuals, records[rank][step]["residuals"], f"resumed rank {rank}")
            assert_state_bits_equal(_params_and_optimizer(snapshot(model, opt), keys),
                                    _params_and_optimizer(records[rank][step]["state"], keys),
                                    f"resumed rank {rank}")
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


def test_a_refusal_on_rank_0_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Every rank constructs the Checkpointer; rank 0's refuses the chain (it holds another
    kind): rank 1's, waiting to learn rank 0's start step, fails at once with rank 0's
    reason instead of waiting for a collective that never comes."""
    torch.manual_seed(0)
    model = TinyNet()
    ldformat.ChainWriter.create(tmp_path / "chain", model, torch.optim.Adam(model.parameters()),
                                kind="state.xor").close()
    started = time.monotonic()
    codes, outputs = _launch(tmp_path, "every")
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert codes[0] != 0 and "grad.topk" in outputs[0] and "state.xor" in outputs[0], outputs[0]
    assert codes[1] != 0 and "rank 0's Checkpointer failed" in outputs[1] and "state.xor" in outputs[1], outputs[1]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
