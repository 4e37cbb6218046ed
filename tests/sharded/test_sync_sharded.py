"""Replication of a sharded chain (spec §20, §17.5): ``ldformat.sync`` and ``ldtools sync``.

- A world-2 FSDP2 chain (tests/support/sharded_chain_maker.py, made once per session) synced to a new
  directory: the replica holds the source's ``sharded.json``, commit records and rank chains
  byte for byte, validates, and materializes every committed step bit for bit like the
  source; a second sync copies nothing; an earlier state of the chain synced first, then the
  whole, copies only the rest. The golden sharded chains of every kind replicate too.
- Interrupted at object writes, rank chain records, syncs and commit records (with a
  simulated machine crash that drops what was not made durable): the replica is empty, an
  unfinished creation, or valid with every committed step whole and bit-exact; the next sync
  finishes it.
- A commit record is never created before every rank chain of the replica holds its step
  (every creation is watched); a source whose rank chain lags gets only the records its rank
  chains hold, the rest once the rank chain catches up.
- Truncation of the source (spec §20.8): the truncating record is copied before the rank
  chains are synced to the truncated state, so that the replica never shows a committed step
  that its newest record does not commit; a source rewound and recorded again with other
  values (chains written in this process) never shows a step mixing the two versions, at any
  moment of the copy.
- Refusals that change nothing: a diverged replica (a commit record or a rank chain), another
  sharded chain, an ordinary chain into a sharded one and back, one rank chain as a
  destination, a rank chain of the replica locked by a live writer.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitwise import assert_same, bits
from clirun import invoke
from make_sharded import FSDP_STEPS, FSDP_WORLD
from paths import TESTS
from torch import nn

import ldformat
from ldformat import ReplicaDivergedError, UsageError
from ldformat.chain.lock import WriterLock
from ldformat.chain.records import ROOT_FILE, log_path, now
from ldformat.chain.sharded_probe import SHARDED_ROOT, rank_location
from ldformat.errors import ChainLockedError, WriterIOError
from ldformat.format.manifest import Record
from ldformat.sharded.chain import (
    Commit,
    ShardedRoot,
    commit_path,
    create_commit,
    create_sharded_root,
    newest_commit,
    read_commits,
)
from ldformat.sharded.layout import Layout, Shard
from ldformat.stores import WRITES, FaultyStore, LocalStore, MemoryStore, Store
from ldformat.stores.prefixed import PrefixedStore
from ldformat.testing.store_contract import StoreContract

GOLDEN = TESTS / "golden" / "1.3"
WORLD = FSDP_WORLD
STEPS = FSDP_STEPS

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning"),
]


# -- helpers ---------------------------------------------------------------------------------------
def files(root: Path) -> dict[str, str]:
    """Every file below ``root`` but the writer locks, by relative path, as a digest."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "lock" not in p.relative_to(root).parts}


def referenced(chain: Path) -> dict[str, str]:
    """The files a reader of the sharded chain reads (roots, records, referenced objects)."""
    out = {SHARDED_ROOT: hashlib.sha256((chain / SHARDED_ROOT).read_bytes()).hexdigest()}
    for p in sorted((chain / "commits").glob("*.json")):
        out[f"commits/{p.name}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    reader = ldformat.open_reader(chain)
    assert isinstance(reader, ldformat.ShardedReader)
    for r, rank in reader.ranks.items():
        base = chain / "ranks" / f"{r:05d}"
        names = [ROOT_FILE, *(log_path(rec.seq) for rec in rank.records), *sorted(rank.state.referenced_objects())]
        out.update({f"ranks/{r:05d}/{n}": hashlib.sha256((base / n).read_bytes()).hexdigest() for n in names})
    return out


def sharded(path: Path | str) -> ldformat.ShardedReader:
    reader = ldformat.open_reader(path)
    assert isinstance(reader, ldformat.ShardedReader)
    return reader


def dump(store: MemoryStore, out: Path) -> Path:
    """The objects of a store that holds a sharded chain, as files, for readers of a directory."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for p in store.list(""):
        (out / p).parent.mkdir(parents=True, exist_ok=True)
        (out / p).write_bytes(store.read(p))
    return out


def rank_top_step(data: bytes) -> int:
    record = Record.from_bytes(data, "record")
    return max([a.step for a in record.anchors] + [s.step for d in record.deltas for s in d.steps], default=-1)


def remove_rank_steps(chain: Path, rank: int, after: int) -> list[tuple[Path, bytes]]:
    """Delete rank ``rank``'s log records that hold a step after ``after`` (as if it lagged
    behind); returns them, to be put back."""
    removed = []
    for p in sorted((chain / "ranks" / f"{rank:05d}" / "log").glob("*.json")):
        data = p.read_bytes()
        if rank_top_step(data) > after:
            removed.append((p, data))
            p.unlink()
    return removed


# -- the chain made by an FSDP2 job (the fsdp_chain fixture of tests/conftest.py) ---------------------
@pytest.fixture(scope="module")
def truth(fsdp_chain: Path) -> dict[int, dict[str, Any]]:
    """The source's full state at every committed step."""
    reader = sharded(fsdp_chain)
    return {s: reader.materialize(s) for s in reader.steps}


