"""End-to-end tests of the ``ldtools`` command line (click.testing.CliRunner).

Every command is driven on small chains built with TinyNet, one per kind (grad.dense,
grad.topk with TopK(0.1), state.xor). Read-only commands run on chains shared by the module;
commands that change a chain (compact, truncate) or tests that damage one work on a copy.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from bitwise import assert_same
from click.testing import Result
from clirun import invoke
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
from ldformat import ChainReader, ChainWriter, TopK
from ldformat.format.jsonvalue import decode

pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)

KINDS = ["grad.dense", "grad.topk", "state.xor"]
STEPS = 12
BATCH_STEPS = 4
ANCHOR_EVERY = 10
COMMANDS = ["info", "log", "materialize", "validate", "compact", "truncate"]


# -- helpers ---------------------------------------------------------------------------------
def one_line_error(result: Result) -> str:
    """The single stderr line of a failed command (and nothing on stdout)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ldtools: error: "), lines[0]
    assert result.stdout == "", result.stdout
    return lines[0]




def training_state(state: dict[str, Any]) -> dict[str, Any]:
    """What must survive compaction bit for bit (top-k residuals live only in original anchors)."""
    return {k: state[k] for k in ("model", "optimizer", "step", "extra")}


def listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content, except the writer lock (not content, spec §15)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).as_posix().startswith("lock/")}


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@dataclass
class Built:
    path: Path
    kind: str
    truth: dict[int, dict[str, Any]]  # live state after every step, as snapshot() returns it


def new_live(kind: str) -> tuple[TinyNet, torch.optim.Optimizer, Any, TopK | None]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    topk = TopK(0.1) if kind == "grad.topk" else None
    return model, opt, sched, topk


def build_chain(path: Path, kind: str) -> Built:
    model, opt, sched, topk = new_live(kind)
    truth = {0: snapshot(model, opt)}
    with ChainWriter.create(path, model, opt, kind=kind, compressor=topk, batch_steps=BATCH_STEPS,
                            anchor_every=ANCHOR_EVERY) as writer:
        for step in range(1, STEPS + 1):
            loss = train_step(model, opt, step, compress=topk.compress_ if topk else None, scheduler=sched)
            writer.record_step(step, extra={"scheduler": sched.state_dict(), "loss": loss})
            truth[step] = snapshot(model, opt)
    return Built(path, kind, truth)


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("chains")
    return {kind: build_chain(root / kind.replace(".", "_"), kind) for kind in KINDS}


@pytest.fixture(params=KINDS)
def built(request: pytest.FixtureRequest, chains: dict[str, Built]) -> Built:
    """A shared, read-only chain of each kind."""
    return chains[request.param]


@pytest.fixture(params=KINDS)
def chain_copy(request: pytest.FixtureRequest, chains: dict[str, Built], tmp_path: Path) -> Built:
    """A private copy of a chain of each kind, for commands that change it."""
    src = chains[request.param]
    dst = tmp_path / "chain"
    shutil.copytree(src.path, dst)
    return Built(dst, src.kind, src.truth)


# -- help and version -------------------------------------------------------------------------
def test_version() -> None:
    result = invoke("--version")
    assert result.output.strip() == f"ldtools, version {ldformat.__version__}"


def test_group_help_lists_every_command() -> None:
    out = invoke("--help").output
    for command in COMMANDS:
        assert command in out
    assert "Exit codes" in out
    assert invoke("-h").output == out


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_shows_an_example(command: str) -> None:
    out = invoke(command, "--help").output
    assert f"Example: ldtools {command} " in out
    assert "Usage:" in out


def test_not_a_chain_is_a_usage_error(tmp_path: Path) -> None:
    for args in (["info", tmp_path / "missing"], ["log", tmp_path], ["validate", tmp_path],
                 ["materialize", tmp_path, "-o", tmp_path / "x.pt"], ["compact", tmp_path],
                 ["truncate", tmp_path, "--after", 0, "--yes"]):
        line = one_line_error(invoke(*args, code=2))
        assert str(tmp_path) in line
    assert files_in(tmp_path) == []


