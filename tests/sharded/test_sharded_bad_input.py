"""A damaged or crafted sharded chain (spec §20.2, §20.3, §20.7, §21): validate reports it,
naming the file; readers raise an ldformat error, never another exception, and allocate
nothing the stored data does not back; ldtools exits with the problem code, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from paths import SUPPORT, TESTS
from ports import gloo_env

import ldformat
from ldformat.format.checksum import with_checksum
from ldformat.sharded.chain import create_commit, newest_commit
from ldtools.cli import cli

WORKER = SUPPORT / "sharded_crash_worker.py"
STEPS = 4

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded-bad")
    env = gloo_env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(out), str(STEPS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert ldformat.validate(out / "chain").ok
    return out / "chain"


@pytest.fixture
def sharded_copy(good: Path, tmp_path: Path) -> Path:
    shutil.copytree(good, tmp_path / "chain")
    return tmp_path / "chain"


def rewrite_root(chain: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((chain / "sharded.json").read_text())
    doc.pop("checksum")
    change(doc)
    (chain / "sharded.json").write_text(json.dumps(with_checksum(doc)))


def assert_reported(chain: Path, needle: str, where: str) -> None:
    report = ldformat.validate(chain)
    assert not report.ok
    text = "; ".join(str(p) for p in report.problems)
    assert needle in text and where in text, text
    with pytest.raises(ldformat.LdformatError):
        ldformat.open_reader(chain).materialize()
    result = CliRunner().invoke(cli, ["validate", str(chain)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    result = CliRunner().invoke(cli, ["materialize", str(chain), "-o", str(chain.parent / "out.pt")])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output


@pytest.mark.procs
def test_flipped_byte_in_the_sharded_root(sharded_copy: Path) -> None:
    data = bytearray((sharded_copy / "sharded.json").read_bytes())
    i = data.index(b'"world_size"') + len(b'"world_size": ')
    data[i] = ord("3") if data[i] != ord("3") else ord("5")
    (sharded_copy / "sharded.json").write_bytes(bytes(data))
    assert_reported(sharded_copy, "", "sharded.json")


@pytest.mark.procs
@pytest.mark.parametrize(("what", "change", "needle"), [
    ("coverage gap", lambda d: d["tensors"]["model/a.weight"]["shards"][1]["lengths"].__setitem__(0, 40),
     "no shard covers"),
    ("outside the shape", lambda d: d["tensors"]["model/a.weight"]["shards"][1]["offsets"].__setitem__(0, 90),
     "outside the global shape"),
    ("rank twice", lambda d: d["tensors"]["model/a.weight"]["shards"][1].__setitem__("rank", 0), "listed twice"),
    ("not a model name", lambda d: d["tensors"].__setitem__("optimizer/0/x", d["tensors"]["model/a.weight"]),
     "not a model tensor name"),
    ("mesh product", lambda d: d["mesh"].__setitem__("shape", [3]), "does not multiply"),
    ("world size", lambda d: d.__setitem__("world_size", 100_001), "out of range"),
    ("dimensions", lambda d: d["tensors"]["model/a.weight"].__setitem__("shape", [1] * 65), "dimensions"),
    ("version", lambda d: d.__setitem__("format_version", "1.2"), "not a sharded format"),
])
def test_crafted_layouts_are_refused(sharded_copy: Path, what: str, change: Callable[[dict[str, Any]], None],
                                     needle: str) -> None:
    rewrite_root(sharded_copy, change)
    assert_reported(sharded_copy, needle, "sharded.json")


@pytest.mark.procs
def test_a_huge_claimed_shape_is_refused_without_allocating(sharded_copy: Path) -> None:
    def huge(d: dict[str, Any]) -> None:
        layout = d["tensors"]["model/a.weight"]
        layout["shape"] = [2**40, 16]
        layout["shards"] = [{"rank": r, "offsets": [r * 2**39, 0], "lengths": [2**39, 16]} for r in range(2)]

    rewrite_root(sharded_copy, huge)
    started = time.monotonic()
    report = ldformat.validate(sharded_copy)
    assert not report.ok and time.monotonic() - started < 30
    assert "model/a.weight" in "; ".join(str(p) for p in report.problems)


@pytest.mark.procs
def test_a_missing_commit_record(sharded_copy: Path) -> None:
    """Validation checks the whole commit log; a reader needs only the newest record (spec §20.3.2)."""
    store = ldformat.LocalStore(sharded_copy)
    while len(list((sharded_copy / "commits").glob("*.json"))) < 3:  # record 2 in the middle, whatever the run made
        last = newest_commit(store, str(sharded_copy))
        assert last is not None
        create_commit(store, str(sharded_copy), last.step, last)
    (sharded_copy / "commits" / "000000000002.json").unlink()
    report = ldformat.validate(sharded_copy)
    assert not report.ok
    assert "commit record missing" in "; ".join(map(str, report.problems))
    assert "commits/000000000002.json" in "; ".join(map(str, report.problems))
    assert ldformat.open_reader(sharded_copy).materialize()["step"] == STEPS


@pytest.mark.procs
def test_a_commit_naming_a_step_no_rank_holds(sharded_copy: Path) -> None:
    store = ldformat.LocalStore(sharded_copy)
    create_commit(store, str(sharded_copy), 99, newest_commit(store, str(sharded_copy)))
    report = ldformat.validate(sharded_copy)
    assert not report.ok and "missing from the chain of rank(s) [0, 1]" in "; ".join(map(str, report.problems))


@pytest.mark.procs
def test_no_commit_record_means_no_committed_step(sharded_copy: Path) -> None:
    shutil.rmtree(sharded_copy / "commits")
    reader = ldformat.open_reader(sharded_copy)
    assert reader.steps == [] and reader.latest_step is None
    with pytest.raises(ldformat.EmptyChainError):
        reader.materialize()
    report = ldformat.validate(sharded_copy)
    assert not report.ok and "no commit record" in "; ".join(map(str, report.problems))


@pytest.mark.procs
def test_an_unfinished_creation_is_one_problem(sharded_copy: Path) -> None:
    """No commit record and rank 1's chain not created yet (a job starting): validate says that
    it is an unfinished creation, and nothing about the missing rank chain."""
    shutil.rmtree(sharded_copy / "commits")
    shutil.rmtree(sharded_copy / "ranks" / "00001")
    report = ldformat.validate(sharded_copy)
    assert [p.message for p in report.problems if "unfinished creation" in p.message]
    assert not [p for p in report.problems if "missing" in p.message], report.problems


@pytest.mark.procs
def test_a_missing_rank_chain(sharded_copy: Path) -> None:
    shutil.rmtree(sharded_copy / "ranks" / "00001")
    assert_reported(sharded_copy, "rank 1's chain is missing", "ranks/00001")


@pytest.mark.procs
def test_both_root_files(sharded_copy: Path) -> None:
    shutil.copy(sharded_copy / "ranks" / "00000" / "ldformat.json", sharded_copy / "ldformat.json")
    assert_reported(sharded_copy, "both sharded.json and ldformat.json", str(sharded_copy))


@pytest.mark.procs
def test_a_flipped_byte_in_a_rank_chain_object_names_it(sharded_copy: Path) -> None:
    anchor = sorted((sharded_copy / "ranks" / "00001" / "anchors").rglob("*.safetensors"))[-1]
    data = bytearray(anchor.read_bytes())
    data[-3] ^= 0x40
    anchor.write_bytes(bytes(data))
    report = ldformat.validate(sharded_copy)
    assert not report.ok
    assert any("ranks/00001" in str(p) and anchor.name in str(p) for p in report.problems), report.problems


@pytest.mark.procs
def test_pending_steps_beyond_the_last_commit_are_not_committed(sharded_copy: Path) -> None:
    commits = sorted((sharded_copy / "commits").glob("*.json"))
    commits[-1].unlink()  # the last commit never happened: its steps are pending in every rank chain
    reader = ldformat.open_reader(sharded_copy)
    assert isinstance(reader, ldformat.ShardedReader)
    assert reader.latest_step is not None and reader.latest_step < STEPS
    assert STEPS in reader.ranks[0].steps and STEPS not in reader.steps
    assert ldformat.validate(sharded_copy).ok


GOLDEN = TESTS / "golden"


@pytest.fixture
def hsdp(tmp_path: Path) -> Path:
    """A format 1.4 chain whose rank 1 is a copy of rank 0 (spec §20.2 ``copies``)."""
    shutil.copytree(GOLDEN / "1.4" / "sharded.copies.state.xor" / "chain", tmp_path / "hsdp")
    return tmp_path / "hsdp"


@pytest.mark.parametrize("what, change, needle", [
    ("copies in a 1.3 root", lambda d: d.update(format_version="1.3"), "copies"),
    ("a rank its own copy", lambda d: d.update(copies={"1": 1}), "lower rank"),
    ("a source outside the world", lambda d: d.update(copies={"1": 7}), "lower rank"),
    ("rank 0 a copy", lambda d: d.update(copies={"0": 0}), "lower rank"),
    ("a rank with a leading zero", lambda d: d.update(copies={"01": 0}), "decimal rank"),
    ("a boolean source", lambda d: d.update(copies={"1": False}), "decimal rank"),
    ("empty copies", lambda d: d.update(copies={}), "non-empty"),
    ("copies that are not an object", lambda d: d.update(copies=[1, 0]), "non-empty"),
])
@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_crafted_copies_are_refused(hsdp: Path, what: str, change: Callable[[dict[str, Any]], None],
                                    needle: str) -> None:
    rewrite_root(hsdp, change)
    assert_reported(hsdp, needle, "sharded.json")


@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_copies_of_a_rank_with_other_blocks_are_refused(tmp_path: Path) -> None:
    """FSDP2's ranks hold different rows: declaring rank 1 a copy would lose them (rule C3)."""
    chain = tmp_path / "fsdp"
    shutil.copytree(GOLDEN / "1.3" / "sharded.state.xor" / "chain", chain)
    rewrite_root(chain, lambda d: d.update(format_version="1.4", copies={"1": 0}))
    assert_reported(chain, "different blocks", "sharded.json")