@pytest.fixture
def source(fsdp_chain: Path, tmp_path: Path) -> Path:
    """A copy of the chain that a test may change."""
    shutil.copytree(fsdp_chain, tmp_path / "src")
    return tmp_path / "src"


def assert_replica(dst: Path, src: Path, truth: dict[int, dict[str, Any]] | None = None) -> None:
    """``dst`` holds what a reader of ``src`` reads, byte for byte, validates, and materializes
    every committed step bit for bit like ``src``."""
    assert referenced(dst) == referenced(src)
    report = ldformat.validate(dst)
    assert report.ok, [str(p) for p in report.problems]
    mine, theirs = sharded(dst), sharded(src)
    assert mine.steps == theirs.steps and mine.anchors == theirs.anchors
    for step in mine.steps:
        assert_same(mine.materialize(step), truth[step] if truth else theirs.materialize(step), f"step {step}")


def check_partial(dst: Path, src_steps: list[int], truth: dict[int, dict[str, Any]]) -> str:
    """What an interrupted sync left: nothing, an unfinished creation (the root, maybe rank
    chains, no commit record), or a valid sharded chain whose committed steps are exactly the
    source's up to its newest record, each whole and bit-exact."""
    if not (dst / SHARDED_ROOT).exists():
        assert not (dst / "commits").exists()
        return "empty"
    commits = read_commits(LocalStore(dst), str(dst))
    if not commits:
        return "unfinished"
    report = ldformat.validate(dst)
    assert report.ok, [str(p) for p in report.problems]
    reader = sharded(dst)
    assert reader.steps == [s for s in src_steps if s <= commits[-1].step]
    for step in reader.steps:
        assert_same(reader.materialize(step), truth[step], f"step {step}")
    return "valid"


@pytest.fixture
def watch_commits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, list[list[int]]]]:
    """Every commit record the replicator creates, with the steps each rank chain of the
    replica held just before: (replica, step, steps per rank chain)."""
    import ldformat.sharded.replicate as replicate

    seen: list[tuple[str, int, list[list[int]]]] = []
    create = replicate.create_or_lose

    def watched(store: Store, path: str, data: bytes, where: str, lost: str, failed: str) -> None:
        if path.startswith("commits/"):
            step = Commit.from_bytes(data, path).step
            world = ShardedRoot.from_bytes(store.read(SHARDED_ROOT), where).world_size
            held = []
            for r in range(world):
                if isinstance(store, LocalStore):
                    rank: ldformat.ChainReader = ldformat.ChainReader(rank_location(store.root, r))
                else:
                    rank = ldformat.ChainReader(f"{where}/ranks/{r:05d}", store=PrefixedStore(
                        store, f"ranks/{r:05d}"))
                held.append(rank.steps)
            seen.append((where, step, held))
        create(store, path, data, where, lost, failed)

    monkeypatch.setattr(replicate, "create_or_lose", watched)
    return seen


def assert_held_first(seen: list[tuple[str, int, list[list[int]]]]) -> None:
    for where, step, held in seen:
        assert all(step in steps for steps in held), f"{where}: commit record of step {step} before {held}"


# -- the view of one rank chain inside a store ---------------------------------------------------------
class TestRankChainView(StoreContract[Store]):
    """A rank chain of a sharded chain given as a store (or a directory) is the part of it
    below ``ranks/<rank>``: a store that keeps the whole contract, crashes included."""

    @pytest.fixture
    def store(self) -> Store:

        return PrefixedStore(MemoryStore(), "ranks/00001")

    def reopen(self, store: Store) -> Store:

        assert isinstance(store, PrefixedStore) and isinstance(store.inner, MemoryStore)
        return PrefixedStore(store.inner.reopen(), store.prefix)

    def crash(self, store: Store) -> None:

        assert isinstance(store, PrefixedStore) and isinstance(store.inner, MemoryStore)
        store.inner.crash()


def test_rank_chain_view_keeps_to_its_prefix() -> None:

    inner = MemoryStore()
    inner.write("ranks/00000/log/000000000001.json", b"rank 0")
    inner.write("ranks/000001/x", b"another directory")
    view = PrefixedStore(inner, "ranks/00001")
    view.write("log/000000000001.json", b"rank 1")
    assert view.list("") == ["log/000000000001.json"] and view.list("log") == ["log/000000000001.json"]
    assert inner.read("ranks/00001/log/000000000001.json") == b"rank 1"
    with pytest.raises(ldformat.CorruptChainError):
        view.read("../00000/log/000000000001.json")


