"""Compaction, retention and truncation (spec §16 "Truncation", §17 "Compaction and retention").

All three rewrite what the chain *references*, never an existing object: new anchors and
merged deltas are written under fresh names and made durable, then one ``snapshot`` record
states the whole new chain, and only then are unreferenced objects removed. A crash at any
point leaves the chain valid (before or after the snapshot), and a reader that still holds
the old view re-reads the log when an object it needs has gone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ChainError, CorruptChainError, StepNotFoundError, UsageError, WriterIOError
from ..format.anchor import anchor_parts, write_anchor_parts
from ..format.checksum import object_checksum_parts
from ..format.delta import (
    MAX_COUNTS,
    BatchEncoder,
    Segment,
    default_encode_pool,
    difference_delta,
    encode_batch,
    tensor_bits,
)
from ..format.dtypes import dtype_name
from ..format.fold import ChainState
from ..format.manifest import (
    AnchorEntry,
    DeltaEntry,
    ObjectRef,
    SlotInfo,
    StepEntry,
    refuse_newer,
    state_delta_encoding,
)
from ..format.replay import Replayer
from ..stores import Store
from .commit import collect_garbage, garbage, open_log_for_write
from .lock import WriterLock
from .reader import ChainReader
from .records import LOCK_DIR, anchor_object_path, batch_group_path
from .sharded_probe import refuse_sharded
from .snapshots import plan_segments, segments_allowed, snapshot_or_unchanged

log = logging.getLogger("ldformat.compact")


@dataclass
class CompactionPlan:
    """What a compaction does (or, with ``dry_run``, would do)."""

    kept_steps: list[int] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    new_anchors: list[int] = field(default_factory=list)
    dropped_anchors: list[int] = field(default_factory=list)
    merged_deltas: list[tuple[int, int]] = field(default_factory=list)
    removed_objects: list[str] = field(default_factory=list)
    #: Incomplete multipart uploads below the chain that were aborted (with ``dry_run``: that
    #: would be), by key; S3 only (spec §7.7).
    aborted_uploads: list[str] = field(default_factory=list)
    #: Why incomplete uploads could not be listed or aborted (the compaction itself went on).
    uploads_problem: str | None = None
    committed: bool = False
    #: A sharded chain's plan per rank chain (spec §20.8); the fields above sum them up.
    ranks: list[CompactionPlan] = field(default_factory=list)

    @property
    def changes_references(self) -> bool:
        return bool(self.dropped_steps or self.new_anchors or self.dropped_anchors or self.merged_deltas)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept_steps": len(self.kept_steps),
            "dropped_steps": self.dropped_steps,
            "new_anchors": self.new_anchors,
            "dropped_anchors": self.dropped_anchors,
            "merged_deltas": [list(m) for m in self.merged_deltas],
            "removed_objects": self.removed_objects,
            "aborted_uploads": self.aborted_uploads,
            "uploads_problem": self.uploads_problem,
            "committed": self.committed,
            **({"ranks": [p.to_dict() for p in self.ranks]} if self.ranks else {}),
        }


def steps_to_keep(steps: list[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    if keep_last is None and keep_every is None:
        return list(steps)
    if keep_last is not None and keep_last < 1:
        raise UsageError("keep_last must be >= 1")
    if keep_every is not None and keep_every < 1:
        raise UsageError("keep_every must be >= 1")
    latest = steps[-1]
    kept = {latest}
    for s in steps:
        if keep_last is not None and s > latest - keep_last:
            kept.add(s)
        if keep_every is not None and s % keep_every == 0:
            kept.add(s)
    return sorted(kept)


def _original_path(state: ChainState, step: int, stop: int) -> list[int] | None:
    """Delta steps leading from ``stop`` to ``step`` in the existing chain, or None."""
    out = []
    s = step
    while s != stop:
        entry = state.deltas.get(s)
        if entry is None or s < stop:
            return None
        out.append(s)
        s = entry[1].base
    return list(reversed(out))


STATE_PREFIXES = ("model/", "optimizer/")  # the state tensors of a replayed state (not residuals)


def _all_xor(state: ChainState, path: list[int]) -> bool:
    """Whether every delta on ``path`` holds XOR slots only, which merge by XOR (a chain older
    than 1.6 holds nothing else; one that does is folded into an anchor instead)."""
    return all(slot.encoding == "xor" for s in path for slot in state.deltas[s][0].slots)


def check_max_replay(max_replay: int | None) -> None:
    if max_replay is not None and max_replay < 0:
        raise UsageError("max_replay must be >= 0")


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
    """Compact an ordinary chain; :func:`ldformat.compact` (which documents it) also compacts sharded ones."""
    check_max_replay(max_replay)
    refuse_sharded(path, store, storage_options, "compacted")
    reader = ChainReader(path, store=store, storage_options=storage_options)
    if dry_run:
        plan = compact_chain(reader, None, max_replay, keep_last, keep_every, progress)
        stale_uploads(reader.store, storage_options, plan, abort=False)
        return plan
    lock = WriterLock.acquire(reader.store, reader.path, break_lock=break_lock, wait_s=lock_wait)
    try:
        reader.records, reader.state = open_log_for_write(reader.store, reader.path, lock)
        aborted = CompactionPlan()
        stale_uploads(reader.store, storage_options, aborted, abort=True)  # before this writes anything
        plan = compact_chain(reader, lock, max_replay, keep_last, keep_every, progress)
        plan.aborted_uploads, plan.uploads_problem = aborted.aborted_uploads, aborted.uploads_problem
        return plan
    except (CorruptChainError, OSError):
        lock.raise_if_lost()  # taken over meanwhile (its holder may have removed what this read or wrote)
        raise
    finally:
        lock.release()


def stale_uploads(store: Store, storage_options: dict[str, Any] | None, plan: CompactionPlan, *,
                   abort: bool) -> None:
    """List (and abort) the incomplete multipart uploads below an S3 chain into ``plan``."""
    from ..stores import uploads

    url = getattr(store, "url", None)
    if not isinstance(url, str) or not uploads.supported(url):
        return
    try:
        found = uploads.list_uploads(url, storage_options)
        plan.aborted_uploads = uploads.abort_uploads(url, found, storage_options) if abort else [u.key for u in found]
    except (OSError, UsageError) as e:
        plan.uploads_problem = str(e)
        log.warning("%s", e)


def retain_from_newest_anchor(path: str, store: Store, lock: WriterLock,
                              at_most: int | None = None) -> tuple[list[int], ChainState]:
    """Drop every step before the newest anchor (the newest at or below ``at_most``, when
    given), under a writer's own ``lock`` (the live retention of ``max_bytes``); returns the
    dropped steps and the chain's new state."""
    reader = ChainReader(path, store=store)
    state = reader.state
    anchors = [a for a in state.anchors if at_most is None or a <= at_most]
    if not anchors or state.latest_step is None:
        return [], state
    keep_last = state.latest_step - max(anchors) + 1
    plan = compact_chain(reader, lock, None, keep_last, None, None)
    return plan.dropped_steps, reader.state


