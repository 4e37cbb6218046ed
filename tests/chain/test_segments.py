"""Format 1.5 segmented snapshots (spec §7.9): a snapshot record references immutable segment
objects holding the restated entries and lists, per segment, the steps it contributes as
ranges, so that opening a chain reads the newest snapshot record and the tail, never the
segments, and a segment is read only when an entry of one of its steps is needed.

Covered here: bit-exact materialization through segments (every kind, after a re-open too),
the lazy O(1) open, the on-disk format, hostile records and segments (each refused with a clean
error naming the file, by the reader, by ``validate`` and by ``ldtools``), truncation,
compaction, retention and sync of segmented chains, and a reader that outlives a compaction
which deleted the segments of its view.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from clirun import invoke
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
import ldformat.chain.snapshots
from ldformat import (
    ChainReader,
    ChainWriter,
    CorruptChainError,
    FormatError,
    MissingObjectError,
    TopK,
    UnsupportedVersionError,
    compact,
    sync,
    truncate,
    validate,
)
from ldformat.chain.writer import SnapshotPolicy
from ldformat.format.checksum import object_checksum, with_checksum
from ldformat.format.jsonvalue import MAX_RECORD_BYTES, canonical
from ldformat.format.manifest import MAX_LISTED_STEPS, SEGMENT_BYTES_PER_STEP, Segment, SegmentRef, expand, ranges_of
from ldformat.stores import FaultyStore, LocalStore, Store

# Small enough that every few commits make a (segmented) snapshot due.
EAGER = SnapshotPolicy(ratio=0.5, min_bytes=0, min_records=3)
SEGMENT_NAME = re.compile(r"^segments/\d{12}-[0-9a-f]{8}\.json$")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Torch on one thread here (tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LDTOOLS_DEBUG", raising=False)


# -- building chains -----------------------------------------------------------------------------
class Training:
    """A writer with its live model, optimizer and compressor, and the state of every step."""

    def __init__(self, path: Path, kind: str, *, batch_steps: int = 2, anchor_every: int | None = None,
                 policy: SnapshotPolicy | None = EAGER, format_version: str | None = None, seed: int = 0,
                 store: Store | None = None) -> None:
        torch.manual_seed(seed)
        self.path, self.kind, self.batch_steps, self.anchor_every = path, kind, batch_steps, anchor_every
        self.model = TinyNet()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.topk = TopK(ratio=0.25) if kind == "grad.topk" else None
        kw: dict[str, Any] = {} if format_version is None else {"format_version": format_version}
        if store is not None:
            kw["store"] = store
        self.writer = ChainWriter.create(path, self.model, self.optimizer, kind=kind, compressor=self.topk,
                                         batch_steps=batch_steps, anchor_every=anchor_every, **kw)
        if policy is not None:
            self.writer.snapshot_policy = policy
        self.states: dict[int, dict[str, Any]] = {0: snapshot(self.model, self.optimizer)}

    def train(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            train_step(self.model, self.optimizer, step, compress=None if self.topk is None else self.topk.compress_)
            self.writer.record_step(step, extra={"step": step})
            self.states[step] = snapshot(self.model, self.optimizer)

    def reopen(self, policy: SnapshotPolicy | None = EAGER) -> None:
        self.writer = ChainWriter.open(self.path, self.model, self.optimizer, compressor=self.topk,
                                       batch_steps=self.batch_steps, anchor_every=self.anchor_every)
        if policy is not None:
            self.writer.snapshot_policy = policy

    def close(self) -> None:
        self.writer.close()


def build(path: Path, kind: str = "grad.dense", steps: int = 30, **kw: Any) -> Training:
    t = Training(path, kind, **kw)
    t.train(1, steps)
    t.close()
    return t


def assert_every_step_exact(path: Path, states: dict[int, dict[str, Any]], steps: list[int] | None = None,
                            reader: ChainReader | None = None) -> None:
    reader = reader or ChainReader(path)
    for step in reader.steps if steps is None else steps:
        got = reader.materialize(step)
        assert_state_bits_equal(got, states[step], f"{path} step {step}")
        assert got["step"] == step
        assert got["extra"] == ({} if step == 0 else {"step": step}), step


# -- reading the files -------------------------------------------------------------------------
def record_path(chain: Path, seq: int) -> Path:
    return chain / "log" / f"{seq:012d}.json"


def log_seqs(chain: Path) -> list[int]:
    return sorted(int(p.name[:12]) for p in (chain / "log").iterdir() if re.fullmatch(r"\d{12}\.json", p.name))


def read_record(chain: Path, seq: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(record_path(chain, seq).read_bytes())
    return doc


def write_record(chain: Path, seq: int, doc: dict[str, Any]) -> None:
    """Write a record in canonical form with a valid checksum, and re-link the records after
    it (their ``prev``), so that a crafted record looks intact."""
    doc = with_checksum(doc)
    record_path(chain, seq).write_bytes(canonical(doc) + b"\n")
    for later in [s for s in log_seqs(chain) if s > seq]:
        nxt = read_record(chain, later)
        nxt["prev"] = doc["checksum"]
        doc = with_checksum(nxt)
        record_path(chain, later).write_bytes(canonical(doc) + b"\n")


def newest_snapshot(chain: Path) -> tuple[int, dict[str, Any]]:
    for seq in reversed(log_seqs(chain)):
        doc = read_record(chain, seq)
        if doc["type"] == "snapshot":
            return seq, doc
    raise AssertionError(f"{chain}: no snapshot record")


def segment_files(chain: Path) -> set[str]:
    d = chain / "segments"
    return {f"segments/{p.name}" for p in d.iterdir()} if d.exists() else set()


def referenced_segments(chain: Path) -> set[str]:
    return {g["path"] for g in newest_snapshot(chain)[1].get("segments", [])}


def listed(ref: dict[str, Any], key: str) -> list[int]:
    return expand(tuple(tuple(r) for r in ref[key]))


def rewrite_segment(chain: Path, index: int, change: Callable[[bytes], bytes]) -> str:
    """Replace segment ``index`` of the newest snapshot with ``change(its bytes)``, and update
    its reference's size and crc32c and the record's checksum, so that only the segment's
    content is wrong. Returns the segment's chain-relative path."""
    seq, doc = newest_snapshot(chain)
    ref = doc["segments"][index]
    data = change((chain / ref["path"]).read_bytes())
    (chain / ref["path"]).write_bytes(data)
    ref["size"], ref["crc32c"] = len(data), object_checksum(ref["path"], data)
    write_record(chain, seq, doc)
    return str(ref["path"])


