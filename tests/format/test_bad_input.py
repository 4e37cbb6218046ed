"""Bad input: damaged, truncated, missing or unknown things, and wrong paths.

Each case checks the specific error class and that its message names the file and/or step,
that :func:`ldformat.validate` reports a problem naming the object, that the CLI
(``validate``, ``materialize``, ``info``) prints one line on stderr without a traceback and
exits with the documented code (1 a problem with the chain, 2 usage or not a chain), and
that the chain's files are byte-for-byte unchanged by the failed reads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import crash_writer as cw
import pytest
from click.testing import Result
from clirun import invoke
from models import assert_state_bits_equal, snapshot

import ldformat
from ldformat import (
    ChainReader,
    ChainWriter,
    CorruptChainError,
    MissingObjectError,
    NotAChainError,
    StepNotFoundError,
    UnsupportedVersionError,
)
from ldformat.chain.lock import current_lock
from ldformat.format.checksum import with_checksum
from ldformat.format.jsonvalue import canonical
from ldformat.stores import LocalStore

STEPS = 12
ANCHOR_EVERY = 5  # anchors 0, 5, 10
BATCH_STEPS = 3  # delta groups 1-3, 4-5, 6-8, 9-10, 11-12

# -- fixtures ----------------------------------------------------------------------------
_BUILT: dict[str, tuple[Path, dict[int, dict[str, Any]]]] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Build each kind's pristine chain once (with the live state of every step)."""

    def get(kind: str) -> tuple[Path, dict[int, dict[str, Any]]]:
        if kind not in _BUILT:
            path = tmp_path_factory.mktemp("pristine") / kind
            model, optimizer, topk = cw.make_training(kind)
            writer = ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk,
                                        batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY)
            live = {0: snapshot(model, optimizer)}
            for s in range(1, STEPS + 1):
                cw.train(model, optimizer, topk, s)
                writer.record_step(s)
                live[s] = snapshot(model, optimizer)
            assert writer.close() == STEPS
            _BUILT[kind] = (path, live)
        return _BUILT[kind]

    return get


@pytest.fixture
def dense_chain(built: Any, tmp_path: Path) -> Path:
    """A private copy of the grad.dense chain."""
    src, _ = built("grad.dense")
    dst = tmp_path / "chain"
    shutil.copytree(src, dst)
    return dst


def copy_of(built: Any, kind: str, tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    src, live = built(kind)
    dst = tmp_path / f"chain-{kind}"
    shutil.copytree(src, dst)
    return dst, live


# -- helpers -----------------------------------------------------------------------------
def tree_digest(root: Path) -> dict[str, str]:
    """Every file's sha256 and every directory, so that any change shows.

    The writer lock (``lock/``) is not committed content: taking and releasing it adds
    generations; that no lock stays *held* is checked with ``current_lock``.
    """
    if not root.exists():
        return {}
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel == "lock" or rel.startswith("lock/"):
            continue
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    if (root / "lock").is_dir():
        assert current_lock(LocalStore(root)) is None, f"{root}: the writer lock is still held"
    return out


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset % len(data)
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def anchor_rel(chain: Path, step: int) -> str:
    return ChainReader(chain).state.anchors[step].object.path


def delta_group(chain: Path, step: int) -> tuple[str, list[str]]:
    entry = ChainReader(chain).state.deltas[step][0]
    return entry.path, sorted(o.path for o in entry.objects)


def record_rel(seq: int) -> str:
    return f"log/{seq:012d}.json"


def last_record(chain: Path) -> str:
    return record_rel(len(list((chain / "log").glob("*.json"))))


def rewrite_json(path: Path, change: Any, *, record: bool = False) -> None:
    """Edit a checksummed JSON file and give it a valid checksum again."""
    doc = json.loads(path.read_bytes())
    change(doc)
    doc = with_checksum(doc)
    path.write_bytes(canonical(doc) + b"\n" if record else json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n")


def assert_cli_fails(code: int, *args: Any, names: tuple[str, ...] = ()) -> Result:
    """Exit ``code`` with one line on stderr that names every string of ``names``."""
    result = invoke(*args, code=None)
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ldtools: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return result


def assert_cli_validate_reports(chain: Path, *names: str) -> None:
    """``ldtools validate`` exits 1, lists the problem on stdout, one summary line on stderr."""
    result = invoke("validate", chain, code=None)
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "problem" in result.stderr, result.stderr
    for name in names:
        assert name in result.stdout, (name, result.stdout)


def assert_validate_reports(chain: Path, rel: str, step: int | None = None) -> ldformat.Problem:
    report = ldformat.validate(chain)
    assert not report.ok
    hits = [p for p in report.problems if rel in str(p)]
    assert hits, [str(p) for p in report.problems]
    if step is not None:
        assert any(p.step == step or f"step {step}" in str(p) for p in hits), [str(p) for p in hits]
    return hits[0]


def cli_materialize_fails(tmp_path: Path, chain: Path, step: int | None, code: int, names: tuple[str, ...]) -> None:
    out = tmp_path / "out" / "state.pt"
    args: list[Any] = ["materialize", chain, "-o", out]
    if step is not None:
        args += ["--step", step]
    assert_cli_fails(code, *args, names=names)
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir())), "partial output left"


