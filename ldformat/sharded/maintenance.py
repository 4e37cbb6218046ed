"""Truncation and compaction of a sharded chain (spec §20.8).

A maintainer changes a sharded chain only while it holds every rank chain's writer lock, so
no writer of the job can be committing meanwhile. A truncation creates the commit record
that makes the removed steps pending *before* it changes any rank chain. A compaction keeps
the same steps in every rank chain (one plan, computed from the committed steps of the
sharded chain) and never changes a kept step, so it needs no commit record.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..chain.commit import open_log_for_write
from ..chain.lock import WriterLock
from ..chain.maintenance import CompactionPlan, compact_chain, stale_uploads, steps_to_keep, truncate_locked
from ..chain.reader import ChainReader, chain_name, open_store
from ..chain.sharded_probe import RANKS_DIR, rank_location
from ..errors import ChainLockedError, EmptyChainError, StepNotFoundError, UsageError
from .chain import ShardedReader, create_commit, newest_commit, read_sharded_root

Progress = Callable[[str, int, int], None]


@contextlib.contextmanager
def every_rank_locked(path: str | os.PathLike[str], storage_options: dict[str, Any] | None, *,
                      break_lock: bool, lock_wait: float) -> Iterator[dict[int, tuple[ChainReader, WriterLock]]]:
    """Hold every rank chain's writer lock, each rank chain folded under it (a takeover fences
    that rank chain), by rank (copy ranks have none). If one lock is held by a live writer,
    the locks already taken are released and :class:`ChainLockedError` names that rank chain."""
    where = chain_name(path, None)
    root = read_sharded_root(open_store(path, None, storage_options), where)
    held: dict[int, tuple[ChainReader, WriterLock]] = {}
    try:
        for r in root.chain_ranks:
            reader = ChainReader(rank_location(path, r), storage_options=storage_options)
            try:
                lock = WriterLock.acquire(reader.store, reader.path, break_lock=break_lock, wait_s=lock_wait)
            except ChainLockedError as e:
                raise ChainLockedError(f"{e}; rank {r}'s chain is in use, so the sharded chain {where} is "
                                       "unchanged") from None
            held[r] = (reader, lock)
            reader.records, reader.state = open_log_for_write(reader.store, reader.path, lock)
        yield held
    finally:
        for _, lock in reversed(held.values()):
            lock.release()


def truncate_sharded(path: str | os.PathLike[str], after: int, *, break_lock: bool = False, lock_wait: float = 0.0,
                     storage_options: dict[str, Any] | None = None) -> list[int]:
    """Remove every step after the committed step ``after`` from every rank chain; returns the
    committed steps removed. Pending steps above it (a rank chain ahead of the newest commit
    record) go too.

    Order (spec §20.8): every lock, then the commit record with ``step`` ``after``, then each
    rank chain's truncation. A crash after the record leaves the remaining steps pending, and
    the next truncation or writer removes them.
    """
    where = chain_name(path, None)
    with every_rank_locked(path, storage_options, break_lock=break_lock, lock_wait=lock_wait) as held:
        chain = ShardedReader(path, storage_options=storage_options)
        if after not in chain.steps:
            raise StepNotFoundError(f"{where}: step {after} is not a committed step of the sharded chain "
                                    f"(latest {chain.latest_step}); nothing was changed")
        removed = [s for s in chain.steps if s > after]
        if all(reader.state.latest_step == after for reader, _ in held.values()) and chain.commit is not None \
                and chain.commit.step == after:
            return removed  # nothing above it anywhere: nothing to change, no record to add
        held[0][1].check()  # rule L: rank chain 0's lock is still ours
        create_commit(chain.store, where, after, newest_commit(chain.store, where))  # rule X
        for reader, lock in held.values():
            truncate_locked(reader, lock, after)
        return removed


def compact_sharded(path: str | os.PathLike[str], *, max_replay: int | None = None, keep_last: int | None = None,
                    keep_every: int | None = None, dry_run: bool = False, break_lock: bool = False,
                    lock_wait: float = 0.0, progress: Progress | None = None,
                    storage_options: dict[str, Any] | None = None) -> CompactionPlan:
    """Compact every rank chain of a sharded chain with one plan (spec §20.8).

    The kept steps are chosen among the committed steps of the sharded chain, the newest
    commit record's step ``S`` always among them, and every rank chain keeps exactly those.
    Steps above ``S`` (pending) are dropped. Whether a kept step is an anchor, a delta or a
    merged xor delta is decided per rank chain. Returns a plan that sums up the per-rank
    plans (``plan.ranks``); ``removed_objects`` are named relative to the sharded chain.
    """
    if max_replay is not None and max_replay < 0:
        raise UsageError("max_replay must be >= 0")
    if dry_run:
        chain = ShardedReader(path, storage_options=storage_options)
        plans = {r: compact_chain(reader, None, max_replay, None, None, None, kept=_kept(chain, keep_last, keep_every))
                 for r, reader in chain.ranks.items()}
        plan = _sum_up(chain.steps, plans)
        stale_uploads(chain.store, storage_options, plan, abort=False)
        return plan
    with every_rank_locked(path, storage_options, break_lock=break_lock, lock_wait=lock_wait) as held:
        chain = ShardedReader(path, storage_options=storage_options)
        kept = _kept(chain, keep_last, keep_every)
        aborted = CompactionPlan()
        stale_uploads(chain.store, storage_options, aborted, abort=True)  # before this writes anything
        plans = {r: compact_chain(reader, lock, max_replay, None, None, _for_rank(progress, r, len(held)), kept=kept)
                 for r, (reader, lock) in held.items()}
        plan = _sum_up(chain.steps, plans)
        plan.aborted_uploads, plan.uploads_problem = aborted.aborted_uploads, aborted.uploads_problem
        return plan


def _kept(chain: ShardedReader, keep_last: int | None, keep_every: int | None) -> list[int]:
    if not chain.steps:
        raise EmptyChainError(f"{chain.path}: the sharded chain has no committed step; nothing to compact")
    return steps_to_keep(chain.steps, keep_last, keep_every)


def _for_rank(progress: Progress | None, rank: int, world: int) -> Progress | None:
    if progress is None:
        return None
    return lambda stage, done, total: progress(f"{_STAGES.get(stage, stage)} of rank {rank} ({world} ranks)",
                                               done, total)


_STAGES = {"anchors": "writing anchors"}


def _sum_up(committed: list[int], by_rank: dict[int, CompactionPlan]) -> CompactionPlan:
    """One plan for the sharded chain: the steps are the same in every rank chain's plan."""
    plans = list(by_rank.values())
    out = CompactionPlan(ranks=plans)
    out.kept_steps = list(plans[0].kept_steps) if plans else []
    out.dropped_steps = sorted(s for s in committed if s not in set(out.kept_steps))
    out.new_anchors = sorted({s for p in plans for s in p.new_anchors})
    out.dropped_anchors = sorted({s for p in plans for s in p.dropped_anchors})
    out.merged_deltas = sorted({m for p in plans for m in p.merged_deltas})
    out.removed_objects = [f"{RANKS_DIR}/{r:05d}/{o}" for r, p in by_rank.items() for o in p.removed_objects]
    out.committed = any(p.committed for p in plans)
    return out