def rewrite_segment_doc(chain: Path, index: int, change: Callable[[dict[str, Any]], None]) -> str:
    """:func:`rewrite_segment` of a change to the segment's JSON, written canonically."""

    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        change(doc)
        return canonical(doc) + b"\n"

    return rewrite_segment(chain, index, edit)


def segment_doc(chain: Path, index: int) -> dict[str, Any]:
    ref = newest_snapshot(chain)[1]["segments"][index]
    doc: dict[str, Any] = json.loads((chain / ref["path"]).read_bytes())
    return doc


# -- the CLI ----------------------------------------------------------------------------------
def assert_cli_validate_reports(chain: Path, name: str) -> None:
    """``ldtools validate`` exits 1, lists the problems (one naming ``name``) on stdout, one
    summary line on stderr, and no traceback."""
    result = invoke("validate", chain, code=None)
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "problem" in result.stderr, result.stderr
    assert name in result.stdout, (name, result.stdout)


def assert_cli_materialize_fails(chain: Path, tmp_path: Path, step: int, name: str) -> None:
    out = tmp_path / "out" / "state.pt"
    result = invoke("materialize", chain, "--step", step, "-o", out, code=None)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldtools: error: "), result.stderr
    assert name in lines[0], (name, lines[0])
    assert not out.exists()


def assert_validate_reports(chain: Path, name: str) -> None:
    report = validate(chain)
    assert not report.ok
    assert any(name in str(p) for p in report.problems), [str(p) for p in report.problems]


# =============================================================================================
# 1. Exactness
# =============================================================================================
@pytest.mark.parametrize("kind", ["grad.dense", "grad.topk", "state.xor"])
def test_every_step_exact_through_segments_and_after_reopen(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    t = Training(path, kind, batch_steps=2, anchor_every=7)
    t.train(1, 28)
    t.close()
    assert t.writer.snapshots >= 4
    reader = ChainReader(path)
    assert reader.records[0].type == "snapshot" and reader.records[0].segments
    before = {g.object.path: g for g in reader.state.segments}
    assert len(before) >= 4, "several segmented snapshots, each adding a segment"
    assert reader.steps == list(range(29)) and reader.anchors == [0, 7, 14, 21, 28]
    assert_every_step_exact(path, t.states, reader=reader)
    assert validate(path).ok

    # A new writer continues the scheme: its snapshots reference the old segments unchanged.
    t.reopen()
    t.train(29, 44)
    t.close()
    assert t.writer.snapshots >= 2
    reader = ChainReader(path)
    after = {g.object.path: g for g in reader.state.segments}
    assert set(before) < set(after), "the new snapshot references every old segment, and new ones"
    for p, g in before.items():
        assert (after[p].anchor_steps, after[p].delta_steps, after[p].object) == (
            g.anchor_steps, g.delta_steps, g.object), p
    assert segment_files(path) == set(after), "every segment file is referenced; none is rewritten"
    assert reader.steps == list(range(45))
    assert_every_step_exact(path, t.states, reader=reader)
    assert validate(path, deep=True).ok


@pytest.mark.parametrize("target", [None, 1], ids=["one segment", "one segment per entry"])
def test_a_batch_split_over_segment_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            target: int | None) -> None:
    """New entries are cut into segments below a target size, a batch's steps over several
    entries if need be (spec §7.9: a batch's steps may be split over segments; a segment is
    kept below 16 MiB by splitting); folding, truncating and compacting stay exact."""
    if target is not None:
        monkeypatch.setattr(ldformat.chain.snapshots, "SEGMENT_TARGET_BYTES", target)
    path = tmp_path / "chain"
    t = Training(path, "state.xor", batch_steps=70, policy=None)
    t.train(1, 70)
    t.writer.write_snapshot()
    t.train(71, 75)
    t.close()
    seq, doc = newest_snapshot(path)
    pieces = [d for i in range(len(doc["segments"])) for d in segment_doc(path, i)["deltas"]]
    assert len({d["path"] for d in pieces}) == 1, "one batch"
    if target is None:
        assert len(doc["segments"]) == 1 and len(pieces) == 1, "anchor 0 and the whole batch in one segment"
    else:
        assert len(doc["segments"]) == 71 and len(pieces) == 70, "anchor 0, then each step: one segment each"
        assert {g["path"][9:21] for g in doc["segments"]} == {f"{seq:012d}"}, "all written for this snapshot"
    # (only anchor 0: each step replays from it, so a sample of steps keeps this fast)
    assert_every_step_exact(path, t.states, steps=[0, 1, 2, 63, 64, 65, 66, 70, 71, 75])
    assert validate(path, deep=True).ok
    assert truncate(path, 66) == list(range(67, 76))
    assert_every_step_exact(path, t.states, steps=[0, 1, 64, 65, 66])
    assert validate(path, deep=True).ok
    compact(path, keep_last=10)
    assert_every_step_exact(path, t.states)
    assert ChainReader(path).steps == list(range(57, 67))
    assert validate(path, deep=True).ok
    assert segment_files(path) == referenced_segments(path)


@pytest.mark.parametrize("op,pattern,torn", [("write", "segments/*", None), ("write", "segments/*", 0.5),
                                             ("sync", "segments/*", None), ("create_exclusive", "log/*", None)],
                         ids=["segment write", "torn segment", "segment sync", "record"])
def test_failed_segmented_snapshot_leaves_only_garbage(tmp_path: Path, op: Any, pattern: str,
                                                       torn: float | None) -> None:
    """Segments are written and synced before the record (data first): a snapshot that fails
    at any of these leaves the chain as it was, plus unreferenced segments that the next
    writer removes."""
    path = tmp_path / "chain"
    store = FaultyStore(LocalStore(path), armed=False)
    t = Training(path, "grad.dense", batch_steps=2, anchor_every=6, store=store)
    t.train(1, 12)
    t.writer.snapshot_policy = None
    t.train(13, 16)
    seqs, referenced = log_seqs(path), referenced_segments(path)
    assert referenced
    store.fail(op, path=pattern, times=1, torn=torn)
    store.arm()
    with pytest.raises(ldformat.WriterIOError):
        t.writer.write_snapshot()
    t.writer.abort()
    store.clear()
    assert log_seqs(path) == seqs and referenced_segments(path) == referenced, "no record was created"
    if op != "write" or torn:
        assert segment_files(path) - referenced, "the failed snapshot left its segment"
    assert_every_step_exact(path, t.states)
    assert validate(path).ok
    t.reopen()
    assert segment_files(path) == referenced, "the next writer removed the leftover"
    t.train(17, 26)
    t.close()
    assert referenced_segments(path) > referenced, "new snapshots after the failure"
    assert segment_files(path) == referenced_segments(path)
    assert_every_step_exact(path, t.states)
    assert validate(path, deep=True).ok


