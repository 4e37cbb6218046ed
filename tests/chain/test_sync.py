"""Replication of a chain (spec §17.5 "Replication"): ``ldformat.sync`` and ``ldtools sync``.

- Every kind, to a local directory, a ``MemoryStore`` and a ``memory://`` URL: the replica
  holds the source's root, records and referenced objects byte for byte, validates, and
  materializes every step bit-exactly like the source (and like the live training state).
- Incremental: a second sync copies exactly the records and objects committed since.
- Interrupted at every object write, sync, record create and root create (with and without
  a simulated machine crash dropping what was not made durable) and by ``kill -9``: the
  replica is valid at its last record, or an unfinished replica creation, at every
  interruption, and the next sync completes it.
- The source compacted or truncated between syncs (the replica jumps to the snapshot) and
  while a sync reads it (the sync folds it again).
- Refusals that change nothing: another chain, a replica written to directly, a directory
  holding other data, a live writer on the replica (``ChainLockedError``, exit code 4).
- A takeover of a dead replicator's lock is fenced by the first copied record; with nothing
  to copy it deletes nothing and leaves the lock held.
- ``ldtools sync`` to and from ``s3://`` (a ``moto_server`` on 127.0.0.1, ``s3server.py``)
  cut off mid-way by a store that fails every request from some point on (503, reset
  connections), and ``kill -9`` of an ``ldtools sync`` to ``s3://``: a clean error exit
  (or a dead process), a replica that is valid or an unfinished creation, and a rerun in
  the same process that completes it, bit-exact.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from click.testing import CliRunner
from models import assert_state_bits_equal, snapshot, train_step
from test_lock import make_chain, make_training, plant_stale_lock

import ldformat
from ldformat import ChainLockedError, ChainReader, ChainWriter, NotAChainError, ReplicaDivergedError, UsageError
from ldformat.chain.lock import current_lock
from ldformat.chain.records import ROOT_FILE, log_path, log_sequence_numbers, read_log
from ldformat.errors import WriterIOError
from ldformat.stores import WRITES, FaultyStore, LocalStore, MemoryStore, Store, open_store
from ldtools.cli import cli

if TYPE_CHECKING:  # s3server is loaded as a plugin (below), not imported before it
    from s3server import FaultProxy, MotoServer

pytest_plugins = ["s3server"]  # the fixtures moto, s3_env, s3_url and fault_proxy

KINDS = ["grad.topk", "grad.dense", "state.xor"]


class Live:
    """A training run writing a source chain (the writer stays open between syncs)."""

    def __init__(self, path: Path, kind: str = "grad.dense", *, batch_steps: int = 2, anchor_every: int = 4) -> None:
        self.path = path
        self.model, self.optimizer = make_training()
        self.topk = ldformat.TopK(0.2) if kind == "grad.topk" else None
        self.writer = ChainWriter.create(path, self.model, self.optimizer, kind=kind, compressor=self.topk,
                                         batch_steps=batch_steps, anchor_every=anchor_every)
        self.step = 0
        self.truth = {0: snapshot(self.model, self.optimizer)}

    def advance(self, n: int) -> None:
        for _ in range(n):
            self.step += 1
            train_step(self.model, self.optimizer, self.step, compress=self.topk.compress_ if self.topk else None)
            self.writer.record_step(self.step)
            self.truth[self.step] = snapshot(self.model, self.optimizer)


def view(store: Store) -> dict[str, bytes]:
    """What a replica must reproduce: the root, the folded records and every referenced object."""
    records, state = read_log(store, "chain")
    keys = [ROOT_FILE] + [log_path(r.seq) for r in records] + sorted(state.referenced_objects())
    return {k: store.read(k) for k in keys}


def files(store: Store) -> dict[str, bytes]:
    """Everything the store holds except the writer lock (not committed content, spec §15)."""
    return {p: store.read(p) for p in store.list("") if not p.startswith("lock/")}


def assert_replica(dst: Store, src: Store, truth: dict[int, Any] | None = None) -> None:
    """``dst`` is a complete replica of ``src``: same content, no garbage, valid, same states."""
    want = view(src)
    assert view(dst) == want
    assert set(files(dst)) == set(want), "the replica holds garbage or superseded records"
    report = ldformat.validate("replica", store=dst)
    assert report.ok, report.problems
    a, b = ChainReader("source", store=src), ChainReader("replica", store=dst)
    assert a.steps == b.steps
    for s in a.steps:
        got, expected = b.materialize(s), a.materialize(s)
        assert_state_bits_equal(got, expected, f"step {s}")
        assert got["extra"] == expected["extra"] and got["step"] == expected["step"] == s
        if truth is not None:
            assert_state_bits_equal(got, truth[s], f"step {s} against the live state")


def assert_valid_or_unfinished(dst: Store, src: Store) -> str:
    """At an interruption: a valid chain whose records are the source's, or an unfinished creation."""
    if not dst.exists(ROOT_FILE):
        seqs = log_sequence_numbers(dst)
        assert len(seqs) <= 1, seqs
        with pytest.raises(NotAChainError):
            ldformat.validate("replica", store=dst)
        return "unfinished"
    report = ldformat.validate("replica", store=dst)
    assert report.ok, report.problems
    records, _ = read_log(dst, "replica")
    for r in records:
        assert dst.read(log_path(r.seq)) == src.read(log_path(r.seq))
    return "valid"


