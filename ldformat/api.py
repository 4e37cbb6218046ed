"""The public operations on any chain: one place decides whether a chain is ordinary or sharded.

Each function here reads what the location holds and hands the work to :mod:`ldformat.chain`
(an ordinary chain) or :mod:`ldformat.sharded` (a sharded chain, spec §20). The library's
other modules and ``ldtools`` go through these functions; nothing below them decides it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .chain import maintenance, replicate
from .chain import validate as plain_validation
from .chain.maintenance import CompactionPlan, check_max_replay
from .chain.reader import open_store
from .chain.replicate import WORKERS, Progress, SyncReport, open_location
from .chain.sharded_probe import is_sharded, is_sharded_location
from .chain.validate import Problem, ValidationReport
from .errors import UsageError
from .sharded.chain import open_reader
from .sharded.maintenance import compact_sharded, truncate_sharded
from .sharded.replicate import sync_sharded
from .sharded.validate import validate_sharded
from .stores import Store, StoreOrPath

__all__ = ["compact", "open_reader", "sync", "truncate", "validate"]


def compact(
    path: str | os.PathLike[str],
    *,
    max_replay: int | None = None,
    keep_last: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    store: Store | None = None,
    break_lock: bool = False,
    lock_wait: float = 0.0,
    progress: Callable[[str, int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CompactionPlan:
    """Bound replay length, apply retention and remove garbage.

    Args:
        max_replay: no kept step may need more than this many deltas replayed; longer runs
            are folded into new anchors (xor deltas of dropped steps are merged exactly).
        keep_last: keep the newest ``keep_last`` steps materializable.
        keep_every: also keep every step that is a multiple of ``keep_every``.
        dry_run: compute and return the plan without changing anything.
        store, storage_options: an explicit store, or settings of the object store at the
            URL ``path`` (see :func:`ldformat.stores.open_store`).

    Every step that stays materializes bit-identically before and after. Running it twice
    changes nothing the second time. On S3 it also aborts the incomplete multipart uploads
    below the chain, which writers killed mid-upload leave (spec §7.7): it holds the writer
    lock, so no live writer is uploading.

    A sharded chain (spec §20.8) is compacted under every rank chain's lock with one plan, so
    that every rank chain keeps the same steps (:func:`ldformat.sharded.maintenance.compact_sharded`);
    one rank chain of it on its own is refused.
    """
    check_max_replay(max_replay)
    if store is None and is_sharded_location(path, storage_options):
        return compact_sharded(path, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every,
                               dry_run=dry_run, break_lock=break_lock, lock_wait=lock_wait, progress=progress,
                               storage_options=storage_options)
    return maintenance.compact(path, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every,
                               dry_run=dry_run, store=store, break_lock=break_lock, lock_wait=lock_wait,
                               progress=progress, storage_options=storage_options)


def truncate(path: str | os.PathLike[str], after: int, *, store: Store | None = None,
             break_lock: bool = False, lock_wait: float = 0.0,
             storage_options: dict[str, Any] | None = None, part_of_sharded: bool = False) -> list[int]:
    """Remove every step after ``after`` (rewind after a loss spike). Returns the removed steps.

    Crash-safe: one snapshot record switches the chain to the truncated view. A writer can
    then re-open the chain and append from ``after + 1``. A sharded chain is truncated under
    every rank chain's lock, after a commit record that makes the removed steps pending (spec
    §20.8, :func:`ldformat.sharded.maintenance.truncate_sharded`); one rank chain of it on its
    own is refused. ``part_of_sharded`` is for the writer of a sharded chain, which truncates
    its rank chain after the commit record that makes those steps pending.
    """
    if not part_of_sharded and store is None and is_sharded_location(path, storage_options):
        return truncate_sharded(path, after, break_lock=break_lock, lock_wait=lock_wait,
                                storage_options=storage_options)
    return maintenance.truncate(path, after, store=store, break_lock=break_lock, lock_wait=lock_wait,
                                storage_options=storage_options, part_of_sharded=part_of_sharded)


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
    src_store, src_name = open_location(src, src_options, create=False)
    if is_sharded(src_store):
        return sync_sharded(src, src_store, src_name, dst, progress=progress, workers=workers,
                            break_lock=break_lock, lock_wait=lock_wait, src_options=src_options,
                            dst_options=dst_options, started=started)
    return replicate.sync_opened(src_store, src_name, dst, progress=progress, workers=workers,
                                 break_lock=break_lock, lock_wait=lock_wait, dst_options=dst_options,
                                 started=started)


def validate(
    path: str | os.PathLike[str],
    deep: bool = False,
    *,
    strict: bool = False,
    store: Store | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ValidationReport:
    """Check a chain and return a report (``report.ok``, ``report.problems``).

    When the report is ok, every step it counts materializes (spec §18): besides every
    record and object, the checks of :mod:`ldformat.format.checks` are run for every anchor and
    step, and the optimizer of a gradient chain is stepped along every replay path on
    one-element stand-ins (:class:`~ldformat.format.replay.ProxyReplayer`), without replaying the
    real tensors. A validation that finds a problem re-reads the log; if the log moved
    meanwhile (a writer committed, or a compaction or truncation replaced it), the problem
    may come from reading two versions of the chain, so validation starts again (at most
    :data:`VALIDATE_ATTEMPTS` times in all), reading only the objects it has not verified yet.

    ``path`` may be a URL (``s3://bucket/prefix``, ...; ``storage_options`` override the
    object store's environment variables, see :func:`ldformat.stores.open_store`).

    ``deep`` also replays the deltas from each anchor to the next and compares the result
    with that stored anchor, bit for bit (``report.drift``: one entry per anchor compared).
    ``strict`` implies ``deep`` and adds a problem when the deep check compared no anchor
    with a replay (one anchor, or none reached by replay from another): it checked nothing.

    Raises:
        NotAChainError: ``path`` is not a chain at all (nothing to validate).
    """
    deep = deep or strict
    store = open_store(path, store, storage_options)
    if is_sharded(store):
        report = validate_sharded(path, store, deep, progress, storage_options)
    else:
        report = plain_validation.validate(path, deep, store=store, progress=progress,
                                           storage_options=storage_options)
    if strict and report.ok and not report.drift:
        n = len(report.anchors)
        report.problems.append(Problem(report.path, None, (
            f"--strict: the deep check compared no anchor with a replay ({n} anchor{'' if n == 1 else 's'}, none "
            "reached by replaying deltas from another), so nothing showed that replay reproduces the stored "
            "state; validate again once the writer has stored a later anchor, or leave out --strict")))
    return report