# =============================================================================================
# 2. Laziness: opening reads no segment
# =============================================================================================
@pytest.fixture(scope="module")
def long_chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """200 steps, one commit each, anchors every 50: many segmented snapshots."""
    path = tmp_path_factory.mktemp("long") / "chain"
    t = build(path, "grad.dense", steps=200, batch_steps=1, anchor_every=50)
    return path, t.states


def test_open_reads_no_segment(long_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    path, states = long_chain
    reader = ChainReader(path)
    assert len(reader.state.segments) >= 30
    assert reader.steps == list(range(201))
    assert reader.latest_step == 200
    assert reader.anchors == [0, 50, 100, 150, 200]
    assert 123 in reader.state.deltas and 100 in reader.state.anchors and 201 not in reader.state.deltas
    assert reader.state.segments_loaded == 0, "the committed steps come from the ranges alone"
    with pytest.raises(ldformat.StepNotFoundError):
        reader.materialize(201)
    assert reader.state.segments_loaded == 0


def test_materialize_reads_only_the_segments_of_its_replay_path(
        long_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    path, states = long_chain
    full = ChainReader(path)
    for step in (120, 7, 200, 150):
        anchor, chain = full.state.replay_path(step)
        refs = full.state.segments
        needed = {i for i, g in enumerate(refs) if anchor in expand(g.anchor_steps)}
        needed |= {i for i, g in enumerate(refs) for s in chain if s in expand(g.delta_steps)}
        reader = ChainReader(path)
        assert_state_bits_equal(reader.materialize(step), states[step], f"step {step}")
        assert reader.state.segments_loaded == len(needed), (step, len(needed))
        assert reader.state.segments_loaded < len(refs) // 3
        if step == 120:
            assert reader.state.segments_loaded >= 3  # anchor 100 and deltas 101-120
        # Materializing again reads nothing more.
        reader.materialize(step)
        assert reader.state.segments_loaded == len(needed)
    reader = ChainReader(path)
    assert reader.extra(170) == {"step": 170}
    assert reader.state.segments_loaded == 1


def test_newest_snapshot_record_is_one_small_reference_per_segment(
        long_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    path, _ = long_chain
    seq, doc = newest_snapshot(path)
    size = record_path(path, seq).stat().st_size
    refs = doc["segments"]
    assert doc["anchors"] == [] and doc["deltas"] == [], "a writer's segmented snapshot states nothing inline"
    assert len({g["path"] for g in refs}) == len(refs) == len(segment_files(path))
    # What an inline snapshot would restate: every entry, i.e. about the segments' bytes.
    restated = sum((path / g["path"]).stat().st_size for g in refs)
    assert size * 10 < restated, (size, restated)
    assert size < 400 + 200 * len(refs), "about one small reference per segment"
    # A reference lists its steps as few ranges, not step by step.
    assert all(len(g["anchor_steps"]) + len(g["delta_steps"]) <= 3 for g in refs)
    # Each snapshot wrote only what was committed since the previous one (spec §7.9: the cost
    # of a snapshot is its new entries plus one reference per segment).
    assert max(len(listed(g, "anchor_steps")) + len(listed(g, "delta_steps")) for g in refs) <= 2 * EAGER.min_records


# =============================================================================================
# 3. Format
# =============================================================================================
def test_format_of_a_segmented_chain(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    t = build(path, "grad.dense", steps=20, anchor_every=8)
    assert ldformat.FORMAT_VERSION in ("1.5", "1.6")  # segments from 1.5 on
    model = TinyNet()
    other = ChainWriter.create(tmp_path / "other", model, torch.optim.SGD(model.parameters(), lr=0.1), kind="state.xor")
    assert isinstance(other.snapshot_policy, SnapshotPolicy), "snapshots are on by default in 1.5"
    other.close()
    assert json.loads((path / "ldformat.json").read_bytes())["format_version"] == ldformat.FORMAT_VERSION
    files = segment_files(path)
    assert files and all(SEGMENT_NAME.match(p) for p in files), files
    for seq in log_seqs(path):
        data = record_path(path, seq).read_bytes()
        doc = json.loads(data)
        if "segments" in doc:
            assert doc["type"] == "snapshot" and doc["segments"], seq
            # canonical (sorted) keys put the member between reason and seq
            assert data.index(b'"reason":') < data.index(b'"segments":') < data.index(b'"seq":')
    seq, doc = newest_snapshot(path)
    for ref in doc["segments"]:
        assert set(ref) == {"path", "size", "crc32c", "anchor_steps", "delta_steps"}
        data = (path / ref["path"]).read_bytes()
        assert len(data) == ref["size"] and object_checksum(ref["path"], data) == ref["crc32c"]
        seg = json.loads(data)
        assert set(seg) == {"anchors", "deltas"} and canonical(seg) + b"\n" == data
        # named after the snapshot it was first written for: this one or an earlier one
        assert int(ref["path"][len("segments/"):][:12]) <= seq
        # the listed steps are those it holds (the writer restates exactly the mapped entries)
        assert listed(ref, "anchor_steps") == sorted(a["step"] for a in seg["anchors"])
        assert listed(ref, "delta_steps") == sorted(s["step"] for d in seg["deltas"] for s in d["steps"])
        parsed = SegmentRef.from_dict(ref, "ref")
        assert parsed.to_dict() == ref
        assert Segment.from_bytes(data, "seg").to_bytes() == data
    assert sum(int(g["path"][9:21]) == seq for g in doc["segments"]) >= 1, "the newest snapshot wrote a segment"
    for args in (["info", path], ["log", path], ["validate", path]):
        assert invoke(*args, code=None).exit_code == 0, args
    assert_every_step_exact(path, t.states)


def test_format_1_4_chain_holds_no_segments(tmp_path: Path) -> None:
    path = tmp_path / "plain"
    t = Training(path, "grad.dense", anchor_every=8, policy=None, format_version="1.4")
    assert t.writer.snapshot_policy is None, "no snapshots by default in an older chain"
    t.train(1, 20)
    t.close()
    assert json.loads((path / "ldformat.json").read_bytes())["format_version"] == "1.4"
    assert {read_record(path, s)["type"] for s in log_seqs(path)} == {"append"}
    assert not (path / "segments").exists()

    # With snapshots asked for, they are inline; so are compaction's and truncation's.
    path = tmp_path / "eager"
    t = Training(path, "state.xor", anchor_every=8, policy=EAGER, format_version="1.4")
    t.train(1, 24)
    t.close()
    assert t.writer.snapshots >= 1
    t.reopen()
    t.train(25, 30)
    t.close()
    compact(path, keep_last=12, max_replay=3)
    assert truncate(path, 28) == [29, 30]
    docs = [read_record(path, s) for s in log_seqs(path)]
    assert any(d["type"] == "snapshot" for d in docs)
    assert not any("segments" in d for d in docs)
    assert not (path / "segments").exists()
    assert json.loads((path / "ldformat.json").read_bytes())["format_version"] == "1.4"
    assert_every_step_exact(path, t.states)
    assert validate(path, deep=True).ok


def test_ranges_helpers() -> None:
    assert ranges_of([]) == ()
    assert ranges_of([5, 1, 2, 3, 3, 9, 10]) == ((1, 3), (5, 5), (9, 10))
    for steps in ([0], [0, 2, 4], list(range(10)) + [12]):
        rs = ranges_of(steps)
        assert expand(rs) == sorted(set(steps))
        assert all(b[0] > a[1] + 1 for a, b in zip(rs, rs[1:], strict=False))  # maximal


# =============================================================================================
# 4. Hostile input
# =============================================================================================
ANCHOR_EVERY = 6
STEPS = 32  # 1-30 with snapshots, then 31-32 in an append record after the newest snapshot


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("pristine") / "chain"
    t = Training(path, "grad.dense", batch_steps=2, anchor_every=ANCHOR_EVERY)
    t.train(1, 30)
    t.writer.snapshot_policy = None
    t.train(31, STEPS)
    t.close()
    seq, doc = newest_snapshot(path)
    assert read_record(path, log_seqs(path)[-1])["type"] == "append", "a tail after the snapshot"
    assert len(doc["segments"]) >= 3
    assert listed(doc["segments"][0], "anchor_steps")[:1] == [0], "segment 0 holds anchor 0"
    return path, t.states


@pytest.fixture
def segmented_chain(pristine: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine[0], tmp_path / "chain"))


@pytest.fixture
def live(pristine: tuple[Path, dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    return pristine[1]


def steps_avoiding(chain: Path, index: int) -> list[int]:
    """The steps whose replay path reads no entry of segment ``index`` (of the newest snapshot)."""
    state = ChainReader(chain).state
    for i in range(len(state.segments)):
        state.load_segment(i)
    out = []
    for step in state.steps:
        anchor, path = state.replay_path(step)
        used = {state.anchors.origin.get(anchor)} | {state.deltas.origin.get(s) for s in path}
        if index not in used:
            out.append(step)
    return out


def assert_segment_refused(chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path, rel: str,
                           error: type[Exception], match: str, *, affected: int = 1,
                           unaffected: list[int] | None = None) -> None:
    """The chain opens (segments are read lazily) with every step listed; ``affected``, whose
    entry is in the segment ``rel``, fails with ``error`` naming the segment; the steps whose
    replay path avoids it still materialize exactly; validate and ldtools report it."""
    reader = ChainReader(chain)
    assert reader.steps == list(range(STEPS + 1)) and reader.latest_step == STEPS
    with pytest.raises(error, match=match or None) as info:
        reader.materialize(affected)
    assert rel in str(info.value), str(info.value)
    assert "Traceback" not in str(info.value)
    for step in unaffected if unaffected is not None else []:
        assert_state_bits_equal(reader.materialize(step), live[step], f"step {step}")
    with pytest.raises(error, match=match or None):
        ChainReader(chain).materialize(affected)  # a fresh reader too
    assert_validate_reports(chain, rel)
    assert_cli_validate_reports(chain, rel)
    assert_cli_materialize_fails(chain, tmp_path, affected, rel)


def assert_record_refused(chain: Path, seq: int, error: type[Exception], match: str) -> None:
    """Folding the log fails with ``error`` naming the record; validate and ldtools report it."""
    rel = f"log/{seq:012d}.json"
    with pytest.raises(error, match=match or None) as info:
        ChainReader(chain)
    assert f"{chain}/{rel}" in str(info.value), str(info.value)
    assert_validate_reports(chain, rel)
    assert_cli_validate_reports(chain, rel)


def test_pristine_chain_is_valid(segmented_chain: Path, live: dict[int, dict[str, Any]]) -> None:
    assert validate(segmented_chain, deep=True).ok
    assert_every_step_exact(segmented_chain, live, steps=[0, 1, 13, 30, 31, STEPS])


# -- damaged segments ------------------------------------------------------------------------
def test_segment_with_a_flipped_byte(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    unaffected = steps_avoiding(segmented_chain, 0)
    assert STEPS in unaffected and 30 in unaffected and 1 not in unaffected
    ref = newest_snapshot(segmented_chain)[1]["segments"][0]
    data = bytearray((segmented_chain / ref["path"]).read_bytes())
    data[len(data) // 2] ^= 0x01
    (segmented_chain / ref["path"]).write_bytes(bytes(data))
    assert_segment_refused(segmented_chain, live, tmp_path, ref["path"], CorruptChainError, "crc32c",
                           unaffected=[unaffected[0], 30, STEPS])


def test_segment_deleted(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    unaffected = steps_avoiding(segmented_chain, 0)
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    (segmented_chain / rel).unlink()
    assert_segment_refused(segmented_chain, live, tmp_path, rel, MissingObjectError, "missing",
                           unaffected=[unaffected[0], STEPS])


def test_segment_truncated(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    unaffected = steps_avoiding(segmented_chain, 0)
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    data = (segmented_chain / rel).read_bytes()
    (segmented_chain / rel).write_bytes(data[: len(data) // 2])
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "differs from the committed",
                           unaffected=[unaffected[0], STEPS])


def test_segment_larger_than_its_reference(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                           tmp_path: Path) -> None:
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    with (segmented_chain / rel).open("ab") as f:
        f.write(b" " * 100)
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "differs from the committed",
                           unaffected=[STEPS])


def test_reference_lists_a_step_the_segment_lacks(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                  tmp_path: Path) -> None:
    """Segment 0 lists step 1 as an anchor, which it only holds as a delta."""
    unaffected = steps_avoiding(segmented_chain, 0)
    seq, doc = newest_snapshot(segmented_chain)
    ref = doc["segments"][0]
    assert 1 not in listed(ref, "anchor_steps") and 1 in listed(ref, "delta_steps")
    ref["anchor_steps"] = [list(r) for r in ranges_of(listed(ref, "anchor_steps") + [1])]
    write_record(segmented_chain, seq, doc)
    assert_segment_refused(segmented_chain, live, tmp_path, ref["path"], CorruptChainError,
                           r"step 1\b.*holds no .*anchor entry",
                           unaffected=[unaffected[0], STEPS])


def test_segment_lacks_a_step_its_reference_lists(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                  tmp_path: Path) -> None:
    """The segment is rewritten without the step entry of step 1 (reference updated)."""
    unaffected = steps_avoiding(segmented_chain, 0)

    def drop_step_1(doc: dict[str, Any]) -> None:
        for d in doc["deltas"]:
            d["steps"] = [s for s in d["steps"] if s["step"] != 1]

    rel = rewrite_segment_doc(segmented_chain, 0, drop_step_1)
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, r"step 1\b.*holds no .*step entry",
                           unaffected=[unaffected[0], STEPS])


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_segment_error_names_the_step(segmented_chain: Path, damage: str) -> None:
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    if damage == "delete":
        (segmented_chain / rel).unlink()
    else:
        data = bytearray((segmented_chain / rel).read_bytes())
        data[20] ^= 1
        (segmented_chain / rel).write_bytes(bytes(data))
    with pytest.raises(CorruptChainError) as info:
        ChainReader(segmented_chain).materialize(3)
    assert rel in str(info.value) and "step 3" in str(info.value), str(info.value)


def test_validate_problems_after_a_missing_segment_name_files(segmented_chain: Path) -> None:
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    (segmented_chain / rel).unlink()
    report = validate(segmented_chain)
    assert not report.ok
    assert all(p.path.startswith(str(segmented_chain)) for p in report.problems), [p.to_dict() for p in report.problems]


def test_listed_step_missing_error_names_the_chain(segmented_chain: Path) -> None:
    seq, doc = newest_snapshot(segmented_chain)
    ref = doc["segments"][0]
    ref["anchor_steps"] = [list(r) for r in ranges_of(listed(ref, "anchor_steps") + [1])]
    write_record(segmented_chain, seq, doc)
    with pytest.raises(CorruptChainError) as info:
        ChainReader(segmented_chain).materialize(1)
    assert f"{segmented_chain}/{ref['path']}" in str(info.value), str(info.value)


def test_segment_not_canonical(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    rel = rewrite_segment(segmented_chain, 0, lambda data: json.dumps(json.loads(data), indent=1).encode() + b"\n")
    assert_segment_refused(segmented_chain, live, tmp_path, rel, FormatError, "canonical", unaffected=[STEPS])


def test_segment_without_its_final_newline(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                           tmp_path: Path) -> None:
    rel = rewrite_segment(segmented_chain, 0, lambda data: data[:-1])
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "canonical", unaffected=[STEPS])


def test_segment_with_an_unknown_member(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    rel = rewrite_segment_doc(segmented_chain, 0, lambda doc: doc.update(comment=1))
    assert_segment_refused(segmented_chain, live, tmp_path, rel, UnsupportedVersionError, "unknown field 'comment'",
                           unaffected=[STEPS])


def test_segment_with_an_ignorable_unknown_member(segmented_chain: Path, live: dict[int, dict[str, Any]]) -> None:
    """An unknown member that is an object with ``"must_understand": false`` is ignored (§3.3)."""
    rewrite_segment_doc(segmented_chain, 0, lambda doc: doc.update(note={"must_understand": False, "x": 1}))
    assert_every_step_exact(segmented_chain, live, steps=[0, 1, 2, STEPS])
    assert validate(segmented_chain).ok


def test_segment_with_two_anchor_entries_of_one_step(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                     tmp_path: Path) -> None:
    rel = rewrite_segment_doc(segmented_chain, 0, lambda doc: doc["anchors"].append(doc["anchors"][0]))
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "two anchor entries",
                           affected=0, unaffected=[STEPS])


def test_segment_with_two_step_entries_of_one_step(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                   tmp_path: Path) -> None:
    rel = rewrite_segment_doc(segmented_chain, 0, lambda doc: doc["deltas"].append(doc["deltas"][0]))
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "two step entries",
                           unaffected=[STEPS])


def test_segment_that_is_not_an_object(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    rel = rewrite_segment(segmented_chain, 0, lambda data: b"[" + data[:-1] + b"]\n")  # canonical, as large
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "not a JSON object",
                           unaffected=[STEPS])


def test_segment_that_is_not_json(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    rel = rewrite_segment(segmented_chain, 0, lambda data: data[: len(data) // 2] + b"\n")
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "", unaffected=[STEPS])


def test_segment_entry_naming_an_object_outside_its_folder(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                           tmp_path: Path) -> None:
    def move(doc: dict[str, Any]) -> None:
        doc["anchors"][0]["object"]["path"] = "deltas/0-0.safetensors"

    rel = rewrite_segment_doc(segmented_chain, 0, move)
    assert_segment_refused(segmented_chain, live, tmp_path, rel, CorruptChainError, "outside anchors/",
                           affected=0, unaffected=[STEPS])


# -- crafted snapshot records --------------------------------------------------------------------
def edit_snapshot(chain: Path, change: Callable[[dict[str, Any]], None]) -> int:
    seq, doc = newest_snapshot(chain)
    change(doc)
    write_record(chain, seq, doc)
    return seq


def test_two_references_list_one_delta_step(segmented_chain: Path) -> None:
    def overlap(doc: dict[str, Any]) -> None:
        a, b = doc["segments"][0], doc["segments"][1]
        b["delta_steps"] = [list(r) for r in ranges_of(listed(b, "delta_steps") + listed(a, "delta_steps")[-1:])]

    seq = edit_snapshot(segmented_chain, overlap)
    assert_record_refused(segmented_chain, seq, CorruptChainError, "listed twice")


def test_two_references_list_one_anchor_step(segmented_chain: Path) -> None:
    def overlap(doc: dict[str, Any]) -> None:
        b = doc["segments"][1]
        b["anchor_steps"] = [list(r) for r in ranges_of(listed(b, "anchor_steps") + [0])]

    seq = edit_snapshot(segmented_chain, overlap)
    assert_record_refused(segmented_chain, seq, CorruptChainError, "step 0 is listed twice")


def test_reference_overlaps_an_inline_anchor(segmented_chain: Path) -> None:
    anchor0 = segment_doc(segmented_chain, 0)["anchors"][0]
    assert anchor0["step"] == 0
    seq = edit_snapshot(segmented_chain, lambda doc: doc.update(anchors=[anchor0]))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "step 0 is listed twice")


def test_reference_overlaps_an_inline_delta(segmented_chain: Path) -> None:
    delta = segment_doc(segmented_chain, 0)["deltas"][0]
    seq = edit_snapshot(segmented_chain, lambda doc: doc.update(deltas=[delta]))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "listed twice")


def test_inline_entries_beside_references_are_folded(segmented_chain: Path, live: dict[int, dict[str, Any]]) -> None:
    """The reverse of the overlap: an entry moved from a reference to the record itself is
    folded from the record (spec §7.9: references, then the record's own entries)."""
    anchor0 = segment_doc(segmented_chain, 0)["anchors"][0]

    def move(doc: dict[str, Any]) -> None:
        ref = doc["segments"][0]
        ref["anchor_steps"] = [list(r) for r in ranges_of(s for s in listed(ref, "anchor_steps") if s != 0)]
        doc["anchors"] = [anchor0]

    edit_snapshot(segmented_chain, move)
    assert_every_step_exact(segmented_chain, live, steps=[0, 1, 5, STEPS])
    assert validate(segmented_chain).ok


BAD_RANGES = {
    "non-maximal": [[1, 1], [2, 3]],
    "touching": [[1, 2], [3, 3]],
    "descending": [[5, 6], [1, 2]],
    "overlapping": [[1, 4], [3, 6]],
    "reversed": [[3, 1]],
    "negative": [[-1, 2]],
    "float": [[1.5, 2]],
    "integral float": [[1.0, 2]],
    "string": [["1", 2]],
    "boolean first": [[True, 2]],
    "boolean last": [[0, True]],
    "null": [[None, 2]],
    "three numbers": [[1, 2, 3]],
    "one number": [[1]],
    "flat": [1, 2],
    "not a list": "1-2",
    "object": {"first": 1, "last": 2},
}


@pytest.mark.parametrize("key", ["delta_steps", "anchor_steps"])
@pytest.mark.parametrize("name", list(BAD_RANGES))
def test_malformed_ranges(segmented_chain: Path, name: str, key: str) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update({key: BAD_RANGES[name]}))
    with pytest.raises(CorruptChainError) as info:
        ChainReader(segmented_chain)
    assert f"log/{seq:012d}.json" in str(info.value) and key in str(info.value), str(info.value)
    if name in ("non-maximal", "descending", "boolean first"):  # the CLI and validate too, for a few
        assert_record_refused(segmented_chain, seq, CorruptChainError, key)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging (or allocating without end) past ``seconds``."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("key", ["delta_steps", "anchor_steps"])
def test_huge_range_is_refused_by_the_size_bound_without_expanding(segmented_chain: Path, key: str) -> None:
    def huge(doc: dict[str, Any]) -> None:
        ref = doc["segments"][0]
        ref[key] = [[0, 2**40]]
        ref["anchor_steps" if key == "delta_steps" else "delta_steps"] = []

    seq = edit_snapshot(segmented_chain, huge)
    started = time.perf_counter()
    with deadline(5):
        with pytest.raises(CorruptChainError, match="cannot hold") as info:
            ChainReader(segmented_chain)
        assert f"log/{seq:012d}.json" in str(info.value)
        assert not validate(segmented_chain).ok
        assert invoke("validate", segmented_chain, code=None).exit_code == 1
    assert time.perf_counter() - started < 2


def test_references_listing_more_than_the_record_limit(segmented_chain: Path) -> None:
    """Each reference claims the largest size a segment may have, enough for its ranges; all
    together they list more than 2^24 steps, which is refused before anything is expanded
    (spec §21.4)."""
    per_ref = MAX_RECORD_BYTES // SEGMENT_BYTES_PER_STEP  # the most steps one reference may list
    count = MAX_LISTED_STEPS // per_ref + 1

    def huge(doc: dict[str, Any]) -> None:
        template = doc["segments"][0]
        refs = []
        for i in range(count):
            first = i * (per_ref + 1)
            refs.append({**template, "path": f"segments/{i:012d}-0000abcd.json", "size": MAX_RECORD_BYTES,
                         "anchor_steps": [], "delta_steps": [[first, first + per_ref - 1]]})
        doc["segments"] = refs

    seq = edit_snapshot(segmented_chain, huge)
    started = time.perf_counter()
    with deadline(5):
        with pytest.raises(CorruptChainError, match=str(MAX_LISTED_STEPS)) as info:
            ChainReader(segmented_chain)
        assert f"log/{seq:012d}.json" in str(info.value)
    assert time.perf_counter() - started < 2


def test_reference_larger_than_a_segment_may_be(segmented_chain: Path) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(size=MAX_RECORD_BYTES + 1))
    started = time.perf_counter()
    with deadline(5):
        assert_record_refused(segmented_chain, seq, CorruptChainError, str(MAX_RECORD_BYTES))
    assert time.perf_counter() - started < 2


def test_reference_listing_no_step(segmented_chain: Path) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(anchor_steps=[], delta_steps=[]))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "lists 0 steps")


def test_segments_in_an_append_record(segmented_chain: Path) -> None:
    refs = newest_snapshot(segmented_chain)[1]["segments"]
    last = log_seqs(segmented_chain)[-1]
    doc = read_record(segmented_chain, last)
    assert doc["type"] == "append"
    doc["segments"] = refs
    write_record(segmented_chain, last, doc)
    assert_record_refused(segmented_chain, last, CorruptChainError, "append record with segments")


def test_empty_segments_list(segmented_chain: Path) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc.update(segments=[]))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "empty segments")


@pytest.mark.parametrize("value", [None, {}, "x", [], {"path": "segments/x.json"}])
def test_segments_member_of_the_wrong_type(segmented_chain: Path, value: Any) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc.update(segments=value if value != [] else [[]]))
    with pytest.raises(CorruptChainError) as info:
        ChainReader(segmented_chain)
    assert f"log/{seq:012d}.json" in str(info.value), str(info.value)


