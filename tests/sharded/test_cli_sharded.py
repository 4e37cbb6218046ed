"""``ldtools`` on a sharded chain (spec §20), made by a world-2 FSDP2 job: info, log and
validate summarize it; materialize writes .pt and .safetensors files bit-identical to
``open_reader(path).materialize(step)`` at every committed step, and ``--format dcp`` a
directory that DCP loads on other meshes (a plain model without a process group, FSDP2 at
world 1); compact and truncate change every rank chain alike, and refuse one rank chain on
its own; sync replicates it whole, and a job mirrors it.

The chain is made once per session (the ``fsdp_chain`` fixture of tests/conftest.py, ~3 s); the DCP directory is
loaded in a fresh process, as a job of another world size would load it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bitwise import assert_same
from click.testing import Result
from clirun import invoke
from make_sharded import FSDP_STEPS, FSDP_WORLD, TIMEOUT_S, finish, run_maker
from ports import gloo_env

import ldformat
from ldformat.export.dcp import dcp_state_dict, export_dcp
from ldformat.format.jsonvalue import decode
from ldformat.sharded.chain import read_commits

WORLD = FSDP_WORLD
STEPS = FSDP_STEPS

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


# -- helpers ---------------------------------------------------------------------------------------
def error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldtools: error: "), result.stderr
    return lines[0]


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``{"model", "optimizer"}`` of a materialized state with the optimizer keyed by FQN, as
    ``get_optimizer_state_dict`` / ``get_state_dict`` lay it out."""
    return dcp_state_dict(state, names)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "lock" not in p.parts}


# -- the chain -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reader(fsdp_chain: Path) -> ldformat.ShardedReader:
    opened = ldformat.open_reader(fsdp_chain)
    assert isinstance(opened, ldformat.ShardedReader)
    assert opened.steps == list(range(STEPS + 1)), opened.steps
    return opened


@pytest.fixture(scope="module")
def names(reader: ldformat.ShardedReader) -> list[str]:
    return list(reader.ranks[0].root.schema["optimizer"]["params"])


# -- info, log, validate ---------------------------------------------------------------------------
def test_info_text(fsdp_chain: Path, reader: ldformat.ShardedReader) -> None:
    out = invoke("info", fsdp_chain).stdout
    assert f"(sharded, format 1.3, kind {reader.kind})" in out
    assert f"ranks        {WORLD}, mesh [{WORLD}]" in out
    assert f"steps        {STEPS + 1} committed (0 .. {STEPS})" in out
    assert f"anchors      {len(reader.anchors)}  [{', '.join(map(str, reader.anchors))}]" in out
    assert "(rank 0: " in out and ", rank 1: " in out
    assert "full state   " in out and f"at step {STEPS}" in out
    rank = invoke("info", fsdp_chain / "ranks" / "00001").stdout
    assert f"the sharded chain {fsdp_chain}, as rank 1" in rank


def test_info_json(fsdp_chain: Path, reader: ldformat.ShardedReader) -> None:
    data = json.loads(invoke("info", fsdp_chain, "--json").stdout)
    assert (data["format_version"], data["kind"], data["world_size"]) == ("1.3", reader.kind, WORLD)
    assert data["mesh"] == {"shape": [WORLD], "dim_names": None}
    assert (data["steps"], data["first_step"], data["latest_step"]) == (STEPS + 1, 0, STEPS)
    assert data["anchors"] == reader.anchors and data["pending_steps"] == []
    assert data["commits"] == len(list((fsdp_chain / "commits").glob("*.json"))) == len(read_commits(reader.store, "x"))
    assert data["bytes_per_rank"] == [r.bytes_on_disk() for r in reader.ranks.values()]
    assert data["bytes_on_disk"] == sum(data["bytes_per_rank"]) == reader.bytes_on_disk()
    # The full-state size, measured from rank 0's chain and the layout, is that of the assembled state.
    full = reader.materialize(STEPS)
    model = sum(t.numel() * t.element_size() for t in full["model"].values())
    optimizer = sum(t.numel() * t.element_size() for s in full["optimizer"]["state"].values()
                    for t in s.values() if isinstance(t, torch.Tensor))
    assert data["full_checkpoint"] == {"step": STEPS, "bytes": model + optimizer, "model_bytes": model,
                                       "optimizer_bytes": optimizer, "error": None}
    assert data["full_checkpoint_bytes"] == model + optimizer
    assert data["compression_vs_full_checkpoints"] == pytest.approx((STEPS + 1) * (model + optimizer)
                                                                    / data["bytes_on_disk"])


