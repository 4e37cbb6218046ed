"""The visible content of a chain: the fold of its log (spec §7.3), with segments read lazily.

A 1.5 snapshot record may hold its restated entries in segment objects and list, per segment,
the steps it contributes (spec §7.9). So the fold knows every committed step from the
record alone; :class:`StepMap` reads a segment only when an entry of one of its steps is asked
for, which keeps opening a chain independent of how many steps it holds.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar

from ..errors import CorruptChainError, LdformatError
from .manifest import (
    AnchorEntry,
    DeltaEntry,
    Ranges,
    Record,
    Segment,
    SegmentRef,
    StepEntry,
    expand,
)

V = TypeVar("V")
DeltaStep = tuple[DeltaEntry, StepEntry]
#: Reads and verifies a segment object (size, crc32c, canonical form; spec §7.9).
SegmentReader = Callable[[SegmentRef], Segment]


class StepMap(MutableMapping[int, V], Generic[V]):
    """step -> entry, where the entries of steps listed by a segment reference are read from
    that segment when first needed.

    Pending steps are kept as ranges (never expanded at open); ``origin`` tells, for each step
    whose entry still comes from a segment, which reference of the start record holds it.
    """

    def __init__(self, load: Callable[[int], None]) -> None:
        self._load = load
        self._entries: dict[int, V] = {}
        self._firsts: list[int] = []
        self._spans: list[tuple[int, int, int]] = []  # (first, last, segment index), ascending
        #: step -> index of the segment reference its entry comes from (loaded or pending).
        self.origin: dict[int, int] = {}

    # -- pending ranges --------------------------------------------------------------------
    def add_pending(self, ranges: Ranges, segment: int) -> None:
        for first, last in ranges:
            i = bisect.bisect_left(self._firsts, first)
            self._firsts.insert(i, first)
            self._spans.insert(i, (first, last, segment))

    def _span(self, step: int) -> int:
        i = bisect.bisect_right(self._firsts, step) - 1
        return i if i >= 0 and self._spans[i][1] >= step else -1

    def has_pending(self, segment: int) -> bool:
        return any(g == segment for _, _, g in self._spans)

    def pending_steps(self, segment: int) -> list[int]:
        return [s for first, last, g in self._spans if g == segment for s in range(first, last + 1)]

    def _unpend(self, step: int) -> None:
        i = self._span(step)
        if i < 0:
            return
        first, last, g = self._spans.pop(i)
        self._firsts.pop(i)
        for a, b in ((step + 1, last), (first, step - 1)):
            if a <= b:
                self._firsts.insert(i, a)
                self._spans.insert(i, (a, b, g))

    def resolve(self, segment: int, entries: dict[int, V]) -> None:
        """Replace the pending steps of ``segment`` with their ``entries`` (read from it)."""
        keep = [(f, la, g) for f, la, g in self._spans if g != segment]
        for step in self.pending_steps(segment):
            self._entries[step] = entries[step]
            self.origin[step] = segment
        self._spans = keep
        self._firsts = [f for f, _, _ in keep]

    def drop(self, segment: int) -> None:
        """Forget the pending steps of ``segment`` (it cannot be read)."""
        self._spans = [span for span in self._spans if span[2] != segment]
        self._firsts = [f for f, _, _ in self._spans]

    # -- mapping -----------------------------------------------------------------------------
    def __getitem__(self, step: int) -> V:
        try:
            return self._entries[step]
        except KeyError:
            pass
        i = self._span(step)
        if i < 0:
            raise KeyError(step)
        try:
            self._load(self._spans[i][2])
        except LdformatError as e:
            raise type(e)(f"{e} (reading the entry of step {step})") from None
        return self._entries[step]

    def __setitem__(self, step: int, value: V) -> None:
        self._unpend(step)
        self.origin.pop(step, None)
        self._entries[step] = value

    def __delitem__(self, step: int) -> None:
        if step in self._entries:
            del self._entries[step]
        elif self._span(step) >= 0:
            self._unpend(step)
        else:
            raise KeyError(step)
        self.origin.pop(step, None)

    def __contains__(self, step: object) -> bool:
        if step in self._entries:
            return True
        try:
            return self._span(operator.index(step)) >= 0  # type: ignore[arg-type]  # any integer type
        except TypeError:
            return False

    def __iter__(self) -> Iterator[int]:
        pending = list(self._spans)
        yield from list(self._entries)
        for first, last, _ in pending:
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return len(self._entries) + sum(last - first + 1 for first, last, _ in self._spans)

    def clear(self) -> None:
        self._entries.clear()
        self._firsts.clear()
        self._spans.clear()
        self.origin.clear()

    def own_entries(self) -> dict[int, V]:
        """The entries that come from no segment (folded from records)."""
        return {s: v for s, v in self._entries.items() if s not in self.origin}

    def max_key(self) -> int | None:
        candidates = [max(self._entries)] if self._entries else []
        if self._spans:
            candidates.append(self._spans[-1][1])
        return max(candidates) if candidates else None


def is_fence(record: Record) -> bool:
    """Whether ``record`` is a fence record: an ``append`` with no anchor and no delta entry
    (spec §15.3). Such a record commits nothing; it is never deleted (spec §7.5)."""
    return record.type == "append" and not record.anchors and not record.deltas


class ChainState:
    """The visible content of a chain after folding the log (spec §7.3)."""

    def __init__(self, *, last_seq: int = 0, last_checksum: str | None = None, first_seq: int = 1,
                 read_segment: SegmentReader | None = None, where: str = "") -> None:
        self.anchors: StepMap[AnchorEntry] = StepMap(self._load)
        self.deltas: StepMap[DeltaStep] = StepMap(self._load)
        self.last_seq = last_seq
        self.last_checksum = last_checksum
        self.first_seq = first_seq
        #: Bytes of the record the fold starts at, when it is a snapshot (0 otherwise), and the
        #: number and bytes of the records folded after it: what the next open reads (spec §7.3).
        #: Only records folded with their size count (:func:`ldformat.chain.records.read_log` and
        #: :func:`ldformat.chain.commit.commit_record` pass it); a writer uses them to decide when to
        #: write a snapshot (spec §7.8).
        self.start_bytes = 0
        self.tail_records = 0
        self.tail_bytes = 0
        #: The segment references of the record the fold starts at (spec §7.9).
        self.segments: tuple[SegmentRef, ...] = ()
        self.read_segment = read_segment
        self.where = where  # how messages name the chain
        self.segments_loaded = 0  # segment objects read (not counting those handed to remember())
        #: Whether each record this process folded or committed is a fence record (an empty
        #: ``append``, spec §15.3), by number: fences are never deleted (spec §7.5), and a record
        #: known here need not be read again to tell.
        self.fences: dict[int, bool] = {}
        self._segment_cache: dict[str, Segment] = {}  # verified segments by path
        self._lock = threading.Lock()

    # -- segments ----------------------------------------------------------------------------
    def remember(self, ref: SegmentRef, segment: Segment) -> None:
        """Keep a segment this process wrote, so that folding the record that references it
        does not read it back."""
        self._segment_cache[ref.object.path] = segment

    def _load(self, index: int) -> None:
        with self._lock:
            ref = self.segments[index]
            if self.anchors.has_pending(index) or self.deltas.has_pending(index):
                segment = self._segment_cache.get(ref.object.path)
                if segment is None:
                    if self.read_segment is None:
                        raise CorruptChainError(f"{ref.object.path}: segment cannot be read: no store (internal)")
                    segment = self.read_segment(ref)
                    self.segments_loaded += 1
                    self._segment_cache[ref.object.path] = segment
                self._resolve(index, ref, segment)

    def _resolve(self, index: int, ref: SegmentRef, segment: Segment) -> None:
        anchors = {a.step: a for a in segment.anchors}
        deltas = {s.step: (d, s) for d in segment.deltas for s in d.steps}
        for listed, have, what in ((ref.anchor_steps, anchors, "anchor entry"),
                                   (ref.delta_steps, deltas, "step entry")):
            missing = next((s for first, last in listed for s in range(first, last + 1) if s not in have), None)
            if missing is not None:
                raise CorruptChainError(
                    f"{self._name(ref.object.path)} (step {missing}): the snapshot lists step {missing}, but the "
                    f"segment holds no {what} for it (spec §7.9)")
        self.anchors.resolve(index, anchors)
        self.deltas.resolve(index, deltas)

    def _name(self, path: str) -> str:
        return f"{self.where}/{path}" if self.where else path

    def load_segment(self, index: int) -> None:
        """Read segment ``index`` of the start record now, if a committed step's entry is in it."""
        self._load(index)

    def drop_segment(self, index: int) -> None:
        """Forget the steps segment ``index`` holds (a validator that reported it unreadable)."""
        with self._lock:
            self.anchors.drop(index)
            self.deltas.drop(index)

    def listed_steps(self, index: int) -> list[int]:
        """The steps the start record's reference ``index`` lists (spec §7.9)."""
        ref = self.segments[index]
        return sorted(set(expand(ref.anchor_steps)) | set(expand(ref.delta_steps)))

    # -- folding -----------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        return sorted(set(self.anchors) | set(self.deltas))

    @property
    def latest_step(self) -> int | None:
        keys = [k for k in (self.anchors.max_key(), self.deltas.max_key()) if k is not None]
        return max(keys) if keys else None

    def restated_deltas(self, steps: Iterable[int]) -> list[DeltaEntry]:
        """Delta entries that restate the committed ``steps`` (delta steps of this state), each
        batch with exactly those of its step entries, unchanged: what a snapshot lists for the
        deltas it keeps (spec §7.8, §16, §17.3)."""
        return restate_deltas(self.deltas[s] for s in sorted(steps))

    def apply(self, record: Record, size: int = 0) -> None:
        """Fold ``record`` (spec §7.3 step 4); ``size``: its length in bytes, if known."""
        if record.type == "snapshot":
            self.anchors.clear()
            self.deltas.clear()
            self.first_seq = record.seq  # every earlier record is superseded (spec §7.3 step 2)
            self.start_bytes, self.tail_records, self.tail_bytes = size, 0, 0
            self.segments = record.segments
            cache, self._segment_cache = self._segment_cache, {}
            for index, ref in enumerate(record.segments):
                self.anchors.add_pending(ref.anchor_steps, index)
                self.deltas.add_pending(ref.delta_steps, index)
                known = cache.get(ref.object.path)
                if known is not None:
                    self._segment_cache[ref.object.path] = known
                    self._resolve(index, ref, known)
        else:
            self.tail_records += 1
            self.tail_bytes += size
        self.fences[record.seq] = is_fence(record)
        for a in record.anchors:
            self.anchors[a.step] = a
        for d in record.deltas:
            for s in d.steps:
                self.deltas[s.step] = (d, s)
        self.last_seq = record.seq
        self.last_checksum = record.checksum

    def referenced_objects(self) -> set[str]:
        """Every object the fold references: anchors, batch objects, and the segments of its
        start record (spec §7.9)."""
        refs = {a.object.path for a in self.anchors.values()}
        for d, _ in self.deltas.values():
            refs.update(f"{d.path}/{o.path}" for o in d.objects)
        refs.update(g.object.path for g in self.segments)
        return refs

    def referenced_bytes(self) -> int:
        """The bytes of the anchors and batch objects the chain references (their sizes as
        recorded): what a disk budget bounds. Metadata (records, segments) is not counted."""
        total = sum(a.object.size for a in self.anchors.values())
        return total + sum(o.size for d in self.delta_entries() for o in d.objects)

    def delta_entries(self) -> list[DeltaEntry]:
        seen: dict[str, DeltaEntry] = {}
        for d, _ in self.deltas.values():
            seen.setdefault(d.path, d)
        return list(seen.values())

    def replay_path(self, step: int) -> tuple[int, list[int]]:
        """Return (anchor step, delta steps to apply in order) that materialize ``step``."""
        chain: list[int] = []
        s = step
        while s not in self.anchors:
            entry = self.deltas.get(s)
            if entry is None:
                raise CorruptChainError(f"{self.where or 'the chain'}: step {step} is not reachable: no anchor or "
                                        f"delta for step {s}")
            chain.append(s)
            s = entry[1].base
        chain.reverse()
        return s, chain


def restate_deltas(entries: Iterable[DeltaStep]) -> list[DeltaEntry]:
    """Group ``(delta entry, step entry)`` pairs by batch: each batch's entry with exactly the
    given step entries, in the given order."""
    by_path: dict[str, tuple[DeltaEntry, list[StepEntry]]] = {}
    for entry, step_entry in entries:
        by_path.setdefault(entry.path, (entry, []))[1].append(step_entry)
    return [DeltaEntry(path=e.path, objects=e.objects, slots=e.slots, rows=e.rows, steps=tuple(kept))
            for e, kept in by_path.values()]


__all__ = ["ChainState", "DeltaStep", "SegmentReader", "StepMap", "expand", "restate_deltas"]
