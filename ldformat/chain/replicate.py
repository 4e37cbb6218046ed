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

A sharded chain (spec §20.12) is replicated part by part by :mod:`.replicate_sharded`, with
this module's machinery for each rank chain. What a sync returns is :mod:`.sync_report`; the
replica's lock across calls (kept held, or taken up again) is :mod:`.replica_lock`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

import numpy as np

from ..errors import (
    ChainExistsError,
    CorruptChainError,
    LdformatError,
    MissingObjectError,
    UsageError,
)
from ..format.checksum import object_checksum_parts, object_checksum_seed
from ..format.fold import ChainState
from ..format.jsonvalue import MAX_RECORD_BYTES, MAX_ROOT_BYTES
from ..format.manifest import ObjectRef, Record, RootMetadata, Segment, SegmentRef, expand
from ..stores import Store, StoreOrPath, open_store, parse_location
from ..stores.local import make_directory
from .commit import collect_garbage
from .lock import WriterLock
from .reader import ChainReader
from .records import (
    LOCK_DIR,
    LOG_DIR,
    ROOT_FILE,
    SEGMENT_DIR,
    MissingLogRecord,
    create_or_lose,
    io_error,
    log_path,
    log_sequence_numbers,
    read_bounded,
    read_log,
    segment_reader,
)
from .replica_lock import settle_lock as settle_lock
from .replica_lock import take_lock as take_lock
from .sharded_probe import is_sharded, is_sharded_location, refuse_sharded
from .sync_report import Progress as Progress
from .sync_report import ReplicaDivergedError, SyncReport

__all__ = ["ReplicaDivergedError", "SyncReport", "sync"]

#: How often the source's log is folded again when a record or object of the version being
#: copied vanishes (a concurrent compaction or truncation, spec §17.4) before giving up.
SOURCE_ATTEMPTS = 5

#: Objects copied at the same time (each is held in memory while it is copied).
WORKERS = 4
#: Objects at least this large are copied from a local source mapped, not read into memory.
STREAM_BYTES = 64 << 20
STREAM_CHUNK = 8 << 20

def sync(
    src: StoreOrPath,
    dst: StoreOrPath,
    *,
    progress: Progress | None = None,
    workers: int = WORKERS,
    break_lock: bool = False,
    lock_wait: float = 0.0,
    src_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
) -> SyncReport:
    """Sync an ordinary chain; :func:`ldformat.sync` (which documents it) also syncs sharded ones."""
    if workers < 1:
        raise UsageError(f"sync: workers must be >= 1, got {workers}")
    started = time.monotonic()
    src_store, src_name = open_location(src, src_options, create=False)
    if is_sharded(src_store):
        raise UsageError(f"{src_name}: a sharded chain; sync it with ldformat.sync")
    return sync_opened(src_store, src_name, dst, progress=progress, workers=workers, break_lock=break_lock,
                       lock_wait=lock_wait, dst_options=dst_options, started=started)


def sync_opened(src_store: Store, src_name: str, dst: StoreOrPath, *, progress: Progress | None,
                workers: int, break_lock: bool, lock_wait: float, dst_options: dict[str, Any] | None,
                started: float) -> SyncReport:
    """:func:`sync` of the ordinary chain in ``src_store``, opened by the caller at ``started``."""
    _refuse_sharded_dst(dst, dst_options, src_name)
    reader = ChainReader(src_name, store=src_store)  # NotAChainError before dst is touched
    root_bytes = read_bounded(src_store, ROOT_FILE, MAX_ROOT_BYTES, f"{src_name}/{ROOT_FILE}")
    if RootMetadata.from_bytes(root_bytes, f"{src_name}/{ROOT_FILE}").chain_id != reader.root.chain_id:
        raise CorruptChainError(f"{src_name}/{ROOT_FILE}: the root changed while it was read; sync again")
    dst_store, dst_name = open_location(dst, dst_options, create=True)
    if same_location(src_store, dst_store):
        raise UsageError(f"{dst_name}: the destination is the source {src_name}; sync to another location")
    report = SyncReport(src=src_name, dst=dst_name)
    job = ChainSync(reader, root_bytes, dst_store, dst_name, report, progress, workers)
    if not dst_store.exists(ROOT_FILE):
        job.check_unfinished_creation()  # refuse someone else's data before taking its lock
    job.lock = take_lock(dst_store, dst_name, break_lock, lock_wait)
    try:
        job.run()
    finally:
        settle_lock(job)
    report.seconds = time.monotonic() - started
    return report