def _remove_garbage(reader: ChainReader, lock: WriterLock | None) -> list[str]:
    """Garbage, deleted unless this is a dry run (``lock`` None); lock generations not listed."""
    if lock is None:
        removed = garbage(reader.store, reader.state)
    else:
        removed = collect_garbage(reader.store, reader.state, lock, reader.path)
    return [p for p in removed if not p.startswith(LOCK_DIR + "/")]


def compact_chain(reader: ChainReader, lock: WriterLock | None, max_replay: int | None, keep_last: int | None,
             keep_every: int | None, progress: Callable[[str, int, int], None] | None,
             kept: list[int] | None = None) -> CompactionPlan:
    """Compact as ``lock``'s holder (a dry run without it); ``kept``, when given, are the
    steps to keep instead of those that ``keep_last``/``keep_every`` select."""
    refuse_newer(reader.root.format_version, reader.path, "compact it")
    state = reader.state
    plan = CompactionPlan()
    if state.latest_step is None:
        plan.removed_objects = _remove_garbage(reader, lock)
        return plan
    limit = max_replay if max_replay is not None else float("inf")
    steps = state.steps
    if kept is None:
        kept = steps_to_keep(steps, keep_last, keep_every)
    plan.kept_steps = kept
    plan.dropped_steps = sorted(set(steps) - set(kept))
    depth: dict[int, int] = {}
    keep_delta: dict[int, StepEntry] = {}
    merges: dict[int, tuple[int, list[int]]] = {}
    # From 1.6 on a merged delta is the difference of the two states (spec §17.2), whatever
    # the deltas between them hold; older chains hold XORs, which merge by XOR.
    direct = state_delta_encoding(reader.root.format_version) == "sub"
    kept_anchors: set[int] = set()
    prev: int | None = None
    for t in kept:
        entry = state.deltas.get(t)
        if t in state.anchors:
            depth[t] = 0
            kept_anchors.add(t)
        elif entry is not None and entry[1].base in depth and depth[entry[1].base] + 1 <= limit:
            depth[t] = depth[entry[1].base] + 1
            keep_delta[t] = entry[1]
        elif (
            reader.kind == "state.xor"
            and prev is not None
            and depth[prev] + 1 <= limit
            and (p := _original_path(state, t, prev)) is not None
            and (direct or _all_xor(state, p))
        ):
            depth[t] = depth[prev] + 1
            merges[t] = (prev, p)
        else:
            depth[t] = 0
            plan.new_anchors.append(t)
        if depth[t] == 0 and entry is not None and entry[1].base in depth:
            # Kept so that `validate --deep` can compare the anchor with a replay.
            keep_delta[t] = entry[1]
        prev = t
    plan.dropped_anchors = sorted(set(state.anchors) - kept_anchors)
    plan.merged_deltas = [(b, t) for t, (b, _) in sorted(merges.items())]
    dropped_deltas = sorted(s for s in state.deltas if s not in keep_delta)
    if not plan.changes_references and not dropped_deltas:
        plan.removed_objects = _remove_garbage(reader, lock)
        return plan
    if lock is None:
        # What the real run removes after its snapshot record (the next sequence number) is
        # committed: what that record no longer references, the records it supersedes, and
        # leftovers already there (spec §7.5). New anchors and merged deltas do not exist yet.
        new_state = _planned_state(state, kept_anchors, keep_delta)
        new_state.first_seq = new_state.last_seq = state.last_seq + 1
        if segments_allowed(reader.root.format_version):  # the segments the snapshot would keep
            new_state.segments = tuple(plan_segments(state, [state.anchors[s] for s in sorted(kept_anchors)],
                                                     state.restated_deltas(keep_delta))[0])
        plan.removed_objects = [p for p in garbage(reader.store, new_state) if not p.startswith(LOCK_DIR + "/")]
        return plan

    written: list[str] = []
    anchors: list[AnchorEntry] = [state.anchors[s] for s in sorted(kept_anchors)]
    for n, t in enumerate(plan.new_anchors, 1):
        anchors.append(_write_anchor(reader, t, written))
        if progress:
            progress("anchors", n, len(plan.new_anchors))
    deltas = state.restated_deltas(keep_delta)
    if merges and direct:
        merged, folded = _write_differences(reader, merges, written)
        deltas.extend(merged)
        anchors.extend(folded)
        for a in folded:  # reported as what they became
            plan.merged_deltas.remove((merges[a.step][0], a.step))
            plan.new_anchors.append(a.step)
        plan.new_anchors.sort()
    elif merges:
        deltas.append(_write_merged(reader, merges, written))
    try:
        reader.store.sync(written)
    except OSError as e:
        raise WriterIOError(f"{reader.path}: syncing compaction objects failed: {e.strerror or e}") from None
    _commit_snapshot(reader, lock, anchors, deltas, "compact")
    plan.committed = True
    reader.refresh()
    plan.removed_objects = _remove_garbage(reader, lock)
    return plan


