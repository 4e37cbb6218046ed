"""Replication of a chain to another location (spec §17.5 "Replication"; sharded chains: §20).

:func:`sync` copies the chain at ``src`` to ``dst`` incrementally and resumably, so that a run
can checkpoint to a fast local disk and replicate in the background to slower or remote
storage. ``dst`` becomes a *replica*: a chain of its own, with the same root and the same
commit records, byte for byte, that any reader opens like ``src``.

The order of every copy is the commit protocol's (spec §7.4): the objects a record references
are read from ``src`` and verified (size and object checksum, spec §7.6), written to ``dst``
and made durable; then the record is created exclusively on ``dst`` with ``src``'s exact
bytes; the root is created right after ``dst``'s first record. ``dst`` is therefore a valid
chain at every moment (valid at its last record), or, before its first record and root
exist, an unfinished replica creation that the next run continues. ``src`` is only read,
never locked: a writer may append to it, and a compaction or truncation may rewrite it,
while it is copied.

A sharded chain (spec §20) is replicated part by part: its ``sharded.json`` first, then each
rank chain as above, then its global commit records, byte for byte and in order, each only
once every rank chain of ``dst`` holds the steps it commits (see :class:`_ShardedSync` for
the order that keeps a reader of ``dst`` from ever seeing a step that is half copied, or
assembled from two versions of the source).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .errors import (
    ChainError,
    ChainExistsError,
    ChainLockedError,
    CorruptChainError,
    LdformatError,
    LockLostError,
    MissingObjectError,
    NotAChainError,
    UsageError,
)
from .jsonvalue import MAX_RECORD_BYTES, MAX_ROOT_BYTES, object_checksum, object_checksum_parts
from .log import (
    LOCK_DIR,
    LOG_DIR,
    ROOT_FILE,
    MissingLogRecord,
    WriterLock,
    collect_garbage,
    create_or_lose,
    current_lock,
    io_error,
    log_path,
    log_sequence_numbers,
    read_bounded,
    read_log,
)
from .manifest import ChainState, ObjectRef, Record, RootMetadata
from .reader import ChainReader
from .sharded import (
    COMMITS_DIR,
    MAX_COMMIT_BYTES,
    MAX_SHARDED_ROOT_BYTES,
    RANKS_DIR,
    SHARDED_ROOT,
    Commit,
    ShardedRoot,
    commit_numbers,
    commit_path,
    is_sharded,
    is_sharded_location,
    rank_location,
    refuse_sharded,
)
from .stores import FaultyStore, LocalStore, MemoryStore, ObjectStore, Store, open_store, parse_location
from .stores.base import check_relative_path
from .stores.local import make_directory

__all__ = ["ReplicaDivergedError", "SyncReport", "sync"]

#: How often the source's log is folded again when a record or object of the version being
#: copied vanishes (a concurrent compaction or truncation, spec §17.4) before giving up.
SOURCE_ATTEMPTS = 5

#: Objects copied at the same time (each is held in memory while it is copied).
WORKERS = 4
#: Objects at least this large are copied from a local source mapped, not read into memory.
STREAM_BYTES = 64 << 20
STREAM_CHUNK = 8 << 20

Progress = Callable[[str, int, int], None]


class ReplicaDivergedError(ChainError):
    """The destination holds another chain, or a log that is not a copy of the source's."""


@dataclass
class SyncReport:
    """What :func:`sync` did, and how far the replica lags behind its source.

    Attributes:
        src, dst: the two locations, as messages name them.
        records_copied: commit records created on ``dst``.
        objects_copied: data objects read from ``src`` and written to ``dst``.
        objects_skipped: objects the copied records reference that ``dst`` already held
            (committed there, or left by an interrupted run and verified).
        bytes_copied: bytes of the copied objects.
        garbage_removed: objects and superseded records removed from ``dst`` afterwards
            (lock generations not counted).
        seconds: wall time of the call.
        created: ``dst`` became a chain in this call (its root was created).
        jumped: ``dst`` skipped superseded records of ``src`` to a newer snapshot (spec §7.3).
        source_refolds: times ``src`` was folded again because a record or object of the
            version being copied vanished (a concurrent compaction or truncation).
        src_last_seq, dst_last_seq: the newest record of each chain when the call returned
            (``src`` re-read at the end: a writer may have committed meanwhile).
        src_latest_step, dst_latest_step: their latest committed steps.
        garbage_deferred: ``dst``'s lock was taken over from a holder that had not released
            it and no record was copied, so nothing was deleted and the lock was left held
            for the next run to take over (spec §17.5).
        sharded: ``src`` is a sharded chain (spec §20). Then ``records_copied``,
            ``src_last_seq`` and ``dst_last_seq`` count global commit records; the steps are
            the newest *committed* steps of each sharded chain (spec §20.3.2); the object,
            byte, garbage and refold counts sum up every rank chain, ``jumped`` and
            ``garbage_deferred`` hold for at least one; ``created`` means ``sharded.json``
            was created.
        world_size: the number of rank chains (sharded only).
        rank_records_copied: records created in the rank chains of ``dst``, all together.
        ranks: each rank chain's own report, by rank (sharded only).
    """

    src: str
    dst: str
    records_copied: int = 0
    objects_copied: int = 0
    objects_skipped: int = 0
    bytes_copied: int = 0
    garbage_removed: int = 0
    seconds: float = 0.0
    created: bool = False
    jumped: bool = False
    source_refolds: int = 0
    src_last_seq: int = 0
    dst_last_seq: int = 0
    src_latest_step: int | None = None
    dst_latest_step: int | None = None
    garbage_deferred: bool = False
    sharded: bool = False
    world_size: int | None = None
    rank_records_copied: int = 0
    ranks: list[SyncReport] = field(default_factory=list)

    @property
    def up_to_date(self) -> bool:
        """``dst`` holds every record of ``src`` (as ``src`` was at the end of the call)."""
        return self.dst_last_seq == self.src_last_seq

    @property
    def lag_steps(self) -> int | None:
        """``src``'s latest step minus ``dst``'s (None when either has no step)."""
        if self.src_latest_step is None or self.dst_latest_step is None:
            return None
        return self.src_latest_step - self.dst_latest_step

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "records_copied": self.records_copied,
            "objects_copied": self.objects_copied,
            "objects_skipped": self.objects_skipped,
            "bytes_copied": self.bytes_copied,
            "garbage_removed": self.garbage_removed,
            "seconds": round(self.seconds, 3),
            "created": self.created,
            "jumped": self.jumped,
            "source_refolds": self.source_refolds,
            "src_last_seq": self.src_last_seq,
            "dst_last_seq": self.dst_last_seq,
            "src_latest_step": self.src_latest_step,
            "dst_latest_step": self.dst_latest_step,
            "lag_steps": self.lag_steps,
            "up_to_date": self.up_to_date,
            "garbage_deferred": self.garbage_deferred,
            "sharded": self.sharded,
            **({"world_size": self.world_size, "rank_records_copied": self.rank_records_copied,
                "ranks": [r.to_dict() for r in self.ranks]} if self.sharded else {}),
        }