# -- which commit records may be created -------------------------------------------------------------
def _copyable_by_definition(pending: list[int], later: list[int], start: int | None, held: set[int],
                            synced: bool) -> int:
    """The conditions of the replication order, written out directly (slowly)."""
    floor = -1 if start is None else start
    for n in range(len(pending), 0, -1):
        step, earlier = pending[n - 1], pending[:n - 1]
        if step not in held:
            continue
        if synced:
            ok = not any(s < step for s in pending[n:] + later) and not any(
                max(step, floor) < h <= s for s in earlier for h in held)
        else:
            ok = start is not None and step <= min([start, *earlier]) and not any(
                min([start, *earlier[:i]]) < h <= s for i, s in enumerate(earlier) for h in held)
        if ok:
            return n
    return 0


def test_copyable_follows_the_rules() -> None:
    import random

    from ldformat.sharded.replicate import copyable

    # Ascending records are all copied once held; none before the rank chains are synced.
    assert copyable([2, 4, 6], [], 0, {0, 1, 2, 3, 4, 5, 6}, rank_chains_synced=True) == 3
    assert copyable([2, 4, 6], [], 0, {0, 1, 2, 3, 4, 5, 6}, rank_chains_synced=False) == 0
    assert copyable([2, 4, 6], [], 0, {0, 1, 2, 3, 4}, rank_chains_synced=True) == 2
    # A truncating record (to 3) goes first when nothing before it shows a held step above 6.
    assert copyable([3], [], 6, set(range(7)), rank_chains_synced=False) == 1
    assert copyable([8, 3], [], 6, set(range(7)), rank_chains_synced=False) == 2
    assert copyable([8, 3], [], 6, set(range(9)), rank_chains_synced=False) == 0  # 8 would show 7, 8
    assert copyable([2, 3], [], 6, set(range(7)), rank_chains_synced=False) == 1  # 3 was truncated by 2
    # After the rank chains: not a record that a later one truncated below.
    assert copyable([5, 7], [4], 3, set(range(8)), rank_chains_synced=True) == 0
    assert copyable([6, 3, 5], [], 4, {0, 1, 2, 3}, rank_chains_synced=True) == 2
    rng = random.Random(7)
    for _ in range(3000):
        pending = [rng.randrange(9) for _ in range(rng.randrange(6))]
        later = [rng.randrange(9) for _ in range(rng.randrange(3))]
        start = rng.choice([None, *range(9)])
        held = {h for h in range(9) if rng.random() < 0.6}
        for synced in (True, False):
            assert copyable(pending, later, start, held, rank_chains_synced=synced) == _copyable_by_definition(
                pending, later, start, held, synced), (pending, later, start, held, synced)


# -- a replica of the FSDP2 chain -------------------------------------------------------------------
def test_replica_is_byte_identical_and_materializes_bit_exactly(
        fsdp_chain: Path, truth: dict[int, dict[str, Any]], tmp_path: Path,
        watch_commits: list[tuple[str, int, list[list[int]]]]) -> None:
    before = files(fsdp_chain)
    progress: list[tuple[str, int, int]] = []
    report = ldformat.sync(fsdp_chain, tmp_path / "dst", progress=lambda *a: progress.append(a))
    commits = read_commits(LocalStore(fsdp_chain), str(fsdp_chain))
    assert (report.sharded, report.world_size, report.created, report.up_to_date) == (True, WORLD, True, True)
    assert report.records_copied == len(commits) == report.src_last_seq == report.dst_last_seq
    assert report.rank_records_copied == sum(len(list((fsdp_chain / "ranks" / f"{r:05d}" / "log").glob("*.json")))
                                             for r in range(WORLD))
    assert (report.src_latest_step, report.dst_latest_step, report.lag_steps) == (STEPS, STEPS, 0)
    assert [r.dst for r in report.ranks] == [f"{tmp_path / 'dst'}/ranks/{r:05d}" for r in range(WORLD)]
    assert report.objects_copied == sum(r.objects_copied for r in report.ranks) > 0
    assert progress and progress[-1] == ("bytes", report.bytes_copied, report.bytes_copied)
    assert all(b[1] <= b[2] == report.bytes_copied for b in progress)
    assert_replica(tmp_path / "dst", fsdp_chain, truth)
    assert files(tmp_path / "dst") == files(fsdp_chain)  # nothing else either (no garbage, no temporaries)
    assert [s for _, s, _ in watch_commits] == [c.step for c in commits]
    assert_held_first(watch_commits)
    assert files(fsdp_chain) == before  # the source is only read
    data = report.to_dict()
    assert data["sharded"] and data["rank_records_copied"] == report.rank_records_copied
    assert [r["records_copied"] for r in data["ranks"]] == [r.records_copied for r in report.ranks]

    again = ldformat.sync(fsdp_chain, tmp_path / "dst")
    assert (again.records_copied, again.rank_records_copied, again.objects_copied, again.bytes_copied) == (0, 0, 0, 0)
    assert again.up_to_date and not again.created and again.lag_steps == 0
    assert files(tmp_path / "dst") == files(fsdp_chain)
    invoke("validate", tmp_path / "dst")