def _planned_state(state: ChainState, anchors: set[int], keep_delta: dict[int, StepEntry]) -> ChainState:
    new = ChainState()
    for s in anchors:
        new.anchors[s] = state.anchors[s]
    for s in keep_delta:
        new.deltas[s] = state.deltas[s]
    return new


def _write_object(reader: ChainReader, path: str, data: bytes, written: list[str]) -> ObjectRef:
    try:
        reader.store.write_parts(path, (data,))
    except OSError as e:
        raise WriterIOError(f"{reader.path}/{path}: {e.strerror or e}; the chain is unchanged") from None
    written.append(path)
    return ObjectRef(path=path, size=len(data), crc32c=object_checksum_parts(path, (data,)))


def _write_anchor(reader: ChainReader, step: int, written: list[str]) -> AnchorEntry:
    anchor_step, replayed = reader.state.replay_path(step)
    replayer = reader.start_replay(anchor_step)
    reader.replay_steps(replayer, replayed)
    replayer.sync_optimizer_tensors()
    # Residuals of a top-k compressor are only valid at the anchor that stored them.
    tensors = {n: t.detach().contiguous() for n, t in replayer.tensors.items() if not n.startswith("compressor")}
    anchor = anchor_parts(tensors, step)
    path = anchor_object_path(step)
    try:
        crc = write_anchor_parts(reader.store, path, anchor)  # checksummed while it is written
    except OSError as e:
        raise WriterIOError(f"{reader.path}/{path}: {e.strerror or e}; the chain is unchanged") from None
    written.append(path)
    ref = ObjectRef(path=path, size=anchor.size, crc32c=crc)
    return AnchorEntry(step=step, object=ref, param_groups=replayer.param_groups, extra=replayer.extra,
                       optimizer=replayer.optimizer_structure)