# -- info and log -----------------------------------------------------------------------------
def test_info_json(built: Built) -> None:
    data = json.loads(invoke("info", built.path, "--json").stdout)
    anchor_files = list((built.path / "anchors").iterdir())
    on_disk = sum(p.stat().st_size for d in ("anchors", "deltas", "log")
                  for p in (built.path / d).rglob("*") if p.is_file())
    full = max(p.stat().st_size for p in anchor_files)
    assert data["kind"] == built.kind
    assert data["steps"] == STEPS + 1
    assert data["first_step"] == 0
    assert data["latest_step"] == STEPS
    assert data["anchors"] == [0, ANCHOR_EVERY]
    assert data["commits"] == len(list((built.path / "log").iterdir()))
    assert data["optimizer"] == "torch.optim.AdamW"
    assert data["format_version"] == ldformat.FORMAT_VERSION
    assert data["bytes_on_disk"] == on_disk
    assert data["anchor_bytes"] == sum(p.stat().st_size for p in anchor_files)
    if built.kind != "grad.topk":  # see test_info_full_checkpoint_excludes_topk_residuals
        assert data["full_checkpoint_bytes"] == full
    full = data["full_checkpoint_bytes"]
    assert data["compression_vs_full_checkpoints"] == pytest.approx((STEPS + 1) * full / on_disk)
    assert data["delta_bytes_per_step"] == pytest.approx(data["delta_bytes"] / STEPS)
    if built.kind == "grad.topk":
        assert data["compression_vs_full_checkpoints"] > 2
    assert data["environment"]["torch"] == torch.__version__


def test_info_full_checkpoint_excludes_topk_residuals(chains: dict[str, Built]) -> None:
    built = chains["grad.topk"]
    data = json.loads(invoke("info", built.path, "--json").stdout)
    state_bytes = max(
        len(safetensors.torch.save({k: v for k, v in safetensors.torch.load_file(p).items()
                                    if not k.startswith("compressor/")}))
        for p in (built.path / "anchors").iterdir()
    )
    assert data["full_checkpoint_bytes"] == pytest.approx(state_bytes, rel=0.1)  # the header may differ


def test_info_text(built: Built) -> None:
    out = invoke("info", built.path).stdout
    assert f"kind {built.kind}" in out
    assert f"steps        {STEPS + 1}  (0 .. {STEPS})" in out
    assert f"anchors      2  [0, {ANCHOR_EVERY}]" in out
    assert "torch.optim.AdamW" in out
    assert "smaller than a full checkpoint per step" in out


def test_log_json_and_text(built: Built) -> None:
    rows = json.loads(invoke("log", built.path, "--json").stdout)
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))
    assert {r["type"] for r in rows} == {"append"}
    assert [(r["anchors"], r["delta_steps"]) for r in rows] == [
        ([0], None), ([], [1, 4]), ([], [5, 8]), ([10], [9, 10]), ([], [11, 12])
    ]
    assert all(r["bytes"] > 0 for r in rows)
    text = invoke("log", built.path).stdout.splitlines()
    assert text[0].split() == ["SEQ", "TIME", "TYPE", "DELTAS", "ANCHORS", "BYTES", "REASON"]
    text = text[1:]
    assert len(text) == len(rows)
    for line, row in zip(text, rows, strict=True):
        assert line.split()[0] == str(row["seq"])
        assert row["type"] in line and row["time"] in line
    assert "deltas 1-4" in text[1] and "anchors [10]" in text[3]


# -- materialize ------------------------------------------------------------------------------
def test_materialize_pt_matches_reader(built: Built, tmp_path: Path) -> None:
    reader = ChainReader(built.path)
    out = tmp_path / "out"
    result = invoke("materialize", built.path, "-o", out / "latest.pt")
    assert result.stdout.startswith(f"wrote step {STEPS} to ")
    latest = torch.load(out / "latest.pt", weights_only=True)
    assert latest["step"] == STEPS
    assert_same(latest, reader.materialize())
    assert_state_bits_equal(latest, built.truth[STEPS], "latest")
    assert latest["extra"]["loss"] > 0 and latest["extra"]["scheduler"]["last_epoch"] == STEPS
    # A delta step and an anchor step (which carries the top-k residuals of grad.topk).
    for step in (7, ANCHOR_EVERY):
        invoke("materialize", built.path, "--step", step, "-o", out / f"step{step}.pth")
        got = torch.load(out / f"step{step}.pth", weights_only=True)
        want = reader.materialize(step)
        assert_same(got, want)
        assert_state_bits_equal(got, built.truth[step], f"step {step}")
        assert ("compressor" in got) == (built.kind == "grad.topk" and step == ANCHOR_EVERY)
    assert files_in(out) == ["latest.pt", f"step{ANCHOR_EVERY}.pth", "step7.pth"]


