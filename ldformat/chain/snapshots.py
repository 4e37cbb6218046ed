"""Snapshot records: restating a chain so that the next open folds from them (spec §7.8, §7.9).

A snapshot of a 1.5 chain is *segmented*: the entries it restates live in segment objects,
and the record lists, per segment, the steps it contributes. Entries that already live in a
segment of the snapshot the fold started from stay there (their reference is restricted to
the steps still mapped to it); every other entry goes into new segments, written and synced
before the record. So a writer's snapshot costs the entries committed since the previous one
plus one reference per segment, and an open reads only the record and the tail after it.
Chains of older versions get inline snapshots, as their readers expect.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterable, Sequence

from ..errors import ChainError, WriterIOError
from ..format.checksum import object_checksum
from ..format.fold import ChainState, DeltaStep, restate_deltas
from ..format.jsonvalue import canonical
from ..format.manifest import (
    SEGMENTS_VERSION,
    AnchorEntry,
    DeltaEntry,
    ObjectRef,
    Record,
    Segment,
    SegmentRef,
    StepEntry,
    minor_version,
    ranges_of,
)
from ..stores import Store
from .commit import commit_record
from .lock import WriterLock
from .records import SEGMENT_DIR, io_error

#: New segments stay below this size (well below the 128 MiB a reader accepts, spec §7.9).
SEGMENT_TARGET_BYTES = 16 << 20


def segments_allowed(format_version: str) -> bool:
    """Whether a chain of this version may hold segments (spec §3.1: never in older chains)."""
    return minor_version(format_version) >= minor_version(SEGMENTS_VERSION)


def segment_path(seq: int) -> str:
    """A fresh name for a segment first written for record ``seq`` (spec §7.9)."""
    return f"{SEGMENT_DIR}/{seq:012d}-{secrets.token_hex(4)}.json"


def commit_snapshot(store: Store, where: str, state: ChainState, lock: WriterLock, *, reason: str,
                    segmented: bool, anchors: Sequence[AnchorEntry] | None = None,
                    deltas: Sequence[DeltaEntry] | None = None) -> Record:
    """Commit a snapshot record stating ``anchors`` and ``deltas`` (default: the whole fold,
    unchanged, without reading any segment) and fold it into ``state``.

    ``segmented``: the chain may hold segments (:func:`segments_allowed`). On a failure the
    record does not exist (or the outcome is unknown, spec §7.4 step 5); new segment objects
    are then garbage.
    """
    if not segmented:
        if anchors is None or deltas is None:
            anchors = list(state.anchors.values())
            deltas = state.restated_deltas(state.deltas)
        return commit_record(store, where, state, lock, type="snapshot", reason=reason, anchors=anchors,
                             deltas=deltas)
    kept, new_anchors, new_deltas = plan_segments(state, anchors, deltas)
    seq = state.last_seq + 1
    written: list[tuple[SegmentRef, Segment]] = []
    for segment in _cut(new_anchors, new_deltas):
        path = segment_path(seq)
        data = segment.to_bytes()
        lock.check()
        try:
            store.write(path, data)
        except OSError as e:
            raise io_error(f"{where}/{path}: cannot write a segment of the snapshot", e) from None
        steps = [a.step for a in segment.anchors], [s.step for d in segment.deltas for s in d.steps]
        ref = SegmentRef(object=ObjectRef(path=path, size=len(data), crc32c=object_checksum(path, data)),
                         anchor_steps=ranges_of(steps[0]), delta_steps=ranges_of(steps[1]))
        written.append((ref, segment))
    try:
        store.sync([ref.object.path for ref, _ in written])
    except OSError as e:
        raise io_error(f"{where}: cannot sync the segments of the snapshot", e) from None
    for ref, segment in written:
        state.remember(ref, segment)  # folding the record must not read them back
    return commit_record(store, where, state, lock, type="snapshot", reason=reason,
                         segments=kept + [ref for ref, _ in written])


def plan_segments(state: ChainState, anchors: Sequence[AnchorEntry] | None, deltas: Sequence[DeltaEntry] | None
          ) -> tuple[list[SegmentRef], list[AnchorEntry], list[DeltaEntry]]:
    """Which entries stay in the segments of ``state``'s start record (each reference
    restricted to them), and which need new segments."""
    n = len(state.segments)
    anchor_steps: list[list[int]] = [[] for _ in range(n)]
    delta_steps: list[list[int]] = [[] for _ in range(n)]
    new_anchors: list[AnchorEntry] = []
    new_deltas: list[DeltaStep] = []
    if anchors is None or deltas is None:  # the whole fold: no segment is read
        for steps, m in ((anchor_steps, state.anchors), (delta_steps, state.deltas)):
            for s, g in m.origin.items():
                steps[g].append(s)
            for g in range(n):
                steps[g] += m.pending_steps(g)
        new_anchors = [a for s, a in sorted(state.anchors.own_entries().items())]
        new_deltas = [e for s, e in sorted(state.deltas.own_entries().items())]
    else:
        for a in anchors:
            where_from = state.anchors.origin.get(a.step)
            if where_from is not None and state.anchors.get(a.step) is a:
                anchor_steps[where_from].append(a.step)
            else:
                new_anchors.append(a)
        for d in deltas:
            for e in d.steps:
                where_from = state.deltas.origin.get(e.step)
                mapped = state.deltas.get(e.step) if where_from is not None else None
                if where_from is not None and mapped is not None and mapped[1] is e and _same_batch(mapped[0], d):
                    delta_steps[where_from].append(e.step)
                else:
                    new_deltas.append((d, e))
    kept = [SegmentRef(object=ref.object, anchor_steps=ranges_of(anchor_steps[g]),
                       delta_steps=ranges_of(delta_steps[g]))
            for g, ref in enumerate(state.segments) if anchor_steps[g] or delta_steps[g]]
    return kept, new_anchors, restate_deltas(new_deltas)


def _same_batch(a: DeltaEntry, b: DeltaEntry) -> bool:
    return (a.path, a.objects, a.slots, a.rows) == (b.path, b.objects, b.slots, b.rows)


def _cut(anchors: Iterable[AnchorEntry], deltas: Iterable[DeltaEntry]) -> list[Segment]:
    """The entries in segments of about :data:`SEGMENT_TARGET_BYTES` each (none when empty)."""
    out: list[Segment] = []
    part_a: list[AnchorEntry] = []
    part_d: list[DeltaEntry] = []
    size = 0

    def cut() -> None:
        nonlocal part_a, part_d, size
        if part_a or part_d:
            out.append(Segment(anchors=tuple(part_a), deltas=tuple(part_d)))
        part_a, part_d, size = [], [], 0

    for a in anchors:
        n = len(canonical(a.to_dict())) + 1
        if size + n > SEGMENT_TARGET_BYTES and (part_a or part_d):
            cut()  # a segment stays below the target, unless one entry alone exceeds it
        part_a.append(a)
        size += n
    for d in deltas:
        # A batch's steps may be spread over several entries, and segments (spec §7.9).
        header = len(canonical(dataclasses.replace(d, steps=()).to_dict()))
        steps: list[StepEntry] = []
        for e in d.steps:
            n = len(canonical(e.to_dict())) + 1
            if size + n + (0 if steps else header) > SEGMENT_TARGET_BYTES and (part_a or part_d or steps):
                if steps:
                    part_d.append(dataclasses.replace(d, steps=tuple(steps)))
                    steps = []
                cut()
            if not steps:
                size += header
            steps.append(e)
            size += n
        if steps:
            part_d.append(dataclasses.replace(d, steps=tuple(steps)))
    cut()
    return out


def snapshot_or_unchanged(store: Store, where: str, state: ChainState, lock: WriterLock, *, reason: str,
                          segmented: bool, anchors: Sequence[AnchorEntry], deltas: Sequence[DeltaEntry]) -> None:
    """:func:`commit_snapshot` for maintenance: an error says the chain is unchanged."""
    try:
        commit_snapshot(store, where, state, lock, reason=reason, segmented=segmented, anchors=anchors,
                        deltas=deltas)
    except WriterIOError as e:
        raise WriterIOError(f"{e}; the chain is unchanged") from None
    except ChainError as e:
        raise type(e)(f"{e}; the chain is unchanged") from None