def test_info_of_a_layout_the_ranks_do_not_match(fsdp_chain: Path, tmp_path: Path) -> None:
    """A layout (re-checksummed) that claims a bigger tensor than the ranks store: info still
    summarizes the chain, and says why it cannot size the full state instead of trusting it."""
    import dataclasses
    import shutil

    from ldformat.chain.sharded_probe import SHARDED_ROOT
    from ldformat.sharded.chain import ShardedRoot
    from ldformat.sharded.layout import Layout, Shard

    copy = tmp_path / "chain"
    shutil.copytree(fsdp_chain, copy)
    root = ShardedRoot.from_bytes((copy / SHARDED_ROOT).read_bytes(), "root")
    big = Layout("float32", (1 << 30, 16), (Shard(0, (0, 0), (1 << 29, 16)), Shard(1, (1 << 29, 0), (1 << 29, 16))))
    crafted = dataclasses.replace(root, tensors={**root.tensors, "model/a.weight": big})
    (copy / SHARDED_ROOT).write_bytes(crafted.to_bytes())
    data = json.loads(invoke("info", copy, "--json").stdout)
    assert data["full_checkpoint_bytes"] is None and data["compression_vs_full_checkpoints"] is None
    assert "model/a.weight: rank 0 stores shape [49, 16], the layout" in data["full_checkpoint"]["error"]
    assert "full state   unknown: measuring step" in invoke("info", copy).stdout
    assert invoke("validate", copy, code=1).stderr.strip().startswith("invalid:")


def test_log(fsdp_chain: Path, reader: ldformat.ShardedReader) -> None:
    records = read_commits(reader.store, str(fsdp_chain))
    lines = invoke("log", fsdp_chain).stdout.splitlines()
    assert lines[0].split() == ["SEQ", "TIME", "STEP", "WRITER"]
    assert [line.split()[:3] for line in lines[1:]] == [[str(c.seq), c.time, str(c.step)] for c in records]
    rows = json.loads(invoke("log", fsdp_chain, "--json").stdout)
    assert rows == [{"seq": c.seq, "time": c.time, "step": c.step, "writer": c.writer} for c in records]
    assert rows[-1]["step"] == STEPS
    # --rank R: that rank's own chain, as `ldtools log PATH/ranks/R` shows it.
    assert invoke("log", fsdp_chain, "--rank", 1).stdout == invoke("log", fsdp_chain / "ranks" / "00001").stdout
    assert "ranks 0..1" in error_line(invoke("log", fsdp_chain, "--rank", WORLD, code=2))
    rank0 = fsdp_chain / "ranks" / "00000"
    assert "applies to a sharded chain" in error_line(invoke("log", rank0, "--rank", 0, code=2))


def test_validate(fsdp_chain: Path, reader: ldformat.ShardedReader) -> None:
    out = invoke("validate", fsdp_chain).stdout
    assert out.strip() == (f"ok: sharded chain of {WORLD} ranks, {STEPS + 1} committed steps, "
                           f"{len(reader.anchors)} anchors, the ranks' copies agree at {len(reader.anchors)} anchors")
    deep = invoke("validate", fsdp_chain, "--deep").stdout
    assert f"the ranks' copies agree at {STEPS + 1} committed steps, replay bit-exact at " in deep
    report = json.loads(invoke("validate", fsdp_chain, "--json").stdout)
    assert report["ok"] and report["steps"] == STEPS + 1


