"""The replica's writer lock across calls of a sync (spec §17.5 "Replication").

A sync takes the replica's lock as any writer does, and at the end of the call releases it,
or keeps it held: a lock taken over from a holder that may still run stays held until a
record fences it, and a release that failed leaves the lock this process's. The next sync
of the same replica in this process continues with such a lock (:func:`take_lock`) instead
of finding the replica held by a live process, this one.
"""

from __future__ import annotations

import threading
from typing import Protocol

from ..errors import LockLostError
from ..stores import Store
from .lock import WriterLock, current_lock
from .sync_report import SyncReport

__all__ = ["settle_lock", "take_lock"]


class SyncJob(Protocol):
    """What :func:`settle_lock` needs of a sync of one chain (a :class:`~.replicate.ChainSync`)."""

    lock: WriterLock | None
    fenced: bool
    report: SyncReport
    dst_name: str


#: Locks of replicas that this process took over and left held without fencing (spec §17.5),
#: by token: the next :func:`sync` of the same replica in this process continues with it
#: instead of finding it held by a live process (this one).
_UNFENCED: dict[str, WriterLock] = {}
_UNFENCED_LOCK = threading.Lock()
#: Locks this process failed to release, by replica (as messages name it): the replica's
#: newest lock generation is still that one, held by this process.
_RELEASING: dict[str, WriterLock] = {}


def take_lock(dst: Store, where: str, break_lock: bool, wait_s: float) -> WriterLock:
    """The replica's writer lock: this process's own when an earlier call here left it held
    (not fenced, or not released), else taken as any writer takes it."""
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


def settle_lock(job: SyncJob) -> None:
    """Release the replica's lock at the end of a call, or keep it held (spec §17.5)."""
    lock = job.lock
    if lock is None:
        return
    if job.fenced:
        if not lock.release():
            # The release failed (the store is down): the lock stays held by this process, which
            # is alive. Remember it, so that the next sync here continues with it instead of
            # finding the replica locked by a running writer (this process) until it exits.
            with _UNFENCED_LOCK:
                _RELEASING[job.dst_name] = lock
    else:
        # Taken over from a holder that may still run, and not fenced: the lock stays held,
        # so that whoever takes it next inherits the duty to fence (spec §17.5).
        job.report.garbage_deferred = True
        with _UNFENCED_LOCK:
            _UNFENCED[lock.owner.token] = lock
