"""Replication of a sharded chain (spec §20.12 "Replication").

Its ``sharded.json`` first, then each rank chain as :mod:`.replicate` copies an ordinary chain,
then the global commit records, byte for byte and in order, each only once every rank chain
of ``dst`` holds the steps it commits (see :class:`_ShardedSync` for the order that keeps a
reader of ``dst`` from ever seeing a step that is half copied, or assembled from two versions
of the source).
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from ..chain.reader import ChainReader
from ..chain.records import ROOT_FILE, create_or_lose, io_error, log_path, read_bounded
from ..chain.replicate import (
    ChainSync,
    Progress,
    ReplicaDivergedError,
    SyncReport,
    open_location,
    same_location,
    settle_lock,
    take_lock,
)
from ..chain.sharded_probe import RANKS_DIR, SHARDED_ROOT, is_sharded_location, rank_location, refuse_sharded
from ..errors import ChainLockedError, CorruptChainError, LdformatError, NotAChainError, UsageError
from ..format.jsonvalue import MAX_ROOT_BYTES
from ..format.manifest import Record, RootMetadata
from ..stores import Store, StoreOrPath, open_store, parse_location
from ..stores.prefixed import PrefixedStore
from .chain import (
    COMMITS_DIR,
    MAX_COMMIT_BYTES,
    MAX_SHARDED_ROOT_BYTES,
    Commit,
    ShardedRoot,
    commit_numbers,
    commit_path,
)

#: Rounds of one sharded sync. Each round syncs the rank chains and copies the commit records
#: it can; a truncation of the source takes up to two (up to the truncating record, then after
#: it), and a round is started again when the source is truncated while it plans.
SHARDED_ROUNDS = 8


def _rank_store(location: StoreOrPath, store: Store, name: str, rank: int,
                options: dict[str, Any] | None) -> tuple[Store, str]:
    """Rank ``rank``'s chain of the sharded chain ``store`` at ``location``, and how messages
    name it. A URL's rank chain is opened as readers and writers open it (``memory://`` names
    one store per location); a directory's or a store's is the part of it below
    ``ranks/<rank>``."""
    part = f"{RANKS_DIR}/{rank:05d}"
    if isinstance(location, Store) or parse_location(location).path is not None:
        return PrefixedStore(store, part), f"{name}/{part}"
    url = rank_location(location, rank)
    return open_store(url, storage_options=options), parse_location(url).name


def _top_step(record: Record) -> int:
    """The newest step a rank chain's record holds (-1: none, e.g. a fence record)."""
    steps = [a.step for a in record.anchors] + [s.step for d in record.deltas for s in d.steps]
    steps += [ranges[-1][1] for g in record.segments for ranges in (g.anchor_steps, g.delta_steps) if ranges]
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
    (each a :class:`ChainSync` under that rank chain's writer lock) and its commit records.

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
                 jobs: list[ChainSync], report: SyncReport, progress: Progress | None) -> None:
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
        for r, job in zip(self.root.chain_ranks, self.jobs, strict=True):
            try:
                job.lock = take_lock(job.dst, job.dst_name, break_lock, lock_wait)
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

    def _rank_plan(self, job: ChainSync) -> list[Record]:
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

            def next_plan(job: ChainSync = job, first: list[list[Record]] = first) -> list[Record]:
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


def sync_sharded(src: StoreOrPath, src_store: Store, src_name: str,
                  dst: StoreOrPath, *, progress: Progress | None, workers: int, break_lock: bool,
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
    sources = {}
    for r in root.chain_ranks:  # every rank chain readable before the replica is touched (copy ranks have none)
        store, name = _rank_store(src, src_store, src_name, r, src_options)
        try:
            reader = ChainReader(name, store=store)
        except NotAChainError as e:
            raise CorruptChainError(f"{name}: rank {r}'s chain of the sharded chain {src_name} is missing or "
                                    f"unreadable ({e})") from None
        data = read_bounded(store, ROOT_FILE, MAX_ROOT_BYTES, f"{name}/{ROOT_FILE}")
        if RootMetadata.from_bytes(data, f"{name}/{ROOT_FILE}").chain_id != reader.root.chain_id:
            raise CorruptChainError(f"{name}/{ROOT_FILE}: the root changed while it was read; sync again")
        sources[r] = (reader, data)
    dst_store, dst_name = open_location(dst, dst_options, create=True)
    if same_location(src_store, dst_store):
        raise UsageError(f"{dst_name}: the destination is the source {src_name}; sync to another location")
    if dst_store.exists(ROOT_FILE):
        raise UsageError(f"{dst_name}: holds an ordinary chain, and {src_name} is a sharded chain; a replica holds "
                         "the same kind of chain as its source: sync to a new location")
    report = SyncReport(src=src_name, dst=dst_name, sharded=True, world_size=root.world_size)
    jobs = []
    for r, (reader, data) in sources.items():
        store, name = _rank_store(dst, dst_store, dst_name, r, dst_options)
        jobs.append(ChainSync(reader, data, store, name, SyncReport(src=reader.path, dst=name), progress, workers))
    job = _ShardedSync(src_store, src_name, root_bytes, root, dst_store, dst_name, jobs, report, progress)
    job.open_root()
    try:
        job.lock_ranks(break_lock, lock_wait)
        job.run()
    finally:
        for rank in jobs:
            settle_lock(rank)
        job.add_up()
    report.seconds = time.monotonic() - started
    return report