def _refuse_sharded_dst(dst: StoreOrPath, options: dict[str, Any] | None, src_name: str) -> None:
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


def open_location(location: StoreOrPath, options: dict[str, Any] | None,
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
    """How messages name ``store`` (:meth:`Store.describe <ldformat.stores.Store.describe>`)."""
    return store.describe()


def same_location(a: Store, b: Store) -> bool:
    """Whether the two stores are one location (a sync onto its own source is refused; ``==``
    of stores)."""
    return a == b


class _SourceMoved(Exception):
    """A record or object of the source's folded version vanished: fold it again."""

    def __init__(self, error: CorruptChainError) -> None:
        super().__init__(str(error))
        self.error = error


Outcome = Literal["committed", "verified", "copied"]


class ChainSync:
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
        # The replica's fold, kept current as records are copied.
        self.state = ChainState(read_segment=segment_reader(dst, dst_name), where=dst_name)
        self.has_root = False
        #: Objects the replica's committed records reference (or referenced during this call:
        #: nothing deletes them before the garbage collection at the end), with their
        #: reference, so that they are neither read back nor overwritten.
        self.committed: dict[str, ObjectRef] = {}
        self._segments: dict[str, Segment] = {}  # the source's segments read during this call
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
        other = [p for p in paths if not p.startswith((f"{LOG_DIR}/", f"{LOCK_DIR}/", "anchors/", "deltas/",
                                                        f"{SEGMENT_DIR}/"))
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
            self.state = ChainState(last_seq=seq, first_seq=seq, read_segment=segment_reader(self.dst, self.dst_name),
                                    where=self.dst_name)
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
        self.committed = {g.object.path: g.object for g in self.state.segments}
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
        self.present = set(self._list("anchors")) | set(self._list("deltas")) | set(self._list(SEGMENT_DIR))
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ldformat-sync") as pool:
            try:
                for record, objects in plans:
                    self._copy_record(pool, record, objects)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def _objects(self, record: Record) -> list[tuple[str, ObjectRef, str]]:
        """Every object ``record`` references: (chain-relative path, reference, group prefix);
        for a snapshot with segments, the segments and the objects of the entries they
        contribute (read from the source, verified, spec §7.9)."""
        out: dict[str, tuple[str, ObjectRef, str]] = {}
        anchors, deltas = list(record.anchors), list(record.deltas)
        for ref in record.segments:
            out.setdefault(ref.object.path, (ref.object.path, ref.object, ""))
            try:
                segment = self._read_segment(ref)
            except MissingObjectError as e:
                raise _SourceMoved(e) from None
            listed_anchors, listed_deltas = set(expand(ref.anchor_steps)), set(expand(ref.delta_steps))
            anchors += [a for a in segment.anchors if a.step in listed_anchors]
            deltas += [d for d in segment.deltas if any(s.step in listed_deltas for s in d.steps)]
        for a in anchors:
            out.setdefault(a.object.path, (a.object.path, a.object, ""))
        for d in deltas:
            for o in d.objects:
                path = f"{d.path}/{o.path}"
                out.setdefault(path, (path, o, d.path))
        return list(out.values())

    def _read_segment(self, ref: SegmentRef) -> Segment:
        cached = self._segments.get(ref.object.path)
        if cached is None:
            cached = self._segments[ref.object.path] = segment_reader(self.reader.store, self.src_name)(ref)
        return cached

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
            _, crc = self.dst.read_buffer_crc32c(path, seed=object_checksum_seed(path))
            return f"{crc:08x}" == ref.crc32c
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