# -- materialize -----------------------------------------------------------------------------------
def test_materialize_pt_every_step(fsdp_chain: Path, reader: ldformat.ShardedReader, tmp_path: Path) -> None:
    for step in reader.steps:
        out = tmp_path / f"s{step}.pt"
        assert f"wrote step {step} to {out}" in invoke("materialize", fsdp_chain, "--step", step, "-o", out).stdout
        got = torch.load(out, weights_only=True)
        want = reader.materialize(step)
        assert set(got) == {"model", "optimizer", "step", "extra", "rank_extra"}
        assert_same(got, want, f"step {step}")
        assert len(got["rank_extra"]) == WORLD
    latest = tmp_path / "latest.bin"  # no --step: the latest; --format pt whatever the suffix
    invoke("materialize", fsdp_chain, "--format", "pt", "-o", latest)
    assert_same(torch.load(latest, weights_only=True), reader.materialize(STEPS))


def test_materialize_safetensors_every_step(fsdp_chain: Path, reader: ldformat.ShardedReader, names: list[str],
                                             tmp_path: Path) -> None:
    from safetensors import safe_open

    for step in reader.steps:
        want = reader.materialize(step)
        plain = tmp_path / f"s{step}.safetensors"
        invoke("materialize", fsdp_chain, "--step", step, "-o", plain)
        with safe_open(str(plain), "pt") as f:
            assert_same({k: f.get_tensor(k) for k in f.keys()}, want["model"], f"step {step}")  # noqa: SIM118
            assert f.metadata() == {"ldformat.step": str(step)}
        full = tmp_path / f"o{step}.safetensors"
        invoke("materialize", fsdp_chain, "--step", step, "--with-optimizer", "-o", full)
        with safe_open(str(full), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
        expected = dict(want["model"])
        for i, state in want["optimizer"]["state"].items():
            expected.update({f"optimizer.state.{i}.{k}": v for k, v in state.items()})
        assert_same(tensors, expected, f"step {step} with optimizer")
        assert decode(json.loads(metadata["optimizer.param_groups"])) == want["optimizer"]["param_groups"]
    assert "--with-optimizer applies to .safetensors" in error_line(
        invoke("materialize", fsdp_chain, "--with-optimizer", "-o", tmp_path / "x.pt", code=2))


def test_materialize_errors_name_the_step(fsdp_chain: Path, tmp_path: Path) -> None:
    line = error_line(invoke("materialize", fsdp_chain, "--step", STEPS + 5, "-o", tmp_path / "x.pt", code=1))
    assert f"step {STEPS + 5} is not a committed step of the sharded chain" in line
    line = error_line(invoke("materialize", fsdp_chain, "--step", STEPS + 5, "--format", "dcp", "-o", tmp_path / "d",
                             code=1))
    assert f"step {STEPS + 5}" in line and not (tmp_path / "d").exists()
    assert not (tmp_path / "x.pt").exists() and not list(tmp_path.iterdir())


def test_materialize_a_rank_chain_says_it_holds_one_rank(fsdp_chain: Path, tmp_path: Path) -> None:
    result = invoke("materialize", fsdp_chain / "ranks" / "00001", "--step", 2, "-o", tmp_path / "r1.pt")
    assert "rank 1's chain of the sharded chain" in result.stderr and "local shards only" in result.stderr


# -- DCP -------------------------------------------------------------------------------------------
@pytest.mark.procs
def test_dcp_export_loads_on_other_meshes(fsdp_chain: Path, reader: ldformat.ShardedReader, names: list[str],
                                          tmp_path: Path) -> None:
    """The DCP directory holds the materialized state, every hyperparameter included, and loads
    with DCP's own tools, bit for bit, into a plain model (no process group) and into FSDP2 at
    world 1: meshes other than the world-2 one that wrote the chain."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = 5  # between anchors, with a learning rate the schedule changed
    assert step not in reader.anchors
    want = reader.materialize(step)
    out = tmp_path / "dcp"
    out.mkdir()  # an empty directory is fine
    assert f"wrote step {step} to {out}/" in invoke("materialize", fsdp_chain, "--step", step, "--format", "dcp",
                                                    "-o", out).stdout
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    # Everything in it: dcp_to_torch_save reads a checkpoint without a state dict to load into.
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    assert_same(torch.load(tmp_path / "whole.pt", weights_only=False), by_name(want, names), "dcp")
    groups = want["optimizer"]["param_groups"]
    # The state of a step is captured at its optimizer step, before that step's scheduler.step().
    assert [g["lr"] for g in groups] == [pytest.approx(0.01 / step)] * 2 and "initial_lr" in groups[0]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    finish([run_maker(["load", str(out), str(tmp_path / "loaded.pt")], env)])
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    expected = by_name(want, names)
    assert_same(loaded["plain"], expected, "plain model, no process group")
    assert_same(loaded["fsdp"], expected, "FSDP2 at world 1")
    assert_same(loaded["plain_torch"], want["optimizer"], "optimizer.state_dict() of the plain model")

    again = invoke("materialize", fsdp_chain, "--step", step, "--format", "dcp", "-o", out, code=2)
    assert "exists and is not an empty directory" in error_line(again)
    file_out = tmp_path / "file"
    file_out.write_text("keep")
    invoke("materialize", fsdp_chain, "--format", "dcp", "-o", file_out, code=2)
    assert file_out.read_text() == "keep"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_dcp_write_failure_is_an_output_error(fsdp_chain: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An OS error while DCP writes (here: its data file's name is taken by a directory) is exit 3,
    naming the output; nothing is left behind."""
    import tempfile

    real = tempfile.mkdtemp

    def mkdtemp(*args: Any, **kwargs: Any) -> str:
        made = real(*args, **kwargs)
        os.mkdir(os.path.join(made, "__0_0.distcp"))
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    out = tmp_path / "sub" / "dcp"
    line = error_line(invoke("materialize", fsdp_chain, "--format", "dcp", "-o", out, code=3))
    assert str(out) in line and "cannot write the DCP checkpoint" in line and "EISDIR" in line
    assert list((tmp_path / "sub").iterdir()) == []


class TaggedSGD(torch.optim.SGD):
    """SGD whose per-parameter state also holds values that are not tensors. (No string:
    ``Optimizer.load_state_dict`` itself turns one into the text of a generator, torch 2.x.)"""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = int(state.get("count", 0)) + 1
                state["pair"], state["nothing"], state["ratio"], state["on"] = (1, 2.5), None, 0.5, True
        return loss


def test_dcp_export_of_an_ordinary_chain_with_non_tensor_state(tmp_path: Path) -> None:
    """ldformat.export.dcp.export_dcp on an ordinary chain: non-tensor optimizer state and extra
    param-group keys round-trip through DCP into a fresh model and optimizer."""
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
        groups: list[dict[str, Any]] = [{"params": list(model[0].parameters()), "note": "first"},
                                        {"params": list(model[1].parameters()), "lr": 0.02, "note": "second"}]
        return model, TaggedSGD(groups, lr=0.05, momentum=0.9)

    model, opt = build()
    with ldformat.ChainWriter.create(tmp_path / "chain", model, opt, kind="state.xor") as writer:
        for step in range(1, 4):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            writer.record_step(step)
    assert export_dcp(tmp_path / "chain", None, tmp_path / "dcp") == 3
    fresh, fresh_opt = build()
    sd: dict[str, Any] = {"model": get_model_state_dict(fresh),
                          "optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optimizer"])
    assert_same(fresh.state_dict(), model.state_dict(), "model")
    assert_same(fresh_opt.state_dict(), opt.state_dict(), "optimizer")
    assert fresh_opt.state_dict()["state"][0]["pair"] == (1, 2.5)
    with pytest.raises(ldformat.UsageError, match="not an empty directory"):
        export_dcp(tmp_path / "chain", None, tmp_path / "dcp")


