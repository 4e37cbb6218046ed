"""``ldtools`` behaviours users see: progress bars, sizes in ``info``, ``validate --strict``, the
``log`` header, ``compact --dry-run`` counts, broken pipes, output file modes and tied weights.

Chains are small TinyNet chains (an embedding tied to the output head) built in the module:
one just created (step 0 only), one with a single anchor and five steps, and one with anchors
at 0 and 10 over 12 steps. Commands run in-process (CliRunner) unless the operating system is
part of the behaviour (a terminal, a closed pipe), which needs a real process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from clirun import child_env, invoke, ldtools_cmd
from models import TinyNet, bits, train_step

from ldformat import ChainReader, ChainWriter, TopK
from ldtools.progress import PROGRESS_ENV, ProgressBar, progress_wanted

pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)

KINDS = ["grad.dense", "grad.topk", "state.xor"]
LOG_HEADER = ["SEQ", "TIME", "TYPE", "DELTAS", "ANCHORS", "BYTES", "REASON"]


# -- helpers ---------------------------------------------------------------------------------
def build(path: Path, kind: str = "grad.dense", steps: int = 5, anchor_every: int = 100,
          batch_steps: int = 4) -> Path:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    topk = TopK(0.1) if kind == "grad.topk" else None
    with ChainWriter.create(path, model, opt, kind=kind, compressor=topk, batch_steps=batch_steps,
                            anchor_every=anchor_every) as writer:
        for step in range(1, steps + 1):
            train_step(model, opt, step, compress=topk.compress_ if topk else None)
            writer.record_step(step)
    return path


def files(chain: Path) -> dict[str, int]:
    """Every file of a chain but the writer lock (spec section 15), with its size."""
    return {p.relative_to(chain).as_posix(): p.stat().st_size for p in sorted(chain.rglob("*"))
            if p.is_file() and not p.relative_to(chain).as_posix().startswith("lock/")}


def unique_tensor_bytes(state: dict[str, Any]) -> tuple[int, int]:
    """Bytes of the model tensors (each storage once: tied weights count once) and of the optimizer state."""
    seen: set[int] = set()
    model = 0
    for t in state["model"].values():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            model += t.numel() * t.element_size()
    optimizer = sum(t.numel() * t.element_size() for entry in state["optimizer"]["state"].values()
                    for t in entry.values() if isinstance(t, torch.Tensor))
    return model, optimizer


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.delenv("LDTOOLS_DEBUG", raising=False)
    yield


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chains")
    out = {"fresh": build(root / "fresh", steps=0), "two_anchors": build(root / "two", steps=12, anchor_every=10)}
    for kind in KINDS:
        out[f"one_anchor/{kind}"] = build(root / f"one_{kind}", kind)
    return out


@pytest.fixture
def one_anchor(chains: dict[str, Path]) -> Path:
    return chains["one_anchor/grad.dense"]


@pytest.fixture
def two_anchors(chains: dict[str, Path]) -> Path:
    return chains["two_anchors"]


def copy(chain: Path, tmp_path: Path, name: str = "chain") -> Path:
    return Path(shutil.copytree(chain, tmp_path / name))


# -- 1. progress bars -------------------------------------------------------------------------
def progress_commands(chains: dict[str, Path], tmp_path: Path) -> dict[str, list[Any]]:
    """One invocation per command with a bar; each on its own copy, as compact changes the chain."""
    return {
        "materialize": ["materialize", chains["two_anchors"], "--step", 7, "-o", tmp_path / "out.pt"],
        "validate --deep": ["validate", chains["two_anchors"], "--deep"],
        "compact": ["compact", copy(chains["two_anchors"], tmp_path, "compacted"), "--max-replay", 2],
        "sync": ["sync", chains["two_anchors"], tmp_path / "replica"],
    }


BAR_LABELS = {"materialize": "replaying to step 7", "validate --deep": "replaying to anchors",
              "compact": "writing anchors", "sync": "copying"}


@pytest.mark.parametrize("command", list(BAR_LABELS))
def test_forced_progress_bar_goes_to_stderr_only(chains: dict[str, Path], tmp_path: Path, command: str) -> None:
    args = progress_commands(chains, tmp_path)[command]
    result = invoke(*args, "--progress")
    label = BAR_LABELS[command]
    assert f"\r{label} [" in result.stderr and "100%" in result.stderr, result.stderr
    assert result.stderr.endswith("\n"), result.stderr  # the bar's line is ended before anything else
    assert "\r" not in result.stdout and "[#" not in result.stdout and "%" not in result.stdout, result.stdout
    assert result.stdout.count("\n") == 1  # the command's one line of output, nothing else


@pytest.mark.parametrize("command", list(BAR_LABELS))
def test_no_progress_bar_when_stderr_is_not_a_terminal(chains: dict[str, Path], tmp_path: Path,
                                                       command: str) -> None:
    args = progress_commands(chains, tmp_path)[command]
    result = invoke(*args)  # CliRunner's stderr is not a terminal: the default draws nothing
    assert result.stderr == "", result.stderr
    assert result.stdout.count("\n") == 1


def test_progress_environment_variable_and_flag(two_anchors: Path, tmp_path: Path) -> None:
    args = ["validate", two_anchors, "--deep"]
    assert "checking objects [" in invoke(*args, env={PROGRESS_ENV: "1"}).stderr
    assert invoke(*args, "--no-progress", env={PROGRESS_ENV: "1"}).stderr == ""  # the flag wins
    assert invoke(*args, env={PROGRESS_ENV: "0"}).stderr == ""
    assert invoke(*args, env={PROGRESS_ENV: "whatever"}).stderr == ""  # not a yes or no: auto, no error
    for command in ("materialize", "validate", "compact", "sync"):
        assert "--progress / --no-progress" in invoke(command, "--help").stdout


@pytest.mark.procs
def test_piped_process_prints_no_bar(two_anchors: Path, tmp_path: Path) -> None:
    """A real process with stdout and stderr pipes: no bar; the file's mode is the umask's (item 7 too)."""
    proc = subprocess.run(ldtools_cmd("materialize", two_anchors, "--step", 7, "-o", tmp_path / "x.safetensors"),
                          capture_output=True, timeout=300, env=child_env(), preexec_fn=lambda: os.umask(0o027))
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""
    assert proc.stdout.decode().startswith("wrote step 7 to ")
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o640


@pytest.mark.procs
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_bar_on_a_terminal_by_default(two_anchors: Path, tmp_path: Path) -> None:
    """stderr a terminal, stdout a pipe: the bar is drawn on the terminal, stdout stays clean."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(ldtools_cmd("materialize", two_anchors, "--step", 7, "-o", tmp_path / "x.pt"),
                                stdout=subprocess.PIPE, stderr=slave, env=child_env())
    finally:
        os.close(slave)
    terminal = b""
    while True:  # read until the child's end of the terminal is closed (EIO on Linux)
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        terminal += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, terminal.decode(errors="replace")
    assert b"replaying to step 7 [" in terminal and b"100%" in terminal, terminal
    assert out.decode().startswith("wrote step 7 to ") and b"\r" not in out


