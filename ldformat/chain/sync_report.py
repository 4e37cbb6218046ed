"""What a sync of a chain returns (spec §17.5 "Replication"): :class:`SyncReport`, and the
error that refuses a destination holding another chain.

Kept apart from the copy (:mod:`.replicate`) so that the sharded replicator and the lock
handling (:mod:`.replica_lock`) use the report without the copying machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ChainError

__all__ = ["Progress", "ReplicaDivergedError", "SyncReport"]

#: ``progress(phase, done, total)``, called as a sync goes on.
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
