"""The pending delta batch of a chain writer: its rows coded as the steps arrive, its slots, and
its objects written when it is committed (spec §10 "Deltas", §10.1 "Batch layout", §10.3
"Slots", §10.4 "Step entries").

The values of each row go to a :class:`~ldformat.format.delta.BatchEncoder` as soon as the
row is made, compressed on the encoder pool's threads (``encode_threads``), so a batch is
never held raw. Segments are laid out in slot order (spec §10.1), and a slot is checked as a
reader checks it before it is first used: what the writer records, a reader accepts. When
the batch is committed, :meth:`PendingBatch.write` writes its objects (data only: the commit
record that references them comes after, spec §7.4 "Commit protocol") and starts a new
batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CorruptChainError, UnsupportedStateError
from ..format.checksum import object_checksum
from ..format.delta import MAX_COUNTS, BatchEncoder, check_encode_threads, default_encode_threads, encode_pool
from ..format.jsonvalue import JSON
from ..format.manifest import DeltaEntry, ObjectRef, RootMetadata, SlotInfo, StepEntry
from .captured import CapturedTensor
from .guard import WriterGuard
from .records import batch_group_path

#: Checks a slot as a reader would (``check_slots(slots, schema, kind, where)``, spec §10.3).
SlotCheck = Callable[[tuple[SlotInfo, ...], JSON, str, str], None]


class PendingBatch:
    """The rows, slots and step entries of the batch not yet committed."""

    def __init__(self, root: RootMetadata, path: str, check: SlotCheck) -> None:
        self._schema: JSON = root.schema
        self._kind = root.kind
        self._path = path
        self._check = check
        self._encode_threads = default_encode_threads()
        self.encoder = self._new_encoder()  # the rows, values compressed as they arrive
        self.steps: list[StepEntry] = []
        self.slots: list[SlotInfo] = []
        self.slot_index: dict[str, int] = {}
        self.nbytes = 0  # the raw bytes of the rows so far

    @property
    def rows(self) -> int:
        return self.encoder.rows

    @property
    def encode_threads(self) -> int:
        return self._encode_threads

    @encode_threads.setter
    def encode_threads(self, threads: int) -> None:
        self._encode_threads = check_encode_threads(threads)
        if self.encoder.rows == 0:
            self.encoder = self._new_encoder()

    def _new_encoder(self) -> BatchEncoder:
        return BatchEncoder(encode_pool(self._encode_threads))

    def slot(self, name: str, ct: CapturedTensor, encoding: str) -> int:
        """The index of ``name``'s slot, made on first use after a reader's check."""
        j = self.slot_index.get(name)
        if j is None:
            slot = SlotInfo(name=name, dtype=ct.dtype, shape=ct.shape, encoding=encoding)
            try:  # what the writer records, the reader reads: the reader's own check (spec §10.3)
                self._check((slot,), self._schema, self._kind, self._path)
            except CorruptChainError as e:
                raise UnsupportedStateError(f"{e}; a reader would refuse it, so it is not recorded") from None
            j = self.slot_index[name] = len(self.slots)
            self.slots.append(slot)
        elif self.slots[j].shape != ct.shape or self.slots[j].dtype != ct.dtype:
            raise UnsupportedStateError(f"{name} changed shape or dtype during training; format 1.x refuses that")
        return j

    def start_row(self) -> None:
        self.encoder.start_row()

    def add(self, slot: int, values: np.ndarray, indices: np.ndarray | None) -> None:
        """Add one segment of the current row (the encoder consumes or copies what it is given)."""
        self.nbytes += values.nbytes + (0 if indices is None else indices.nbytes)
        self.encoder.add(slot, values, indices)

    def due(self, batch_steps: int, max_batch_bytes: int) -> bool:
        """Whether the batch is to be committed now: full, large, or at the bound of spec §10.5."""
        return (self.rows >= batch_steps or self.nbytes >= max_batch_bytes
                or (self.rows + 1) * max(1, len(self.slots)) > MAX_COUNTS)

    def write(self, guard: WriterGuard, written: list[str]) -> DeltaEntry | None:
        """Write the batch's objects (their paths appended to ``written`` as they are) and start a
        new batch; returns the batch's entry, or None if it has no row."""
        if not self.rows:
            return None
        first, last = self.steps[0].step, self.steps[-1].step
        group = batch_group_path(first, last)
        objects = self.encoder.finish(len(self.slots), {"kind": self._kind, "first": first, "last": last})
        refs = []
        for key, data in sorted(objects.items()):
            path = f"{group}/{key}"
            guard.io(path, guard.store.write, path, data)
            written.append(path)
            refs.append(ObjectRef(path=key, size=len(data), crc32c=object_checksum(path, data)))
        entry = DeltaEntry(path=group, objects=tuple(refs), slots=tuple(self.slots), rows=self.rows,
                           steps=tuple(self.steps))
        self.encoder, self.steps, self.slots, self.slot_index = self._new_encoder(), [], [], {}
        self.nbytes = 0
        return entry