# -- damaged objects ---------------------------------------------------------------------
def test_flipped_byte_in_an_anchor(dense_chain: Path, built: Any, tmp_path: Path) -> None:
    rel = anchor_rel(dense_chain, 5)
    flip_byte(dense_chain / rel)
    before = tree_digest(dense_chain)
    reader = ChainReader(dense_chain)
    for step in (5, 7):  # the anchor itself, and a step replayed from it
        with pytest.raises(CorruptChainError, match="crc32c") as info:
            reader.materialize(step)
        assert rel in str(info.value) and "step 5" in str(info.value), str(info.value)
    # Steps that do not need the damaged anchor still read, exactly.
    _, live = built("grad.dense")
    for step in (3, 10, 12):
        assert_state_bits_equal(reader.materialize(step), live[step], f"step {step}")
    assert_validate_reports(dense_chain, rel, 5)
    assert_cli_validate_reports(dense_chain, rel)
    cli_materialize_fails(tmp_path, dense_chain, 5, 1, (rel, "step 5"))
    assert invoke("info", dense_chain, code=None).exit_code == 0  # info reads the log, not the objects
    assert tree_digest(dense_chain) == before


@pytest.mark.parametrize("kind", cw.KINDS)
def test_flipped_byte_in_any_object_of_a_delta_group(built: Any, tmp_path: Path, kind: str) -> None:
    chain, live = copy_of(built, kind, tmp_path)
    group, objects = delta_group(chain, 7)
    assert any("/c/" in o for o in objects), objects
    pristine = {o: (chain / group / o).read_bytes() for o in objects}
    for obj in objects:
        rel = f"{group}/{obj}"
        flip_byte(chain / rel)
        before = tree_digest(chain)
        with pytest.raises(CorruptChainError) as info:
            ChainReader(chain).materialize(7)
        assert rel in str(info.value) and "step 6" in str(info.value), str(info.value)
        assert_validate_reports(chain, rel, 6)
        assert tree_digest(chain) == before
        (chain / rel).write_bytes(pristine[obj])
    assert ldformat.validate(chain).ok
    assert_state_bits_equal(ChainReader(chain).materialize(7), live[7], "step 7 repaired")


def test_flipped_byte_in_a_delta_chunk_through_the_cli(dense_chain: Path, tmp_path: Path) -> None:
    group, objects = delta_group(dense_chain, 7)
    rel = f"{group}/{next(o for o in objects if o.startswith('values_') and '/c/' in o)}"
    flip_byte(dense_chain / rel)
    before = tree_digest(dense_chain)
    assert_cli_validate_reports(dense_chain, rel)
    cli_materialize_fails(tmp_path, dense_chain, 8, 1, (rel, "step 6"))
    cli_materialize_fails(tmp_path, dense_chain, 7, 1, (rel,))
    assert tree_digest(dense_chain) == before