# -- the flight recorder: stats, diff, plot ------------------------------------------------------
def _sq(t: torch.Tensor) -> float:
    # The formula of ldformat.export.history; every tensor of the chain is below torch's parallel
    # grain, so the sum is one thread's, as history computes it, whatever the thread count.
    return float(torch.linalg.vector_norm(t)) ** 2


def _groups(state: dict[str, Any], before: dict[str, Any] | None, names: list[str]) -> dict[str, list[float]]:
    """Per module (depth 1): numel, |w|^2, |w - w_before|^2 and exp_avg_sq's sum of a full state."""
    out: dict[str, list[float]] = {}
    for i, n in enumerate(names):
        w = state["model"][n]
        a = out.setdefault(n.split(".")[0], [0, 0.0, 0.0, 0.0])
        a[0] += w.numel()
        a[1] += _sq(w)
        if before is not None:
            a[2] += _sq(torch.sub(w, before["model"][n]))
        v = state["optimizer"]["state"].get(i, {}).get("exp_avg_sq")
        a[3] += float(v.sum()) if v is not None else 0.0
    return out


def test_stats_measures_the_full_tensors(fsdp_chain: Path, reader: ldformat.ShardedReader, names: list[str]) -> None:
    """``ldtools stats`` on the sharded chain: the rank chains replay side by side and every step's
    numbers are those of the full state materialize gives (groups by FQN, full sizes)."""
    data = json.loads(invoke("stats", fsdp_chain, "--json").stdout)
    assert [s["step"] for s in data["steps"]] == reader.steps
    before = None
    for s in data["steps"]:
        state = reader.materialize(s["step"])
        want = _groups(state, before, names)
        assert [g["name"] for g in s["groups"]] == list(want) == ["a", "b", "norm"]  # in optimizer order
        for g in s["groups"]:
            numel, w2, d2, v_sum = want[g["name"]]
            assert (g["numel"], g["weight_norm"]) == (numel, math.sqrt(w2)), (s["step"], g["name"])
            assert g["update_norm"] == (math.sqrt(d2) if before is not None else None), (s["step"], g["name"])
            assert g["v_mean"] == (v_sum / numel if s["step"] else None), (s["step"], g["name"])
        # LambdaLR 1 / (1 + s): step k used 1e-2 / k in both groups (step 0: the anchor's groups, step 1's)
        assert s["lrs"] == [1e-2 * (1.0 / max(1, s["step"]))] * 2, s["step"]
        assert s["anchor"] == (s["step"] % 3 == 0) and s["bytes"] > 0
        before = state
    assert want["a"][0] == 97 * 16 + 97  # the full a.weight and a.bias, not one rank's rows
    text = invoke("stats", fsdp_chain, "--from", 4, "--groups").stdout
    assert text.splitlines()[1].startswith("4 ") and "  norm " in text and "no step flagged" in text
    out = fsdp_chain.parent / "history.html"
    assert "8 steps" in invoke("plot", fsdp_chain, "-o", out, "--force").stdout
    assert out.read_text().count('class="cell"') == 3 * STEPS  # steps x modules; step 0 has no update