def test_unknown_member_in_a_reference(segmented_chain: Path) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(level=2))
    assert_record_refused(segmented_chain, seq, UnsupportedVersionError, "unknown field 'level'")


def test_ignorable_unknown_member_in_a_reference(segmented_chain: Path, live: dict[int, dict[str, Any]]) -> None:
    edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(hint={"must_understand": False}))
    assert_every_step_exact(segmented_chain, live, steps=[0, 1, STEPS])
    assert validate(segmented_chain).ok


@pytest.mark.parametrize("member", ["path", "size", "crc32c", "anchor_steps", "delta_steps"])
def test_reference_without_a_member(segmented_chain: Path, member: str) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].pop(member))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "")


@pytest.mark.parametrize("change", [{"size": -1}, {"size": "10"}, {"size": True}, {"crc32c": "ABCDEF01"},
                                    {"crc32c": "1234"}, {"crc32c": 1}],
                         ids=["negative size", "string size", "boolean size", "uppercase crc", "short crc", "int crc"])
def test_reference_with_a_malformed_size_or_crc(segmented_chain: Path, change: dict[str, Any]) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(change))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "")


@pytest.mark.parametrize("path", ["anchors/0-00000000.json", "segments/../ldformat.json", "/etc/passwd",
                                  "segments//x.json", "segments", "segmentsx/1.json", "log/000000000001.json"])