@pytest.mark.parametrize("where", [0.0, 0.25, 0.5, 0.75, 1.0], ids=lambda w: f"at{int(w * 100)}%")
@pytest.mark.parametrize("seq", [3, "last"])
def test_flipped_byte_in_a_log_record(dense_chain: Path, tmp_path: Path, seq: Any, where: float) -> None:
    rel = last_record(dense_chain) if seq == "last" else record_rel(seq)
    size = (dense_chain / rel).stat().st_size
    flip_byte(dense_chain / rel, min(int(where * size), size - 1))
    before = tree_digest(dense_chain)
    with pytest.raises(CorruptChainError) as info:
        ChainReader(dense_chain)
    assert rel in str(info.value), str(info.value)
    assert_validate_reports(dense_chain, rel)
    assert_cli_validate_reports(dense_chain, rel)
    assert_cli_fails(1, "info", dense_chain, names=(rel,))
    cli_materialize_fails(tmp_path, dense_chain, None, 1, (rel,))
    assert tree_digest(dense_chain) == before


def test_flipped_byte_in_the_root_file(dense_chain: Path, tmp_path: Path) -> None:
    text = (dense_chain / "ldformat.json").read_bytes()
    chain_id = json.loads(text)["chain_id"]
    flip_byte(dense_chain / "ldformat.json", text.index(chain_id.encode()) + 3)
    before = tree_digest(dense_chain)
    with pytest.raises(CorruptChainError, match="checksum") as info:
        ChainReader(dense_chain)
    assert "ldformat.json" in str(info.value)
    assert_validate_reports(dense_chain, "ldformat.json")
    assert_cli_validate_reports(dense_chain, "ldformat.json")
    assert_cli_fails(1, "info", dense_chain, names=("ldformat.json",))
    cli_materialize_fails(tmp_path, dense_chain, 3, 1, ("ldformat.json",))
    assert tree_digest(dense_chain) == before