def test_ldtools_sync_and_validate(fsdp_chain: Path, tmp_path: Path) -> None:
    line = invoke("sync", fsdp_chain, tmp_path / "dst").stdout.strip()
    commits = len(list((fsdp_chain / "commits").glob("*.json")))
    assert line.startswith(f"synced {commits} ") and "up to date" in line, line
    assert f"{tmp_path / 'dst'} at step {STEPS}" in line
    invoke("validate", tmp_path / "dst")
    assert "(sharded" in invoke("info", tmp_path / "dst").stdout
    data = json.loads(invoke("sync", fsdp_chain, tmp_path / "dst", "--json").stdout)
    assert (data["records_copied"], data["rank_records_copied"], data["sharded"], data["up_to_date"]) == (
        0, 0, True, True)
    assert len(data["ranks"]) == WORLD
    # One rank chain copied out on its own is an ordinary chain.
    invoke("sync", fsdp_chain / "ranks" / "00001", tmp_path / "rank1")
    assert ldformat.ChainReader(tmp_path / "rank1").steps == sharded(fsdp_chain).ranks[1].steps


KEEP = 3  # commit records of the earlier state of the chain


@pytest.fixture(scope="module")
def early(fsdp_chain: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chain as it was after its third commit record (its later records removed)."""
    early = tmp_path_factory.mktemp("early") / "chain"
    shutil.copytree(fsdp_chain, early)
    commits = read_commits(LocalStore(fsdp_chain), str(fsdp_chain))
    for c in commits[KEEP:]:
        (early / commit_path(c.seq)).unlink()
    for r in range(WORLD):
        remove_rank_steps(early, r, commits[KEEP - 1].step)
    assert sharded(early).steps == list(range(commits[KEEP - 1].step + 1))
    return early


def test_incremental_from_an_earlier_state(fsdp_chain: Path, early: Path, truth: dict[int, dict[str, Any]],
                                           tmp_path: Path) -> None:
    """The earlier state of the chain, then the whole: the second sync copies only the later
    records and the objects they reference."""
    commits = read_commits(LocalStore(fsdp_chain), str(fsdp_chain))
    keep = KEEP
    first = ldformat.sync(early, tmp_path / "dst")
    assert first.records_copied == keep and first.up_to_date
    assert_replica(tmp_path / "dst", early, truth)
    second = ldformat.sync(fsdp_chain, tmp_path / "dst")
    assert second.records_copied == len(commits) - keep and not second.created and second.up_to_date
    assert 0 < second.bytes_copied < first.bytes_copied + second.bytes_copied
    shutil.rmtree(tmp_path / "whole", ignore_errors=True)
    whole = ldformat.sync(fsdp_chain, tmp_path / "whole")
    assert second.objects_copied + first.objects_copied >= whole.objects_copied > second.objects_copied
    assert_replica(tmp_path / "dst", fsdp_chain, truth)


@pytest.mark.parametrize("name", ["sharded.state.xor", "sharded.grad.dense", "sharded.grad.topk"])
def test_golden_sharded_chains_replicate(name: str, tmp_path: Path) -> None:
    src = GOLDEN / name / "chain"
    before = files(src)
    report = ldformat.sync(src, tmp_path / "dst")
    assert report.up_to_date and report.records_copied == len(list((src / "commits").glob("*.json")))
    assert_replica(tmp_path / "dst", src)
    assert ldformat.validate(tmp_path / "dst", deep=True).ok
    assert files(src) == before


# -- interruptions -----------------------------------------------------------------------------------
def _interrupt(chain: Path, truth: dict[int, dict[str, Any]], tmp_path: Path,
               arm: Callable[[FaultyStore], None], early: Path | None = None) -> tuple[str, int]:
    """Sync into memory (a replica of ``early`` first, if given) with faults armed, drop what
    was not made durable (a machine crash), check what is left, then sync again without
    faults: the replica is complete."""
    inner = MemoryStore()
    dst = FaultyStore(inner)
    if early is not None:
        ldformat.sync(early, dst)
    arm(dst)
    try:
        ldformat.sync(chain, dst, workers=1)
        failed = 0
    except WriterIOError as e:
        assert "sync again" in str(e), e
        failed = 1
    inner.crash()
    status = check_partial(dump(inner, tmp_path / "left"), sharded(chain).steps, truth)
    dst.clear()
    resumed = ldformat.sync(chain, dst, workers=1)
    assert resumed.up_to_date and inner.unsynced() == []
    assert referenced(dump(inner, tmp_path / "done")) == referenced(chain)
    return status, failed


def test_interrupted_at_object_writes_resumes(fsdp_chain: Path, truth: dict[int, dict[str, Any]],
                                              tmp_path: Path) -> None:
    total = ldformat.sync(fsdp_chain, MemoryStore()).objects_copied
    statuses = set()
    for n in sorted({*range(0, total, 6), total - 1, total}):
        def arm(dst: FaultyStore, n: int = n) -> None:
            dst.fail(WRITES, errno.ENOSPC, after=n, torn=0.5)  # the disk fills up after n objects

        status, failed = _interrupt(fsdp_chain, truth, tmp_path, arm)
        assert failed == (n < total), n
        statuses.add(status)
    assert statuses == {"unfinished", "valid"}


@pytest.mark.parametrize(("op", "path", "when"), [
    ("create_exclusive", "ranks/*/log/*", "before"), ("create_exclusive", "ranks/*/log/*", "after"),
    ("create_exclusive", "commits/*", "before"), ("create_exclusive", "commits/*", "after"),
    ("create_exclusive", SHARDED_ROOT, "before"), ("sync", "*", "before")])
def test_interrupted_at_records_and_syncs_resumes(fsdp_chain: Path, truth: dict[int, dict[str, Any]], tmp_path: Path,
                                                  op: Any, path: str, when: Any) -> None:
    counts = {"ranks/*/log/*": sum(len(list((fsdp_chain / "ranks" / f"{r:05d}" / "log").glob("*.json")))
                                   for r in range(WORLD)),
              "commits/*": len(list((fsdp_chain / "commits").glob("*.json"))), SHARDED_ROOT: 1, "*": 12}
    statuses = set()
    for k in range(counts[path]):
        def arm(dst: FaultyStore, k: int = k) -> None:
            dst.fail(op, path=path, after=k, when=when)

        status, failed = _interrupt(fsdp_chain, truth, tmp_path, arm)
        assert failed, (op, path, when, k)
        statuses.add(status)
    if path == "commits/*":
        assert "valid" in statuses
    if path == SHARDED_ROOT:
        assert statuses == {"empty"}


@pytest.mark.parametrize(("op", "path"), [(WRITES, "*"), ("create_exclusive", "ranks/*/log/*"),
                                        ("create_exclusive", "commits/*"), ("sync", "*")])
def test_interrupted_incremental_sync_stays_valid(fsdp_chain: Path, early: Path, truth: dict[int, dict[str, Any]],
                                                  tmp_path: Path, op: Any, path: str) -> None:
    """A replica of the earlier state, interrupted while it catches up: valid at every point."""
    for k in range(0, 30, 3):
        def arm(dst: FaultyStore, k: int = k) -> None:
            dst.fail(op, path=path, after=k, when="before")

        status, failed = _interrupt(fsdp_chain, truth, tmp_path, arm, early=early)
        assert status == "valid", (op, path, k)
        if not failed:
            break


# -- commit records wait for the rank chains ---------------------------------------------------------
def test_records_wait_until_every_rank_chain_holds_the_step(
        source: Path, truth: dict[int, dict[str, Any]], tmp_path: Path,
        watch_commits: list[tuple[str, int, list[list[int]]]]) -> None:
    """Rank 1's chain of the source lags (its newest records are held back): the replica gets
    the commit records up to the newest step that rank chain holds; once it catches up, the rest."""
    commits = read_commits(LocalStore(source), str(source))
    held_back = remove_rank_steps(source, 1, 3)
    rank1 = set(sharded(source).ranks[1].steps)
    waiting = next(i for i, c in enumerate(commits) if c.step not in rank1)
    assert 0 < waiting < len(commits)
    report = ldformat.sync(source, tmp_path / "dst")
    assert report.records_copied == report.dst_last_seq == waiting and not report.up_to_date
    # The source's own newest committed step is at least that one: its newest record's step is
    # not in every rank chain of it (spec §20.3.2), and the steps between the record copied last
    # and the newest step rank 1 holds have no record of their own (when a batch ends is timing).
    assert report.dst_latest_step == commits[waiting - 1].step <= report.src_latest_step
    assert report.lag_steps == len([s for s in sharded(source).steps if s > commits[waiting - 1].step])
    mine = sharded(tmp_path / "dst")
    assert mine.steps == [s for s in truth if s <= commits[waiting - 1].step]
    assert ldformat.validate(tmp_path / "dst").ok
    assert_held_first(watch_commits)
    for p, data in held_back:  # the rank chain catches up
        p.write_bytes(data)
    report = ldformat.sync(source, tmp_path / "dst")
    assert report.records_copied == len(commits) - waiting and report.up_to_date
    assert_replica(tmp_path / "dst", source, truth)
    assert_held_first(watch_commits)


# -- refusals ------------------------------------------------------------------------------------------
def test_diverged_replica_is_refused(fsdp_chain: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    ldformat.sync(fsdp_chain, dst)
    commits = read_commits(LocalStore(dst), str(dst))
    # The newest commit record rewritten (another time): same number, other bytes.
    import dataclasses

    other = dataclasses.replace(commits[-1], time=now(), checksum="")
    (dst / commit_path(other.seq)).write_bytes(other.to_bytes())
    before = files(dst)
    with pytest.raises(ReplicaDivergedError, match="diverged"):
        ldformat.sync(fsdp_chain, dst)
    assert files(dst) == before
    line = invoke("sync", fsdp_chain, dst, code=1).stderr
    assert "diverged" in line and "Traceback" not in line
    # One more record than the source.
    shutil.rmtree(dst)
    ldformat.sync(fsdp_chain, dst)
    create_commit(LocalStore(dst), str(dst), STEPS, newest_commit(LocalStore(dst), str(dst)))
    before = files(dst)
    with pytest.raises(ReplicaDivergedError, match="commit records"):
        ldformat.sync(fsdp_chain, dst)
    assert files(dst) == before
    # A rank chain written to directly: its newest record differs.
    shutil.rmtree(dst)
    ldformat.sync(fsdp_chain, dst)
    log = sorted((dst / "ranks" / "00001" / "log").glob("*.json"))[-1]
    record = Record.from_bytes(log.read_bytes(), str(log))
    log.write_bytes(dataclasses.replace(record, reason="written here", checksum="").to_bytes())
    before = files(dst)
    with pytest.raises(ReplicaDivergedError, match="ranks/00001"):
        ldformat.sync(fsdp_chain, dst)
    assert files(dst) == before


def test_other_chains_are_refused(fsdp_chain: Path, tmp_path: Path) -> None:
    # Another sharded chain (another chain id).
    other = tmp_path / "other"
    shutil.copytree(GOLDEN / "sharded.state.xor" / "chain", other)
    before = files(other)
    with pytest.raises(ReplicaDivergedError, match="holds sharded chain"):
        ldformat.sync(fsdp_chain, other)
    assert files(other) == before
    # An ordinary chain into a sharded one, and back.
    plain = tmp_path / "plain"
    ldformat.sync(fsdp_chain / "ranks" / "00000", plain)
    with pytest.raises(UsageError, match="holds an ordinary chain") as e:
        ldformat.sync(fsdp_chain, plain)
    assert str(fsdp_chain) in str(e.value)
    with pytest.raises(UsageError, match="holds a sharded chain") as e:
        ldformat.sync(plain, other)
    assert str(plain) in str(e.value)
    assert files(other) == before
    with pytest.raises(UsageError, match="holds a sharded chain"):
        ldformat.sync(plain, LocalStore(other))
    # One rank chain of a sharded chain as the destination, whatever the source.
    for src in (plain, fsdp_chain):
        line = invoke("sync", src, other / "ranks" / "00001", code=2).stderr
        assert "one rank's chain of a sharded chain" in line, line
    assert files(other) == before
    # A directory holding something else.
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        ldformat.sync(fsdp_chain, tmp_path / "junk")
    assert sorted(p.name for p in (tmp_path / "junk").iterdir()) == ["notes.txt"]
    with pytest.raises(UsageError, match="is the source"):
        ldformat.sync(fsdp_chain, str(fsdp_chain) + "/")


def test_a_live_writer_on_a_rank_chain_of_the_replica_is_refused(fsdp_chain: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    ldformat.sync(fsdp_chain, dst)
    lock = WriterLock.acquire(LocalStore(dst / "ranks" / "00001"), "rank 1")  # this process: alive
    try:
        before = files(dst)
        with pytest.raises(ChainLockedError, match="rank 1's chain of the replica"):
            ldformat.sync(fsdp_chain, dst)
        assert files(dst) == before
    finally:
        lock.release()
    assert ldformat.sync(fsdp_chain, dst).up_to_date  # rank 0's lock was released too


# -- truncation and rewinds, with chains written in this process -------------------------------------
class Sharded:
    """A world-2 state.xor sharded chain written in this process: each rank records its rows
    of ``weight`` (4 x 3) and ``bias`` (4) with its own ChainWriter; the test makes the commit
    records. ``version`` changes the values recorded for a step (a run after a rewind)."""

    ROWS = 2

    def __init__(self, path: Path) -> None:
        self.path = path
        self.models: list[nn.Linear] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.writers: list[ldformat.ChainWriter | None] = []
        layout = {
            "model/weight": Layout("float32", (WORLD * self.ROWS, 3), tuple(
                Shard(r, (r * self.ROWS, 0), (self.ROWS, 3)) for r in range(WORLD))),
            "model/bias": Layout("float32", (WORLD * self.ROWS,), tuple(
                Shard(r, (r * self.ROWS,), (self.ROWS,)) for r in range(WORLD))),
        }
        path.mkdir(parents=True)
        self.store = LocalStore(path)
        create_sharded_root(self.store, ShardedRoot(chain_id=os.urandom(16).hex(), created=now(), kind="state.xor",
                                                    world_size=WORLD, mesh_shape=(WORLD,), dim_names=None,
                                                    tensors=layout), str(path))
        for r in range(WORLD):
            model = nn.Linear(3, self.ROWS)
            self._set(model, r, 0, 0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            self.models.append(model)
            self.optimizers.append(optimizer)
            self.writers.append(ldformat.ChainWriter.create(rank_location(path, r), model, optimizer,
                                                            kind="state.xor", batch_steps=1, anchor_every=3,
                                                            format_version="1.3"))
        self.versions: dict[int, int] = {0: 0}  # the version each step of the chain holds now
        #: what each commit record made committed: seq -> {step: version}
        self.committed: dict[int, dict[int, int]] = {}
        self.commit(0)

    @staticmethod
    def value(step: int, version: int) -> torch.Tensor:
        """The global weight (4 x 3) then bias (4) of a step, as one tensor of 16 values."""
        return torch.arange(16, dtype=torch.float32) * 0.25 + step + 100.0 * version

    def _set(self, model: nn.Linear, rank: int, step: int, version: int) -> None:
        v = self.value(step, version)
        weight, bias = v[:12].reshape(4, 3), v[12:]
        rows = slice(rank * self.ROWS, (rank + 1) * self.ROWS)
        with torch.no_grad():
            model.weight.copy_(weight[rows])
            model.bias.copy_(bias[rows])

    def record(self, step: int, version: int = 0, ranks: range | None = None) -> None:
        for r in ranks if ranks is not None else range(WORLD):
            writer = self.writers[r]
            assert writer is not None
            self._set(self.models[r], r, step, version)
            writer.record_step(step)
        self.versions[step] = version

    def commit(self, step: int) -> None:
        record = create_commit(self.store, str(self.path), step, newest_commit(self.store, str(self.path)))
        self.committed[record.seq] = {s: v for s, v in self.versions.items() if s <= step}

    def rewind(self, after: int) -> None:
        """Truncate after ``after`` (ldformat's own sharded truncation) and reopen the writers."""
        from ldformat.sharded.maintenance import truncate_sharded

        for w in self.writers:
            assert w is not None
            w.close()
        truncate_sharded(self.path, after)
        seq = newest_commit(self.store, str(self.path))
        assert seq is not None and seq.step == after
        self.versions = {s: v for s, v in self.versions.items() if s <= after}
        self.committed[seq.seq] = dict(self.versions)
        self.writers = [ldformat.ChainWriter.open(rank_location(self.path, r), self.models[r], self.optimizers[r],
                                                  batch_steps=1, anchor_every=3) for r in range(WORLD)]

    def close(self) -> None:
        for w in self.writers:
            if w is not None:
                w.close()
        self.writers = [None] * WORLD


def global_value(state: dict[str, Any]) -> torch.Tensor:
    return torch.cat([state["model"]["weight"].reshape(-1), state["model"]["bias"]])


class Watching(LocalStore):
    """The replica's store: after every record it creates (rank chain or commit record), what a
    reader of the replica sees is checked."""

    def __init__(self, root: Path, check: Callable[[str], None]) -> None:
        super().__init__(root)
        self.check = check

    def create_exclusive(self, path: str, data: bytes) -> None:
        super().create_exclusive(path, data)
        if path.startswith("commits/") or "/log/" in path:
            self.check(path)


def watch(dst: Path, chain: Sharded, exact: bool) -> tuple[Watching, list[dict[int, int]]]:
    """A store for ``dst`` that checks, after every record created in it, that each step its
    reader sees committed holds the values one version of the source committed, in every
    rank chain (never a mix), and that they are the steps the newest commit record committed
    at the source (``exact``), or some of them."""
    seen: list[dict[int, int]] = []

    def check(path: str) -> None:
        if not (dst / "commits").exists():
            return
        reader = sharded(dst)
        assert reader.commit is not None
        wanted = chain.committed[reader.commit.seq]
        visible = {}
        for step in reader.steps:
            got = global_value(reader.materialize(step))
            versions = [v for v in range(3) if torch.equal(bits(got), bits(Sharded.value(step, v)))]
            assert versions, f"after {path}: step {step} mixes versions: {got.tolist()}"
            visible[step] = versions[0]
        assert set(visible.items()) <= set(wanted.items()), f"after {path}: {visible} not in {wanted}"
        if exact:
            assert visible == wanted, f"after {path}: committed {visible}, the newest record commits {wanted}"
        seen.append(visible)

    return Watching(dst, check), seen


def test_truncation_record_is_copied_before_the_rank_chains(tmp_path: Path) -> None:
    """Source committed up to 6 and replicated; then truncated after 3 and recorded again (4', 5').
    The truncating record reaches the replica before its rank chains are truncated: at every
    moment the replica shows exactly the steps its newest record committed at the source."""
    src = Sharded(tmp_path / "src")
    for step in range(1, 7):
        src.record(step)
    src.commit(6)
    ldformat.sync(src.path, tmp_path / "dst")
    src.rewind(3)
    for step in (4, 5):
        src.record(step, version=1)
    src.commit(5)
    src.close()
    store, seen = watch(tmp_path / "dst", src, exact=True)
    report = ldformat.sync(src.path, store)
    assert report.records_copied == 2 and report.up_to_date
    assert seen[0] == {0: 0, 1: 0, 2: 0, 3: 0}  # the truncating record first: nothing above 3 shows
    assert seen[-1] == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    assert_replica(tmp_path / "dst", src.path)


def test_truncated_source_with_the_replica_interrupted(tmp_path: Path) -> None:
    """The replica's rank chains cannot be written after the truncating record was copied:
    the replica is valid at that record, and the next sync finishes."""
    src = Sharded(tmp_path / "src")
    for step in range(1, 7):
        src.record(step)
    src.commit(4)
    src.commit(6)
    ldformat.sync(src.path, tmp_path / "dst")
    src.rewind(2)
    src.record(3, version=1)
    src.commit(3)
    src.close()
    dst = FaultyStore(LocalStore(tmp_path / "dst"))
    dst.fail("create_exclusive", path="ranks/*/log/*", error=errno.EIO)
    with pytest.raises(WriterIOError):
        ldformat.sync(src.path, dst)
    reader = sharded(tmp_path / "dst")
    assert reader.commit is not None and reader.commit.step == 2 and reader.steps == [0, 1, 2]
    assert ldformat.validate(tmp_path / "dst").ok
    dst.clear()
    assert ldformat.sync(src.path, dst).up_to_date
    assert_replica(tmp_path / "dst", src.path)
    assert global_value(sharded(tmp_path / "dst").materialize(3)).equal(Sharded.value(3, 1))


def test_rewound_source_never_shows_a_mixed_step(tmp_path: Path,
                                                 watch_commits: list[tuple[str, int, list[list[int]]]]) -> None:
    """The replica's rank chains hold steps the source had not committed yet (5, 6) when the
    source commits 6, rewinds to 3 and records 4', 5' again. The truncating record cannot go
    first (the record of 6 before it would show the old 5 and 6), so the rank chains are synced
    only up to 3 first: the replica shows fewer steps for a moment, never a wrong or mixed one."""
    src = Sharded(tmp_path / "src")
    for step in range(1, 7):
        src.record(step)
    src.commit(4)
    ldformat.sync(src.path, tmp_path / "dst")
    assert sharded(tmp_path / "dst").ranks[0].steps == list(range(7))  # 5 and 6 copied, not committed
    src.commit(6)
    src.rewind(3)
    for step in (4, 5):
        src.record(step, version=1)
    src.commit(5)
    src.close()
    store, seen = watch(tmp_path / "dst", src, exact=False)
    watch_commits.clear()
    report = ldformat.sync(src.path, store)
    assert report.up_to_date and report.records_copied == 3
    assert seen[-1] == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
    assert_replica(tmp_path / "dst", src.path)
    # Only the record of 6, superseded by the truncating record created right after it, found
    # its step missing from the rank chains.
    steps = [s for _, s, _ in watch_commits]
    assert steps == [6, 3, 5]
    assert [s for _, s, held in watch_commits if not all(s in h for h in held)] == [6]


def test_rank_chain_lagging_behind_a_rewind(tmp_path: Path,
                                            watch_commits: list[tuple[str, int, list[list[int]]]]) -> None:
    """Rank 1 of the source has not recorded the rewound run's step 5' yet: the replica gets
    the truncating record and the records its rank chains hold, the rest later."""
    src = Sharded(tmp_path / "src")
    for step in range(1, 5):
        src.record(step)
    src.commit(4)
    src.rewind(2)
    src.record(3, version=1)
    src.record(4, version=1)
    src.commit(4)
    src.record(5, version=1, ranks=range(1))  # rank 0 only: not committed
    report = ldformat.sync(src.path, tmp_path / "dst")
    assert report.up_to_date and sharded(tmp_path / "dst").steps == [0, 1, 2, 3, 4]
    src.record(5, version=1, ranks=range(1, 2))
    src.commit(5)
    src.close()
    report = ldformat.sync(src.path, tmp_path / "dst")
    assert report.records_copied == 1 and report.up_to_date
    assert_replica(tmp_path / "dst", src.path)
    assert_held_first(watch_commits)