def test_materialize_safetensors(built: Built, tmp_path: Path) -> None:
    reader = ChainReader(built.path)
    state = reader.materialize()
    path = tmp_path / "model.safetensors"
    invoke("materialize", built.path, "-o", path)
    tensors = safetensors.torch.load_file(path)
    stored = {name: "embed.weight" if name == "head.weight" else name for name in state["model"]}
    assert sorted(tensors) == sorted(set(stored.values()))
    assert "head.weight" not in tensors and "embed.weight" in tensors  # tied weights once, as save_model
    for name, t in state["model"].items():
        assert_same(tensors[stored[name]], t, name)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"ldformat.step": str(STEPS), "head.weight": "embed.weight"}

    step = 5
    state = reader.materialize(step)
    path = tmp_path / "full.safetensors"
    invoke("materialize", built.path, "--step", step, "--with-optimizer", "-o", path)
    tensors = safetensors.torch.load_file(path)
    opt_keys = {f"optimizer.state.{i}.{k}" for i, entry in state["optimizer"]["state"].items() for k in entry}
    assert len(opt_keys) >= 3 * len(state["optimizer"]["state"]) > 0  # AdamW: step, exp_avg, exp_avg_sq
    assert set(tensors) == set(stored.values()) | opt_keys
    for i, entry in state["optimizer"]["state"].items():
        for k, t in entry.items():
            assert_same(tensors[f"optimizer.state.{i}.{k}"], t, f"optimizer {i}/{k}")
    for name, t in state["model"].items():
        assert_same(tensors[stored[name]], t, name)
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["ldformat.step"] == str(step)
    assert decode(json.loads(meta["optimizer.param_groups"])) == state["optimizer"]["param_groups"]
    assert files_in(tmp_path) == ["full.safetensors", "model.safetensors"]


def test_materialize_errors(chains: dict[str, Built], tmp_path: Path) -> None:
    chain = chains["grad.dense"].path
    out = tmp_path / "out"
    line = one_line_error(invoke("materialize", chain, "-o", out / "x.bin", code=2))
    assert "x.bin" in line and ".safetensors" in line
    one_line_error(invoke("materialize", chain, "--with-optimizer", "-o", out / "x.pt", code=2))
    line = one_line_error(invoke("materialize", chain, "--step", STEPS + 1, "-o", out / "x.pt", code=1))
    assert f"step {STEPS + 1} is not in the chain" in line
    one_line_error(invoke("materialize", chain, "--step", -1, "-o", out / "x.safetensors", code=1))
    assert files_in(out) == []  # nothing created, not even a temp file

    # A failed materialize leaves an existing output file alone.
    out.mkdir()
    (out / "keep.pt").write_bytes(b"previous")
    one_line_error(invoke("materialize", chain, "--step", 99, "-o", out / "keep.pt", "--force", code=1))
    assert (out / "keep.pt").read_bytes() == b"previous"
    assert files_in(out) == ["keep.pt"]


