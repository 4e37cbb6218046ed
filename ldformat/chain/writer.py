"""The chain writer (spec §7.4 "Commit protocol", §10 "Deltas", §9 "Anchors").

Call order in a training loop::

    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense")
    for step in range(1, n + 1):
        loss.backward(); optimizer.step(); scheduler.step()
        writer.record_step(step, extra={"scheduler": scheduler.state_dict()})
    writer.close()

Gradients and the hyperparameters the optimizer actually used are captured by a step
pre-hook on the optimizer, so that a loop that sets ``lr`` by hand, zeroes gradients early
or runs an optimizer that modifies ``grad`` in place still records what the step consumed.

:class:`ChainWriter` is a front over roles, one module each (as Orbax's ``CheckpointManager``
over its handlers, or torch DCP's planner over its storage writer):

* :mod:`.opening`: create or open a chain: the schema of the live objects, the root, the
  location and lock a creation claims and undoes on failure (spec §5, §7.4, §15).
* :mod:`.live`: the live model and optimizer: the step pre-hook, copies of the gradients,
  buffers and state, and the :class:`~ldformat.chain.captured.CapturedStep` of a step (spec §8).
* :mod:`.rows`: each step's row and step entry, by delta kind; the ``state.xor`` base (spec §11).
* :mod:`.batches`: the pending batch, its slots and encoder pool, its objects (spec §10.1).
* :mod:`.anchors`: anchor objects (spec §9).
* :mod:`.committer`: commit records under the lock, snapshots, live retention (spec §7.4,
  §7.8, §17).
* :mod:`.guard`: what they share: the lock, the committed state, the storage calls and the
  error that stops the writer.

A step goes live → rows → batch; an anchor's object is written when it is due; a commit
writes the batch's objects, syncs every new object and then creates the record (data first,
then an exclusive commit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Generic, TypeVar, cast, overload

import numpy as np
import torch

from ..errors import UsageError
from ..format.delta import check_slots
from ..format.environment import current_environment
from ..format.fold import ChainState
from ..format.jsonvalue import JSON, encode
from ..format.manifest import FORMAT_VERSION, Encoding, RootMetadata, StepEntry
from ..format.state import encode_param_groups
from ..format.topk import TopK
from ..stores import Store
from .anchors import write_anchor_object
from .batches import PendingBatch
from .captured import CapturedStep, CapturedTensor
from .committer import Committer, SnapshotPolicy
from .guard import WriterGuard
from .live import LiveCapture
from .lock import WriterLock
from .opening import (
    WRITABLE_VERSIONS,
    CreationSite,
    build_schema,
    check_open,
    new_root,
    open_for_append,
    refuse_tensor_hyperparameters,
)
from .reader import ChainReader, chain_name, open_store
from .records import read_root
from .rows import RowBuilder
from .state_delta import coefficients as state_coefficients

# Kept importable from here, where they were defined before the roles were split out.
__all__ = ["WRITABLE_VERSIONS", "ChainWriter", "SnapshotPolicy", "build_schema", "refuse_tensor_hyperparameters"]

T = TypeVar("T")


class _OnRole(Generic[T]):
    """An attribute of the writer kept on one of its roles (``writer.max_bytes`` is
    ``writer._committer.max_bytes``), read and set as it was before the split."""

    def __init__(self, role: str, name: str | None = None) -> None:
        self._role = role
        self._name = name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _OnRole[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | _OnRole[T]:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, self._role), self._name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._role), self._name, value)


class ChainWriter:
    """Appends steps to a chain. Use :meth:`create` or :meth:`open`, not the constructor."""

    #: Code the second moment and the parameter of ``torch.optim.Adam``/``AdamW`` parameters
    #: as differences from a prediction (``adam.v``, ``adam.w``; format 1.6 chains, spec
    #: §11.3): about 0.3 of the raw state per step instead of 0.7. False: plain differences.
    predict_state: _OnRole[bool] = _OnRole("_rows")
    #: A disk budget kept by dropping history after commits (spec §17); None: none.
    max_bytes: _OnRole[int | None] = _OnRole("_committer")
    #: Steps dropped to keep ``max_bytes``.
    retained: _OnRole[list[int]] = _OnRole("_committer")
    #: Retention keeps every step from the newest anchor at or below this step on (a rank
    #: chain's writer: the sharded chain's newest committed step, spec §20.8); when it
    #: returns None, nothing is dropped.
    retain_at_most: _OnRole[Callable[[], int | None] | None] = _OnRole("_committer")
    #: When to write snapshot records (spec §7.8); None: never. The default is segmented
    #: snapshots where the chain's version allows them (1.5), none in older chains, whose
    #: inline snapshots are about as large as the log they replace.
    snapshot_policy: _OnRole[SnapshotPolicy | None] = _OnRole("_committer")
    #: Snapshot records this writer committed.
    snapshots: _OnRole[int] = _OnRole("_committer")
    #: Commit records this writer committed.
    commits: _OnRole[int] = _OnRole("_committer")
    #: Seconds of the sync and record creation of the latest commit (and its snapshot).
    last_commit_seconds: _OnRole[float] = _OnRole("_committer")
    # Private names that tests and benchmarks read or set on a writer.
    _lock: _OnRole[WriterLock | None] = _OnRole("_guard", "lock")
    _state: _OnRole[ChainState] = _OnRole("_guard", "state")
    _state_encoding: _OnRole[Encoding] = _OnRole("_rows", "state_encoding")
    _xor_base: _OnRole[dict[str, np.ndarray]] = _OnRole("_rows", "xor_base")

    def __init__(
        self,
        *,
        path: str,
        store: Store,
        root: RootMetadata,
        state: ChainState,
        lock: WriterLock,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        compressor: TopK | None,
        batch_steps: int,
        anchor_every: int | None,
        capture_hook: bool = True,
    ) -> None:
        if batch_steps < 1:
            raise UsageError(f"batch_steps must be >= 1, got {batch_steps}")
        if anchor_every is not None and anchor_every < 1:
            raise UsageError(f"anchor_every must be >= 1 or None, got {anchor_every}")
        self.path = path
        self.store = store
        self.root = root
        self.kind = root.kind
        self.model = model
        self.optimizer = optimizer
        self.compressor = compressor
        self.batch_steps = batch_steps
        self.anchor_every = anchor_every
        self.max_batch_bytes = 1 << 30  # a batch is committed early once its rows hold this much
        self._guard = WriterGuard(path, store, lock, state)
        # check_slots and state_coefficients as this module names them (tests replace them here).
        self._batch = PendingBatch(root, path, check_slots)
        self._rows = RowBuilder(root, path, optimizer, self._batch, self._guard, state_coefficients)
        self._committer = Committer(self._guard, self._batch, root.format_version)
        self._live = LiveCapture(root, path, model, optimizer, compressor, self._guard)
        if capture_hook:  # the capture runtime captures gradients itself and appends CapturedSteps
            self._live.add_hook()

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        kind: str,
        batch_steps: int = 8,
        compressor: TopK | None = None,
        anchor_every: int | None = None,
        step: int = 0,
        extra: dict[str, Any] | None = None,
        store: Store | None = None,
        capture_hook: bool = True,
        storage_options: dict[str, Any] | None = None,
        format_version: str = FORMAT_VERSION,
    ) -> ChainWriter:
        """Create a chain and write the anchor of the current state as step ``step``.

        Args:
            path: a new or empty directory, or the URL of an empty prefix
                (``s3://bucket/prefix``, ``memory://name``, ...; see
                :func:`ldformat.stores.open_store`).
            model, optimizer: the live training objects (the optimizer's parameters must
                belong to the model).
            kind: ``"grad.topk"`` (needs ``compressor``), ``"grad.dense"`` or ``"state.xor"``.
            batch_steps: steps per delta batch; a full batch is committed automatically.
            anchor_every: write an anchor every this many steps (``None``: only when asked).
            step: the step number of the current state (0 before training).
            extra: JSON-able extra state of the first anchor.
            store: an explicit store (``path`` then only names the chain).
            storage_options: object store settings overriding the environment variables.
            format_version: the version the root records (spec §3.1). An older one (down to
                1.2) keeps the chain readable by older readers: before 1.6 its ``state.xor``
                slots are XORs, not differences (spec §11.3); before 1.5 it holds no
                segments (spec §7.9), and this writer writes no snapshot records into it by
                default.

        Raises:
            ChainExistsError: ``path`` already holds a chain.
            UnsupportedStateError: the model or optimizer uses something format 1.x refuses.
        """
        root = new_root(model, optimizer, kind, compressor, format_version, current_environment)
        site = CreationSite.claim(path, store, storage_options)
        try:
            writer = cls(path=site.where, store=site.store, root=root, state=ChainState(), lock=site.lock,
                         model=model, optimizer=optimizer, compressor=compressor, batch_steps=batch_steps,
                         anchor_every=anchor_every, capture_hook=capture_hook)
        except BaseException:
            site.undo([])
            raise
        writer._write_first_anchor(site, step, extra)
        return writer

    def _write_first_anchor(self, site: CreationSite, step: int, extra: dict[str, Any] | None) -> None:
        """The last step of a creation: the anchor of ``step`` in record 1, then the root; undone
        on failure (spec §7.4)."""
        self._committer.pending_root = self.root  # created after record 1: a root always has a log (spec §7.4)
        try:
            self._rows.last_step = step
            self._rows.last_extra = encode(extra or {}, "extra")
            self._reset_xor_base_from_live()
            self.write_anchor(step)
        except BaseException:
            written = list(self._committer.written)
            self._guard.lock = None  # released (or not) by the undo
            self.abort()
            site.undo(written)
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        compressor: TopK | None = None,
        batch_steps: int = 8,
        anchor_every: int | None = None,
        store: Store | None = None,
        break_lock: bool = False,
        lock_wait: float = 0.0,
        capture_hook: bool = True,
        storage_options: dict[str, Any] | None = None,
        lock: WriterLock | None = None,
    ) -> ChainWriter:
        """Re-open a chain to append after its latest committed step.

        The live ``model`` and ``optimizer`` must hold the state of that step (load it with
        :meth:`ChainReader.load_into`). A dead writer's lock is taken over and its
        uncommitted leftovers are removed. ``lock``: the chain's lock, already taken by the
        caller; the writer owns it from here (released on failure and by :meth:`close`).
        """
        where = chain_name(path, store)
        store = open_store(path, store, storage_options)
        root = read_root(store, where)
        check_open(root, model, optimizer, compressor, where)
        if lock is None:
            lock = WriterLock.acquire(store, where, break_lock=break_lock, wait_s=lock_wait)
        try:
            state = open_for_append(store, where, lock)  # fences the log after a takeover
            writer = cls(path=where, store=store, root=root, state=state, lock=lock, model=model,
                         optimizer=optimizer, compressor=compressor, batch_steps=batch_steps,
                         anchor_every=anchor_every, capture_hook=capture_hook)
        except BaseException:
            lock.release()
            raise
        writer._take_up(path, state.latest_step)
        return writer

    def _take_up(self, path: str | os.PathLike[str], latest: int | None) -> None:
        """Continue an opened chain: anchor a chain without a step; a ``state.xor`` chain's base
        is what the chain holds, so deltas stay exact even if the live state was not reloaded."""
        try:
            if latest is None:
                self._rows.last_step = 0
                self._reset_xor_base_from_live()
                self.write_anchor(0)
            elif self.kind == "state.xor":
                self._rows.set_base(ChainReader(path, store=self.store).stored_tensors(latest))
        except BaseException:
            self.abort()
            raise

    # -- capture -------------------------------------------------------------------------
    def check_param_groups(self) -> None:
        """Refuse ``add_param_group`` or swapped parameters: the schema is fixed at creation."""
        self._live.check_param_groups()

    def capture_gradients(self) -> dict[str, CapturedTensor]:
        """The gradients the optimizer is about to consume, as ``grad/<index>`` tensors.

        For ``grad.topk`` only the values at the compressor's indices are copied, and the
        compressor must have run since the previous step.
        """
        return self._live.gradients()

    def capture_buffers(self) -> dict[str, CapturedTensor]:
        """Copies of the model's buffers (``model/<key>``): the optimizer never touches them."""
        return self._live.buffers()

    def live_state(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """Every state tensor under its stored name (live objects, not copies) and the
        optimizer structure (spec §8.2; encoded, so later changes do not reach it)."""
        return self._live.state()

    def live_state_tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor under its stored name (live objects, not copies)."""
        return self.live_state()[0]

    def record_step(self, step: int, extra: dict[str, Any] | None = None) -> None:
        """Record step ``step``; the live objects must hold the state after it.

        Call it once per optimizer step, after ``optimizer.step()`` and any scheduler step.
        A step in which the optimizer did not run (e.g. GradScaler skipped it) is recorded
        as a step without an optimizer update.
        """
        self._guard.check_usable()
        self.append(self._live.step(step, extra, self._rows.last_step, self.anchor_every))

    def snapshot_anchor(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """CPU copies of the whole live state, plus top-k residuals, for an anchor; and the
        optimizer structure (spec §8.2)."""
        return self._live.anchor()

    def snapshot_anchor_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of :meth:`snapshot_anchor`."""
        return self.snapshot_anchor()[0]

    @property
    def anchors(self) -> list[int]:
        return sorted(self._guard.state.anchors)

    def append(self, captured: CapturedStep, encoded: Callable[[], None] | None = None) -> None:
        """Add a captured step to the current batch; commits when the batch is full.

        This is the part of :meth:`record_step` that may run off the training thread: the
        XOR against the previous step, encoding and I/O. ``captured.tensors`` may be reused
        by the caller once this returns, or once ``encoded()`` is called: right after the
        step's row is encoded, before any anchor or commit I/O (so that a staging buffer
        goes back to training without waiting for the disk).
        """
        self._guard.check_usable()
        self._row_added(captured, self._rows.add(captured), encoded)

    def append_in_pieces(self, captured: CapturedStep,
                         read: Callable[[list[str]], Iterable[Mapping[str, CapturedTensor]]],
                         encoded: Callable[[], None] | None = None) -> None:
        """Add a ``state.xor`` step whose tensors are read piece by piece, for a state whose
        host copy must stay within a memory budget (docs/capture-runtime.md "Host memory").

        ``captured.tensors`` says what each tensor is (dtype and shape; its bits are not read).
        ``read(order)`` yields the bits in pieces: consecutive runs of the names of ``order``
        (the row's slot order), each piece's bits scratch buffers that this method overwrites
        with the values and is done with before it asks for the next piece. Every check of
        :meth:`append` runs before the first piece is read. Needs ``predict_state`` off: a
        predicted tensor's values depend on tensors of other pieces, a plain one's on its own
        bits and base only.
        """
        self._guard.check_usable()
        self._row_added(captured, self._rows.add_in_pieces(captured, read), encoded)

    def _row_added(self, captured: CapturedStep, entry: StepEntry, encoded: Callable[[], None] | None) -> None:
        """The step's row is in the batch: record its entry, then its anchor or the commit it makes due."""
        step = captured.step
        self._rows.row_added(captured, entry)
        if captured.anchor and captured.anchor_tensors is None and self.kind != "state.xor":
            raise UsageError(f"{self.path}: an anchor at step {step} needs anchor_tensors")
        if encoded is not None:
            encoded()
        if captured.anchor:
            tensors = captured.anchor_tensors
            if tensors is None:  # xor: the base holds this step's bits now (the tensors may hold deltas)
                tensors = self._rows.base_tensors(captured)
            self._write_anchor_object(step, tensors, captured.param_groups, captured.extra, captured.optimizer)
            self.commit()
        elif self._batch.due(self.batch_steps, self.max_batch_bytes):
            self.commit()

    def _reset_xor_base_from_live(self) -> None:
        if self.kind == "state.xor":
            self._rows.reset_base(self.live_state_tensors())

    # -- anchors and commits -------------------------------------------------------------
    def write_anchor(self, step: int) -> int | None:
        """Write a full anchor of the live state at ``step`` (the last recorded step) and commit."""
        self._guard.check_usable()
        if step != self._rows.last_step:
            raise UsageError(
                f"{self.path}: write_anchor({step}): the live state is at step {self._rows.last_step}; "
                "anchors can only be written for the last recorded step"
            )
        groups = encode_param_groups(self.optimizer, with_params=True)
        tensors, structure = self.snapshot_anchor()
        self._rows.refuse_structure_in_old_chain(structure, step)
        self._write_anchor_object(step, tensors, groups, self._rows.last_extra, structure)
        return self.commit()

    def _write_anchor_object(self, step: int, tensors: dict[str, torch.Tensor], param_groups: Any, extra: Any,
                             optimizer: JSON) -> None:
        pending = self._committer
        pending.pending_anchors.append(
            write_anchor_object(self._guard, pending.written, step, tensors, param_groups, extra, optimizer))

    @property
    def encode_threads(self) -> int:
        """Threads that compress a batch's value chunks alongside the writer (blosc releases the
        GIL); 1: the writer's thread alone. The objects are the same bytes either way. Default:
        half the cores, at most 8, and 1 on 3 cores or fewer. A change applies from the next
        batch (at once if the pending batch has no row yet)."""
        return self._batch.encode_threads

    @encode_threads.setter
    def encode_threads(self, threads: int) -> None:
        self._batch.encode_threads = threads

    def commit(self) -> int | None:
        """Make everything recorded so far durable; returns the last durable step."""
        return self._committer.commit()

    def write_snapshot(self) -> None:
        """Commit a snapshot record that restates the chain as it is (spec §7.8).

        It states every committed anchor entry and, for every batch, its entry with its
        committed steps, unchanged: in a 1.5 chain through segments (the entries committed
        since the previous snapshot go into a new one, spec §7.9), in older chains inline. It
        changes no step. It is created like any record, through the exclusive,
        lock-checked commit path, after everything pending is committed. Then the records
        below the *previous* snapshot are deleted (the newest superseded ones are left for
        readers still folding from there).
        """
        self._committer.write_snapshot()

    def keep_budget(self) -> None:
        """Run live retention now (spec §17), after committing what is pending.

        A rank chain of a sharded chain keeps everything from the newest anchor at or below the
        newest global commit; when that commit lags the rank's own commits, a pass after it has
        caught up drops what the earlier passes had to keep.
        """
        self.commit()
        self._committer.retain_if_over_budget()

    @property
    def durable_step(self) -> int | None:
        """The newest step that is committed (None before the first commit)."""
        return self._guard.durable_step

    @property
    def last_step(self) -> int | None:
        """The newest recorded step (committed or not)."""
        return self._rows.last_step

    def close(self) -> int | None:
        """Commit what is pending, release the lock and remove the optimizer hook."""
        try:
            if self._guard.lock is not None and self._guard.failed is None:
                self.commit()
        finally:
            self._live.remove_hook()
            self._guard.release()
        return self.durable_step

    def abort(self) -> None:
        """Drop what is not committed and release the lock."""
        self._live.remove_hook()
        self._guard.release()

    def __enter__(self) -> ChainWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