def _write_merged(reader: ChainReader, merges: dict[int, tuple[int, list[int]]], written: list[str]) -> DeltaEntry:
    """XOR the deltas of each run into one delta per kept step (exact; chains before 1.6, spec §17.2)."""
    state = reader.state
    slots: list[SlotInfo] = []
    slot_index: dict[str, int] = {}
    rows: list[dict[int, Segment]] = []
    entries: list[StepEntry] = []
    cache: dict[str, Any] = {}
    for t, (base, path) in sorted(merges.items()):
        acc: dict[str, np.ndarray] = {}
        info: dict[str, SlotInfo] = {}
        for s in path:
            d, se = state.deltas[s]
            batch = cache.get(d.path)
            if batch is None:
                batch = cache[d.path] = reader.load_batch(d, s)
            row = batch.row(se.row)
            for name in acc:
                if name not in row:
                    raise ChainError(f"{reader.path}: {name} disappears between steps {base} and {t}; cannot merge")
            for name, (_, vals) in row.items():
                info[name] = next(sl for sl in d.slots if sl.name == name)
                acc[name] = vals.copy() if name not in acc else np.bitwise_xor(acc[name], vals)
        row_out: dict[int, Segment] = {}
        for name, vals in acc.items():
            j = slot_index.get(name)
            if j is None:
                j = slot_index[name] = len(slots)
                slots.append(info[name])
            row_out[j] = (None, vals)
        last = state.deltas[t][1]
        entries.append(StepEntry(step=t, base=base, row=len(rows), stepped=True, hyper=None,
                                 param_groups=last.param_groups, extra=last.extra, optimizer=last.optimizer))
        rows.append(row_out)
    first, last_step = entries[0].step, entries[-1].step
    group = batch_group_path(first, last_step)
    objects = encode_batch(slots, rows, {"kind": reader.kind, "first": first, "last": last_step, "merged": True},
                           default_encode_pool())
    refs = []
    for key, data in sorted(objects.items()):
        ref = _write_object(reader, f"{group}/{key}", data, written)
        refs.append(ObjectRef(path=key, size=ref.size, crc32c=ref.crc32c))
    return DeltaEntry(path=group, objects=tuple(refs), slots=tuple(slots), rows=len(rows), steps=tuple(entries))


def _write_differences(reader: ChainReader, merges: dict[int, tuple[int, list[int]]],
                       written: list[str]) -> tuple[list[DeltaEntry], list[AnchorEntry]]:
    """One ``sub`` delta per merged step: the difference of its state and its new base's state,
    both replayed (spec §17.2). Exact for every slot encoding, predicted ones included. One
    replayer walks the runs in order (a run starts where an earlier one ended, or at a kept
    step after it), and each row is compressed as soon as it is computed. A tensor that comes
    back with another shape or dtype in a later run starts a new batch (one slot per name).

    A run in which a tensor vanished and came back with another shape or dtype cannot be one
    delta (a slot applies only to a tensor like it, spec §11.6): its step gets an anchor
    instead, returned with the batches."""
    state = reader.state
    anchors: list[AnchorEntry] = []
    batches: list[DeltaEntry] = []
    batch = _MergedBatch()
    replayer: Replayer | None = None
    at: int | None = None  # the step the replayer holds
    for t, (base, path) in sorted(merges.items()):
        anchor_step, to_base = state.replay_path(base)
        if replayer is not None and at in to_base:
            to_base = to_base[to_base.index(at) + 1:]
        elif replayer is None or at != anchor_step:
            replayer = reader.start_replay(anchor_step)
        reader.replay_steps(replayer, to_base)
        before = {n: tensor_bits(x).copy() for n, x in replayer.tensors.items() if n.startswith(STATE_PREFIXES)}
        before_meta = {n: (x.dtype, tuple(x.shape)) for n, x in replayer.tensors.items() if n in before}
        reader.replay_steps(replayer, path)
        at = t
        if any(n in before_meta and before_meta[n] != (x.dtype, tuple(x.shape)) for n, x in replayer.tensors.items()):
            del before
            anchors.append(_write_anchor(reader, t, written))
            continue
        row: list[tuple[SlotInfo, np.ndarray]] = []
        for name, x in replayer.tensors.items():
            if not name.startswith(STATE_PREFIXES):
                continue
            values = tensor_bits(x).copy()
            difference_delta(values, before.get(name), values)
            row.append((SlotInfo(name=name, dtype=dtype_name(x.dtype), shape=tuple(x.shape), encoding="sub"), values))
        del before
        if not batch.fits(row):
            batches.append(batch.write(reader, written))
            batch = _MergedBatch()
        last = state.deltas[t][1]
        batch.add(row, StepEntry(step=t, base=base, row=batch.rows, stepped=True, hyper=None,
                                 param_groups=last.param_groups, extra=last.extra, optimizer=last.optimizer))
    if batch.rows:
        batches.append(batch.write(reader, written))
    return batches, anchors