@pytest.mark.parametrize("what", ["anchor", "record"])
def test_truncated_file(dense_chain: Path, tmp_path: Path, what: str) -> None:
    rel = anchor_rel(dense_chain, 10) if what == "anchor" else last_record(dense_chain)
    data = (dense_chain / rel).read_bytes()
    (dense_chain / rel).write_bytes(data[: len(data) // 2])
    before = tree_digest(dense_chain)
    if what == "anchor":
        with pytest.raises(CorruptChainError, match="truncated") as info:
            ChainReader(dense_chain).materialize(11)
        assert rel in str(info.value) and "step 10" in str(info.value), str(info.value)
        assert_validate_reports(dense_chain, rel, 10)
        cli_materialize_fails(tmp_path, dense_chain, 10, 1, (rel, "step 10"))
    else:
        with pytest.raises(CorruptChainError) as info:
            ChainReader(dense_chain)
        assert rel in str(info.value), str(info.value)
        assert_validate_reports(dense_chain, rel)
        assert_cli_fails(1, "info", dense_chain, names=(rel,))
        cli_materialize_fails(tmp_path, dense_chain, None, 1, (rel,))
    assert_cli_validate_reports(dense_chain, rel)
    assert tree_digest(dense_chain) == before


@pytest.mark.parametrize("what", ["anchor", "delta chunk"])
def test_missing_object(dense_chain: Path, tmp_path: Path, what: str) -> None:
    if what == "anchor":
        rel, step, named_step = anchor_rel(dense_chain, 5), 6, 5
    else:
        group, objects = delta_group(dense_chain, 11)
        rel, step, named_step = f"{group}/{next(o for o in objects if '/c/' in o)}", 12, 11
    (dense_chain / rel).unlink()
    before = tree_digest(dense_chain)
    with pytest.raises(MissingObjectError) as info:
        ChainReader(dense_chain).materialize(step)
    assert rel in str(info.value) and f"step {named_step}" in str(info.value), str(info.value)
    assert_validate_reports(dense_chain, rel, named_step)
    assert_cli_validate_reports(dense_chain, rel)
    cli_materialize_fails(tmp_path, dense_chain, step, 1, (rel, f"step {named_step}"))
    assert tree_digest(dense_chain) == before


def test_missing_log_record(dense_chain: Path, tmp_path: Path) -> None:
    rel = record_rel(3)
    (dense_chain / rel).unlink()
    before = tree_digest(dense_chain)
    with pytest.raises(CorruptChainError, match="missing") as info:
        ChainReader(dense_chain)
    assert rel in str(info.value), str(info.value)
    assert_validate_reports(dense_chain, rel)
    assert_cli_validate_reports(dense_chain, rel)
    assert_cli_fails(1, "info", dense_chain, names=(rel,))
    cli_materialize_fails(tmp_path, dense_chain, 2, 1, (rel,))
    assert tree_digest(dense_chain) == before


def test_validate_problems_name_the_object_and_step_separately(dense_chain: Path) -> None:
    # Problem.path is the object's path and Problem.step its step (``validate --json``
    # consumers read them as fields); str(problem) names the step once.
    rel = anchor_rel(dense_chain, 5)
    flip_byte(dense_chain / rel)
    report = ldformat.validate(dense_chain)
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert problem.path == f"{dense_chain}/{rel}", problem.path
    assert problem.step == 5
    assert str(problem).count("step 5") == 1, str(problem)


# -- versions and unknown fields -----------------------------------------------------------
def test_unknown_major_version(dense_chain: Path, tmp_path: Path) -> None:
    rewrite_json(dense_chain / "ldformat.json", lambda d: d.update(format_version="2.0"))
    before = tree_digest(dense_chain)
    with pytest.raises(UnsupportedVersionError) as info:
        ChainReader(dense_chain)
    assert "ldformat.json" in str(info.value) and "2.0" in str(info.value), str(info.value)
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(UnsupportedVersionError):
        ChainWriter.open(dense_chain, model, optimizer)
    assert_validate_reports(dense_chain, "ldformat.json")
    assert_cli_validate_reports(dense_chain, "2.0")
    assert_cli_fails(1, "info", dense_chain, names=("ldformat.json", "2.0"))
    cli_materialize_fails(tmp_path, dense_chain, 3, 1, ("ldformat.json", "2.0"))
    assert tree_digest(dense_chain) == before


def test_newer_minor_version_is_read(dense_chain: Path, built: Any) -> None:
    rewrite_json(dense_chain / "ldformat.json", lambda d: d.update(format_version="1.9"))
    _, live = built("grad.dense")
    assert ldformat.validate(dense_chain).ok
    assert_state_bits_equal(ChainReader(dense_chain).materialize(12), live[12], "step 12")


UNKNOWN_FIELD_PLACES = {
    # Edits go to the last record, so that no later record's ``prev`` checksum breaks.
    "root": lambda d, f: d.update(f),
    "record": lambda d, f: d.update(f),
    "step entry": lambda d, f: d["deltas"][0]["steps"][0].update(f),
    "object reference": lambda d, f: d["deltas"][0]["objects"][0].update(f),
}


@pytest.mark.parametrize("where", list(UNKNOWN_FIELD_PLACES))
def test_unknown_must_understand_field(dense_chain: Path, tmp_path: Path, where: str) -> None:
    field = {"sparse_dictionary": {"id": 7}}
    rel = "ldformat.json" if where == "root" else last_record(dense_chain)
    rewrite_json(dense_chain / rel, lambda d: UNKNOWN_FIELD_PLACES[where](d, field), record=where != "root")
    before = tree_digest(dense_chain)
    with pytest.raises(UnsupportedVersionError, match="sparse_dictionary") as info:
        ChainReader(dense_chain)
    assert rel in str(info.value), str(info.value)
    assert_validate_reports(dense_chain, rel)
    assert_cli_validate_reports(dense_chain, "sparse_dictionary")
    assert_cli_fails(1, "info", dense_chain, names=(rel, "sparse_dictionary"))
    cli_materialize_fails(tmp_path, dense_chain, None, 1, (rel,))
    assert tree_digest(dense_chain) == before


@pytest.mark.parametrize("where", list(UNKNOWN_FIELD_PLACES))
def test_unknown_field_marked_not_must_understand_is_ignored(dense_chain: Path, built: Any, where: str) -> None:
    field = {"sparse_dictionary": {"id": 7, "must_understand": False}}
    rel = "ldformat.json" if where == "root" else last_record(dense_chain)
    rewrite_json(dense_chain / rel, lambda d: UNKNOWN_FIELD_PLACES[where](d, field), record=where != "root")
    _, live = built("grad.dense")
    report = ldformat.validate(dense_chain)
    assert report.ok, [str(p) for p in report.problems]
    assert_state_bits_equal(ChainReader(dense_chain).materialize(STEPS), live[STEPS], f"step {STEPS}")


# -- steps -------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [13, 999, -1])
def test_step_out_of_range(dense_chain: Path, tmp_path: Path, step: int) -> None:
    before = tree_digest(dense_chain)
    with pytest.raises(StepNotFoundError) as info:
        ChainReader(dense_chain).materialize(step)
    msg = str(info.value)
    assert f"step {step}" in msg and f"0-{STEPS}" in msg and str(dense_chain) in msg, msg
    assert isinstance(info.value, KeyError)
    cli_materialize_fails(tmp_path, dense_chain, step, 1, (f"step {step}", f"0-{STEPS}"))
    assert ldformat.validate(dense_chain).ok
    assert tree_digest(dense_chain) == before


def test_chain_without_a_committed_step(dense_chain: Path, tmp_path: Path) -> None:
    """A root without records is corrupt (spec §7.3), not an empty chain."""
    shutil.rmtree(dense_chain / "log")
    shutil.rmtree(dense_chain / "anchors")
    shutil.rmtree(dense_chain / "deltas")
    before = tree_digest(dense_chain)
    with pytest.raises(CorruptChainError, match="no commit record") as info:
        ChainReader(dense_chain).materialize()
    assert str(dense_chain) in str(info.value)
    cli_materialize_fails(tmp_path, dense_chain, None, 1, (str(dense_chain), "no commit record"))
    assert tree_digest(dense_chain) == before


# -- not a chain -------------------------------------------------------------------------
def _not_a_chain(tmp_path: Path, what: str) -> Path:
    if what == "empty directory":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if what == "file":
        (tmp_path / "notes.txt").write_text("not a chain\n")
        return tmp_path / "notes.txt"
    if what == "foreign ldformat.json":
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "ldformat.json").write_text('{"format": "something-else"}\n')
        return tmp_path / "other"
    return tmp_path / "does-not-exist"


@pytest.mark.parametrize("what", ["empty directory", "file", "nonexistent", "foreign ldformat.json"])
def test_not_a_chain(tmp_path: Path, what: str) -> None:
    path = _not_a_chain(tmp_path, what)
    before = tree_digest(path)
    with pytest.raises(NotAChainError) as info:
        ChainReader(path)
    assert str(path) in str(info.value), str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(NotAChainError):
        ldformat.validate(path)
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(NotAChainError):
        ChainWriter.open(path, model, optimizer)
    for command in ("validate", "info"):
        assert_cli_fails(2, command, path, names=(str(path),))
    cli_materialize_fails(tmp_path, path, None, 2, (str(path),))
    assert tree_digest(path) == before, "a failed read created or changed files"


# -- a writer opened on a damaged chain --------------------------------------------------
def test_open_on_a_damaged_log_leaves_it_as_it_was(dense_chain: Path) -> None:
    rel = last_record(dense_chain)
    flip_byte(dense_chain / rel)
    before = tree_digest(dense_chain)
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(CorruptChainError) as info:
        ChainWriter.open(dense_chain, model, optimizer)
    assert rel in str(info.value), str(info.value)
    assert tree_digest(dense_chain) == before, "a failed open changed the chain"


def test_open_on_a_damaged_xor_chain_leaves_it_as_it_was(built: Any, tmp_path: Path) -> None:
    # Opening a state.xor chain materializes its latest step (the XOR base); when that
    # fails the chain must be left as it was: no writer.lock left behind by this process.
    chain, live = copy_of(built, "state.xor", tmp_path)
    group, objects = delta_group(chain, STEPS)
    rel = f"{group}/{next(o for o in objects if o.startswith('values_') and '/c/' in o)}"
    flip_byte(chain / rel)
    before = tree_digest(chain)
    model, optimizer, _ = cw.make_training("state.xor")
    ChainReader(chain).load_into(model, optimizer, step=10)
    with pytest.raises(CorruptChainError) as info:
        ChainWriter.open(chain, model, optimizer)
    assert rel in str(info.value), str(info.value)
    assert tree_digest(chain) == before, "a failed open changed the chain (lock left behind?)"
    assert_state_bits_equal(ChainReader(chain).materialize(10), live[10], "step 10")