def referenced(store: Store, after_seq: int = 0) -> tuple[int, int, int]:
    """Records of ``store``'s fold above ``after_seq``, and the objects (count, bytes) they reference."""
    records, _ = read_log(store, "chain")
    objects: dict[str, int] = {}
    count = 0
    for r in records:
        if r.seq <= after_seq:
            continue
        count += 1
        for a in r.anchors:
            objects[a.object.path] = a.object.size
        for d in r.deltas:
            for o in d.objects:
                objects[f"{d.path}/{o.path}"] = o.size
    return count, len(objects), sum(objects.values())


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Live]:
    """A closed source chain of each kind: 10 steps, batches of 2, anchors every 4 steps."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for kind in KINDS:
        live = Live(root / kind.replace(".", "_"), kind)
        live.advance(10)
        live.writer.close()
        out[kind] = live
    return out


# -- full copies ------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["local", "memory", "memory-url"])
@pytest.mark.parametrize("kind", KINDS)
def test_replica_of_every_kind_is_bit_exact(sources: dict[str, Live], tmp_path: Path, kind: str,
                                            target: str) -> None:
    live = sources[kind]
    src = LocalStore(live.path)
    dst_arg: Any
    if target == "local":
        dst_arg = tmp_path / "replica" / "chain"  # parents are created
        dst: Store = LocalStore(dst_arg)
    elif target == "memory":
        dst_arg = dst = MemoryStore()
    else:
        name = f"sync-{kind}-{tmp_path.name}"
        dst_arg, dst = f"memory://{name}", MemoryStore.named(name)
    report = ldformat.sync(live.path, dst_arg)
    records, objects, size = referenced(src)
    assert (report.records_copied, report.objects_copied, report.bytes_copied) == (records, objects, size)
    assert report.objects_skipped == 0 and report.created and report.up_to_date
    assert report.dst_latest_step == report.src_latest_step == 10 and report.lag_steps == 0
    if isinstance(dst, MemoryStore):
        assert dst.unsynced() == []  # everything the replica references was made durable
    assert_replica(dst, src, live.truth)
    assert current_lock(dst) is None  # released

    again = ldformat.sync(live.path, dst_arg)
    assert (again.records_copied, again.objects_copied, again.objects_skipped, again.created) == (0, 0, 0, False)
    assert_replica(dst, src)


def test_incremental_sync_copies_only_new_commits(tmp_path: Path) -> None:
    live = Live(tmp_path / "src", "state.xor")
    src, dst = LocalStore(live.path), MemoryStore()
    live.advance(4)
    first = ldformat.sync(live.path, dst)  # the writer holds the source's lock: sync never takes it
    assert first.records_copied == 3 and first.dst_latest_step == 4
    seen = first.src_last_seq

    live.advance(6)  # three more commits, one with the anchor of step 8
    records, objects, size = referenced(src, seen)
    assert records == 3
    second = ldformat.sync(live.path, dst)
    assert (second.records_copied, second.objects_copied, second.bytes_copied) == (records, objects, size)
    assert second.objects_skipped == 0 and not second.created
    assert second.dst_latest_step == 10 and second.lag_steps == 0

    live.advance(1)  # recorded, not committed: nothing to copy, and no lag a reader could see
    third = ldformat.sync(live.path, dst)
    assert third.records_copied == 0 and third.dst_latest_step == 10 and third.up_to_date
    live.writer.commit()
    fourth = ldformat.sync(live.path, dst)
    assert fourth.records_copied == 1 and fourth.objects_copied == referenced(src, fourth.src_last_seq - 1)[1]
    live.writer.close()
    assert_replica(dst, src, live.truth)


# -- interruptions ----------------------------------------------------------------------------
def _interrupt_and_resume(src_path: Path, src: Store, dst: FaultyStore,
                          crash: bool) -> tuple[Exception | None, str, list[int]]:
    """Sync with ``dst``'s faults armed, check the replica, then sync again without faults.

    Returns the error of the interrupted sync, the replica's status then, and its records then.
    """
    error: Exception | None = None
    try:
        ldformat.sync(src_path, dst, workers=1)
    except WriterIOError as e:
        error = e
    if crash:
        assert isinstance(dst.inner, MemoryStore)
        dst.inner.crash()  # the machine goes down: what was not made durable is lost
    status = assert_valid_or_unfinished(dst.inner, src)
    seqs = log_sequence_numbers(dst.inner)
    dst.clear()
    resumed = ldformat.sync(src_path, dst, workers=1)
    assert resumed.up_to_date
    if isinstance(dst.inner, MemoryStore):
        assert dst.inner.unsynced() == []  # leftovers reused by the rerun were made durable too
    assert_replica(dst.inner, src)
    return error, status, seqs


@pytest.mark.parametrize("target", ["memory+crash", "memory", "local"])
def test_interrupted_at_every_object_write_resumes(sources: dict[str, Live], tmp_path: Path, target: str) -> None:
    live = sources["grad.dense"]
    src = LocalStore(live.path)
    _, total, _ = referenced(src)
    statuses = set()
    # Every n in memory; on a disk (real fsyncs) every third, and the last.
    for n in range(total + 1) if target != "local" else sorted({*range(0, total + 1, 3), total}):
        inner: Store = LocalStore(tmp_path / f"dst{n}") if target == "local" else MemoryStore()
        dst = FaultyStore(inner)
        dst.fail(WRITES, errno.ENOSPC, after=n)  # the disk fills up after n objects
        error, status, _ = _interrupt_and_resume(live.path, src, dst, crash=target == "memory+crash")
        assert (error is None) == (n == total), n
        if error is not None:
            assert "sync again" in str(error)
        statuses.add(status)
    assert statuses == {"unfinished", "valid"}


@pytest.mark.parametrize(("op", "when"), [("record", "before"), ("record", "after"), ("root", "before"),
                                          ("root", "after"), ("sync", "before")])
def test_interrupted_at_every_commit_step_resumes(sources: dict[str, Live], op: str, when: str) -> None:
    live = sources["grad.topk"]
    src = LocalStore(live.path)
    records, _, _ = referenced(src)
    for k in range(1 if op == "root" else records):
        dst = FaultyStore(MemoryStore())
        if op == "record":
            dst.fail("create_exclusive", path="log/*", after=k, when=when)  # the (k+1)-th record
        elif op == "root":
            dst.fail("create_exclusive", path=ROOT_FILE, when=when)
        else:
            dst.fail("sync", after=k)
        error, status, seqs = _interrupt_and_resume(live.path, src, dst, crash=True)
        assert error is not None, (op, when, k)
        if op == "record":
            # after: the record exists although its create failed, and the replica is valid at it
            assert seqs == list(range(1, k + 1 + (when == "after"))), (when, k, seqs)
        # Before the first record and the root exist the replica is not a chain yet.
        expected = "valid" if (op == "root" and when == "after") or (op != "root" and k >= 1) else "unfinished"
        assert status == expected, (op, when, k, status)


KILL_SCRIPT = """
import sys
import ldformat
from ldformat.stores import FaultyStore, LocalStore
dst = FaultyStore(LocalStore(sys.argv[2]), stall={"write_parts": 0.04, "create_exclusive": 0.04})
ldformat.sync(sys.argv[1], dst, workers=1)
"""


@pytest.mark.procs
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="a dead replicator is recognized through /proc")
def test_killed_replicator_is_resumed(sources: dict[str, Live], tmp_path: Path) -> None:
    """``kill -9`` at several points of a copy, then a run to the end, which takes the dead lock over."""
    live = sources["state.xor"]
    src = LocalStore(live.path)
    dst_path = tmp_path / "dst"
    dst = LocalStore(dst_path)
    _, total, _ = referenced(src)
    kills = 0
    for threshold in (3, total // 2, total - 2, None):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(live.path), str(dst_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            written = [p for p in dst.list("") if p.startswith(("anchors/", "deltas/"))]
            if threshold is not None and len(written) >= threshold:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.01)
        _, err = proc.communicate(timeout=120)
        if threshold is None:
            assert proc.returncode == 0, err.decode()
        assert_valid_or_unfinished(dst, src)
    assert kills >= 2
    assert view(dst) == view(src)
    assert ldformat.validate(dst_path).ok


def test_a_lock_whose_release_failed_is_continued_by_the_next_sync(sources: dict[str, Live]) -> None:
    """The replica's store fails from some point on, the release of its lock included: the lock
    stays held by this process, which lives on (a mirror thread, a notebook). The next sync
    here continues with it rather than finding the replica locked by a running writer."""
    live = sources["grad.dense"]
    src, dst = LocalStore(live.path), FaultyStore(MemoryStore())
    dst.fail((*WRITES, "create_exclusive"), errno.EIO, after=6)  # the lock, some objects, then nothing
    with pytest.raises(WriterIOError):
        ldformat.sync(live.path, dst, workers=1)
    held = current_lock(dst.inner)
    assert held is not None and held.pid == os.getpid()  # the release failed
    dst.clear()
    report = ldformat.sync(live.path, dst, workers=1)
    assert report.up_to_date and report.objects_skipped > 0
    assert current_lock(dst.inner) is None
    assert_replica(dst.inner, src, live.truth)
    again = ldformat.sync(live.path, dst, workers=1)  # and a lock released normally is not taken for ours
    assert again.records_copied == 0 and current_lock(dst.inner) is None


# -- the source changes ------------------------------------------------------------------------
def test_source_compacted_and_truncated_between_syncs(tmp_path: Path) -> None:
    live = Live(tmp_path / "src", "grad.dense")
    live.advance(12)
    live.writer.close()
    src, dst = LocalStore(live.path), LocalStore(tmp_path / "dst")
    ldformat.sync(live.path, tmp_path / "dst")
    last = ldformat.sync(live.path, tmp_path / "dst").dst_last_seq

    ldformat.compact(live.path, keep_last=3)  # snapshot last + 1
    ldformat.compact(live.path, max_replay=0)  # snapshot last + 2; last + 1 is deleted as superseded
    assert not src.exists(log_path(last + 1))
    report = ldformat.sync(live.path, tmp_path / "dst")
    assert report.jumped and report.records_copied == 1 and report.dst_last_seq == last + 2
    assert report.objects_skipped > 0  # the kept anchors and batches were on the replica already
    assert report.garbage_removed > 0
    assert log_sequence_numbers(dst) == [last + 2]
    assert_replica(dst, src, live.truth)

    ldformat.truncate(live.path, after=11)
    report = ldformat.sync(live.path, tmp_path / "dst")
    assert report.records_copied == 1 and report.dst_latest_step == 11 and not report.jumped
    assert_replica(dst, src, live.truth)


class CompactsOnFirstRead(LocalStore):
    """A source store that compacts the chain, through another handle, when the sync first reads
    an object: the version the sync folded loses objects under it (spec §17.4)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.compacted = False

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        if not self.compacted and path.startswith(("anchors/", "deltas/")):
            self.compacted = True
            plan = ldformat.compact(self.root, keep_last=3, max_replay=1)
            assert plan.committed and plan.removed_objects
        return super().read_buffer(path, max_size)