class _MergedBatch:
    """A batch of merged ``sub`` rows being encoded (one slot per tensor name)."""

    def __init__(self) -> None:
        self.slots: list[SlotInfo] = []
        self.index: dict[str, int] = {}
        self.entries: list[StepEntry] = []
        self.encoder = BatchEncoder(default_encode_pool())

    @property
    def rows(self) -> int:
        return len(self.entries)

    def fits(self, row: list[tuple[SlotInfo, np.ndarray]]) -> bool:
        """Whether every tensor of ``row`` has this batch's slot for its name, or none yet, and
        the batch stays within the counts a reader accepts (spec §10.5)."""
        new = sum(1 for slot, _ in row if slot.name not in self.index)
        if (self.rows + 1) * max(1, len(self.slots) + new) > MAX_COUNTS:
            return False
        return all(slot.name not in self.index or self.slots[self.index[slot.name]] == slot for slot, _ in row)

    def add(self, row: list[tuple[SlotInfo, np.ndarray]], entry: StepEntry) -> None:
        segments = []
        for slot, values in row:
            j = self.index.get(slot.name)
            if j is None:
                j = self.index[slot.name] = len(self.slots)
                self.slots.append(slot)
            segments.append((j, values))
        self.encoder.start_row()
        for j, values in sorted(segments, key=lambda r: r[0]):  # segment order is slot order (spec §10.1)
            self.encoder.add(j, values)
        self.entries.append(entry)

    def write(self, reader: ChainReader, written: list[str]) -> DeltaEntry:
        first, last = self.entries[0].step, self.entries[-1].step
        group = batch_group_path(first, last)
        objects = self.encoder.finish(len(self.slots), {"kind": reader.kind, "first": first, "last": last,
                                                        "merged": True})
        refs = []
        for key, data in sorted(objects.items()):
            ref = _write_object(reader, f"{group}/{key}", data, written)
            refs.append(ObjectRef(path=key, size=ref.size, crc32c=ref.crc32c))
        return DeltaEntry(path=group, objects=tuple(refs), slots=tuple(self.slots), rows=self.rows,
                          steps=tuple(self.entries))


def _commit_snapshot(reader: ChainReader, lock: WriterLock, anchors: list[AnchorEntry], deltas: list[DeltaEntry],
                     reason: str) -> None:
    snapshot_or_unchanged(reader.store, reader.path, reader.state, lock, reason=reason,
                          segmented=segments_allowed(reader.root.format_version), anchors=anchors, deltas=deltas)


def truncate(path: str | os.PathLike[str], after: int, *, store: Store | None = None,
             break_lock: bool = False, lock_wait: float = 0.0,
             storage_options: dict[str, Any] | None = None, part_of_sharded: bool = False) -> list[int]:
    """Truncate an ordinary chain; :func:`ldformat.truncate` (which documents it) also truncates sharded ones."""
    if not part_of_sharded:
        refuse_sharded(path, store, storage_options, "truncated")
    reader = ChainReader(path, store=store, storage_options=storage_options)
    lock = WriterLock.acquire(reader.store, reader.path, break_lock=break_lock, wait_s=lock_wait)
    try:
        reader.records, reader.state = open_log_for_write(reader.store, reader.path, lock)
        return truncate_locked(reader, lock, after)
    except (CorruptChainError, OSError):
        lock.raise_if_lost()  # taken over meanwhile: that is the error to report
        raise
    finally:
        lock.release()


def truncate_locked(reader: ChainReader, lock: WriterLock, after: int) -> list[int]:
    """Truncate after ``after`` as ``lock``'s holder, ``reader`` folded under it; the removed steps."""
    refuse_newer(reader.root.format_version, reader.path, "truncate it")
    state = reader.state
    if after not in state.anchors and after not in state.deltas:
        raise StepNotFoundError(f"{reader.path}: step {after} is not in the chain; nothing was changed")
    removed = [s for s in state.steps if s > after]
    if removed:
        anchors = [a for s, a in state.anchors.items() if s <= after]
        keep = {s: e for s, (_, e) in state.deltas.items() if s <= after}
        _commit_snapshot(reader, lock, anchors, state.restated_deltas(keep), f"truncate after {after}")
        reader.refresh()
    collect_garbage(reader.store, reader.state, lock, reader.path)
    return removed
