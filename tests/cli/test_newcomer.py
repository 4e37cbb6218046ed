"""What a newcomer trips over in ``ldtools``: commands that delete, outputs, paths, messages.

Each test pins one defect of the "first hour" review: it failed before the fix. Commands run
in-process through click's CliRunner, whose standard input is not a terminal (as in
``printf 'n\\n' | ldtools truncate ...``); the terminal case patches
:func:`ldtools.consent.stdin_is_terminal`. One 12-step ``grad.dense`` chain is built per
module and copied for each test that changes it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from clirun import invoke
from models import GRAD_CHAIN_ANCHOR_EVERY, GRAD_CHAIN_STEPS, TinyNet, build_grad_chain, train_step
from paths import REPO

import ldformat
import ldtools.consent
from ldformat import ChainReader, ChainWriter, LockLostError
from ldtools.cli import cli

pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)

STEPS = GRAD_CHAIN_STEPS
ANCHOR_EVERY = GRAD_CHAIN_ANCHOR_EVERY
GOLDEN_SHARDED = REPO / "tests" / "golden" / "1.3" / "sharded.state.xor" / "chain"


# -- helpers ---------------------------------------------------------------------------------
def build_chain(path: Path, steps: int = STEPS) -> Path:
    return Path(build_grad_chain(path, steps, ANCHOR_EVERY))


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("LDTOOLS_DEBUG", "LDTOOLS_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    yield


def flat(text: str) -> str:
    """``text`` with its line wrapping undone (help text wraps to the terminal's width)."""
    return " ".join(text.split())


def ok(*args: Any, input: str | None = None) -> str:
    return invoke(*args, input=input).stdout


def fails(code: int, *args: Any, input: str | None = None, env: dict[str, str | None] | None = None) -> str:
    """``ldtools args`` exits ``code`` with exactly one line on stderr; returns that line."""
    result = invoke(*args, input=input, env=env, code=code)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ldtools: error: "), lines[0]
    return lines[0]


def listing(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content (the writer lock included: nothing may change)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard input is a terminal: the commands that delete ask."""
    monkeypatch.setattr(ldtools.consent, "stdin_is_terminal", lambda: True)


# -- 2.1 commands that delete ask, or refuse when they cannot ask -----------------------------
def test_truncate_without_yes_and_without_a_terminal_refuses(chain: Path) -> None:
    before = listing(chain)
    line = fails(2, "truncate", chain, "--after", 8, input="n\n")  # printf 'n\n' | ldtools truncate ...
    assert "would remove 4 steps (9..12)" in line and "--yes" in line and "nothing was changed" in line
    assert listing(chain) == before
    assert "removed 4 steps" in ok("truncate", chain, "--after", 8, "--yes")
    assert ChainReader(chain).latest_step == 8


def test_truncate_asks_on_a_terminal(chain: Path, terminal: None) -> None:
    before = listing(chain)
    declined = invoke("truncate", chain, "--after", 11, input="n\n", code=None)
    assert declined.exit_code == 130 and "remove 1 step (12)?" in declined.stdout, declined.output
    assert listing(chain) == before
    out = ok("truncate", chain, "--after", 11, input="y\n")
    assert "removed 1 step;" in out and ChainReader(chain).latest_step == 11


def test_truncate_with_nothing_after_needs_no_consent(chain: Path) -> None:
    assert "removed 0 steps" in ok("truncate", chain, "--after", STEPS)


def test_compact_with_retention_refuses_without_yes(chain: Path) -> None:
    before = listing(chain)
    line = fails(2, "compact", chain, "--keep-last", 3)
    assert "compact would remove 10 steps (0..9)" in line and "--yes" in line and "nothing was changed" in line
    assert listing(chain) == before
    assert "would keep 3 steps" in ok("compact", chain, "--keep-last", 3, "--dry-run")  # a dry run never asks
    assert listing(chain) == before
    assert "did keep 3 steps, drop 10" in ok("compact", chain, "--keep-last", 3, "--yes")
    assert ChainReader(chain).steps == [10, 11, 12]


def test_compact_that_removes_no_step_does_not_ask(chain: Path) -> None:
    out = ok("compact", chain, "--max-replay", 1)
    assert out.startswith(f"did keep {STEPS + 1} steps, drop 0, ")
    assert ok("compact", chain, "--keep-last", STEPS + 1).startswith(f"did keep {STEPS + 1} steps, drop 0, ")
    assert ChainReader(chain).steps == list(range(STEPS + 1))


def test_compact_asks_on_a_terminal_with_the_count(chain: Path, terminal: None) -> None:
    before = listing(chain)
    declined = invoke("compact", chain, "--keep-last", 3, input="n\n", code=None)
    assert declined.exit_code == 130 and f"remove 10 steps (0..9) of {chain}?" in declined.stdout, declined.output
    assert listing(chain) == before
    ok("compact", chain, "--keep-last", 3, input="y\n")
    assert ChainReader(chain).steps == [10, 11, 12]


def test_the_rule_is_in_the_help() -> None:
    top = flat(ok("--help"))
    assert "Commands that delete ask first" in top and "exit 2" in top
    for command in ("truncate", "compact"):
        text = flat(ok(command, "--help"))
        assert "--yes" in text and "not a terminal" in text and "--break-lock" in text, command


# -- 2.3 an http:// endpoint without AWS_ALLOW_HTTP -------------------------------------------
def test_plain_http_endpoint_without_allow_http_says_what_to_set() -> None:
    pytest.importorskip("obstore", reason="the s3 extra is not installed")
    from ports import free_port

    env: dict[str, str | None] = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ALLOW_HTTP": None, "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1", "AWS_PROFILE": None, "AWS_ENDPOINT": None,
    }
    line = fails(1, "info", "s3://bucket/chain", env=env)
    assert "builder error" not in line
    assert "plain http://" in line and "AWS_ALLOW_HTTP=true" in line and "https://" in line


# -- 2.4 one Azure URL form -------------------------------------------------------------------
AZ_FORM = re.compile(r"az://[\w.<>-]+")


def test_one_azure_url_form_everywhere() -> None:
    from ldformat.stores import parse_location

    assert parse_location("az://container/runs/chain").target == "container/runs/chain"
    assert "az://container/prefix" in ok("--help")
    texts = {"ldtools --help": ok("--help"), "README.md": (REPO / "README.md").read_text(encoding="utf-8")}
    for folder in ("docs", "ldformat", "ldtools", "examples"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".md", ".py") and path.is_file():
                texts[str(path.relative_to(REPO))] = path.read_text(encoding="utf-8")
    wrong = [f"{where}: {m.group(0)}" for where, text in texts.items() for m in re.finditer(r"az://account/", text)]
    assert not wrong, wrong
    assert "az://container/" in texts["README.md"]


# -- 2.5 a mirror ahead of its chain ----------------------------------------------------------
def test_info_says_when_the_mirror_is_ahead(tmp_path: Path) -> None:
    original = build_chain(tmp_path / "original", steps=8)
    behind = Path(shutil.copytree(original, tmp_path / "behind"))  # this chain stays at step 8
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ChainReader(original).load_into(model, opt)
    with ChainWriter.open(original, model, opt, batch_steps=1) as w:
        for step in (9, 10):
            train_step(model, opt, step)
            w.record_step(step)
    mirror = "memory://newcomer-mirror-ahead"
    ldformat.sync(original, mirror)
    out = ok("info", behind, "--mirror", mirror)
    assert "up to date" not in out
    line = next(x for x in out.splitlines() if x.startswith("mirror"))
    assert "ahead of this chain" in line and "at step 10" in line and "this chain at step 8" in line, line
    lag = json.loads(ok("info", behind, "--mirror", mirror, "--json"))["mirror"]
    assert lag["ahead_records"] >= 1 and lag["lag_records"] == 0 and lag["mirror_latest_step"] == 10
    assert "up to date (step 10)" in ok("info", original, "--mirror", mirror)


# -- 2.6 outputs: replaced only with --force --------------------------------------------------
@pytest.mark.parametrize("name", ["state.pt", "state.safetensors"])
def test_materialize_does_not_overwrite_without_force(chain: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    out.write_bytes(b"previous")
    line = fails(2, "materialize", chain, "-o", out)
    assert str(out) in line and "exists" in line and "--force" in line
    assert out.read_bytes() == b"previous"
    assert f"wrote step {STEPS} to {out}" in ok("materialize", chain, "-o", out, "--force")
    assert out.read_bytes() != b"previous"


def test_materialize_dcp_directory_needs_force_too(chain: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = fails(2, "materialize", chain, "--format", "dcp", "-o", out)
    assert "exists" in line and "--force" in line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    ok("materialize", chain, "--format", "dcp", "-o", out, "--force")
    assert ".metadata" in {p.name for p in out.iterdir()} and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain", "dcp"]  # no temporary left beside it


def test_materialize_creates_missing_folders_as_documented(chain: Path, tmp_path: Path) -> None:
    assert "missing parent folders of -o are created" in flat(ok("materialize", "--help"))
    out = tmp_path / "new" / "dir" / "x.pt"
    ok("materialize", chain, "-o", out)
    assert out.is_file()


# -- 2.7 one message for a missing path -------------------------------------------------------
def test_a_missing_chain_has_one_message(tmp_path: Path) -> None:
    nope = tmp_path / "nope"
    lines = [fails(2, "info", nope), fails(2, "sync", nope, tmp_path / "x"), fails(2, "validate", nope)]
    assert lines == [f"ldtools: error: {nope}: no such directory"] * 3
    assert not (tmp_path / "x").exists()


# -- 2.8 the lock: advice the command line can follow, and --break-lock -----------------------
@pytest.fixture
def held(chain: Path) -> Iterator[ChainWriter]:
    """A live writer of ``chain`` in this process."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    writer = ChainWriter.open(chain, model, opt)
    yield writer
    try:
        writer.close()
    except LockLostError:
        pass  # its lock was broken: it may no longer commit


def test_lock_error_advises_break_lock(chain: Path, grad_chain_pristine: Path, held: ChainWriter) -> None:
    for args in (["compact", chain, "--max-replay", 2], ["truncate", chain, "--after", 5, "--yes"],
                 ["sync", grad_chain_pristine, chain]):
        line = fails(4, *args)
        assert "locked by a running writer" in line and "rerun with --break-lock" in line, line
        assert "lock_wait" not in line, line


def test_break_lock_needs_consent(chain: Path, held: ChainWriter) -> None:
    before = {k: v for k, v in listing(chain).items() if not k.startswith("lock/")}
    line = fails(2, "truncate", chain, "--after", 5, "--break-lock")
    assert "--break-lock" in line and "--yes" in line and "nothing was changed" in line
    line = fails(2, "compact", chain, "--max-replay", 2, "--break-lock")
    assert "--break-lock" in line and "--yes" in line
    line = fails(2, "sync", chain, chain, "--break-lock")
    assert "--break-lock" in line and "--yes" in line
    assert {k: v for k, v in listing(chain).items() if not k.startswith("lock/")} == before
    assert "removed 7 steps" in ok("truncate", chain, "--after", 5, "--yes", "--break-lock")
    assert ChainReader(chain).latest_step == 5


def test_break_lock_asks_on_a_terminal(chain: Path, held: ChainWriter, terminal: None) -> None:
    declined = invoke("compact", chain, "--max-replay", 2, "--break-lock", input="n\n", code=None)
    assert declined.exit_code == 130, declined.output
    assert "locked by a running writer" in declined.stdout and "Break the lock?" in declined.stdout
    ok("compact", chain, "--max-replay", 2, "--break-lock", input="y\n")


# -- 2.10 ChainReader on a sharded chain ------------------------------------------------------
def test_chain_reader_on_a_sharded_chain_names_open_reader() -> None:
    with pytest.raises(ldformat.NotAChainError, match=r"sharded chain.*ldformat\.open_reader"):
        ChainReader(GOLDEN_SHARDED)
    assert isinstance(ldformat.open_reader(GOLDEN_SHARDED), ldformat.ShardedReader)
    from ldformat.chain.reader import SHARDED_ROOT_FILE
    from ldformat.chain.sharded_probe import SHARDED_ROOT

    assert SHARDED_ROOT_FILE == SHARDED_ROOT


# -- 2.11 help text and wording ---------------------------------------------------------------
def test_help_examples_stay_on_their_lines() -> None:
    info = ok("info", "--help")
    assert "\n  Example: ldtools info runs/chain --json\n  Example: ldtools info runs/chain --mirror" in info
    compact = CliRunner().invoke(cli, ["compact", "--help"], terminal_width=80).stdout
    examples = [line for line in compact.splitlines() if "Example:" in line]
    assert len(examples) == 2 and any("--keep-every 1000" in line for line in examples), compact


def test_counts_agree_with_their_nouns(chain: Path) -> None:
    from ldtools.cli import plural

    assert [plural(n, "anchor") for n in (0, 1, 2)] == ["0 anchors", "1 anchor", "2 anchors"]
    ok("truncate", chain, "--after", 5, "--yes")
    assert ok("validate", chain).strip() == "ok: 6 steps, 1 anchor"
    out = ok("compact", chain, "--max-replay", 2)
    assert "write 1 new anchor [3]" in out, out
    texts = [out, ok("info", chain), ok("validate", chain, "--deep"), ok("sync", chain, "memory://newcomer-plural")]
    for text in texts:
        assert not re.search(r"\b1 (anchors|records|steps|objects|xor runs)\b", text), text


def test_info_names_everything_on_disk(chain: Path) -> None:
    out = ok("info", chain)
    line = next(x for x in out.splitlines() if x.startswith("on disk"))
    assert "log and segments" in line, line
    data = json.loads(ok("info", chain, "--json"))
    assert data["anchor_bytes"] + data["delta_bytes"] + data["log_bytes"] == data["bytes_on_disk"]


# -- 2.12 the examples say what they cost and how to see a crash ------------------------------
def example_doc(name: str) -> str:
    import ast

    doc = ast.get_docstring(ast.parse((REPO / "examples" / name).read_text(encoding="utf-8")))
    assert doc is not None, name
    return doc


def test_hf_example_states_its_cost_and_explains_the_tied_head_message() -> None:
    doc = example_doc("hf_trainer.py")
    assert "seconds on a CPU" not in doc and "minutes" in doc
    assert "missing keys" in doc and "lm_head.weight" in doc and "tied" in doc
    assert "lm_head.weight" in flat((REPO / "docs" / "trainers.md").read_text(encoding="utf-8"))


def test_lightning_example_demonstrates_the_kill_in_order() -> None:
    doc = example_doc("lightning.py")
    commands = [line.split("#")[0].strip() for line in doc.splitlines() if line.strip().startswith("python ")]
    assert "--fresh" in commands[0] and "--kill-at" in commands[0], commands  # a new chain, then the crash
    assert commands[1] == "python examples/lightning.py", commands  # the same command continues
    assert "--fresh deletes the chain" in flat(doc)