def test_diff_compares_the_full_tensors(fsdp_chain: Path, reader: ldformat.ShardedReader) -> None:
    data = json.loads(invoke("diff", fsdp_chain, 3, 4, "--json").stdout)
    got = {t["name"]: t for t in data["tensors"]}
    a, b = reader.materialize(3), reader.materialize(4)
    assert {n for n in got if n.startswith("model/")} == {f"model/{n}" for n in a["model"]}
    for n in a["model"]:
        t, want_a, want_b = got[f"model/{n}"], a["model"][n], b["model"][n]
        assert t["shape"] == list(want_a.shape), n  # full shapes: a.weight is [97, 16]
        if t["status"] == "changed":
            d = want_a.double() - want_b.double()
            assert t["max_abs"] == float(d.abs().max()), n
            assert t["changed_fraction"] == float((want_a != want_b).double().mean()), n
        else:
            assert t["status"] == "same" and torch.equal(want_a, want_b), n
    assert got["model/a.weight"]["shape"] == [97, 16] and got["model/a.weight"]["status"] == "changed"
    assert got["optimizer/0/exp_avg_sq"]["status"] == "changed"
    same = json.loads(invoke("diff", fsdp_chain, 5, 5, "--other", fsdp_chain, "--json").stdout)
    assert {t["status"] for t in same["tensors"]} == {"same"}