def test_reference_path_outside_segments(segmented_chain: Path, path: str) -> None:
    seq = edit_snapshot(segmented_chain, lambda doc: doc["segments"][0].update(path=path))
    assert_record_refused(segmented_chain, seq, CorruptChainError, "outside segments/|unsafe object path")


def test_segment_path_is_a_directory(segmented_chain: Path, live: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    rel = newest_snapshot(segmented_chain)[1]["segments"][0]["path"]
    (segmented_chain / rel).unlink()
    (segmented_chain / rel).mkdir()
    # A local store treats a directory where an object should be as no object.
    assert_segment_refused(segmented_chain, live, tmp_path, rel, MissingObjectError, "missing", unaffected=[STEPS])


def test_segment_replaced_by_another_segments_bytes(segmented_chain: Path, live: dict[int, dict[str, Any]],
                                                    tmp_path: Path) -> None:
    """Segment 0's file holds segment 1's bytes (its reference's size matching): the crc32c
    catches the swap."""
    seq, doc = newest_snapshot(segmented_chain)
    a, b = doc["segments"][0], doc["segments"][1]
    data = (segmented_chain / b["path"]).read_bytes()
    (segmented_chain / a["path"]).write_bytes(data)  # same bytes under segment 0's name
    a["size"] = len(data)
    write_record(segmented_chain, seq, doc)
    assert_segment_refused(segmented_chain, live, tmp_path, a["path"], CorruptChainError, "crc32c", unaffected=[STEPS])


# =============================================================================================
# 5. Maintenance
# =============================================================================================
def snapshot_refs(chain: Path) -> dict[str, dict[str, Any]]:
    return {g["path"]: g for g in newest_snapshot(chain)[1]["segments"]}


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_truncate_keeps_old_segments_with_clipped_ranges(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    t = build(path, kind, steps=30, anchor_every=8)
    before = snapshot_refs(path)
    before_bytes = {p: (path / p).read_bytes() for p in before}
    assert len(before) >= 4
    after = 19
    assert truncate(path, after) == list(range(after + 1, 31))
    reader = ChainReader(path)
    assert reader.steps == list(range(after + 1)) and reader.records[-1].type == "snapshot"
    assert reader.records[-1].segments
    assert_every_step_exact(path, t.states, reader=reader)
    assert validate(path, deep=True).ok

    refs = snapshot_refs(path)
    old_listed: set[int] = set()
    for p, g in before.items():
        anchors = [s for s in listed(g, "anchor_steps") if s <= after]
        deltas = [s for s in listed(g, "delta_steps") if s <= after]
        old_listed |= set(anchors) | set(deltas)
        if anchors or deltas:
            assert p in refs, f"{p} holds kept steps and is still referenced"
            assert (listed(refs[p], "anchor_steps"), listed(refs[p], "delta_steps")) == (anchors, deltas)
            assert (refs[p]["size"], refs[p]["crc32c"]) == (g["size"], g["crc32c"])
            assert (path / p).read_bytes() == before_bytes[p], "never rewritten"
        else:
            assert p not in refs and not (path / p).exists(), f"{p} holds only removed steps"
    assert any(listed(refs[p], "delta_steps") != listed(before[p], "delta_steps") for p in refs if p in before), \
        "some reference was clipped"
    for p in set(refs) - set(before):  # new segments only hold entries that were in no segment
        assert not (set(listed(refs[p], "anchor_steps")) | set(listed(refs[p], "delta_steps"))) & old_listed
    assert segment_files(path) == set(refs)
    # Entries of removed steps stay in the old segments, unlisted; the objects they name are garbage.
    anchors_on_disk = {f"anchors/{p.name}" for p in (path / "anchors").iterdir()}
    assert anchors_on_disk == {reader.state.anchors[a].object.path for a in reader.anchors}
    assert max(reader.anchors) <= after

    # The truncated chain continues: a writer appends and snapshots on top of it.
    torch.manual_seed(5)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reader.load_into(model, optimizer, after)
    t.model, t.optimizer = model, optimizer
    t.reopen()
    t.train(after + 1, after + 12)
    t.close()
    assert_every_step_exact(path, t.states)
    assert validate(path, deep=True).ok


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_compact_segmented_chain(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    t = build(path, kind, steps=30, anchor_every=8)
    before = snapshot_refs(path)
    twin = Path(shutil.copytree(path, tmp_path / "twin"))
    dry = compact(twin, keep_last=10, max_replay=3, dry_run=True)
    plan = compact(path, keep_last=10, max_replay=3)
    assert plan.committed and plan.dropped_steps == list(range(21))
    reader = ChainReader(path)
    assert reader.steps == list(range(21, 31))
    assert_every_step_exact(path, t.states, reader=reader)
    assert all(len(reader.state.replay_path(s)[1]) <= 3 for s in reader.steps)
    assert validate(path, deep=True).ok

    refs = snapshot_refs(path)
    seq, doc = newest_snapshot(path)
    assert doc["reason"] == "compact" and doc["anchors"] == [] and doc["deltas"] == [], "segmented, not inline"
    assert any(int(p[9:21]) == seq for p in refs), "the new anchors went into a new segment"
    assert segment_files(path) == set(refs), "garbage collection removed every unreferenced segment"
    assert set(plan.removed_objects) >= {p for p in before if p not in refs}
    # Kept anchors that lived in a segment stay there (the reference is clipped, not rewritten).
    kept_in_old = {p: a for p, g in before.items() for a in listed(g, "anchor_steps") if a in reader.anchors}
    assert kept_in_old, "the test needs a kept anchor restated in an old segment"
    for p, a in kept_in_old.items():
        assert p in refs and a in listed(refs[p], "anchor_steps")
    # The dry run named what the real run removed (spec: the same plan, nothing changed).
    assert sorted(dry.removed_objects) == sorted(plan.removed_objects)
    assert (dry.new_anchors, dry.dropped_steps, dry.merged_deltas) == (plan.new_anchors, plan.dropped_steps,
                                                                      plan.merged_deltas)

    again = compact(path, keep_last=10, max_replay=3)
    assert not again.committed and again.removed_objects == []
    # Compacting with max_replay only keeps every step.
    path2 = tmp_path / "chain2"
    t2 = build(path2, kind, steps=16, anchor_every=None)
    compact(path2, max_replay=4)
    assert ChainReader(path2).steps == list(range(17))
    assert_every_step_exact(path2, t2.states)
    assert segment_files(path2) == set(snapshot_refs(path2))
    assert validate(path2, deep=True).ok


def test_live_retention_on_a_segmented_chain(tmp_path: Path) -> None:
    """The writer's max_bytes retention drops old history through segmented snapshots."""
    path = tmp_path / "chain"
    t = Training(path, "grad.dense", batch_steps=2, anchor_every=10)
    t.writer.max_bytes = 1  # keep only from the newest anchor on
    t.train(1, 34)
    t.close()
    reader = ChainReader(path)
    assert reader.steps[0] == 30 and reader.latest_step == 34 and t.writer.retained
    assert_every_step_exact(path, t.states, reader=reader)
    assert segment_files(path) <= set(snapshot_refs(path))
    assert validate(path, deep=True).ok


# =============================================================================================
# 6. Sync
# =============================================================================================
def assert_replica(src: Path, dst: Path) -> None:
    a, b = ChainReader(src), ChainReader(dst)
    assert a.steps == b.steps and a.anchors == b.anchors
    for step in a.steps:
        got, want = b.materialize(step), a.materialize(step)
        assert_state_bits_equal(got, want, f"replica step {step}")
        assert got["extra"] == want["extra"]
    assert validate(dst).ok
    refs = referenced_segments(dst)
    assert refs == referenced_segments(src) and segment_files(dst) == refs
    for p in refs:
        assert (dst / p).read_bytes() == (src / p).read_bytes(), p


def test_sync_copies_segments(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    t = build(src, "grad.dense", steps=24, anchor_every=10)
    report = sync(src, dst)
    assert report.created and report.records_copied >= 1 and report.objects_copied > 0
    assert_replica(src, dst)

    again = sync(src, dst)
    assert again.records_copied == 0 and again.objects_copied == 0 and again.bytes_copied == 0

    # More steps with new snapshots: the next sync copies only the new segments and objects.
    old = referenced_segments(dst)
    t.reopen()
    t.train(25, 40)
    t.close()
    assert referenced_segments(src) > old
    more = sync(src, dst)
    assert more.records_copied >= 1 and more.objects_copied > 0
    assert_replica(src, dst)
    assert_every_step_exact(dst, t.states)

    # After the source is compacted (its old segments deleted), the replica follows.
    compact(src, keep_last=6)
    assert sync(src, dst).records_copied >= 1
    assert_replica(src, dst)
    assert ChainReader(dst).steps == list(range(35, 41))

    # A truncated source references segments partly (entries of removed steps, whose objects
    # are gone, stay in them unlisted): a new replica copies only what is listed.
    assert truncate(src, 38) == [39, 40]
    fresh = tmp_path / "fresh"
    sync(src, fresh)
    assert_replica(src, fresh)
    assert sync(src, dst).records_copied >= 1
    assert_replica(src, dst)
    assert_every_step_exact(dst, t.states)


def test_sync_refuses_a_damaged_source_segment(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    build(src, "grad.dense", steps=20, anchor_every=10)
    rel = sorted(referenced_segments(src))[0]
    data = bytearray((src / rel).read_bytes())
    data[10] ^= 0x20
    (src / rel).write_bytes(bytes(data))
    with pytest.raises(CorruptChainError, match="crc32c") as info:
        sync(src, dst)
    assert rel in str(info.value)
    assert not (dst / "ldformat.json").exists() and not (dst / "log" / "000000000001.json").exists()


# =============================================================================================
# 7. A reader that outlives a compaction
# =============================================================================================
@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_reader_opened_before_a_compaction_deleting_its_segments(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    t = build(path, kind, steps=30, anchor_every=None)
    reader = ChainReader(path)  # the old view: nothing read from its segments yet
    old = snapshot_refs(path)
    holder = next(p for p, g in old.items() if 0 in listed(g, "anchor_steps"))
    compact(path, keep_last=3)
    assert not (path / holder).exists(), "the segment holding anchor 0 was deleted"
    assert reader.state.segments_loaded == 0
    assert reader.steps == list(range(31)), "the old view"
    assert_state_bits_equal(reader.materialize(30), t.states[30], "old reader, latest step")
    assert reader.steps == [28, 29, 30], "the reader folded the log again"
    for step in (28, 29):
        assert_state_bits_equal(reader.materialize(step), t.states[step], f"step {step}")
    with pytest.raises(ldformat.StepNotFoundError):
        reader.materialize(5)


def test_extra_of_a_reader_opened_before_a_compaction(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    build(path, "grad.dense", steps=30, anchor_every=None)
    reader = ChainReader(path)
    compact(path, keep_last=3)
    try:
        value = reader.extra(5)
    except ldformat.StepNotFoundError:
        pass  # folded again: step 5 is no longer committed
    else:
        assert value == {"step": 5}


def test_reader_with_loaded_segments_outlives_a_compaction(tmp_path: Path) -> None:
    """The old view had already read its segments (cached); the objects they name were removed."""
    path = tmp_path / "chain"
    t = build(path, "grad.dense", steps=30, anchor_every=None)
    reader = ChainReader(path)
    reader.materialize(3)
    assert reader.state.segments_loaded >= 1
    compact(path, keep_last=4)
    assert_state_bits_equal(reader.materialize(30), t.states[30], "old reader")
    assert reader.steps == [27, 28, 29, 30]


# =============================================================================================
# Odds and ends of the lazy maps
# =============================================================================================
def test_numpy_integer_steps(long_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    """Steps given as numpy integers (e.g. from np.arange) are found whether their entry is
    still in an unread segment or not, as in a chain without segments."""
    path, states = long_chain
    reader = ChainReader(path)
    step = np.int64(120)
    assert_state_bits_equal(reader.materialize(step), states[120], "numpy step")  # type: ignore[arg-type]
    assert step in reader.state.deltas
