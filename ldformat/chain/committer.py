"""A chain writer's commits: what the other roles wrote becomes durable in one commit record,
then snapshot records and live retention keep the chain short (spec §7.4 "Commit protocol",
§7.8 "Snapshots written by a writer", §7.9 "Segments", §17 "Compaction and retention").

A commit keeps the protocol's order: the pending batch's objects are written, every new object
(anchors and batches) is synced, and only then is the commit record created, exclusively and
under the writer lock (spec §7.4: data first, then an exclusive commit). A creation creates the
root after record 1, once the lock is checked again. After a commit, live retention drops
history beyond ``max_bytes`` and a snapshot record is written when :class:`SnapshotPolicy` says
it is due; the records a snapshot supersedes are deleted one snapshot later (spec §7.5
"Leftovers and garbage"), so that readers folding from the previous one still find theirs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ChainError
from ..format.manifest import AnchorEntry, DeltaEntry, RootMetadata
from .batches import PendingBatch
from .commit import commit_record, delete_superseded
from .guard import WriterGuard
from .lock import WriterLock
from .maintenance import retain_from_newest_anchor
from .records import ROOT_FILE, create_root
from .snapshots import commit_snapshot, segments_allowed

log = logging.getLogger("ldformat")


@dataclass(frozen=True)
class SnapshotPolicy:
    """When a writer restates its chain in a snapshot record (spec §7.8).

    After a commit, a snapshot is written once the records after the newest snapshot (the
    *tail*, which every open reads and parses) number at least ``min_records`` and either
    ``max_tail_records`` or ``min_bytes`` bytes, and hold at least ``ratio * S`` bytes, ``S``
    being the size of that snapshot record. So an open reads ``S`` plus a tail of about
    ``max_tail_records`` small records or ``min_bytes`` of large ones (records that carry RNG
    states are about 18 KB per step), and at most ``1 / ratio`` bytes of snapshot record are
    written per byte committed.

    In a 1.5 chain (the default) a snapshot is segmented (spec §7.9): it writes the entries
    committed since the previous snapshot into a new segment object and references the older
    segments, so ``S`` is one small reference per segment and an open reads ``S`` plus the
    tail, whatever the number of committed steps. In an older chain a snapshot restates every
    entry inline, so ``S`` grows with the chain; writing the next one only after ``ratio * S``
    new bytes keeps the commit cost O(1) amortized, and one that would exceed ``max_bytes`` is
    not written (compact the chain instead).
    """

    ratio: float = 0.125
    min_bytes: int = 1 << 20
    min_records: int = 4
    max_bytes: int = 32 << 20
    max_tail_records: int = 64


class Committer:
    """The anchors and batches not yet committed, the commits, snapshots and live retention."""

    def __init__(self, guard: WriterGuard, batch: PendingBatch, format_version: str) -> None:
        self._guard = guard
        self._batch = batch
        self.pending_anchors: list[AnchorEntry] = []
        self.pending_deltas: list[DeltaEntry] = []
        self.written: list[str] = []  # objects written since the last commit, synced before it
        self.pending_root: RootMetadata | None = None  # set while a chain is being created
        self.commits = 0
        self.last_commit_seconds = 0.0  # sync + record creation of the latest commit (and snapshot)
        #: When to write snapshot records (spec §7.8); None: never. The default is segmented
        #: snapshots where the chain's version allows them (1.5), none in older chains, whose
        #: inline snapshots are about as large as the log they replace.
        self.segmented = segments_allowed(format_version)
        self.snapshot_policy: SnapshotPolicy | None = SnapshotPolicy() if self.segmented else None
        self.snapshots = 0  # snapshot records this writer committed
        self._snapshot_too_large_warned = False
        # Records below this number may still exist although a snapshot supersedes them: those
        # below the previous snapshot are deleted after each new one (spec §7.5).
        self._superseded_from = guard.state.first_seq
        self.max_bytes: int | None = None  # a disk budget kept by dropping history after commits
        self.retained: list[int] = []  # steps dropped to keep max_bytes
        #: Retention keeps every step from the newest anchor at or below this step on (a rank
        #: chain's writer: the sharded chain's newest committed step, spec §20.8); when it
        #: returns None, nothing is dropped.
        self.retain_at_most: Callable[[], int | None] | None = None
        self._over_budget_warned = False

    # -- commits -------------------------------------------------------------------------
    def commit(self) -> int | None:
        """Make everything recorded so far durable; returns the last durable step."""
        guard = self._guard
        lock = guard.check_usable()
        entry = self._batch.write(guard, self.written)
        if entry is not None:
            self.pending_deltas.append(entry)
        if not self.pending_anchors and not self.pending_deltas:
            return guard.durable_step
        started = time.perf_counter()
        self._commit_record(lock)
        self.commits += 1
        self.pending_anchors, self.pending_deltas, self.written = [], [], []
        self.retain_if_over_budget()
        if self._snapshot_due():
            self.write_snapshot()
        self.last_commit_seconds = time.perf_counter() - started
        return guard.durable_step

    def _commit_record(self, lock: WriterLock) -> None:
        """Sync the new objects, then create the commit record (and, creating a chain, the root)."""
        guard = self._guard
        guard.io(f"{len(self.written)} new objects ({', '.join(self.written[:3])}...)", guard.store.sync,
                 self.written)
        creating = self.pending_root is not None
        guard.io("the commit record", lambda: commit_record(
            guard.store, guard.path, guard.state, lock, type="append", reason="create" if creating else "append",
            anchors=self.pending_anchors, deltas=self.pending_deltas), outcome_unknown=True)
        if self.pending_root is not None:
            guard.io(ROOT_FILE, lock.check)  # a creation taken over meanwhile creates no root
            guard.io(ROOT_FILE, create_root, guard.store, self.pending_root, guard.path)
            self.pending_root = None

    # -- snapshots -----------------------------------------------------------------------
    def _snapshot_due(self) -> bool:
        policy, st = self.snapshot_policy, self._guard.state
        if policy is None or self._guard.lock is None or st.tail_records < policy.min_records:
            return False
        if st.tail_bytes < policy.ratio * st.start_bytes:
            return False
        if st.tail_records < policy.max_tail_records and st.tail_bytes < policy.min_bytes:
            return False
        # The records' sizes bound an inline snapshot's: it restates their entries without their
        # headers. A segmented one cuts its new entries into segments.
        if not self.segmented and st.start_bytes + st.tail_bytes > policy.max_bytes:
            if not self._snapshot_too_large_warned:
                self._snapshot_too_large_warned = True
                log.warning("%s: a snapshot of this chain would exceed %d bytes; no more snapshots are written, "
                            "so opening it reads the %d records since the newest one (compact the chain with "
                            "keep_last to shorten it)", self._guard.path, policy.max_bytes, st.tail_records)
            return False
        return True

    def write_snapshot(self) -> None:
        """Commit a snapshot record that restates the chain as it is (see
        :meth:`ldformat.ChainWriter.write_snapshot`)."""
        self.commit()  # nothing may be pending: a snapshot states committed content only
        guard = self._guard
        lock, state = guard.lock, guard.state
        if lock is None or state.latest_step is None or state.tail_records == 0:
            return  # the newest record is a snapshot already
        previous_start = state.first_seq
        guard.io("the snapshot record", lambda: commit_snapshot(
            guard.store, guard.path, state, lock, reason="snapshot", segmented=self.segmented))
        self.snapshots += 1
        guard.io("superseded records", delete_superseded, guard.store, guard.path, lock,
                 range(self._superseded_from, previous_start), state)
        self._superseded_from = max(self._superseded_from, previous_start)

    # -- live retention ------------------------------------------------------------------
    def retain_if_over_budget(self) -> None:
        """Run live retention when the chain references more than ``max_bytes``."""
        lock = self._guard.lock
        if self.max_bytes is not None and lock is not None and self._guard.state.referenced_bytes() > self.max_bytes:
            self._keep_budget(lock, self.max_bytes)

    def _keep_budget(self, lock: WriterLock, max_bytes: int) -> None:
        """Live retention (spec §17): drop every step before the newest anchor, as
        ``compact(keep_last=...)`` would, so that the chain keeps within ``max_bytes``.

        Runs right after a commit, when no uncommitted object exists, under this writer's
        lock; it writes no anchor (the kept steps start at one), only a snapshot record.
        """
        guard = self._guard
        try:
            at_most = None
            if self.retain_at_most is not None:
                at_most = self.retain_at_most()
                if at_most is None:
                    return  # nothing committed in the sharded chain yet: keep everything
            dropped, guard.state = retain_from_newest_anchor(guard.path, guard.store, lock, at_most)
        except ChainError as e:
            guard.failed = e
            raise
        self.retained.extend(dropped)
        self._superseded_from = max(self._superseded_from, guard.state.first_seq)  # compaction removed those
        if guard.state.referenced_bytes() > max_bytes and not self._over_budget_warned:
            self._over_budget_warned = True
            log.warning("%s: the chain holds %d bytes from its newest anchor on, more than max_bytes=%d; it is "
                        "kept whole until the next anchor (raise max_bytes or anchor more often)",
                        guard.path, guard.state.referenced_bytes(), max_bytes)