@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_a_copy_rank_without_copies_is_a_missing_rank_chain(hsdp: Path) -> None:
    rewrite_root(hsdp, lambda d: d.pop("copies"))
    assert_reported(hsdp, "rank 1's chain is missing", "ranks/00001")


@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_a_stray_directory_of_a_copy_rank_is_ignored(hsdp: Path) -> None:
    shutil.copytree(GOLDEN / "1.3" / "sharded.state.xor" / "chain" / "ranks" / "00001", hsdp / "ranks" / "00001")
    assert ldformat.validate(hsdp, deep=True).ok
    assert list(ldformat.open_reader(hsdp).materialize()["model"])


def test_an_unreadable_commit_record_is_warned_about_once_while_a_rank_polls_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A rank's last retention pass polls the newest commit record (every 0.1 s, up to
    ``commit_timeout``): a store that keeps failing gives one warning per distinct error, not
    one per poll, and a success in between makes the next failure warn again."""
    from ldformat.capture import sharded as capture_sharded

    failure: list[BaseException | None] = [OSError("disk gone")]

    def flaky(store: Any, path: str) -> Any:
        if failure[0] is not None:
            raise failure[0]
        return None

    monkeypatch.setattr(capture_sharded, "newest_commit", flaky)
    newest = capture_sharded.newest_committed(str(tmp_path / "chain"), None)
    with caplog.at_level("DEBUG", logger="ldformat.capture"):
        assert [newest() for _ in range(50)] == [None] * 50
        failure[0] = OSError("permission denied")
        newest()
        newest()
        failure[0] = None
        assert newest() is None
        failure[0] = OSError("permission denied")
        newest()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3, warnings
    assert "disk gone" in warnings[0] and "permission denied" in warnings[1] and "permission denied" in warnings[2]
    assert sum(r.levelname == "DEBUG" for r in caplog.records) == 50