def test_source_compacted_while_it_is_copied(sources: dict[str, Live], tmp_path: Path) -> None:
    import shutil

    shutil.copytree(sources["grad.topk"].path, tmp_path / "src")
    src = CompactsOnFirstRead(tmp_path / "src")
    dst = MemoryStore()
    report = ldformat.sync(src, dst, workers=1)
    assert src.compacted and report.source_refolds == 1 and report.up_to_date
    assert ChainReader("replica", store=dst).steps == [8, 9, 10]
    assert_replica(dst, LocalStore(tmp_path / "src"), sources["grad.topk"].truth)


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_corrupt_source_is_reported_and_the_replica_stays_valid(sources: dict[str, Live], tmp_path: Path,
                                                                damage: str) -> None:
    import shutil

    shutil.copytree(sources["grad.dense"].path, tmp_path / "src")
    src = LocalStore(tmp_path / "src")
    records, _ = read_log(src, "src")
    victim = f"{records[2].deltas[0].path}/{records[2].deltas[0].objects[0].path}"  # an object of record 3
    if damage == "missing":
        src.delete(victim)
    else:
        data = bytearray(src.read(victim))
        data[len(data) // 2] ^= 0x01
        src.write(victim, bytes(data))
    dst = MemoryStore()
    error = ldformat.MissingObjectError if damage == "missing" else ldformat.CorruptChainError
    with pytest.raises(error, match=victim):
        ldformat.sync(tmp_path / "src", dst, workers=1)
    assert log_sequence_numbers(dst) == [1, 2]  # the records before the damage, and nothing else
    assert assert_valid_or_unfinished(dst, src) == "valid"
    result = CliRunner().invoke(cli, ["sync", str(tmp_path / "src"), str(tmp_path / "dst")])
    assert result.exit_code == 1 and victim in result.stderr


# -- refusals -----------------------------------------------------------------------------------
def test_another_chain_is_refused(tmp_path: Path) -> None:
    make_chain(tmp_path / "a")
    make_chain(tmp_path / "b")  # same training, another chain id
    ldformat.sync(tmp_path / "a", tmp_path / "dst")
    before = files(LocalStore(tmp_path / "dst"))
    with pytest.raises(ReplicaDivergedError, match="holds chain"):
        ldformat.sync(tmp_path / "b", tmp_path / "dst")
    assert files(LocalStore(tmp_path / "dst")) == before
    result = CliRunner().invoke(cli, ["sync", str(tmp_path / "b"), str(tmp_path / "dst")])
    assert result.exit_code == 1, result.output
    assert "holds chain" in result.stderr and "delete" in result.stderr


def test_replica_written_to_directly_is_refused(tmp_path: Path) -> None:
    live = Live(tmp_path / "src", "grad.dense")
    live.advance(4)
    src_path, dst_path = live.path, tmp_path / "dst"
    ldformat.sync(src_path, dst_path)
    ldformat.truncate(dst_path, after=2)  # a maintainer ran on the replica: its record 4 is its own
    dst = LocalStore(dst_path)
    before = files(dst)
    with pytest.raises(ReplicaDivergedError, match="ends at record 3"):
        ldformat.sync(src_path, dst_path)  # the replica is ahead of the source
    live.advance(2)  # the source's record 4 now exists, and differs
    with pytest.raises(ReplicaDivergedError, match="bytes differ"):
        ldformat.sync(src_path, dst_path)
    assert files(dst) == before
    assert ldformat.validate(dst_path).ok
    live.writer.close()


def test_directory_with_other_data_is_refused(sources: dict[str, Live], tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        ldformat.sync(sources["grad.dense"].path, tmp_path / "dst")
    assert sorted(os.listdir(tmp_path / "dst")) == ["notes.txt"]  # not even a lock was taken
    result = CliRunner().invoke(cli, ["sync", str(sources["grad.dense"].path), str(tmp_path / "dst")])
    assert result.exit_code == 2
    result = CliRunner().invoke(cli, ["sync", str(tmp_path / "nothing"), str(tmp_path / "dst2")])
    assert result.exit_code == 2 and not (tmp_path / "dst2").exists()


def test_live_writer_on_the_replica_is_refused(tmp_path: Path) -> None:
    make_chain(tmp_path / "src")
    ldformat.sync(tmp_path / "src", tmp_path / "dst")
    model, optimizer = make_training()
    ChainReader(tmp_path / "dst").load_into(model, optimizer)
    writer = ChainWriter.open(tmp_path / "dst", model, optimizer)  # holds the replica's lock
    before = files(LocalStore(tmp_path / "dst"))
    try:
        with pytest.raises(ChainLockedError):
            ldformat.sync(tmp_path / "src", tmp_path / "dst")
        result = CliRunner().invoke(cli, ["sync", str(tmp_path / "src"), str(tmp_path / "dst")])
        assert result.exit_code == 4, result.output
        assert "locked" in result.stderr
    finally:
        writer.abort()
    assert files(LocalStore(tmp_path / "dst")) == before
    assert ldformat.sync(tmp_path / "src", tmp_path / "dst").up_to_date


# -- lock takeover ------------------------------------------------------------------------------
def test_takeover_is_fenced_by_the_first_copied_record(tmp_path: Path) -> None:
    live = Live(tmp_path / "src", "grad.dense")
    live.advance(2)
    dst_path = tmp_path / "dst"
    dst = LocalStore(dst_path)
    ldformat.sync(live.path, dst_path)
    stray = "anchors/99-0123abcd.safetensors"
    dst.write(stray, b"left by a replicator that died")
    dead = plant_stale_lock(dst_path)  # a replicator died holding the lock

    # Nothing to copy: no record can fence the log, so nothing is deleted and the lock stays held.
    report = ldformat.sync(live.path, dst_path)
    assert report.garbage_deferred and report.records_copied == 0 and report.garbage_removed == 0
    assert dst.exists(stray)
    held = current_lock(dst)
    assert held is not None and held.generation == dead + 1 and held.pid == os.getpid()
    # The same process continues with the lock it kept (instead of finding itself live).
    again = ldformat.sync(live.path, dst_path)
    assert again.garbage_deferred and current_lock(dst) == held

    live.advance(2)  # one more commit: copying it fences the log
    report = ldformat.sync(live.path, dst_path)
    assert report.records_copied == 1 and not report.garbage_deferred and report.garbage_removed >= 1
    assert not dst.exists(stray) and current_lock(dst) is None
    live.writer.close()
    ldformat.sync(live.path, dst_path)
    assert_replica(dst, LocalStore(live.path), live.truth)  # no fence record: still a replica


# -- command line -------------------------------------------------------------------------------
def test_cli_sync_summary_and_json(sources: dict[str, Live], tmp_path: Path) -> None:
    src = str(sources["grad.dense"].path)
    result = CliRunner().invoke(cli, ["sync", src, str(tmp_path / "dst")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synced ") and "up to date" in lines[0]
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    result = CliRunner().invoke(cli, ["sync", src, str(tmp_path / "dst"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["records_copied"] == 0 and data["up_to_date"] and data["lag_steps"] == 0
    result = CliRunner().invoke(cli, ["sync", src, "bogus://x"])
    assert result.exit_code == 2 and "unsupported URL scheme" in result.stderr


def test_dst_cannot_be_src(sources: dict[str, Live]) -> None:
    path = sources["grad.dense"].path
    with pytest.raises(UsageError, match="is the source"):
        ldformat.sync(path, str(path) + "/")


# -- to and from s3:// ---------------------------------------------------------------------------
#: Retries fast enough for tests, for the command line (the defaults allow 30 s).
FAST_RETRY_ENV = {"LDFORMAT_MAX_RETRIES": "1", "LDFORMAT_RETRY_TIMEOUT": "1", "LDFORMAT_RETRY_INIT_BACKOFF": "0.01",
                  "LDFORMAT_RETRY_MAX_BACKOFF": "0.05"}


def _s3_url(tag: str) -> str:
    from s3server import BUCKET

    return f"s3://{BUCKET}/{tag}-{secrets.token_hex(6)}"


@pytest.mark.parametrize(("direction", "action", "fraction"), [("to-s3", "503", 0.2), ("to-s3", "reset", 0.6),
                                                                ("from-s3", "503", 0.3), ("from-s3", "reset", 0.7)])
def test_ldtools_sync_with_s3_cut_off_midway_resumes(sources: dict[str, Live], fault_proxy: FaultProxy,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     direction: str, action: str, fraction: float) -> None:
    """The store fails every request (writes to s3://, reads from it) after ``fraction`` of
    those a whole sync sends: ``ldtools sync`` exits 1 with one line naming the store; once
    the store answers again a rerun (in the same process: the lock the failed run could not
    release is its own) completes the replica, bit-exact, reusing what the first run copied."""
    for name, value in FAST_RETRY_ENV.items():
        monkeypatch.setenv(name, value)
    live = sources["grad.topk"]
    url = _s3_url(f"sync-{direction}")
    if direction == "to-s3":
        src_arg, dst_arg, methods = str(live.path), url, ("PUT",)
        probe = _s3_url("sync-probe")
    else:
        assert ldformat.sync(live.path, url).up_to_date
        src_arg, dst_arg, methods = url, str(tmp_path / "replica"), ("GET",)
        probe = str(tmp_path / "probe")
    src, dst = open_store(src_arg), open_store(dst_arg)
    records, objects, _ = referenced(src)
    fault_proxy.forward_all()
    assert ldformat.sync(src_arg, probe).up_to_date  # how many requests a whole sync sends
    total = sum(r.method in methods for r in fault_proxy.seen)

    fault_proxy.fail_after(max(1, int(total * fraction)), action, methods=methods)  # down mid-way
    first = CliRunner().invoke(cli, ["sync", src_arg, dst_arg])
    assert fault_proxy.faults() > 0
    assert first.exit_code == 1, first.output
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldtools: error: ") and url in lines[0], first.stderr
    assert ("503" in lines[0]) if action == "503" else ("connection" in lines[0]), lines[0]
    fault_proxy.forward_all()  # the store is back
    status = assert_valid_or_unfinished(dst, src)
    done_before = len(log_sequence_numbers(dst))
    assert done_before < records  # cut off before the end

    second = CliRunner().invoke(cli, ["sync", src_arg, dst_arg, "--json"])
    assert second.exit_code == 0, second.output
    report = json.loads(second.stdout)
    assert report["up_to_date"] and report["dst_latest_step"] == 10
    # Resumed, not started again: the records (or objects) the first run copied are reused.
    assert report["records_copied"] == records - done_before
    if status == "valid" or direction == "to-s3":
        assert report["objects_copied"] < objects
    assert_replica(dst, src, live.truth)
    assert current_lock(dst) is None


KILL_CLI_SLOW_S = 0.1  # each PUT to s3:// waits this long in the proxy: the copy takes seconds


@pytest.mark.procs
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="a dead replicator is recognized through /proc")
def test_killed_ldtools_sync_to_s3_is_resumed(sources: dict[str, Live], s3_env: MotoServer,
                                              fault_proxy: FaultProxy) -> None:
    """``kill -9`` of ``ldtools sync`` to s3:// after some objects, then after some records;
    each time the replica is valid or an unfinished creation; a rerun takes the dead
    process's lock over and completes it, bit-exact."""
    from s3server import BUCKET

    live = sources["state.xor"]
    src = LocalStore(live.path)
    url = _s3_url("sync-kill")
    dst = open_store(url)
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    records, objects, _ = referenced(src)
    fault_proxy.slow_s = KILL_CLI_SLOW_S
    fault_proxy.affect("slow", methods=("PUT",))

    def copied() -> tuple[int, int]:
        keys = [k.removeprefix(prefix) for k in s3_env.object_keys(BUCKET, prefix)]
        return (sum(k.startswith(("anchors/", "deltas/")) for k in keys), sum(k.startswith("log/") for k in keys))

    kills: list[tuple[int, int]] = []
    # Killed once it copied two objects, then (the next run) once it copied a record of its own.
    for enough in (lambda n, r: n >= 2, lambda n, r: r > kills[0][1]):
        proc = subprocess.Popen([sys.executable, "-m", "ldtools", "sync", str(live.path), url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if enough(*copied()):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.02)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL, f"not killed mid-copy (exit {proc.returncode}): {err.decode()}"
        time.sleep(KILL_CLI_SLOW_S * 3)  # requests the proxy still held have landed
        kills.append(copied())
        assert_valid_or_unfinished(dst, src)
        held = current_lock(dst)
        assert held is not None and held.pid == proc.pid  # the dead process's lock
    assert kills[0][1] < records and kills[1][1] < records, kills  # both were mid-copy
    assert kills[1][1] > kills[0][1]

    fault_proxy.forward_all()
    result = CliRunner().invoke(cli, ["sync", str(live.path), url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["up_to_date"] and report["records_copied"] < records
    assert report["objects_copied"] < objects
    assert_replica(dst, src, live.truth)
    assert current_lock(dst) is None