@pytest.mark.procs
def test_bar_never_fails_the_command(two_anchors: Path, tmp_path: Path) -> None:
    """A forced bar on a stderr whose reader has gone: the command still succeeds."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(ldtools_cmd("materialize", two_anchors, "--step", 7, "-o", tmp_path / "x.pt",
                                          "--progress"),
                              stdout=subprocess.PIPE, stderr=write_end, timeout=300, env=child_env())
    finally:
        os.close(write_end)
    assert proc.returncode == 0
    assert torch.load(tmp_path / "x.pt", weights_only=True)["step"] == 7


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_bar_lines() -> None:
    stream, clock = io.StringIO(), Clock()
    bar = ProgressBar({"objects": "checking", "bytes": "copying"}, enabled=True, byte_stages=("bytes",),
                      stream=stream, clock=clock)
    bar("objects", 1, 4)
    clock.now = 0.01
    bar("objects", 2, 4)  # too soon after the last redraw: skipped
    clock.now = 2.0
    bar("objects", 2, 4)
    bar("objects", 4, 4)  # the end of a stage is always drawn
    bar("bytes", 1536, 3 * 1024 * 1024)  # a new stage: a new line
    bar.close()
    lines = stream.getvalue().split("\n")
    assert lines[0] == ("\rchecking [######------------------]  25%  1/4"
                        "\rchecking [############------------]  50%  2/4  0:02 left"
                        "\rchecking [########################] 100%  4/4  0:02" + " " * 5)  # wipes " left"
    assert lines[1] == "\rcopying [------------------------]   0%  1.5 KiB/3.0 MiB"
    assert lines[2] == ""  # closed: the last line is ended
    bar.close()  # twice is harmless
    assert stream.getvalue().count("\n") == 2


def test_progress_bar_off_and_broken() -> None:
    stream = io.StringIO()
    ProgressBar({"": "x"}, enabled=False, stream=stream)(1, 2)
    assert stream.getvalue() == ""

    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    bar = ProgressBar({"": "x"}, enabled=True, stream=Broken())
    bar(1, 2)  # no exception: the bar turns itself off
    assert bar.enabled is False
    bar.close()

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_wanted(None, Terminal()) and not progress_wanted(None, io.StringIO())
    assert not progress_wanted(False, Terminal()) and progress_wanted(True, io.StringIO())


# -- 2. info: the size of a full checkpoint ----------------------------------------------------
@pytest.mark.parametrize("name", ["fresh", "two_anchors", *(f"one_anchor/{k}" for k in KINDS)])
def test_info_sizes_are_those_of_the_state_and_the_disk(chains: dict[str, Path], tmp_path: Path, name: str) -> None:
    chain = copy(chains[name], tmp_path)
    data = json.loads(invoke("info", chain, "--json").stdout)
    reader = ChainReader(chain)
    latest = reader.latest_step
    assert latest is not None
    # The tensors of the latest step's state, as materialize gives it (tied weights once).
    model_bytes, optimizer_bytes = unique_tensor_bytes(reader.materialize(latest))
    full = data["full_checkpoint"]
    assert full["step"] == latest and full["error"] is None
    assert (full["model_bytes"], full["optimizer_bytes"]) == (model_bytes, optimizer_bytes)
    if name != "fresh":
        assert optimizer_bytes > 0  # AdamW has stepped: the anchor at creation had no optimizer state
    # The bytes on disk: the chain's objects and log, and the anchor of that step once written.
    on_disk = files(chain)
    assert data["bytes_on_disk"] == sum(size for path, size in on_disk.items() if path.split("/")[0] in
                                        ("anchors", "deltas", "log"))
    if latest not in reader.anchors:
        invoke("compact", chain, "--max-replay", 0)  # writes an anchor of every step from a replay
    stored = (chain / ChainReader(chain).state.anchors[latest].object.path).stat().st_size
    assert data["full_checkpoint_bytes"] == stored
    assert data["compression_vs_full_checkpoints"] == pytest.approx(data["steps"] * stored / data["bytes_on_disk"])


def test_info_text_of_a_new_chain(chains: dict[str, Path], one_anchor: Path) -> None:
    out = invoke("info", chains["fresh"]).stdout
    assert "full state   " in out and "at step 0" in out
    assert "smaller than a full checkpoint" not in out  # one step: nothing is saved yet
    assert "compression  none yet" in out
    out = invoke("info", one_anchor).stdout
    full = json.loads(invoke("info", one_anchor, "--json").stdout)["full_checkpoint"]
    model, optimizer = full["model_bytes"] / 1024, full["optimizer_bytes"] / 1024
    assert f"at step 5 (model {model:.1f} KiB, optimizer {optimizer:.1f} KiB)" in out, out
    assert "smaller than a full checkpoint per step" in out


def test_info_still_summarizes_a_chain_it_cannot_replay(one_anchor: Path, tmp_path: Path) -> None:
    chain = copy(one_anchor, tmp_path)
    batch = next((chain / "deltas").glob("5-5-*"))
    biggest = max((p for p in batch.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.unlink()
    data = json.loads(invoke("info", chain, "--json").stdout)
    assert data["full_checkpoint_bytes"] is None and "missing" in data["full_checkpoint"]["error"]
    out = invoke("info", chain).stdout
    assert "full state   unknown" in out and "ldtools validate" in out


# -- 3. validate --deep counts what it compared; --strict ---------------------------------------
def test_validate_deep_says_how_many_anchors_it_compared(two_anchors: Path, one_anchor: Path) -> None:
    report = json.loads(invoke("validate", two_anchors, "--deep", "--json").stdout)
    assert report["anchors_compared"] == 1 and report["ok"] is True and report["strict"] is False
    assert invoke("validate", two_anchors, "--deep").stdout.strip().endswith("replay at 1 anchor bit-exact")
    assert json.loads(invoke("validate", two_anchors, "--json").stdout)["anchors_compared"] is None  # no --deep

    report = json.loads(invoke("validate", one_anchor, "--deep", "--json").stdout)
    assert report["anchors_compared"] == 0 and report["ok"] is True
    out = invoke("validate", one_anchor, "--deep").stdout
    assert out.startswith("ok: 6 steps, 1 anchor; --deep compared no anchor") and "--strict" in out


def test_validate_strict_fails_when_deep_compared_nothing(two_anchors: Path, one_anchor: Path,
                                                          chains: dict[str, Path]) -> None:
    for chain in (one_anchor, chains["fresh"]):
        result = invoke("validate", chain, "--strict", code=1)  # the code of an invalid chain (spec 18.1)
        assert result.stdout.startswith(f"{chain}: --strict: the deep check compared no anchor"), result.stdout
        assert result.stderr.strip() == "invalid: 1 problem"
        report = json.loads(invoke("validate", chain, "--strict", "--json", code=1).stdout)
        assert report["ok"] is False and report["deep"] is True and report["strict"] is True
        assert report["anchors_compared"] == 0
        assert [p["message"].split(":")[0] for p in report["problems"]] == ["--strict"]
    assert invoke("validate", two_anchors, "--strict").stdout.startswith("ok: 13 steps, 2 anchors, replay at 1")
    help_text = " ".join(invoke("validate", "--help").stdout.split())
    assert "--strict" in help_text and "exit 1" in help_text and "Implies --deep" in help_text


# -- 4. log has a header row --------------------------------------------------------------------
def test_log_table_has_a_header(two_anchors: Path) -> None:
    rows = json.loads(invoke("log", two_anchors, "--json").stdout)
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows)  # --json: records only
    lines = invoke("log", two_anchors).stdout.splitlines()
    assert lines[0].split() == LOG_HEADER
    assert len(lines) == len(rows) + 1
    time_at, reason_at = lines[0].index("TIME"), lines[0].index("REASON")
    for line, row in zip(lines[1:], rows, strict=True):
        assert line.split()[0] == str(row["seq"])
        assert line.index(row["time"]) == time_at  # the columns line up under the header
        assert line[reason_at:] == row["reason"]


# -- 5. compact --dry-run reports what the real run then does ------------------------------------
@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
@pytest.mark.parametrize("args", [["--max-replay", "2"], ["--keep-last", "3", "--keep-every", "4"],
                                  ["--max-replay", "1", "--keep-last", "3"], []],
                         ids=["max-replay", "retention", "both", "garbage-only"])
def test_compact_dry_run_matches_the_real_run(tmp_path: Path, kind: str, args: list[str]) -> None:
    chain = build(tmp_path / "chain", kind, steps=12, anchor_every=10)
    (chain / "anchors" / "99-0badf00d.safetensors").write_bytes(b"left over by a crashed writer")
    twin = copy(chain, tmp_path, "twin")  # for the text of the real run
    before = files(chain)
    dry = json.loads(invoke("compact", chain, *args, "--dry-run", "--json").stdout)
    dry_text = invoke("compact", chain, *args, "--dry-run").stdout
    assert files(chain) == before  # a dry run changes nothing
    real = json.loads(invoke("compact", chain, *args, "--json", "--yes").stdout)
    after = files(chain)
    assert dry.pop("committed") is False
    real.pop("committed")
    assert dry == real
    assert sorted(set(before) - set(after)) == sorted(real["removed_objects"])  # what was really removed
    assert "anchors/99-0badf00d.safetensors" in dry["removed_objects"]
    if args:  # the snapshot record supersedes every earlier one
        assert {f"log/{n:012d}.json" for n in range(1, 6)} <= set(dry["removed_objects"])
    # The text says the same numbers.
    assert invoke("compact", twin, *args, "--yes").stdout.replace("did ", "would ") == dry_text


# -- 6. a closed stdout pipe: quiet, exit 141 (spec 18.1) ----------------------------------------
@pytest.mark.procs
def test_stdout_closed_early_is_quiet_141(two_anchors: Path, tmp_path: Path) -> None:
    """No traceback, no error line, no exit 1: the code of a process killed by SIGPIPE."""
    commands = [["log", two_anchors], ["materialize", two_anchors, "--step", 7, "-o", tmp_path / "x.pt", "--progress"]]
    for args in commands:
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone before ldtools writes
        try:
            proc = subprocess.run(ldtools_cmd(*args), stdout=write_end, stderr=subprocess.PIPE, timeout=300,
                                  env=child_env())
        finally:
            os.close(write_end)
        err = proc.stderr.decode()
        assert proc.returncode == 141, (args, proc.returncode, err)
        if "--progress" in args:  # the bar, and nothing after it
            assert err.startswith("\rreplaying to step 7 [") and err.endswith("\n") and err.count("\n") == 1, err
        else:
            assert err == "", (args, err)


@pytest.mark.procs
@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
def test_pipe_into_head_c1(two_anchors: Path) -> None:
    """``ldtools info --json CHAIN | head -c1``: one byte out, nothing on stderr, exit 0 or 141."""
    proc = subprocess.Popen(ldtools_cmd("info", two_anchors, "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env())
    head = subprocess.run(["head", "-c1"], stdin=proc.stdout, capture_output=True, timeout=300)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert head.stdout == b"{"
    assert proc.returncode in (0, 141), (proc.returncode, err.decode())
    assert err == b""


# -- 7. output files get the mode the umask gives -----------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077])
@pytest.mark.parametrize("name,extra", [("x.pt", []), ("x.pth", []), ("x.safetensors", []),
                                        ("x.safetensors", ["--with-optimizer"])])
def test_output_mode_follows_the_umask(one_anchor: Path, tmp_path: Path, umask: int, name: str,
                                       extra: list[str]) -> None:
    target = tmp_path / name
    target.write_bytes(b"an older file")
    target.chmod(0o600 if umask == 0o022 else 0o644)  # replaced, not kept
    old = os.umask(umask)
    try:
        invoke("materialize", one_anchor, "-o", target, "--force", *extra)
        invoke("materialize", one_anchor, "-o", tmp_path / "new" / name, *extra)
    finally:
        os.umask(old)
    for path in (target, tmp_path / "new" / name):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, (path, oct(path.stat().st_mode))


# -- 8. tied weights in .safetensors, all keys in .pt ----------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_safetensors_stores_tied_weights_once_for_load_model(chains: dict[str, Path], tmp_path: Path,
                                                             kind: str) -> None:
    chain = chains[f"one_anchor/{kind}"]
    state = ChainReader(chain).materialize()
    out = tmp_path / "model.safetensors"
    invoke("materialize", chain, "-o", out)

    fresh = TinyNet(vocab=32, width=16)
    assert fresh.head.weight is fresh.embed.weight
    missing, unexpected = safetensors.torch.load_model(fresh, out)  # strict: raises on a key it cannot place
    assert (list(missing), list(unexpected)) == ([], [])
    assert fresh.head.weight is fresh.embed.weight  # still tied
    loaded = fresh.state_dict()
    assert list(loaded) == list(state["model"])
    for name, t in state["model"].items():
        got = loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(bits(got), bits(t)), f"{name} differs in bits"

    # The same file safetensors.torch.save_model writes for that model: names and metadata.
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_model(fresh, str(reference))
    assert sorted(safetensors.torch.load_file(out)) == sorted(safetensors.torch.load_file(reference))
    assert "head.weight" not in safetensors.torch.load_file(out)
    with safetensors.safe_open(out, "pt") as f, safetensors.safe_open(reference, "pt") as g:
        assert f.metadata() == {**g.metadata(), "ldformat.step": "5"}

    # With the optimizer: the tied weight still once, every optimizer tensor there.
    full = tmp_path / "full.safetensors"
    invoke("materialize", chain, "--with-optimizer", "-o", full)
    names = set(safetensors.torch.load_file(full))
    assert "head.weight" not in names and "embed.weight" in names
    assert {n for n in names if n.startswith("optimizer.state.")} == {
        f"optimizer.state.{i}.{k}" for i, entry in state["optimizer"]["state"].items() for k in entry}


def test_pt_keeps_every_key(one_anchor: Path, tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    invoke("materialize", one_anchor, "-o", out)
    model = torch.load(out, weights_only=True)["model"]
    fresh = TinyNet()
    assert list(model) == list(fresh.state_dict())  # tied names both there, as model.state_dict() gives
    fresh.load_state_dict(model)  # strict
    assert torch.equal(bits(model["head.weight"]), bits(model["embed.weight"]))