def test_materialize_write_is_atomic(chains: dict[str, Built], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    chain = chains["state.xor"].path
    target = tmp_path / "ckpt.pt"
    invoke("materialize", chain, "--step", 3, "-o", target)
    before = target.read_bytes()
    real_save = torch.save

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")  # half-written, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    # spec §18.1: output not written
    line = one_line_error(invoke("materialize", chain, "-o", target, "--force", code=3))
    assert "No space left on device" in line
    assert target.read_bytes() == before
    assert files_in(tmp_path) == ["ckpt.pt"]
    monkeypatch.setattr(torch, "save", real_save)
    invoke("materialize", chain, "-o", target, "--force")  # replaces the old file
    assert torch.load(target, weights_only=True)["step"] == STEPS
    assert files_in(tmp_path) == ["ckpt.pt"]


def test_materialize_output_honours_umask(chains: dict[str, Built], tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        invoke("materialize", chains["grad.dense"].path, "-o", tmp_path / "x.pt")
    finally:
        os.umask(umask)
    assert (tmp_path / "x.pt").stat().st_mode & 0o777 == 0o644


def test_materialize_is_deterministic(chains: dict[str, Built]) -> None:
    reader = ChainReader(chains["grad.dense"].path)
    for step in (ANCHOR_EVERY, STEPS):
        orders = {tuple(tuple(entry) for entry in reader.materialize(step)["optimizer"]["state"].values())
                  for _ in range(4)}
        assert len(orders) == 1, orders


# -- validate ---------------------------------------------------------------------------------
def test_validate_ok(built: Built) -> None:
    out = invoke("validate", built.path).stdout
    assert out.strip() == f"ok: {STEPS + 1} steps, 2 anchors"
    out = invoke("validate", built.path, "--deep").stdout
    assert out.strip() == f"ok: {STEPS + 1} steps, 2 anchors, replay at 1 anchor bit-exact"
    report = json.loads(invoke("validate", built.path, "--json").stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["kind"] == built.kind and report["steps"] == STEPS + 1 and report["deep"] is False
    assert report["anchors"] == [0, ANCHOR_EVERY] and report["latest_step"] == STEPS
    report = json.loads(invoke("validate", built.path, "--deep", "--json").stdout)
    assert report["ok"] is True and report["deep"] is True
    assert report["drift"] == [{"from_anchor": 0, "anchor": ANCHOR_EVERY, "max_ulps": 0, "tensor": None}]


def _damage(chain: Path) -> list[tuple[str, int]]:
    """Flip a byte in an anchor and in a delta object, delete another delta object.

    Returns (object path relative to the chain, first step it concerns) per damaged object.
    """
    anchor = next((chain / "anchors").glob(f"{ANCHOR_EVERY}-*.safetensors"))
    first_batch = next((chain / "deltas").glob("1-4-*"))
    second_batch = next((chain / "deltas").glob("5-8-*"))
    flipped = max((p for p in first_batch.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    deleted = max((p for p in second_batch.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    for p in (anchor, flipped):
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    deleted.unlink()
    return [(p.relative_to(chain).as_posix(), step) for p, step in
            ((anchor, ANCHOR_EVERY), (flipped, 1), (deleted, 5))]


def test_validate_corrupt_chain(chain_copy: Built) -> None:
    chain = chain_copy.path
    damaged = _damage(chain)
    result = invoke("validate", chain, code=1)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(damaged)  # one line per problem
    for line, (rel, step) in zip(lines, damaged, strict=True):
        assert f"{chain}/{rel}" in line and f"(step {step})" in line
    assert ("crc32c mismatch" in lines[0] and "crc32c mismatch" in lines[1] and "missing" in lines[2])
    assert result.stderr.strip() == f"invalid: {len(damaged)} problems"

    report = json.loads(invoke("validate", chain, "--deep", "--json", code=1).stdout)
    assert report["ok"] is False
    assert len(report["problems"]) == len(damaged)
    for problem, (rel, step) in zip(report["problems"], damaged, strict=True):
        assert f"{chain}/{rel}" in problem["path"]
        assert problem["step"] == step
    # A damaged object also stops a materialize that needs it, with one line naming it.
    line = one_line_error(invoke("materialize", chain, "--step", 3, "-o", chain.parent / "x.pt", code=1))
    assert damaged[1][0] in line


def test_validate_problem_names_the_object_cleanly(chains: dict[str, Built], tmp_path: Path) -> None:
    chain = tmp_path / "chain"
    shutil.copytree(chains["grad.dense"].path, chain)
    damaged = _damage(chain)
    report = json.loads(invoke("validate", chain, "--json", code=1).stdout)
    assert [(p["path"], p["step"]) for p in report["problems"]] == [(f"{chain}/{rel}", s) for rel, s in damaged]
    lines = invoke("validate", chain, code=1).stdout.strip().splitlines()
    assert all(line.count("(step ") == 1 for line in lines), lines


# -- compact ----------------------------------------------------------------------------------
def test_compact(chain_copy: Built) -> None:
    chain = chain_copy.path
    reader = ChainReader(chain)
    before = {s: training_state(reader.materialize(s)) for s in reader.steps}
    files = listing(chain)

    out = invoke("compact", chain, "--max-replay", 2, "--dry-run").stdout
    assert out.startswith(f"would keep {STEPS + 1} steps, drop 0, write ")
    plan = json.loads(invoke("compact", chain, "--max-replay", 2, "--keep-last", 3, "--dry-run",
                             "--json").stdout)
    assert plan["committed"] is False and plan["dropped_steps"]
    assert listing(chain) == files  # a dry run changes nothing on disk

    plan = json.loads(invoke("compact", chain, "--max-replay", 2, "--json").stdout)
    assert plan["committed"] is True
    assert plan["kept_steps"] == STEPS + 1 and plan["dropped_steps"] == []
    assert plan["new_anchors"] and plan["dropped_anchors"] == []
    reader = ChainReader(chain)
    assert reader.steps == sorted(before)
    for s in reader.steps:
        assert len(reader.state.replay_path(s)[1]) <= 2, s
        assert_same(training_state(reader.materialize(s)), before[s], f"step {s} after --max-replay")

    out = invoke("compact", chain, "--keep-last", 3, "--keep-every", 4, "--yes").stdout
    kept = [0, 4, 8, 10, 11, 12]
    assert out.startswith(f"did keep {len(kept)} steps, drop {STEPS + 1 - len(kept)}, ")
    reader = ChainReader(chain)
    assert reader.steps == kept
    for s in kept:
        assert_same(training_state(reader.materialize(s)), before[s], f"step {s} after retention")
    line = one_line_error(invoke("materialize", chain, "--step", 5, "-o", chain.parent / "x.pt", code=1))
    assert "step 5 is not in the chain" in line
    rows = json.loads(invoke("log", chain, "--json").stdout)
    assert rows[-1]["type"] == "snapshot" and rows[-1]["reason"] == "compact"
    assert [r["seq"] for r in rows] == list(range(rows[0]["seq"], rows[0]["seq"] + len(rows)))
    assert json.loads(invoke("info", chain, "--json").stdout)["steps"] == len(kept)
    invoke("validate", chain, "--deep")

    # Idempotent: the same compaction again changes nothing.
    files = listing(chain)
    plan = json.loads(invoke("compact", chain, "--keep-last", 3, "--keep-every", 4, "--json").stdout)
    assert plan["committed"] is False and plan["new_anchors"] == [] and plan["removed_objects"] == []
    assert listing(chain) == files


# -- truncate ---------------------------------------------------------------------------------
def test_truncate_then_append(chain_copy: Built) -> None:
    chain, kind = chain_copy.path, chain_copy.kind
    files = listing(chain)
    line = one_line_error(invoke("truncate", chain, "--after", 99, "--yes", code=1))
    assert "step 99 is not in the chain" in line
    assert listing(chain) == files

    after = 7
    out = invoke("truncate", chain, "--after", after, "--yes").stdout
    assert out.strip() == f"removed {STEPS - after} steps; the chain now ends at step {after}"
    reader = ChainReader(chain)
    assert reader.steps == list(range(after + 1))
    assert_state_bits_equal(reader.materialize(), chain_copy.truth[after], "after truncate")
    info = json.loads(invoke("info", chain, "--json").stdout)
    assert info["latest_step"] == after and info["steps"] == after + 1 and info["anchors"] == [0]
    invoke("validate", chain, "--deep")

    # Resume from the truncated chain and append step after+1.
    model, opt, sched, topk = new_live(kind)
    resumed = reader.load_into(model, opt, after, compressor=topk)
    sched.load_state_dict(resumed["extra"]["scheduler"])
    with ChainWriter.open(chain, model, opt, compressor=topk, batch_steps=BATCH_STEPS,
                          anchor_every=ANCHOR_EVERY) as writer:
        loss = train_step(model, opt, after + 1, compress=topk.compress_ if topk else None, scheduler=sched)
        writer.record_step(after + 1, extra={"scheduler": sched.state_dict(), "loss": loss})
    live = snapshot(model, opt)
    reader = ChainReader(chain)
    assert reader.steps == list(range(after + 2))
    assert_state_bits_equal(reader.materialize(), live, "appended step")
    if kind != "grad.topk":  # top-k residuals restart from zero when resuming between anchors
        assert_state_bits_equal(live, chain_copy.truth[after + 1], "resumed run reproduces the original")
    out = invoke("validate", chain).stdout
    assert out.strip() == f"ok: {after + 2} steps, 1 anchor"