def sync(
    src: str | os.PathLike[str] | Store,
    dst: str | os.PathLike[str] | Store,
    *,
    progress: Progress | None = None,
    workers: int = WORKERS,
    break_lock: bool = False,
    lock_wait: float = 0.0,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> SyncReport:
    """Copy the chain at ``src`` to ``dst``, continuing where the last call stopped.

    A sharded chain (spec §20) is copied whole: ``sharded.json``, every rank chain and the
    global commit records. ``dst`` then holds every rank chain's writer lock while it is
    written, and a commit record is created there only once every rank chain of ``dst``
    holds the steps it commits, so that a reader of ``dst`` never sees a committed step
    half copied (see :class:`_ShardedSync`). A commit record that the rank chains of
    ``dst`` cannot hold yet waits for a later call.

    Args:
        src: the chain to copy: a location (a local directory, ``file://``, ``memory://``,
            ``s3://``, ...; see :func:`ldformat.stores.open_store`) or a
            :class:`~ldformat.stores.Store`. It is only read, never locked.
        dst: the replica: a new or empty location, one an interrupted call left, or a
            replica of ``src`` made by an earlier call.
        progress: called as ``progress("bytes", done, total)`` while objects are copied
            (for a sharded chain: the objects of every rank chain together).
        workers: objects copied at the same time.
        break_lock: take ``dst``'s writer lock even from a live holder (only when that
            holder is known to be gone).
        lock_wait: seconds to wait for a holder of ``dst``'s lock on another host whose
            lease runs out (spec §15.6).
        src_options, dst_options: ``storage_options`` of object store locations.

    Returns:
        A :class:`SyncReport`.

    Raises:
        NotAChainError: ``src`` holds no chain.
        UsageError: one of ``src`` and ``dst`` is a sharded chain (spec §20) and the other an
            ordinary one, or ``dst`` is one rank's chain of a sharded chain; ``dst`` holds
            something that is neither a chain nor an interrupted replica creation; a
            malformed location.
        ReplicaDivergedError: ``dst`` holds another chain (a different ``chain_id``), or a
            record that differs from ``src``'s record of the same number, or more records
            than ``src`` (for a sharded chain: in any rank chain, or among the commit
            records). Nothing is changed: delete ``dst`` and sync again, or sync to a new
            location.
        ChainLockedError: another process holds ``dst``'s writer lock
            (:class:`~ldformat.errors.LockLostError`: it took the lock over meanwhile).
        CorruptChainError: ``src`` is corrupt (an object fails its checksum; an object or
            record stays missing after the log was folded again).
        WriterIOError: writing ``dst`` failed; ``dst`` stays valid at its last record and
            the next call continues.

    Example:
        >>> report = ldformat.sync("runs/chain", "s3://bucket/runs/chain")   # doctest: +SKIP
        >>> report.records_copied, report.lag_steps                            # doctest: +SKIP
        (3, 0)
    """
    if workers < 1:
        raise UsageError(f"sync: workers must be >= 1, got {workers}")
    started = time.monotonic()
    src_store, src_name = _open(src, src_options, create=False)
    if is_sharded(src_store):
        return _sync_sharded(src, src_store, src_name, dst, progress=progress, workers=workers,
                             break_lock=break_lock, lock_wait=lock_wait, src_options=src_options,
                             dst_options=dst_options, started=started)
    _refuse_sharded_dst(dst, dst_options, src_name)
    reader = ChainReader(src_name, store=src_store)  # NotAChainError before dst is touched
    root_bytes = read_bounded(src_store, ROOT_FILE, MAX_ROOT_BYTES, f"{src_name}/{ROOT_FILE}")
    if RootMetadata.from_bytes(root_bytes, f"{src_name}/{ROOT_FILE}").chain_id != reader.root.chain_id:
        raise CorruptChainError(f"{src_name}/{ROOT_FILE}: the root changed while it was read; sync again")
    dst_store, dst_name = _open(dst, dst_options, create=True)
    if _same_location(src_store, dst_store):
        raise UsageError(f"{dst_name}: the destination is the source {src_name}; sync to another location")
    report = SyncReport(src=src_name, dst=dst_name)
    job = _Sync(reader, root_bytes, dst_store, dst_name, report, progress, workers)
    if not dst_store.exists(ROOT_FILE):
        job.check_unfinished_creation()  # refuse someone else's data before taking its lock
    job.lock = _take_lock(dst_store, dst_name, break_lock, lock_wait)
    try:
        job.run()
    finally:
        _settle_lock(job)
    report.seconds = time.monotonic() - started
    return report


def _settle_lock(job: _Sync) -> None:
    """Release the replica's lock at the end of a call, or keep it held (spec §17.5)."""
    lock = job.lock
    if lock is None:
        return
    if job.fenced:
        # A release that fails (the store is down) leaves the lock held by this process, which
        # is alive: remember it, so that the next sync here continues with it instead of
        # finding the replica locked by a running writer (this process) until it exits.
        with _UNFENCED_LOCK:
            _RELEASING[job.dst_name] = lock
        lock.release()
    else:
        # Taken over from a holder that may still run, and not fenced: the lock stays held,
        # so that whoever takes it next inherits the duty to fence (spec §17.5).
        job.report.garbage_deferred = True
        with _UNFENCED_LOCK:
            _UNFENCED[lock.owner.token] = lock


def _refuse_sharded_dst(dst: str | os.PathLike[str] | Store, options: dict[str, Any] | None, src_name: str) -> None:
    """An ordinary chain is not synced into a sharded chain, nor into one rank chain of one."""
    if isinstance(dst, Store):
        here, name = is_sharded(dst), describe_store(dst)
    else:
        here, name = is_sharded_location(dst, options), parse_location(dst).name
    if here:
        raise UsageError(f"{name}: holds a sharded chain, and {src_name} is an ordinary chain; a replica holds the "
                         "same kind of chain as its source: sync to a new location")
    if not isinstance(dst, Store):
        refuse_sharded(dst, None, options, "synced into")  # one rank's chain of a sharded chain


#: Locks of replicas that this process took over and left held without fencing (spec §17.5),
#: by token: the next :func:`sync` of the same replica in this process continues with it
#: instead of finding it held by a live process (this one).
_UNFENCED: dict[str, WriterLock] = {}
_UNFENCED_LOCK = threading.Lock()
#: The lock this process released last, by replica (as messages name it): if that release
#: failed, the replica's newest lock generation is still this one, held by this process.
_RELEASING: dict[str, WriterLock] = {}


def _take_lock(dst: Store, where: str, break_lock: bool, wait_s: float) -> WriterLock:
    owner = current_lock(dst, where)
    if owner is not None:
        with _UNFENCED_LOCK:
            mine = _UNFENCED.pop(owner.token, None)
            released = _RELEASING.get(where)
            if released is not None and released.owner.token == owner.token:
                del _RELEASING[where]
            else:
                released = None
        if mine is None and released is not None and released.generation == owner.generation:
            # Our release failed: the lock is still ours, and was fenced by our records.
            mine = WriterLock(dst, where, owner, released.previous, took_over=False)
        if mine is not None and mine.generation == owner.generation:
            try:
                mine.check()
                return mine
            except LockLostError:
                pass  # taken over meanwhile (a lease ran out): take it like anyone else
    return WriterLock.acquire(dst, where, break_lock=break_lock, wait_s=wait_s)


def _open(location: str | os.PathLike[str] | Store, options: dict[str, Any] | None,
          create: bool) -> tuple[Store, str]:
    if isinstance(location, Store):
        if options:
            raise UsageError("sync: storage options apply to a location, not to a Store object")
        return location, describe_store(location)
    loc = parse_location(location)
    store = open_store(location, storage_options=options)
    if create and loc.path is not None:
        p = loc.path
        if p.exists() and not p.is_dir():
            raise UsageError(f"{loc.name}: exists and is not a directory; sync to a directory")
        if not p.exists():
            make_directory(p)
    return store, loc.name


def describe_store(store: Store) -> str:
    if isinstance(store, FaultyStore):
        return describe_store(store.inner)
    if isinstance(store, _Prefixed):
        return f"{describe_store(store.inner)}/{store.prefix}"
    if isinstance(store, LocalStore):
        return str(store.root)
    if isinstance(store, MemoryStore) and store.name is not None:
        return f"memory://{store.name}"
    if isinstance(store, ObjectStore):
        return store.url
    return repr(store)


def _same_location(a: Store, b: Store) -> bool:
    while isinstance(a, FaultyStore):
        a = a.inner
    while isinstance(b, FaultyStore):
        b = b.inner
    if isinstance(a, LocalStore) and isinstance(b, LocalStore):
        return a.root.resolve() == b.root.resolve()
    if isinstance(a, MemoryStore) and isinstance(b, MemoryStore):
        return a is b or (a.name is not None and a.name == b.name)
    if isinstance(a, ObjectStore) and isinstance(b, ObjectStore):
        return a.url == b.url
    return a is b


class _SourceMoved(Exception):
    """A record or object of the source's folded version vanished: fold it again."""

    def __init__(self, error: CorruptChainError) -> None:
        super().__init__(str(error))
        self.error = error


Outcome = Literal["committed", "verified", "copied"]


class _Sync:
    """One call of :func:`sync`: the source's fold, the replica's fold and what was done."""

    def __init__(self, reader: ChainReader, root_bytes: bytes, dst: Store, dst_name: str, report: SyncReport,
                 progress: Progress | None, workers: int) -> None:
        self.reader = reader
        self.src_name = reader.path
        self.root_bytes = root_bytes
        self.dst = dst
        self.dst_name = dst_name
        self.report = report
        self.progress = progress
        self.workers = workers
        self.lock: WriterLock | None = None
        self.state = ChainState()  # the replica's fold, kept current as records are copied
        self.has_root = False
        #: Objects the replica's committed records reference (or referenced during this call:
        #: nothing deletes them before the garbage collection at the end), with their
        #: reference, so that they are neither read back nor overwritten.
        self.committed: dict[str, ObjectRef] = {}
        self.fenced = True
        self.present: set[str] = set()  # objects under anchors/ and deltas/ when the copy started
        self.done_bytes = 0
        self.total_bytes = 0
        #: Reports the progress of several copies as one (the rank chains of a sharded chain).
        self.meter: Callable[[], None] | None = None

    # -- the replica's state -----------------------------------------------------------------
    def check_unfinished_creation(self) -> None:
        """Refuse a location without a root that holds more than an interrupted replica creation.

        Such a creation (spec §17.5) holds at most one record, objects under ``anchors/`` and
        ``deltas/``, the lock and temporary files; anything else may be someone's data.
        """
        paths = self._list("")
        records = [p for p in paths if p.startswith(f"{LOG_DIR}/") and not p.split("/")[-1].startswith(".tmp-")]
        other = [p for p in paths if not p.startswith((f"{LOG_DIR}/", f"{LOCK_DIR}/", "anchors/", "deltas/"))
                 and not p.startswith(f".tmp-{ROOT_FILE}-")]
        numbered = log_sequence_numbers(self.dst)
        if other or len(records) != len(numbered) or len(numbered) > 1:
            shown = (other or records)[0]
            raise UsageError(
                f"{self.dst_name}: holds no chain and is not empty ({shown}); sync into a new or empty "
                f"location, or into a replica of {self.src_name}"
            )

    def _list(self, prefix: str) -> list[str]:
        try:
            return self.dst.list(prefix)
        except OSError as e:
            raise io_error(f"{self.dst_name}: cannot list the replica", e) from None

    def open_replica(self) -> None:
        """Read the replica's root and fold its log (as the lock holder)."""
        assert self.lock is not None
        self.fenced = not self.lock.took_over
        self.has_root = self.dst.exists(ROOT_FILE)
        if self.has_root:
            where = f"{self.dst_name}/{ROOT_FILE}"
            data = read_bounded(self.dst, ROOT_FILE, MAX_ROOT_BYTES, where)
            root = RootMetadata.from_bytes(data, where)
            if root.chain_id != self.reader.root.chain_id:
                raise ReplicaDivergedError(
                    f"{self.dst_name}: holds chain {root.chain_id}, not {self.src_name} (chain "
                    f"{self.reader.root.chain_id}); nothing was changed. Sync to a new location, or delete "
                    f"{self.dst_name} first"
                )
            if data != self.root_bytes:
                raise ReplicaDivergedError(
                    f"{where}: differs from {self.src_name}/{ROOT_FILE} although the chain id is the same: "
                    f"{self.dst_name} is not a replica of {self.src_name}; nothing was changed. Delete it and "
                    "sync again"
                )
            _, self.state = read_log(self.dst, self.dst_name)
            self._index_all()
            return
        self.check_unfinished_creation()  # again, under the lock
        seqs = log_sequence_numbers(self.dst)
        if seqs:
            self._resume_creation(seqs[0])

    def _resume_creation(self, seq: int) -> None:
        """The replica has no root and one record, left by an interrupted creation (spec §17.5)."""
        mine = self._read_dst_record(seq)
        theirs: bytes | None = None
        for _ in range(SOURCE_ATTEMPTS):
            if seq > self.reader.state.last_seq:
                raise self._diverged(seq, f"{self.src_name} ends at record {self.reader.state.last_seq}")
            try:
                theirs = self._read_src_record(seq)
                break
            except _SourceMoved:
                if seq < self.reader.records[0].seq:
                    break  # superseded by the snapshot the source's fold starts at, and removed
                self.reader.refresh()  # it was in the fold just read: the source moved on
        if theirs is None:
            if seq >= self.reader.records[0].seq:
                raise CorruptChainError(f"{self.src_name}/{log_path(seq)}: keeps vanishing while it is read; "
                                        "sync again")
            # Unverifiable, but the snapshot the copy starts with supersedes it on the replica
            # too. It is left in place: only a fenced lock holder deletes (spec §17.5).
            self.state = ChainState(last_seq=seq, first_seq=seq)
            return
        if mine != theirs:
            raise self._diverged(seq, "its bytes differ")
        record = Record.from_bytes(mine, f"{self.dst_name}/{log_path(seq)}")
        if record.type != "snapshot" and seq != 1:
            raise UsageError(
                f"{self.dst_name}: holds no chain and its only record, {log_path(seq)}, cannot start one; "
                "delete it and sync again"
            )
        _, self.state = read_log(self.dst, self.dst_name)
        self._index_all()
        self._create_root()

    def _index_all(self) -> None:
        self.committed = {}
        for a in self.state.anchors.values():
            self.committed[a.object.path] = a.object
        for d in self.state.delta_entries():
            for o in d.objects:
                self.committed[f"{d.path}/{o.path}"] = o

    # -- the copy ----------------------------------------------------------------------------
    def run(self) -> None:
        self.open_replica()
        self.copy(self._plan)
        self.finish()

    def copy(self, plan: Callable[[], list[Record]], replanned: Callable[[], None] | None = None) -> None:
        """Copy the records ``plan()`` names; when the source moved while they were copied, fold
        it again, call ``replanned()`` and copy what ``plan()`` names then (spec §17.5)."""
        for attempt in range(SOURCE_ATTEMPTS):
            head = (self.reader.state.last_seq, self.reader.state.last_checksum)
            try:
                self._copy(plan())
                return
            except _SourceMoved as moved:
                self.reader.refresh()
                if (self.reader.state.last_seq, self.reader.state.last_checksum) == head:
                    raise moved.error from None  # nothing moved: the source itself lacks it
                if attempt == SOURCE_ATTEMPTS - 1:
                    raise CorruptChainError(
                        f"{moved.error}; {self.src_name} changed {SOURCE_ATTEMPTS} times while it was copied "
                        "(compacted or truncated): sync again"
                    ) from None
                self.report.source_refolds += 1
                if replanned is not None:
                    replanned()

    def finish(self) -> None:
        """Remove the replica's garbage (as a fenced lock holder) and fill in the report."""
        if self.fenced:
            assert self.lock is not None
            _, folded = read_log(self.dst, self.dst_name)
            removed = collect_garbage(self.dst, folded, self.lock, self.dst_name)
            self.report.garbage_removed = sum(1 for p in removed if not p.startswith(f"{LOCK_DIR}/"))
        try:
            self.reader.refresh()  # how far the source is now, for the lag
        except (LdformatError, OSError):
            pass  # the copy is done; report the lag against the version copied
        self.report.src_last_seq = self.reader.state.last_seq
        self.report.src_latest_step = self.reader.state.latest_step
        self.report.dst_last_seq = self.state.last_seq
        self.report.dst_latest_step = self.state.latest_step

    def _plan(self) -> list[Record]:
        """The source's records the replica lacks, in order (spec §17.5)."""
        records = self.reader.records
        start, end = records[0].seq, records[-1].seq
        last = self.state.last_seq
        if last > end:
            raise self._diverged(last, f"{self.src_name} ends at record {end}")
        if last and self.has_root:
            try:
                theirs: bytes | None = self._read_src_record(last)
            except _SourceMoved:
                if last >= start:
                    raise
                theirs = None  # superseded on the source and removed: the snapshot decides
            if theirs is not None and theirs != self._read_dst_record(last):
                raise self._diverged(last, "its bytes differ")
        todo = [r for r in records if r.seq > last]
        if last and todo and todo[0].seq != last + 1:
            self.report.jumped = True  # the source's fold starts at a snapshot after `last` (spec §7.3)
        return todo

    def planned_bytes(self, records: list[Record]) -> int:
        """The bytes of the objects ``records`` reference, each object once."""
        sizes = {path: ref.size for r in records for path, ref, _prefix in self._objects(r)}
        return sum(sizes.values())

    def _copy(self, records: list[Record]) -> None:
        plans = [(r, self._objects(r)) for r in records]
        self.total_bytes = self.done_bytes + self.planned_bytes(records)
        self._report_progress()
        if not plans:
            return
        # One listing instead of a request per object to learn which ones are there already.
        self.present = set(self._list("anchors")) | set(self._list("deltas"))
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ldformat-sync") as pool:
            try:
                for record, objects in plans:
                    self._copy_record(pool, record, objects)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    @staticmethod
    def _objects(record: Record) -> list[tuple[str, ObjectRef, str]]:
        """Every object ``record`` references: (chain-relative path, reference, group prefix)."""
        out: dict[str, tuple[str, ObjectRef, str]] = {}
        for a in record.anchors:
            out.setdefault(a.object.path, (a.object.path, a.object, ""))
        for d in record.deltas:
            for o in d.objects:
                path = f"{d.path}/{o.path}"
                out.setdefault(path, (path, o, d.path))
        return list(out.values())

    def _copy_record(self, pool: ThreadPoolExecutor, record: Record, objects: list[tuple[str, ObjectRef, str]]
                     ) -> None:
        assert self.lock is not None
        raw = self._read_src_record(record.seq)  # before the objects: it may have vanished
        if Record.from_bytes(raw, f"{self.src_name}/{log_path(record.seq)}").checksum != record.checksum:
            raise CorruptChainError(
                f"{self.src_name}/{log_path(record.seq)}: changed while it was copied (records are never "
                "rewritten); check the source"
            )
        if record.type != "snapshot" and (record.seq != self.state.last_seq + 1 or (
                self.state.last_seq and record.prev != self.state.last_checksum)):
            raise self._diverged(self.state.last_seq, f"{self.src_name}'s record {record.seq} does not follow it")
        pending: set[Future[tuple[str, ObjectRef, Outcome]]] = {
            pool.submit(self._put, path, ref, prefix) for path, ref, prefix in objects
        }
        to_sync: list[str] = []
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            self.lock.renew_if_due()  # a long copy must not let the lease run out (spec §15.6)
            for future in done:
                path, ref, outcome = future.result()
                self.done_bytes += ref.size
                if outcome == "copied":
                    self.report.objects_copied += 1
                    self.report.bytes_copied += ref.size
                else:
                    self.report.objects_skipped += 1
                if outcome != "committed":
                    to_sync.append(path)
            self._report_progress()
        try:
            self.dst.sync(sorted(to_sync))
        except OSError as e:
            raise io_error(
                f"{self.dst_name}: cannot make the objects of record {record.seq} durable (no record references "
                "them yet; sync again)", e
            ) from None
        self.lock.renew_if_due()
        self.lock.check()
        create_or_lose(self.dst, log_path(record.seq), raw, self.dst_name,
                        "another process created this record of the replica",
                        f"cannot create the record; the replica is valid at record {self.state.last_seq} or at "
                        f"this one, sync again")
        self.fenced = True  # our first record is the fence of a takeover (spec §17.5)
        committed = Record.from_bytes(raw, f"{self.dst_name}/{log_path(record.seq)}")
        self.state.apply(committed)
        if committed.type == "snapshot":
            self._index_all()
        else:
            for path, ref, _prefix in objects:
                self.committed[path] = ref
        self.report.records_copied += 1
        if not self.has_root:
            self._create_root()

    def _put(self, path: str, ref: ObjectRef, prefix: str) -> tuple[str, ObjectRef, Outcome]:
        """Make sure the replica holds the object ``path`` with reference ``ref`` (not yet synced)."""
        known = self.committed.get(path)
        if known is not None:
            if (known.size, known.crc32c) == (ref.size, ref.crc32c):
                return path, ref, "committed"
            raise ReplicaDivergedError(
                f"{self.dst_name}/{path}: committed with size {known.size} and crc32c {known.crc32c}, while "
                f"{self.src_name} references it with size {ref.size} and crc32c {ref.crc32c}: the replica is "
                f"not a copy of {self.src_name}; nothing was changed. Delete it and sync again"
            )
        if self._holds(path, ref):
            return path, ref, "verified"
        try:
            data = self._mapped(ref, prefix)
            if data is None:
                data = self.reader.read_object(ref, None, prefix)  # size and checksum verified (spec §7.6)
        except MissingObjectError as e:
            raise _SourceMoved(e) from None
        try:
            self.dst.write_parts(path, (data,))
        except OSError as e:
            raise io_error(f"{self.dst_name}/{path}: cannot write the object (no record references it yet; "
                            "sync again)", e) from None
        return path, ref, "copied"

    def _mapped(self, ref: ObjectRef, prefix: str) -> np.ndarray | None:
        """A large object of a local source, mapped rather than read into memory and verified
        chunk by chunk, so that copying an anchor to an object store (streamed in parts) needs
        no full-size buffer; None for any other object. Objects are never changed in place
        (spec §7.2), so the mapping stays what was verified."""
        path = f"{prefix}/{ref.path}" if prefix else ref.path
        local = self.reader.store.local_path(path) if ref.size >= STREAM_BYTES else None
        if local is None:
            return None
        where = f"{self.src_name}/{path}"
        try:
            data = np.memmap(local, dtype=np.uint8, mode="r")
        except FileNotFoundError:
            raise MissingObjectError(f"{where}: object is missing (deleted by a compaction?)") from None
        except (OSError, ValueError):
            return None  # a plain read reports what is wrong
        if len(data) != ref.size:
            raise CorruptChainError(f"{where}: size {len(data)} differs from the committed {ref.size}")
        chunks = (data[i:i + STREAM_CHUNK] for i in range(0, len(data), STREAM_CHUNK))
        if object_checksum_parts(path, chunks) != ref.crc32c:
            raise CorruptChainError(f"{where}: crc32c mismatch (the object was modified or damaged)")
        return data

    def _holds(self, path: str, ref: ObjectRef) -> bool:
        """Whether the replica already holds the object (a leftover of an interrupted call)."""
        if path not in self.present:
            return False
        try:
            if self.dst.size(path) != ref.size:
                return False
            return object_checksum(path, self.dst.read_buffer(path)) == ref.crc32c
        except FileNotFoundError:
            return False
        except OSError as e:
            raise io_error(f"{self.dst_name}/{path}: cannot read the replica's object", e) from None

    def _create_root(self) -> None:
        """Create the replica's root with the source's bytes, after its first record (spec §7.4)."""
        try:
            self.dst.create_exclusive(ROOT_FILE, self.root_bytes)
        except FileExistsError:
            raise ChainExistsError(
                f"{self.dst_name}: another process created a chain here concurrently; nothing else was changed"
            ) from None
        except OSError as e:
            raise io_error(f"{self.dst_name}/{ROOT_FILE}: cannot create the replica's root (sync again)", e) from None
        self.has_root = True
        self.report.created = True

    # -- reading ----------------------------------------------------------------------------
    def _read_src_record(self, seq: int) -> bytes:
        where = f"{self.src_name}/{log_path(seq)}"
        try:
            return read_bounded(self.reader.store, log_path(seq), MAX_RECORD_BYTES, where)
        except FileNotFoundError:
            raise _SourceMoved(MissingLogRecord(f"{where}: commit record vanished while it was copied")) from None

    def _read_dst_record(self, seq: int) -> bytes:
        where = f"{self.dst_name}/{log_path(seq)}"
        try:
            return read_bounded(self.dst, log_path(seq), MAX_RECORD_BYTES, where)
        except FileNotFoundError:
            raise CorruptChainError(f"{where}: the replica's record vanished; is another process changing "
                                    "it?") from None

    def _diverged(self, seq: int, why: str) -> ReplicaDivergedError:
        return ReplicaDivergedError(
            f"{self.dst_name}/{log_path(seq)}: the replica has diverged from {self.src_name} ({why}): it was written "
            f"to directly (a writer, compaction or truncation of the replica), or {self.src_name} was replaced; "
            f"nothing was changed. Delete {self.dst_name} and sync again, or sync to a new location"
        )

    def _report_progress(self) -> None:
        if self.meter is not None:
            self.meter()
        elif self.progress is not None and self.total_bytes:
            self.progress("bytes", self.done_bytes, self.total_bytes)



# -- sharded chains (spec §20) -----------------------------------------------------------------
#: Rounds of one sharded sync. Each round syncs the rank chains and copies the commit records
#: it can; a truncation of the source takes up to two (up to the truncating record, then after
#: it), and a round is started again when the source is truncated while it plans.
SHARDED_ROUNDS = 8


class _Prefixed(Store):
    """The objects of ``inner`` below ``prefix``, as a store of their own: one rank chain of
    a sharded chain given as a :class:`~ldformat.stores.Store` or a local directory (syncing
    an object makes every directory up to the sharded chain's own durable, spec §20.3.3
    rule D)."""

    def __init__(self, inner: Store, prefix: str) -> None:
        self.inner = inner
        self.prefix = check_relative_path(prefix)

    def __repr__(self) -> str:
        return describe_store(self)

    def _path(self, path: str) -> str:
        return f"{self.prefix}/{check_relative_path(path)}"

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write(self._path(path), data)

    def write_parts(self, path: str, parts: Any) -> None:
        self.inner.write_parts(self._path(path), parts)

    def sync(self, paths: Any) -> None:
        self.inner.sync([self._path(p) for p in paths])

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(self._path(path), data)

    def read(self, path: str) -> bytes:
        return self.inner.read(self._path(path))

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self.inner.read_buffer(self._path(path), max_size)

    def size(self, path: str) -> int:
        return self.inner.size(self._path(path))

    def list(self, prefix: str) -> list[str]:
        n = len(self.prefix) + 1
        return [p[n:] for p in self.inner.list(self._path(prefix) if prefix else self.prefix)]

    def delete(self, path: str) -> None:
        self.inner.delete(self._path(path))

    def exists(self, path: str) -> bool:
        return self.inner.exists(self._path(path))

    def local_path(self, path: str) -> Path | None:
        return self.inner.local_path(self._path(path))


def _rank_store(location: str | os.PathLike[str] | Store, store: Store, name: str, rank: int,
                options: dict[str, Any] | None) -> tuple[Store, str]:
    """Rank ``rank``'s chain of the sharded chain ``store`` at ``location``, and how messages
    name it. A URL's rank chain is opened as readers and writers open it (``memory://`` names
    one store per location); a directory's or a store's is the part of it below
    ``ranks/<rank>``."""
    part = f"{RANKS_DIR}/{rank:05d}"
    if isinstance(location, Store) or parse_location(location).path is not None:
        return _Prefixed(store, part), f"{name}/{part}"
    url = rank_location(location, rank)
    return open_store(url, storage_options=options), parse_location(url).name


def _top_step(record: Record) -> int:
    """The newest step a rank chain's record holds (-1: none, e.g. a fence record)."""
    steps = [a.step for a in record.anchors] + [s.step for d in record.deltas for s in d.steps]
    return max(steps, default=-1)


def copyable(pending: list[int], later: list[int], start: int | None, held: set[int], *,
             rank_chains_synced: bool) -> int:
    """How many of the replica's pending commit records may be created now, in order (spec
    §20, see :class:`_ShardedSync`): the largest ``n`` such that creating records ``1 .. n``
    of ``pending`` never lets a reader of the replica see a step as committed that is not a
    committed step of the source, with the same bits in every rank chain.

    Args:
        pending: the steps of the source's records that the replica lacks, in order.
        later: the steps of the source's records after them, read after the rank chains
            were synced (only with ``rank_chains_synced``).
        start: the step of the replica's newest commit record (None: it has none). Its
            committed steps are those ``<= start`` that every rank chain of it holds.
        held: the steps that every rank chain of the replica holds.
        rank_chains_synced: ``pending`` was read before the rank chains were synced. If not
            (step 1 of :class:`_ShardedSync`, before they are synced), only records that commit
            no step above ``start`` are created: they can only remove committed steps.

    Record ``n``, newest once created, must name a step that every rank chain holds (rule I1
    of spec §20.3.4). After the rank chains were synced, no record after it may name a lower
    step: such a record truncated the source below it, maybe before a rank chain was read,
    which would then hold steps of two versions; and each record before it, newest for a
    moment, must not make a held step committed that is above both ``start`` (committed
    already) and record ``n``'s step (committed by record ``n``): such a step may belong to a
    run that the source abandoned. Before the rank chains are synced, the held steps are the
    ones the replica's records committed, and a record may only make committed the steps
    that no record before it truncated (none above the lowest step named before it).
    """
    ordered = sorted(held)

    def holds_within(low: int, high: int) -> bool:
        """Whether a held step ``h`` has ``low < h <= high``."""
        i = bisect.bisect_right(ordered, low)
        return i < len(ordered) and ordered[i] <= high

    count = len(pending)
    most = [-1] * (count + 1)  # most[i]: the greatest step of pending[:i]
    least = [start if start is not None else -1] * (count + 1)  # least[i]: min(start, pending[:i])
    for i, s in enumerate(pending):
        most[i + 1] = max(most[i], s)
        least[i + 1] = min(least[i], s)
    after = [min(later, default=1 << 62)] * (count + 1)  # after[i]: the lowest step of pending[i:] + later
    for i in range(count - 1, -1, -1):
        after[i] = min(pending[i], after[i + 1])
    # Before the rank chains are synced: record i may show no held step above least[i].
    shows_old = [True] * (count + 1)  # shows_old[i]: every record before i does so
    for i, s in enumerate(pending):
        shows_old[i + 1] = shows_old[i] and not holds_within(least[i], s)
    floor = -1 if start is None else start
    for n in range(count, 0, -1):
        step = pending[n - 1]
        if step not in held:
            continue
        if rank_chains_synced:
            if after[n] < step or holds_within(max(step, floor), most[n - 1]):
                continue
        elif start is None or step > least[n - 1] or not shows_old[n - 1]:
            continue
        return n
    return 0


class _Restart(Exception):
    """The source was truncated below the replica's newest committed step after its commit
    records were read: plan the round again, so that the truncating record can go first."""


class _ShardedSync:
    """One call of :func:`sync` for a sharded chain (spec §20): its root, every rank chain
    (each a :class:`_Sync` under that rank chain's writer lock) and its commit records.

    ``sharded.json`` is created first (exclusively, with the source's bytes); the rank chains
    and the commit records follow in rounds. A reader of the replica takes as committed the
    steps at most the newest commit record's step that every rank chain holds. The order
    keeps every step it can see committed a committed step of the source, assembled from one
    version of it in every rank chain, and never makes it lose a committed step that the
    source still has, except as a record at the replica says (a truncation):

    1. **Records first where they only remove steps.** Commit records that name no step
       above the replica's newest record's step (a truncation or rewind record, spec §20.3.3;
       the fence record of an opening) are created before any rank chain is synced, when
       every rank chain holds their step, no record before them names a lower step (its
       truncation may have changed that step since the rank chains were last synced), and
       no record passed on the way commits a held step above it. The replica's committed
       steps then shrink exactly as the source's did, so syncing the rank chains to the
       truncated source afterwards removes only steps that are no longer committed.
    2. **Rank chains, up to a limit.** Each rank chain is synced as an ordinary chain
       (spec §17.5), and no further than a step limit when a record still to be copied
       names a lower step than one before it. If one names a step below the replica's
       newest step (a truncation that step 1 could not copy yet: a record before it names
       a step above the replica's newest one that its rank chains hold, perhaps from a run
       the source abandoned), the limit is the lowest step named, so that no committed step
       of the replica changes version in one rank chain while another still holds the old
       one (its committed steps shrink to the limit until the records follow). Otherwise it
       is the last record's step, so that the steps above it that the records before it
       name are not held. A rank chain that could only follow by jumping past the limit to
       a snapshot of a source truncated again or compacted since makes the call refuse (the
       replica is deleted and synced again). After the logs are folded, and before anything
       is copied, the source's commit records are read again: a new one below the replica's
       newest step (the source was truncated meanwhile) starts the round again, so that it
       goes first.
    3. **Records after the rank chains.** Then the records read before the rank chains were
       synced are created in order, up to the newest one that :func:`copyable` allows: its
       step held by every rank chain (rule I1 of spec §20.3.4), durable there first (rule D),
       and no later record of the source, read after the rank chains were synced, naming a
       lower step. Such a record was created when every rank chain held its steps; a rank
       chain loses or changes a step only by a truncation below it, which a record with a
       lower step precedes (I2, I3). So every rank chain of the replica, a copy of the source's
       made after the record, holds the steps that record commits, as it committed them.

    A record whose step the rank chains no longer hold (a later record truncated the source
    below it, or a compaction dropped it) can never be held again; it is created only on the
    way to a later record of the same round whose step they hold. Until that one exists (an
    interruption in between), the replica's newest record names a step its rank chains lack:
    readers see the committed steps below it, and validation reports it until the next sync.
    Every record is created with the source's exact bytes, in order and exclusively, while
    the replicator holds every rank chain's lock.
    """

    def __init__(self, src: Store, src_name: str, root_bytes: bytes, root: ShardedRoot, dst: Store, dst_name: str,
                 jobs: list[_Sync], report: SyncReport, progress: Progress | None) -> None:
        self.src = src
        self.src_name = src_name
        self.root_bytes = root_bytes
        self.root = root
        self.dst = dst
        self.dst_name = dst_name
        self.jobs = jobs
        self.report = report
        self.progress = progress
        #: The source's commit records above the replica's, by number, with their bytes.
        self.records: dict[int, tuple[Commit, bytes]] = {}
        self.known = 0  # the source's newest record read
        self.known_checksum: str | None = None
        self.seq = 0  # the replica's newest record
        self.last: Commit | None = None
        self.limit: int | None = None
        self.descent = False
        for job in jobs:
            job.meter = self._meter

    def _meter(self) -> None:
        total = sum(j.total_bytes for j in self.jobs)
        if self.progress is not None and total:
            self.progress("bytes", sum(j.done_bytes for j in self.jobs), total)

    # -- the root and the locks ------------------------------------------------------------------
    def open_root(self) -> None:
        """Check the replica's ``sharded.json``, or create it in an empty location."""
        where = f"{self.dst_name}/{SHARDED_ROOT}"
        try:
            exists = self.dst.exists(SHARDED_ROOT)
        except OSError as e:
            raise io_error(f"{where}: cannot read the replica", e) from None
        if exists:
            self._check_root(read_bounded(self.dst, SHARDED_ROOT, MAX_SHARDED_ROOT_BYTES, where))
            return
        try:
            paths = self.dst.list("")
        except OSError as e:
            raise io_error(f"{self.dst_name}: cannot list the replica", e) from None
        other = [p for p in paths if not p.startswith(f".tmp-{SHARDED_ROOT}-")]
        if other:
            raise UsageError(f"{self.dst_name}: holds no chain and is not empty ({other[0]}); sync into a new or "
                             f"empty location, or into a replica of {self.src_name}")
        try:
            self.dst.create_exclusive(SHARDED_ROOT, self.root_bytes)
        except FileExistsError:  # another replicator of the same chain, or someone else's chain
            self._check_root(read_bounded(self.dst, SHARDED_ROOT, MAX_SHARDED_ROOT_BYTES, where))
            return
        except OSError as e:
            raise io_error(f"{where}: cannot create the replica's sharded root (sync again)", e) from None
        self.report.created = True

    def _check_root(self, data: bytes) -> None:
        if data == self.root_bytes:
            return
        where = f"{self.dst_name}/{SHARDED_ROOT}"
        try:
            theirs: str | None = ShardedRoot.from_bytes(data, where).chain_id
        except (CorruptChainError, NotAChainError):
            theirs = None
        if theirs is not None and theirs != self.root.chain_id:
            raise ReplicaDivergedError(
                f"{self.dst_name}: holds sharded chain {theirs}, not {self.src_name} (chain {self.root.chain_id}); "
                f"nothing was changed. Sync to a new location, or delete {self.dst_name} first"
            )
        raise ReplicaDivergedError(
            f"{where}: differs from {self.src_name}/{SHARDED_ROOT}: {self.dst_name} is not a replica of "
            f"{self.src_name}; nothing was changed. Delete it and sync again"
        )

    def lock_ranks(self, break_lock: bool, lock_wait: float) -> None:
        """Take every rank chain's writer lock, in rank order (spec §20.3.1: commit records are
        created by a maintainer that holds them all)."""
        for r, job in enumerate(self.jobs):
            try:
                job.lock = _take_lock(job.dst, job.dst_name, break_lock, lock_wait)
            except ChainLockedError as e:
                raise type(e)(f"{e}; rank {r}'s chain of the replica {self.dst_name} is in use, so nothing more "
                              "was copied") from None
            job.fenced = not job.lock.took_over

    # -- commit records ----------------------------------------------------------------------------
    def open_commits(self) -> None:
        """The replica's newest commit record, checked against the source's (spec §17.5 step 2)."""
        mine = self._numbers(self.dst, self.dst_name)
        if mine != list(range(1, len(mine) + 1)):
            missing = next(n for n, seq in enumerate(mine, start=1) if n != seq)
            raise self._diverged(missing, "it is missing while later ones exist")
        theirs = self._numbers(self.src, self.src_name)
        if theirs != list(range(1, len(theirs) + 1)):
            missing = next(n for n, seq in enumerate(theirs, start=1) if n != seq)
            raise CorruptChainError(f"{self.src_name}/{commit_path(missing)}: commit record missing (the records "
                                    f"jump to {theirs[missing - 1]})")
        self.seq = len(mine)
        if self.seq:
            if self.seq > len(theirs):
                raise self._diverged(self.seq, f"{self.src_name} has {len(theirs)} commit records")
            data = self._read(self.dst, self.dst_name, self.seq)
            if data != self._read(self.src, self.src_name, self.seq):
                raise self._diverged(self.seq, "its bytes differ")
            self.last = Commit.from_bytes(data, f"{self.dst_name}/{commit_path(self.seq)}")
        self.known, self.known_checksum = self.seq, None if self.last is None else self.last.checksum
        self._read_src(len(theirs))

    @staticmethod
    def _numbers(store: Store, name: str) -> list[int]:
        try:
            return commit_numbers(store)
        except OSError as e:
            raise io_error(f"{name}: cannot list the commit records", e) from None

    @staticmethod
    def _read(store: Store, name: str, seq: int) -> bytes:
        where = f"{name}/{commit_path(seq)}"
        try:
            return read_bounded(store, commit_path(seq), MAX_COMMIT_BYTES, where)
        except FileNotFoundError:
            raise CorruptChainError(f"{where}: commit record vanished (commit records are never deleted); is "
                                    "another process changing the chain?") from None

    def _read_src(self, upto: int | None = None) -> list[Commit]:
        """Read the source's records after the newest one read, up to ``upto`` (None: as
        long as there are more); each must follow the one before it (spec §20.3.1)."""
        new = []
        while upto is None or self.known < upto:
            seq = self.known + 1
            where = f"{self.src_name}/{commit_path(seq)}"
            try:
                data = read_bounded(self.src, commit_path(seq), MAX_COMMIT_BYTES, where)
            except FileNotFoundError:
                if upto is None:
                    break
                raise CorruptChainError(f"{where}: commit record vanished (commit records are never "
                                        "deleted)") from None
            commit = Commit.from_bytes(data, where)
            if commit.seq != seq:
                raise CorruptChainError(f"{where}: the record says seq {commit.seq}")
            if commit.prev != self.known_checksum:
                raise CorruptChainError(f"{where}: prev does not match record {seq - 1}")
            self.records[seq] = (commit, data)
            self.known, self.known_checksum = seq, commit.checksum
            new.append(commit)
        return new

    def _pending(self, upto: int) -> list[int]:
        return [self.records[s][0].step for s in range(self.seq + 1, upto + 1)]

    def _later(self, upto: int) -> list[int]:
        return [self.records[s][0].step for s in range(upto + 1, self.known + 1)]

    def _start(self) -> int | None:
        return None if self.last is None else self.last.step

    def _held(self) -> set[int]:
        """The steps that every rank chain of the replica holds."""
        held: set[int] | None = None
        for job in self.jobs:
            steps = set(job.state.steps) if job.has_root else set()
            held = steps if held is None else held & steps
        return held or set()

    def _create(self, n: int) -> None:
        """Create the replica's next ``n`` commit records, in order, with the source's bytes."""
        if not n:
            return
        for job in self.jobs:  # rule D: the rank chains' records are durable before a record relies on them
            if job.state.last_seq:
                try:
                    job.dst.sync([log_path(job.state.last_seq)])
                except OSError as e:
                    raise io_error(f"{job.dst_name}: cannot make its log durable (no commit record was copied; "
                                   "sync again)", e) from None
        for job in self.jobs:  # rule L, for every rank chain: we hold them all
            assert job.lock is not None
            job.lock.renew_if_due()
            job.lock.check()
        for seq in range(self.seq + 1, self.seq + n + 1):
            commit, data = self.records[seq]
            create_or_lose(self.dst, commit_path(seq), data, self.dst_name,
                           "another process created this commit record of the replica",
                           f"cannot create the commit record (the replica's newest is {self.seq}); sync again")
            self.seq, self.last = seq, commit
            self.report.records_copied += 1

    # -- the rank chains ---------------------------------------------------------------------------
    def _set_limit(self, upto: int) -> None:
        """How far the rank chains are synced in this round (step 2 of the class docstring)."""
        pending, start = self._pending(upto), self._start()
        self.limit, self.descent = None, False
        if pending and start is not None and min(pending) < start:
            self.limit, self.descent = min(pending), True
        elif pending and max(pending) > pending[-1]:
            self.limit = pending[-1]

    def _rank_plan(self, job: _Sync) -> list[Record]:
        """The records of a rank chain to copy, as far as the limit allows."""
        todo = job._plan()
        if self.limit is None:
            return todo
        cut: list[Record] = []
        for record in todo:
            if _top_step(record) > self.limit:
                break
            cut.append(record)
        if cut or not todo:
            return cut
        if not job.state.last_seq:
            return todo  # a new rank chain: no step of it is committed yet
        if todo[0].type != "snapshot":
            return []  # steps after the limit: they wait for the next round or call
        if self.descent:
            raise ReplicaDivergedError(
                f"{job.dst_name}: {self.src_name} was truncated below step {self._start()} of the replica and "
                f"truncated or compacted again since; the replica cannot follow it without making a committed step "
                f"hold parts of two versions; nothing more was changed. Delete {self.dst_name} and sync again"
            )
        return todo  # a compaction: the replica's committed steps keep their bits

    def _check_source(self) -> None:
        """After a rank chain's log was folded: a new record below the replica's newest step
        means that the source was truncated, maybe before that fold."""
        new = self._read_src()
        start = self._start()
        if start is not None and any(c.step < start for c in new):
            raise _Restart

    def _sync_ranks(self, upto: int) -> None:
        self._set_limit(upto)
        plans = []
        for job in self.jobs:
            job.reader.refresh()
            plans.append(self._rank_plan(job))
        for job, plan in zip(self.jobs, plans, strict=True):
            job.total_bytes = job.done_bytes + job.planned_bytes(plan)
        self._check_source()
        for job, plan in zip(self.jobs, plans, strict=True):
            first = [plan]

            def next_plan(job: _Sync = job, first: list[list[Record]] = first) -> list[Record]:
                return first.pop() if first else self._rank_plan(job)

            job.copy(next_plan, self._check_source)

    # -- the call ------------------------------------------------------------------------------------
    def run(self) -> None:
        self.open_commits()
        for job in self.jobs:
            job.open_replica()
        for _ in range(SHARDED_ROUNDS):
            before = self.report.records_copied
            self._read_src()
            upto = self.known
            self._create(copyable(self._pending(upto), [], self._start(), self._held(), rank_chains_synced=False))
            try:
                self._sync_ranks(upto)
            except _Restart:
                continue
            self._read_src()
            self._create(copyable(self._pending(upto), self._later(upto), self._start(), self._held(),
                                  rank_chains_synced=True))
            if self.seq >= upto or self.report.records_copied == before:
                break
        for job in self.jobs:
            job.finish()
        if all(job.fenced for job in self.jobs):
            self._remove_temporaries()
        self._sum_up()

    def _remove_temporaries(self) -> None:
        """Temporary files of commit records whose creation was interrupted (spec §7.5)."""
        try:
            for path in self.dst.list(COMMITS_DIR):
                if path.rsplit("/", 1)[-1].startswith(".tmp-"):
                    self.dst.delete(path)
                    self.report.garbage_removed += 1
        except OSError:
            pass  # garbage stays garbage; the next sync removes it

    def _sum_up(self) -> None:
        report = self.report
        try:
            self._read_src()  # how far the source is now, for the lag
        except (LdformatError, OSError):
            pass
        newest = self.records[self.known][0] if self.known > self.seq else self.last
        report.src_last_seq, report.dst_last_seq = self.known, self.seq
        report.src_latest_step = _committed(newest, [set(j.reader.state.steps) for j in self.jobs])
        report.dst_latest_step = _committed(self.last, [self._held()])

    def add_up(self) -> None:
        """The rank chains' reports, summed up (also after a failure)."""
        report = self.report
        report.ranks = [job.report for job in self.jobs]
        report.rank_records_copied = sum(r.records_copied for r in report.ranks)
        report.objects_copied = sum(r.objects_copied for r in report.ranks)
        report.objects_skipped = sum(r.objects_skipped for r in report.ranks)
        report.bytes_copied = sum(r.bytes_copied for r in report.ranks)
        report.garbage_removed += sum(r.garbage_removed for r in report.ranks)
        report.source_refolds = sum(r.source_refolds for r in report.ranks)
        report.jumped = any(r.jumped for r in report.ranks)
        report.garbage_deferred = any(r.garbage_deferred for r in report.ranks)

    def _diverged(self, seq: int, why: str) -> ReplicaDivergedError:
        return ReplicaDivergedError(
            f"{self.dst_name}/{commit_path(seq)}: the replica has diverged from {self.src_name} ({why}): it was "
            f"written to directly (a writer, compaction or truncation of the replica), or {self.src_name} was "
            f"replaced; nothing was changed. Delete {self.dst_name} and sync again, or sync to a new location"
        )


def _committed(commit: Commit | None, ranks: list[set[int]]) -> int | None:
    """The newest committed step: at most ``commit``'s step, held by every rank chain."""
    if commit is None or not ranks:
        return None
    common = set.intersection(*ranks)
    steps = [s for s in common if s <= commit.step]
    return max(steps) if steps else None


def _sync_sharded(src: str | os.PathLike[str] | Store, src_store: Store, src_name: str,
                  dst: str | os.PathLike[str] | Store, *, progress: Progress | None, workers: int, break_lock: bool,
                  lock_wait: float, src_options: dict[str, Any] | None, dst_options: dict[str, Any] | None,
                  started: float) -> SyncReport:
    """:func:`sync` of a sharded chain (spec §20): see :class:`_ShardedSync`."""
    where = f"{src_name}/{SHARDED_ROOT}"
    root_bytes = read_bounded(src_store, SHARDED_ROOT, MAX_SHARDED_ROOT_BYTES, where)
    root = ShardedRoot.from_bytes(root_bytes, where)
    if src_store.exists(ROOT_FILE):
        raise CorruptChainError(f"{src_name}: holds both {SHARDED_ROOT} and {ROOT_FILE} (spec §20.1)")
    if not isinstance(dst, Store) and not is_sharded_location(dst, dst_options):
        refuse_sharded(dst, None, dst_options, "synced into")  # one rank's chain of a sharded chain
    sources = []
    for r in range(root.world_size):  # every rank chain readable before the replica is touched
        store, name = _rank_store(src, src_store, src_name, r, src_options)
        try:
            reader = ChainReader(name, store=store)
        except NotAChainError as e:
            raise CorruptChainError(f"{name}: rank {r}'s chain of the sharded chain {src_name} is missing or "
                                    f"unreadable ({e})") from None
        data = read_bounded(store, ROOT_FILE, MAX_ROOT_BYTES, f"{name}/{ROOT_FILE}")
        if RootMetadata.from_bytes(data, f"{name}/{ROOT_FILE}").chain_id != reader.root.chain_id:
            raise CorruptChainError(f"{name}/{ROOT_FILE}: the root changed while it was read; sync again")
        sources.append((reader, data))
    dst_store, dst_name = _open(dst, dst_options, create=True)
    if _same_location(src_store, dst_store):
        raise UsageError(f"{dst_name}: the destination is the source {src_name}; sync to another location")
    if dst_store.exists(ROOT_FILE):
        raise UsageError(f"{dst_name}: holds an ordinary chain, and {src_name} is a sharded chain; a replica holds "
                         "the same kind of chain as its source: sync to a new location")
    report = SyncReport(src=src_name, dst=dst_name, sharded=True, world_size=root.world_size)
    jobs = []
    for r, (reader, data) in enumerate(sources):
        store, name = _rank_store(dst, dst_store, dst_name, r, dst_options)
        jobs.append(_Sync(reader, data, store, name, SyncReport(src=reader.path, dst=name), progress, workers))
    job = _ShardedSync(src_store, src_name, root_bytes, root, dst_store, dst_name, jobs, report, progress)
    job.open_root()
    try:
        job.lock_ranks(break_lock, lock_wait)
        job.run()
    finally:
        for rank in jobs:
            _settle_lock(rank)
        job.add_up()
    report.seconds = time.monotonic() - started
    return report