# -- commands that change a chain ------------------------------------------------------------------
def every_state(reader: ldformat.ShardedReader) -> dict[int, dict[str, Any]]:
    return {s: reader.materialize(s) for s in reader.steps}


def rank_steps(chain: Path) -> list[list[int]]:
    return [ldformat.ChainReader(chain / "ranks" / f"{r:05d}").steps for r in range(WORLD)]


@pytest.fixture
def chain_copy(fsdp_chain: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "chain"
    shutil.copytree(fsdp_chain, copy)
    return copy


def test_compact_keeps_the_same_steps_in_every_rank_chain(chain_copy: Path) -> None:
    before = every_state(ldformat.ShardedReader(chain_copy))
    files = digest(chain_copy)
    dry = json.loads(invoke("compact", chain_copy, "--keep-last", 2, "--keep-every", 3, "--max-replay", 1,
                            "--dry-run", "--json").stdout)
    assert digest(chain_copy) == files, "a dry run changed the chain"
    plan = json.loads(invoke("compact", chain_copy, "--keep-last", 2, "--keep-every", 3, "--max-replay", 1,
                             "--json", "--yes").stdout)
    kept = [s for s in range(STEPS + 1) if s >= STEPS - 1 or s % 3 == 0]
    assert plan["committed"] and plan["kept_steps"] == dry["kept_steps"] == len(kept)
    assert plan["dropped_steps"] == dry["dropped_steps"] == [s for s in range(STEPS + 1) if s not in kept]
    assert len(plan["ranks"]) == WORLD and plan["new_anchors"] == dry["new_anchors"]
    assert all(o.startswith("ranks/0000") for o in plan["removed_objects"])
    reader = ldformat.ShardedReader(chain_copy)
    assert reader.steps == kept and rank_steps(chain_copy) == [kept] * WORLD
    for s in kept:
        assert_same(reader.materialize(s), before[s], f"step {s} after compaction")
    invoke("validate", chain_copy, "--deep")
    files = digest(chain_copy)  # idempotent
    again = json.loads(invoke("compact", chain_copy, "--keep-last", 2, "--keep-every", 3, "--max-replay", 1,
                              "--json").stdout)
    assert not again["committed"] and again["removed_objects"] == [] and digest(chain_copy) == files


def test_stats_of_a_compacted_chain_reports_removed_steps_absent(chain_copy: Path, names: list[str]) -> None:
    before = every_state(ldformat.ShardedReader(chain_copy))
    ldformat.compact(chain_copy, keep_last=2, keep_every=3, max_replay=1)
    kept = ldformat.ShardedReader(chain_copy).steps
    assert kept == [0, 3, 6, 7]
    steps = json.loads(invoke("stats", chain_copy, "--json").stdout)["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS + 1))
    for s in steps:
        assert s["present"] == (s["step"] in kept), s["step"]
        if not s["present"]:
            assert s["groups"] == [] and s["update_norm"] is None and s["bytes"] == 0
    at6 = steps[6]
    assert at6["since"] == 3  # its update spans the removed steps 4 and 5
    want = _groups(before[6], before[3], names)
    assert at6["update_norm"] == math.sqrt(sum(a[2] for a in want.values()))
    assert "absent (compacted)" in invoke("stats", chain_copy).stdout


def test_compact_drops_pending_steps(chain_copy: Path) -> None:
    """Steps above the newest commit record's (rank 0 died before committing them) are pending:
    compaction drops them from every rank chain, and keeps every committed step."""
    records = sorted((chain_copy / "commits").glob("*.json"))
    newest = read_commits(ldformat.ShardedReader(chain_copy).store, str(chain_copy))
    keep = next(c for c in reversed(newest) if c.step < STEPS)
    for r in records[keep.seq:]:
        r.unlink()
    before = every_state(ldformat.ShardedReader(chain_copy))
    assert sorted(before) == list(range(keep.step + 1))
    plan = ldformat.compact(chain_copy)
    assert plan.committed and plan.kept_steps == sorted(before)
    assert rank_steps(chain_copy) == [sorted(before)] * WORLD
    for s, want in before.items():
        assert_same(ldformat.ShardedReader(chain_copy).materialize(s), want, f"step {s}")
    assert ldformat.validate(chain_copy).ok


def test_truncate(chain_copy: Path) -> None:
    reader = ldformat.ShardedReader(chain_copy)
    before = every_state(reader)
    seq = reader.commit.seq if reader.commit else 0
    line = error_line(invoke("truncate", chain_copy, "--after", STEPS + 5, "--yes", code=1))
    assert f"step {STEPS + 5} is not in the chain" in line
    out = invoke("truncate", chain_copy, "--after", 4, "--yes").stdout
    assert "removed 3 steps" in out and "ends at step 4" in out
    reader = ldformat.ShardedReader(chain_copy)
    assert reader.commit is not None and (reader.commit.seq, reader.commit.step) == (seq + 1, 4)
    assert reader.steps == [0, 1, 2, 3, 4] and rank_steps(chain_copy) == [[0, 1, 2, 3, 4]] * WORLD
    for s in reader.steps:
        assert_same(reader.materialize(s), before[s], f"step {s} after truncation")
    invoke("validate", chain_copy)
    files = digest(chain_copy)
    assert ldformat.truncate(chain_copy, 4) == [] and digest(chain_copy) == files  # nothing to do, no record


def test_truncate_interrupted_after_the_record(chain_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after the commit record and one rank chain's truncation leaves the other rank
    chain's later steps pending: the chain is valid at the truncated step, and the next
    truncation finishes the work."""
    from ldformat.sharded import maintenance as sharded_maintenance

    before = every_state(ldformat.ShardedReader(chain_copy))
    real = sharded_maintenance.truncate_locked
    calls: list[str] = []

    def crash_on_the_second(reader: ldformat.ChainReader, lock: Any, after: int) -> list[int]:
        calls.append(reader.path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(reader, lock, after)

    monkeypatch.setattr(sharded_maintenance, "truncate_locked", crash_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        ldformat.truncate(chain_copy, 3)
    monkeypatch.undo()
    reader = ldformat.ShardedReader(chain_copy)
    assert reader.steps == [0, 1, 2, 3] and rank_steps(chain_copy)[1] == list(range(STEPS + 1))
    for s in reader.steps:
        assert_same(reader.materialize(s), before[s], f"step {s}")
    assert ldformat.validate(chain_copy).ok
    assert ldformat.truncate(chain_copy, 3) == []
    assert rank_steps(chain_copy) == [[0, 1, 2, 3]] * WORLD


@pytest.mark.procs
def test_a_live_writer_on_one_rank_refuses_maintenance(chain_copy: Path) -> None:
    """A live holder of one rank chain's lock (this process): compact and truncate exit 4 with one
    line naming that rank chain, change nothing, and leave no lock of theirs behind."""
    from ldformat.chain.lock import WriterLock

    files = digest(chain_copy)
    rank1 = ldformat.ChainReader(chain_copy / "ranks" / "00001")
    held = WriterLock.acquire(rank1.store, rank1.path)
    try:
        for args in (("compact", chain_copy, "--keep-last", 2, "--yes"),
                     ("truncate", chain_copy, "--after", 2, "--yes")):
            proc = subprocess.run([sys.executable, "-m", "ldtools", *map(str, args)], capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
            assert proc.returncode == 4, (args, proc.stderr)
            assert "ranks/00001" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    finally:
        held.release()
    assert digest(chain_copy) == files
    assert ldformat.truncate(chain_copy, STEPS - 1) == [STEPS]  # rank 0's lock was released


@pytest.mark.procs
def test_a_job_opens_the_chain_only_holding_every_rank_lock(chain_copy: Path) -> None:
    """Opening a sharded chain to append (spec §20.3.3): every rank takes its rank chain's lock
    before rank 0 fences the commit records. With rank 1's lock held by a live writer (this
    process), the job fails on every rank, creates no commit record, and rank 0's lock,
    taken meanwhile, is released again."""
    from ldformat.chain.lock import WriterLock, current_lock

    files = digest(chain_copy)
    rank1 = ldformat.ChainReader(chain_copy / "ranks" / "00001")
    held = WriterLock.acquire(rank1.store, rank1.path)
    try:
        env = gloo_env()
        procs = [run_maker(["make", str(r), str(WORLD), str(chain_copy.parent), "2"], env) for r in range(WORLD)]
        try:
            outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:  # never leave a rank behind, whatever happened
                if p.poll() is None:
                    p.kill()
                    p.wait()
    finally:
        held.release()
    for out, p in zip(outputs, procs, strict=True):
        assert p.returncode != 0 and "ChainLockedError" in out and "ranks/00001" in out, out
    assert digest(chain_copy) == files  # no commit record, no rank chain changed
    rank0 = ldformat.ChainReader(chain_copy / "ranks" / "00000")
    assert current_lock(rank0.store, rank0.path) is None


@pytest.mark.procs
def test_a_job_mirrors_the_sharded_chain(tmp_path: Path) -> None:
    """``Checkpointer(..., mirror=)`` with a sharded model: rank 0 replicates the whole sharded
    chain after its commits; at close the mirror holds every committed step, bit for bit."""
    env = gloo_env()
    mirror = tmp_path / "mirror"
    finish([run_maker(["make", str(r), str(WORLD), str(tmp_path), "5", str(mirror)], env) for r in range(WORLD)])
    src = ldformat.ShardedReader(tmp_path / "chain")
    copy = ldformat.open_reader(mirror)
    assert isinstance(copy, ldformat.ShardedReader)
    assert copy.steps == src.steps == list(range(6))
    for s in src.steps:
        assert_same(copy.materialize(s), src.materialize(s), f"mirror step {s}")
    assert ldformat.validate(mirror).ok
    out = invoke("info", tmp_path / "chain", "--mirror", mirror).stdout
    assert f"mirror       {mirror}: up to date (step 5)" in out, out
    lag = json.loads(invoke("info", tmp_path / "chain", "--mirror", mirror, "--json").stdout)["mirror"]
    assert lag["lag_steps"] == 0 and lag["lag_records"] == 0


def test_one_rank_chain_on_its_own_is_refused(fsdp_chain: Path, tmp_path: Path) -> None:
    before = digest(fsdp_chain)
    rank0 = fsdp_chain / "ranks" / "00000"
    for args in (("compact", rank0, "--keep-last", 2), ("compact", rank0, "--max-replay", 1, "--dry-run"),
                 ("truncate", rank0, "--after", 2, "--yes")):
        line = error_line(invoke(*args, code=2))
        assert str(rank0) in line and "one rank's chain of a sharded chain" in line, (args, line)
    with pytest.raises(ldformat.UsageError):  # the API refuses alike
        ldformat.compact(rank0, keep_last=2)
    with pytest.raises(ldformat.UsageError):
        ldformat.truncate(rank0, 2)
    invoke("sync", fsdp_chain, tmp_path / "copy")  # the whole sharded chain is replicated (test_sync_sharded.py)
    assert digest(tmp_path / "copy") == digest(fsdp_chain)
    line = error_line(invoke("sync", fsdp_chain / "ranks" / "00001", rank0, code=2))
    assert "one rank's chain of a sharded chain" in line
    invoke("sync", rank0, tmp_path / "rank0-copy")  # copying one rank's chain out only reads it
    assert digest(fsdp_chain) == before
