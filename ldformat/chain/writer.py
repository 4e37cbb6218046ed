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
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, cast

import numpy as np
import torch

from ..chain.state_delta import NO_PREDICTION, row_values, wanted_encodings
from ..chain.state_delta import coefficients as state_coefficients
from ..errors import (
    ChainError,
    ChainExistsError,
    ChainLockedError,
    CorruptChainError,
    LdformatError,
    LockLostError,
    UnsupportedStateError,
    UsageError,
    WriterIOError,
)
from ..format.anchor import anchor_parts, write_anchor_parts
from ..format.delta import (
    DIFFERENCE_VALUE_CODECS,
    MAX_COUNTS,
    PREDICTED,
    BatchEncoder,
    check_encode_threads,
    check_slots,
    default_encode_threads,
    encode_pool,
    tensor_bits,
)
from ..format.environment import current_environment
from ..format.fold import ChainState
from ..format.jsonvalue import JSON, dtype_name, encode, object_checksum
from ..format.manifest import (
    FORMAT_VERSION,
    KINDS,
    AnchorEntry,
    DeltaEntry,
    Kind,
    ObjectRef,
    RootMetadata,
    SlotInfo,
    StepEntry,
    minor_version,
    refuse_newer,
    state_delta_encoding,
)
from ..format.optstate import live_optimizer_state, probe_unstorable_state
from ..format.predict import COEFFICIENTS, PREDICT, predicted_param
from ..format.state import (
    check_schema_matches,
    encode_param_groups,
    live_model_tensors,
    model_schema,
    optimizer_class_name,
    optimizer_param_names,
    optimizer_params,
    resolve_implementation,
)
from ..format.topk import TopK
from ..stores import LocalStore, Store, parse_location
from ..stores import open_store as open_location
from ..stores.local import make_directory
from .captured import (
    CapturedStep,
    CapturedTensor,
    StepArgs,
    around_closure,
    capture_gradients,
    capture_tensors,
    live_buffers,
    nested_step,
)
from .commit import collect_garbage, commit_record, delete_superseded, open_log_for_write
from .lock import WriterLock
from .reader import SHARDED_ROOT_FILE, ChainReader, chain_name, open_store
from .records import ROOT_FILE, anchor_object_path, batch_group_path, create_root, io_error, lock_path, now, read_root
from .snapshots import commit_snapshot, segments_allowed

log = logging.getLogger("ldformat")


#: Versions :meth:`ChainWriter.create` can write (1.0 and 1.1 chains are only appended to).
WRITABLE_VERSIONS = ("1.2", "1.3", "1.4", "1.5", "1.6")


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


class ChainWriter:
    """Appends steps to a chain. Use :meth:`create` or :meth:`open`, not the constructor."""

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
        self._state = state
        self._lock: WriterLock | None = lock
        self._params = optimizer_params(optimizer)
        self._param_names: list[str] = root.schema["optimizer"]["params"]
        self._buffers = [e["name"] for e in root.schema["model"] if e["role"] == "buffer" and e["alias_of"] is None]
        self._last_step: int | None = state.latest_step
        self._last_extra: Any = {}
        self._captured: tuple[Any, dict[str, CapturedTensor]] | None = None
        self._captures_since_record = 0
        self._seen_generation = -1
        self._row_steps: list[StepEntry] = []
        self._slots: list[SlotInfo] = []
        self._slot_index: dict[str, int] = {}
        self._pending_anchors: list[AnchorEntry] = []
        self._pending_deltas: list[DeltaEntry] = []
        self._written: list[str] = []
        self._xor_base: dict[str, np.ndarray] = {}
        self._xor_meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # (dtype, shape) of each base
        #: How state.xor slots are coded: ``sub`` (differences) from format 1.6 on, else ``xor``.
        self._state_encoding = state_delta_encoding(root.format_version)
        self._encode_threads = default_encode_threads()
        self._batch = self._new_batch()  # the rows of the pending batch, values compressed as they arrive
        #: Code the second moment and the parameter of ``torch.optim.Adam``/``AdamW`` parameters
        #: as differences from a prediction (``adam.v``, ``adam.w``; format 1.6 chains, spec
        #: §11.3): about 0.3 of the raw state per step instead of 0.7. False: plain differences.
        self.predict_state = True
        self._failed: LdformatError | None = None
        self._pending_root: RootMetadata | None = None  # set while a chain is being created
        self.max_batch_bytes = 1 << 30  # a batch is committed early once its rows hold this much
        self._batch_bytes = 0
        self.max_bytes: int | None = None  # a disk budget kept by dropping history after commits
        self.retained: list[int] = []  # steps dropped to keep max_bytes
        #: Retention keeps every step from the newest anchor at or below this step on (a rank
        #: chain's writer: the sharded chain's newest committed step, spec §20.8); when it
        #: returns None, nothing is dropped.
        self.retain_at_most: Callable[[], int | None] | None = None
        self._over_budget_warned = False
        self.last_commit_seconds = 0.0  # sync + record creation of the latest commit (and snapshot)
        self.commits = 0
        #: When to write snapshot records (spec §7.8); None: never. The default is segmented
        #: snapshots where the chain's version allows them (1.5), none in older chains, whose
        #: inline snapshots are about as large as the log they replace.
        self._segmented = segments_allowed(root.format_version)
        self.snapshot_policy: SnapshotPolicy | None = SnapshotPolicy() if self._segmented else None
        self.snapshots = 0  # snapshot records this writer committed
        self._snapshot_too_large_warned = False
        # Records below this number may still exist although a snapshot supersedes them: those
        # below the previous snapshot are deleted after each new one (spec §7.5).
        self._superseded_from = state.first_seq
        # The capture runtime captures gradients itself and appends CapturedSteps.
        self._hook = optimizer.register_step_pre_hook(self._pre_hook) if capture_hook else None

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
        if kind not in KINDS:
            raise UsageError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
        if format_version not in WRITABLE_VERSIONS:
            raise UsageError(f"format_version must be one of {', '.join(WRITABLE_VERSIONS)} (default {FORMAT_VERSION})")
        if kind == "grad.topk" and not isinstance(compressor, TopK):
            raise UsageError("kind 'grad.topk' needs compressor=ldformat.TopK(...) (the one that compresses p.grad)")
        if kind != "grad.topk" and compressor is not None:
            raise UsageError(f"kind {kind!r} takes no compressor; use kind='grad.topk' with a TopK compressor")
        schema = build_schema(model, optimizer, kind, compressor)
        device = str(next(iter(optimizer_params(optimizer)), torch.empty(0)).device.type)
        environment = {**current_environment(device), "implementation": resolve_implementation(optimizer)}
        root = RootMetadata(
            format_version=format_version,
            chain_id=secrets.token_hex(16),
            created=now(),
            kind=kind,
            schema=schema,
            environment=environment,
        )
        where = chain_name(path, store)
        owned_dir: Path | None = None
        if store is None:
            location = parse_location(path)
            if location.path is None or storage_options:
                # An object store or memory:// URL (storage_options are refused for a directory).
                store = open_location(path, storage_options=storage_options)
            else:
                p = location.path
                if p.exists() and not p.is_dir():
                    raise UsageError(f"{where}: exists and is not a directory")
                owned_dir = None if p.exists() else p
                make_directory(p)
                store = LocalStore(p)
        try:
            exists = store.exists(ROOT_FILE)
            if not exists:
                _check_empty_or_unfinished(store, where)
        except LdformatError:
            raise
        except OSError as e:
            _remove_creation(store, owned_dir)
            raise io_error(f"{where}: cannot look at the location to create a chain", e) from None
        if exists:
            raise ChainExistsError(f"{where}: already holds a chain; use ChainWriter.open to append")
        try:
            lock = WriterLock.acquire(store, where)
        except ChainLockedError as e:
            raise ChainLockedError(f"{e} (another process is creating a chain here)") from None
        except BaseException:
            _remove_creation(store, owned_dir)
            raise
        try:
            _remove_unfinished_creation(store, where, lock)
        except BaseException:
            lock.release()  # the directory holds something else now: touch nothing
            raise
        try:
            writer = cls(path=where, store=store, root=root, state=ChainState(), lock=lock, model=model,
                         optimizer=optimizer, compressor=compressor, batch_steps=batch_steps,
                         anchor_every=anchor_every, capture_hook=capture_hook)
        except BaseException:
            _undo_creation(store, owned_dir, lock, [])
            raise
        writer._pending_root = root  # created after record 1: a root always has a log (spec §7.4)
        try:
            writer._last_step = step
            writer._last_extra = encode(extra or {}, "extra")
            writer._reset_xor_base_from_live()
            writer.write_anchor(step)
        except BaseException:
            written = list(writer._written)
            writer._lock = None  # released (or not) by _undo_creation
            writer.abort()
            _undo_creation(store, owned_dir, lock, written)
            raise
        return writer

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
        refuse_newer(root.format_version, where, "append to it")
        live_schema = build_schema(model, optimizer, root.kind, compressor)
        check_schema_matches(root.schema["model"], live_schema["model"], where)
        if root.schema["optimizer"]["params"] != live_schema["optimizer"]["params"]:
            raise UsageError(f"{where}: the optimizer's parameters differ from the chain's schema")
        if root.schema["optimizer"]["class"] != live_schema["optimizer"]["class"]:
            raise UsageError(
                f"{where}: the chain was written with {root.schema['optimizer']['class']}, "
                f"not {live_schema['optimizer']['class']}"
            )
        if root.kind == "grad.topk" and not isinstance(compressor, TopK):
            raise UsageError("this grad.topk chain needs compressor=ldformat.TopK(...)")
        if lock is None:
            lock = WriterLock.acquire(store, where, break_lock=break_lock, wait_s=lock_wait)
        try:
            _, state = open_log_for_write(store, where, lock)  # fences the log after a takeover
            collect_garbage(store, state, lock, where)
            writer = cls(path=where, store=store, root=root, state=state, lock=lock, model=model,
                         optimizer=optimizer, compressor=compressor, batch_steps=batch_steps,
                         anchor_every=anchor_every, capture_hook=capture_hook)
        except BaseException:
            lock.release()
            raise
        try:
            if state.latest_step is None:
                writer._last_step = 0
                writer._reset_xor_base_from_live()
                writer.write_anchor(0)
            elif root.kind == "state.xor":
                # The XOR base is what the chain holds, so deltas stay exact even if the live
                # state was not reloaded.
                writer._set_xor_base(ChainReader(path, store=store).stored_tensors(state.latest_step))
        except BaseException:
            writer.abort()
            raise
        return writer

    # -- capture -------------------------------------------------------------------------
    def check_param_groups(self) -> None:
        """Refuse ``add_param_group`` or swapped parameters: the schema is fixed at creation."""
        live = [p for g in self.optimizer.param_groups for p in g["params"]]
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        if sizes != self.root.schema["optimizer"]["group_sizes"] or any(
            a is not b for a, b in zip(live, self._params, strict=False)
        ):
            raise UnsupportedStateError(
                f"{self.path}: the optimizer's param groups changed since the chain was created "
                "(add_param_group?); format 1.x fixes them at creation: start a new chain"
            )
        if self.kind.startswith("grad."):
            refuse_tensor_hyperparameters(self.optimizer, self.kind)

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> StepArgs | None:
        if self._failed is not None or nested_step(optimizer):
            return None
        self._captures_since_record += 1
        if self.kind.startswith("grad."):
            def failed() -> None:
                self._captured = None  # the optimizer will not step

            wrapped = around_closure(args, kwargs, lambda: self._capture(optimizer), failed)
            if wrapped is not None:
                return wrapped
        self._capture(optimizer)
        return None

    def _capture(self, optimizer: torch.optim.Optimizer) -> None:
        try:
            self.check_param_groups()
            self._captured = (encode_param_groups(optimizer, with_params=False), self.capture_gradients())
        except LdformatError as e:
            self._failed = e

    def capture_gradients(self) -> dict[str, CapturedTensor]:
        """The gradients the optimizer is about to consume, as ``grad/<index>`` tensors.

        For ``grad.topk`` only the values at the compressor's indices are copied, and the
        compressor must have run since the previous step.
        """
        kind = cast(Kind, self.kind)  # RootMetadata checked it
        topk = self.compressor if kind == "grad.topk" else None
        if topk is not None and any(p.grad is not None for p in self._params):
            if topk.generation == self._seen_generation:
                raise UsageError(
                    "optimizer.step() ran without TopK.compress_(model) before it; a grad.topk "
                    "chain records the compressed gradient, so compress every step"
                )
            self._seen_generation = topk.generation
        return capture_gradients(self._params, self._param_names, kind, topk)

    def capture_buffers(self) -> dict[str, CapturedTensor]:
        """Copies of the model's buffers (``model/<key>``): the optimizer never touches them."""
        return capture_tensors(live_buffers(self.model, self._buffers))

    def live_state(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """Every state tensor under its stored name (live objects, not copies) and the
        optimizer structure (spec §8.2; encoded, so later changes do not reach it)."""
        tensors = live_model_tensors(self.model, self.root.schema["model"])
        optimizer_tensors, structure = live_optimizer_state(self.optimizer)
        tensors.update(optimizer_tensors)
        return tensors, structure

    def live_state_tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor under its stored name (live objects, not copies)."""
        return self.live_state()[0]

    def record_step(self, step: int, extra: dict[str, Any] | None = None) -> None:
        """Record step ``step``; the live objects must hold the state after it.

        Call it once per optimizer step, after ``optimizer.step()`` and any scheduler step.
        A step in which the optimizer did not run (e.g. GradScaler skipped it) is recorded
        as a step without an optimizer update.
        """
        self._check_usable()
        try:
            self.check_param_groups()
        except UnsupportedStateError as e:
            self._failed = e
            raise
        # A state.xor chain may skip steps (spec §11.3): then one optimizer step per step number.
        steps = 1 if self.kind.startswith("grad.") or self._last_step is None else max(1, step - self._last_step)
        if self._captures_since_record > steps:
            raise UsageError(
                f"{self.path}: optimizer.step() ran {self._captures_since_record} times since the "
                "last record_step; call record_step after every optimizer step"
                f"{' (or record the step number it has reached)' if not self.kind.startswith('grad.') else ''}"
            )
        hyper, grads = self._captured if self._captured is not None else (None, {})
        anchor = self.anchor_every is not None and step % self.anchor_every == 0
        anchor_tensors, structure = None, None
        if self.kind.startswith("grad."):
            tensors = {**grads, **self.capture_buffers()}
            if anchor:
                anchor_tensors, structure = self.snapshot_anchor()
        else:  # hyper: what Adam prediction uses (spec §11.3); the step entry's is null
            live, structure = self.live_state()
            tensors = capture_tensors(live)
        captured = CapturedStep(
            step=step,
            stepped=self._captured is not None,
            hyper=hyper,
            param_groups=encode_param_groups(self.optimizer, with_params=True),
            extra=encode(extra or {}, "extra"),
            tensors=tensors,
            anchor_tensors=anchor_tensors,
            anchor=anchor,
            optimizer=structure,
            scratch=True,  # fresh host copies (capture_tensors, capture_gradients)
        )
        self._captured = None
        self._captures_since_record = 0
        self.append(captured)

    def snapshot_anchor(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """CPU copies of the whole live state, plus top-k residuals, for an anchor; and the
        optimizer structure (spec §8.2)."""
        live, structure = self.live_state()
        tensors = {n: t.to("cpu", copy=True).contiguous() for n, t in live.items()}
        if self.compressor is not None:
            for name, r in self.compressor.state_dict().items():
                tensors[f"compressor/{name}"] = r.to("cpu", copy=True).contiguous()
        return tensors, structure

    def snapshot_anchor_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of :meth:`snapshot_anchor`."""
        return self.snapshot_anchor()[0]

    @property
    def anchors(self) -> list[int]:
        return sorted(self._state.anchors)

    def append(self, captured: CapturedStep, encoded: Callable[[], None] | None = None) -> None:
        """Add a captured step to the current batch; commits when the batch is full.

        This is the part of :meth:`record_step` that may run off the training thread: the
        XOR against the previous step, encoding and I/O. ``captured.tensors`` may be reused
        by the caller once this returns, or once ``encoded()`` is called: right after the
        step's row is encoded, before any anchor or commit I/O (so that a staging buffer
        goes back to training without waiting for the disk).
        """
        self._check_usable()
        step = captured.step
        xor = self.kind == "state.xor"
        base = self._check_next(captured)
        values: dict[str, np.ndarray] = {}
        slots: list[tuple[int, str, CapturedTensor | None]]
        if xor:
            self._state_row(captured, values)  # checks and codes every tensor of the row
            slots = [(self._slot_index[name], name, None) for name in values]
        else:
            # Check every tensor before encoding any: a refused step must leave no part of a row behind.
            slots = [(self._slot(name, ct, "dense" if ct.indices is None else "sparse"), name, ct)
                     for name, ct in captured.tensors.items()]
        entry = self._step_entry(captured, base)
        try:
            self._batch.start_row()
            for j, name, ct in sorted(slots, key=lambda s: s[0]):  # segment order is slot order (spec §10.1)
                # The encoder consumes or copies what it is given, so reused buffers are fine.
                if ct is None:  # state.xor
                    self._batch_bytes += values[name].nbytes
                    self._batch.add(j, values[name], None)
                else:
                    self._batch_bytes += ct.bits.nbytes + (0 if ct.indices is None else ct.indices.nbytes)
                    self._batch.add(j, ct.bits, ct.indices)
        except Exception as e:
            # Part of this row is encoded already: the pending batch can no longer be committed.
            self._failed = ChainError(f"{self.path}: encoding step {step} failed ({type(e).__name__}: {e}); "
                                      f"nothing after step {self.durable_step} is durable. Re-open the chain "
                                      "with ChainWriter.open to continue")
            raise self._failed from e
        self._row_added(captured, entry, encoded)

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
        self._check_usable()
        if self.kind != "state.xor" or self.predict_state:
            raise UsageError(f"{self.path}: a row in pieces needs a state.xor chain with predict_state off")
        step = captured.step
        base = self._check_next(captured)
        encodings, _ = self._state_slots(captured)
        order = sorted(captured.tensors, key=self._slot_index.__getitem__)
        entry = self._step_entry(captured, base)
        done = 0
        try:
            for name in [n for n in self._xor_base if n not in captured.tensors]:
                del self._xor_base[name]
            self._batch.start_row()
            pool = encode_pool(self._encode_threads)
            for piece in read(order):
                names = list(piece)
                if not names or names != order[done:done + len(names)]:
                    raise ValueError(f"a piece holds {names[:3]}, not the next tensors in slot order "
                                     f"{order[done:done + 3]}")
                for name in names:
                    want, got = captured.tensors[name], piece[name]
                    if (want.dtype, tuple(want.shape)) != (got.dtype, tuple(got.shape)):
                        raise ValueError(f"{name} is {got.dtype} {list(got.shape)} in its piece, "
                                         f"{want.dtype} {list(want.shape)} in the step")
                values = row_values(piece, {n: encodings[n] for n in names}, self._param_names, {},
                                    self._xor_base, {}, True, pool)
                for name in names:  # segment order is slot order (spec §10.1); the piece may be reused after
                    self._batch_bytes += values[name].nbytes
                    self._batch.add(self._slot_index[name], values[name], None)
                done += len(names)
            if done != len(order):
                raise ValueError(f"the pieces ended after {done} of the row's {len(order)} tensors")
        except Exception as e:
            # The base and the batch hold part of this row: neither can take another step.
            self._failed = ChainError(f"{self.path}: coding step {step} in pieces failed ({type(e).__name__}: "
                                      f"{e}); nothing after step {self.durable_step} is durable. Re-open the chain "
                                      "with ChainWriter.open to continue")
            raise self._failed from e
        self._xor_meta = {name: (ct.dtype, tuple(ct.shape)) for name, ct in captured.tensors.items()}
        self._row_added(captured, entry, encoded)

    def _check_next(self, captured: CapturedStep) -> int:
        """Refuse a step that cannot follow the last one (before any part of its row is made);
        returns the step it follows."""
        step = captured.step
        self._refuse_structure_in_old_chain(captured.optimizer, step)
        xor = self.kind == "state.xor"
        # A state delta may span steps that were not captured (spec §11.3); a gradient delta may not.
        if self._last_step is None or step <= self._last_step or (step != self._last_step + 1 and not xor):
            raise UsageError(
                f"{self.path}: step {step} recorded out of order; the next step is "
                f"{None if self._last_step is None else self._last_step + 1}"
                f"{' or, in a state.xor chain, a later one' if xor and self._last_step is not None else ''}"
            )
        return self._last_step

    def _step_entry(self, captured: CapturedStep, base: int) -> StepEntry:
        xor = self.kind == "state.xor"
        return StepEntry(
            step=captured.step,
            base=base,
            row=self._batch.rows,
            stepped=captured.stepped,
            hyper=None if xor else captured.hyper,
            param_groups=captured.param_groups,
            extra=captured.extra,
            optimizer=captured.optimizer if xor else None,
        )

    def _row_added(self, captured: CapturedStep, entry: StepEntry, encoded: Callable[[], None] | None) -> None:
        """The step's row is in the batch: record its entry, then its anchor or the commit it makes due."""
        step = captured.step
        xor = self.kind == "state.xor"
        self._row_steps.append(entry)
        self._last_step = step
        self._last_extra = captured.extra
        if captured.anchor and captured.anchor_tensors is None and not xor:
            raise UsageError(f"{self.path}: an anchor at step {step} needs anchor_tensors")
        if encoded is not None:
            encoded()
        if captured.anchor:
            tensors = captured.anchor_tensors
            if tensors is None:  # xor: the base holds this step's bits now (the tensors may hold deltas)
                tensors = {n: replace(ct, bits=self._xor_base[n]).to_tensor() for n, ct in captured.tensors.items()}
            self._write_anchor_object(step, tensors, captured.param_groups, captured.extra, captured.optimizer)
            self.commit()
        elif (self._batch.rows >= self.batch_steps or self._batch_bytes >= self.max_batch_bytes
              or (self._batch.rows + 1) * max(1, len(self._slots)) > MAX_COUNTS):  # spec §10.5 bound
            self.commit()

    def _refuse_structure_in_old_chain(self, structure: JSON, step: int) -> None:
        """Records of a chain created as format 1.0 or 1.1 cannot carry an optimizer structure
        (spec §3.1): its readers would refuse them."""
        if structure is not None and minor_version(self.root.format_version) < 2:
            err = UnsupportedStateError(
                f"{self.path}: step {step}: the optimizer's state holds values that are not tensors (or empty "
                f"per-parameter states), which format {self.root.format_version} chains cannot store; this chain "
                "was created by an older ldformat: start a new chain to keep this optimizer's whole state")
            self._failed = err
            raise err

    def _slot(self, name: str, ct: CapturedTensor, encoding: str) -> int:
        j = self._slot_index.get(name)
        if j is None:
            slot = SlotInfo(name=name, dtype=ct.dtype, shape=ct.shape, encoding=encoding)
            try:  # what the writer records, the reader reads: the reader's own check (spec §10.3)
                check_slots((slot,), self.root.schema, self.kind, self.path)
            except CorruptChainError as e:
                raise UnsupportedStateError(f"{e}; a reader would refuse it, so it is not recorded") from None
            j = self._slot_index[name] = len(self._slots)
            self._slots.append(slot)
        elif self._slots[j].shape != ct.shape or self._slots[j].dtype != ct.dtype:
            raise UnsupportedStateError(f"{name} changed shape or dtype during training; format 1.x refuses that")
        return j

    def _state_row(self, captured: CapturedStep, values: dict[str, np.ndarray]) -> None:
        """Fill ``values`` with every slot of a ``state.xor`` row (spec §11.3) and move the
        base on to this step's bits. Slots are checked first (a refused step leaves no part of
        a row behind); a tensor keeps the encoding its slot has in the batch.

        ``captured.scratch``: its bits are staging buffers, which receive the values (no
        copy of the state is needed besides the base); otherwise each value gets its own array.
        """
        tensors = captured.tensors
        encodings, coefs = self._state_slots(captured)
        params = self._param_names
        # A tensor absent at this step is absent in the replayed state too: forget its base
        # (after keeping what the predictions of this row read from the previous state).
        prior = dict(self._xor_base)
        try:
            for name in [n for n in self._xor_base if n not in tensors]:
                del self._xor_base[name]
            values.update(row_values(tensors, encodings, params, coefs, self._xor_base, prior, captured.scratch,
                                     encode_pool(self._encode_threads)))
        except Exception as e:
            # The base has partly moved on to this step: no later step can be coded against it.
            self._failed = ChainError(f"{self.path}: coding step {captured.step} failed ({type(e).__name__}: {e}); "
                                      f"nothing after step {self.durable_step} is durable. Re-open the chain "
                                      "with ChainWriter.open to continue")
            raise self._failed from e
        self._xor_meta = {name: (ct.dtype, tuple(ct.shape)) for name, ct in tensors.items()}

    def _state_slots(self, captured: CapturedStep) -> tuple[dict[str, str], dict[int, np.ndarray]]:
        """Check every tensor of a ``state.xor`` row against its slot and the base, give the new
        ones slots, and return each tensor's encoding in the batch and the Adam coefficients."""
        tensors = captured.tensors
        for name, ct in tensors.items():  # replay applies a slot only to a tensor like it (spec §11.6)
            meta = self._xor_meta.get(name)
            if meta is not None and meta != (ct.dtype, tuple(ct.shape)):
                raise UnsupportedStateError(
                    f"{self.path}: step {captured.step}: {name} changed from {meta[0]} {list(meta[1])} to {ct.dtype} "
                    f"{list(ct.shape)} during training; format 1.x refuses that: start a new chain")
        params = self._param_names
        coefs: dict[int, np.ndarray] = {}
        # Adam prediction (format 1.6 on) models one optimizer step: a row spanning several is coded by `sub`.
        spans_one_step = self._last_step is None or captured.step == self._last_step + 1
        if self._state_encoding == "sub" and self.predict_state and spans_one_step:
            groups = captured.hyper if captured.stepped and captured.hyper is not None else captured.param_groups
            coefs = state_coefficients(self.optimizer, tensors, groups)
        wanted = wanted_encodings(tensors, params, self._state_encoding, coefs)
        if self._batch.rows == 0 and any(e in PREDICTED for e in wanted.values()):
            # A batch of Adam-predicted rows: lz4 stores them at half zstd's CPU for 10% more bytes.
            self._batch.value_codecs = DIFFERENCE_VALUE_CODECS
        encodings: dict[str, str] = {}
        for name, ct in tensors.items():
            encodings[name] = self._slots[self._slot(name, ct, wanted[name])].encoding
        for i in sorted({predicted_param(n, e, params) for n, e in encodings.items() if e in PREDICTED}):
            coef = coefs.get(i, NO_PREDICTION)
            self._slot(f"{PREDICT}{i}", CapturedTensor(bits=coef, dtype="float32", shape=(COEFFICIENTS,)), "dense")
        return encodings, coefs

    def _reset_xor_base_from_live(self) -> None:
        if self.kind == "state.xor":
            live = self.live_state_tensors()
            self._xor_base = {n: tensor_bits(t.to("cpu", copy=True)) for n, t in live.items()}
            self._xor_meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in live.items()}

    def _set_xor_base(self, stored: dict[str, torch.Tensor]) -> None:
        """The XOR base from the chain's own tensors (by their stored names) at its latest step."""
        state = {n: t for n, t in stored.items() if n.startswith(("model/", "optimizer/"))}
        self._xor_base = {n: tensor_bits(t.detach().clone()) for n, t in state.items()}
        self._xor_meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}

    # -- anchors and commits -------------------------------------------------------------
    def write_anchor(self, step: int) -> int | None:
        """Write a full anchor of the live state at ``step`` (the last recorded step) and commit."""
        self._check_usable()
        if step != self._last_step:
            raise UsageError(
                f"{self.path}: write_anchor({step}): the live state is at step {self._last_step}; "
                "anchors can only be written for the last recorded step"
            )
        groups = encode_param_groups(self.optimizer, with_params=True)
        tensors, structure = self.snapshot_anchor()
        self._refuse_structure_in_old_chain(structure, step)
        self._write_anchor_object(step, tensors, groups, self._last_extra, structure)
        return self.commit()

    def _write_anchor_object(self, step: int, tensors: dict[str, torch.Tensor], param_groups: Any, extra: Any,
                             optimizer: JSON) -> None:
        path = anchor_object_path(step)
        anchor = anchor_parts(tensors, step)  # streamed: the object is never joined in memory
        checksums: list[str] = []  # computed while the object is written
        self._io(path, lambda: checksums.append(write_anchor_parts(self.store, path, anchor)))
        self._written.append(path)
        crc32c = checksums[0]
        self._pending_anchors.append(
            AnchorEntry(
                step=step,
                object=ObjectRef(path=path, size=anchor.size, crc32c=crc32c),
                param_groups=param_groups,
                extra=extra,
                optimizer=optimizer,
            )
        )

    def _flush_batch(self) -> None:
        if not self._batch.rows:
            return
        first, last = self._row_steps[0].step, self._row_steps[-1].step
        group = batch_group_path(first, last)
        objects = self._batch.finish(len(self._slots), {"kind": self.kind, "first": first, "last": last})
        refs = []
        for key, data in sorted(objects.items()):
            path = f"{group}/{key}"
            self._io(path, self.store.write, path, data)
            self._written.append(path)
            refs.append(ObjectRef(path=key, size=len(data), crc32c=object_checksum(path, data)))
        self._pending_deltas.append(
            DeltaEntry(path=group, objects=tuple(refs), slots=tuple(self._slots), rows=self._batch.rows,
                       steps=tuple(self._row_steps))
        )
        self._batch, self._row_steps, self._slots, self._slot_index = self._new_batch(), [], [], {}
        self._batch_bytes = 0

    @property
    def encode_threads(self) -> int:
        """Threads that compress a batch's value chunks alongside the writer (blosc releases the
        GIL); 1: the writer's thread alone. The objects are the same bytes either way. Default:
        half the cores, at most 8, and 1 on 3 cores or fewer. A change applies from the next
        batch (at once if the pending batch has no row yet)."""
        return self._encode_threads

    @encode_threads.setter
    def encode_threads(self, threads: int) -> None:
        self._encode_threads = check_encode_threads(threads)
        if self._batch.rows == 0:
            self._batch = self._new_batch()

    def _new_batch(self) -> BatchEncoder:
        return BatchEncoder(encode_pool(self._encode_threads))

    def commit(self) -> int | None:
        """Make everything recorded so far durable; returns the last durable step."""
        self._check_usable()
        self._flush_batch()
        if not self._pending_anchors and not self._pending_deltas:
            return self.durable_step
        started = time.perf_counter()
        self._io(f"{len(self._written)} new objects ({', '.join(self._written[:3])}...)", self.store.sync,
                 self._written)
        creating = self._pending_root is not None
        self._io("the commit record", lambda: commit_record(
            self.store, self.path, self._state, self._lock, type="append", reason="create" if creating else "append",
            anchors=self._pending_anchors, deltas=self._pending_deltas), outcome_unknown=True)
        if self._pending_root is not None:
            assert self._lock is not None
            self._io(ROOT_FILE, self._lock.check)  # a creation taken over meanwhile creates no root
            self._io(ROOT_FILE, create_root, self.store, self._pending_root, self.path)
            self._pending_root = None
        self.commits += 1
        self._pending_anchors, self._pending_deltas, self._written = [], [], []
        if self.max_bytes is not None and self._lock is not None and self._state.referenced_bytes() > self.max_bytes:
            self._keep_budget(self._lock, self.max_bytes)
        if self._snapshot_due():
            self.write_snapshot()
        self.last_commit_seconds = time.perf_counter() - started
        return self.durable_step

    def _snapshot_due(self) -> bool:
        policy, st = self.snapshot_policy, self._state
        if policy is None or self._lock is None or st.tail_records < policy.min_records:
            return False
        if st.tail_bytes < policy.ratio * st.start_bytes:
            return False
        if st.tail_records < policy.max_tail_records and st.tail_bytes < policy.min_bytes:
            return False
        # The records' sizes bound an inline snapshot's: it restates their entries without their
        # headers. A segmented one cuts its new entries into segments.
        if not self._segmented and st.start_bytes + st.tail_bytes > policy.max_bytes:
            if not self._snapshot_too_large_warned:
                self._snapshot_too_large_warned = True
                log.warning("%s: a snapshot of this chain would exceed %d bytes; no more snapshots are written, "
                            "so opening it reads the %d records since the newest one (compact the chain with "
                            "keep_last to shorten it)", self.path, policy.max_bytes, st.tail_records)
            return False
        return True

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
        self.commit()  # nothing may be pending: a snapshot states committed content only
        lock = self._lock
        state = self._state
        if lock is None or state.latest_step is None or state.tail_records == 0:
            return  # the newest record is a snapshot already
        previous_start = state.first_seq
        self._io("the snapshot record", lambda: commit_snapshot(
            self.store, self.path, state, lock, reason="snapshot", segmented=self._segmented))
        self.snapshots += 1
        self._io("superseded records", delete_superseded, self.store, self.path, lock,
                 range(self._superseded_from, previous_start), state)
        self._superseded_from = max(self._superseded_from, previous_start)

    def keep_budget(self) -> None:
        """Run live retention now (spec §17), after committing what is pending.

        A rank chain of a sharded chain keeps everything from the newest anchor at or below the
        newest global commit; when that commit lags the rank's own commits, a pass after it has
        caught up drops what the earlier passes had to keep.
        """
        self.commit()
        if self.max_bytes is not None and self._lock is not None and self._state.referenced_bytes() > self.max_bytes:
            self._keep_budget(self._lock, self.max_bytes)

    def _keep_budget(self, lock: WriterLock, max_bytes: int) -> None:
        """Live retention (spec §17): drop every step before the newest anchor, as
        ``compact(keep_last=...)`` would, so that the chain keeps within ``max_bytes``.

        Runs right after a commit, when no uncommitted object exists, under this writer's
        lock; it writes no anchor (the kept steps start at one), only a snapshot record.
        """
        from .maintenance import retain_from_newest_anchor  # compact builds on this module

        try:
            at_most = None
            if self.retain_at_most is not None:
                at_most = self.retain_at_most()
                if at_most is None:
                    return  # nothing committed in the sharded chain yet: keep everything
            dropped, self._state = retain_from_newest_anchor(self.path, self.store, lock, at_most)
        except ChainError as e:
            self._failed = e
            raise
        self.retained.extend(dropped)
        self._superseded_from = max(self._superseded_from, self._state.first_seq)  # compaction removed those
        if self._state.referenced_bytes() > max_bytes and not self._over_budget_warned:
            self._over_budget_warned = True
            log.warning("%s: the chain holds %d bytes from its newest anchor on, more than max_bytes=%d; it is "
                        "kept whole until the next anchor (raise max_bytes or anchor more often)",
                        self.path, self._state.referenced_bytes(), max_bytes)

    @property
    def durable_step(self) -> int | None:
        """The newest step that is committed (None before the first commit)."""
        return self._state.latest_step

    @property
    def last_step(self) -> int | None:
        """The newest recorded step (committed or not)."""
        return self._last_step

    def _io(self, what: str, fn: Callable[..., object], *args: Any, outcome_unknown: bool = False) -> None:
        """Run a storage call; a failure poisons the writer with a clear error. ``outcome_unknown``:
        the call creates a commit record, which may exist although the call failed (spec §7.4 step 5)."""
        if outcome_unknown:
            durable = ("the chain is valid either without or with this commit's steps (the next open decides); "
                       f"nothing after {'its creation' if self.durable_step is None else f'step {self.durable_step}'}"
                       " is known to be durable")
        else:
            durable = "no step is durable yet" if self.durable_step is None else (
                f"nothing after step {self.durable_step} is durable and the chain is valid there")
        try:
            fn(*args)
        except WriterIOError as e:
            self._raise_if_superseded()
            self._raise_io(what, e, durable)
        except ChainError as e:
            self._failed = e
            raise
        except OSError as e:
            self._raise_if_superseded()
            self._raise_io(what, e, durable)

    def _raise_if_superseded(self) -> None:
        """After a failed storage call: if another process took the lock over meanwhile (and,
        say, removed this writer's uncommitted objects as garbage), that is the error to report."""
        if self._lock is None:
            return
        try:
            self._lock.raise_if_lost()
        except LockLostError as lost:
            self._failed = lost
            raise lost from None

    def _raise_io(self, what: str, e: OSError, durable: str) -> NoReturn:
        if isinstance(e, WriterIOError):  # already names the object (the commit path's I/O errors)
            err = WriterIOError(f"{e}; {durable}. Fix the cause and re-open the chain with ChainWriter.open "
                                "to continue")
            err.errno = e.errno
            self._failed = err
            raise err from None
        err = WriterIOError(
            f"{self.path}/{what}: {e.strerror or e} (errno {e.errno}); {durable}. Fix the cause and "
            "re-open the chain with ChainWriter.open to continue"
        )
        err.errno = e.errno
        self._failed = err
        raise err from None

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._lock is None:
            raise UsageError(f"{self.path}: the writer is closed")

    def close(self) -> int | None:
        """Commit what is pending, release the lock and remove the optimizer hook."""
        try:
            if self._lock is not None and self._failed is None:
                self.commit()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        return self.durable_step

    def abort(self) -> None:
        """Drop what is not committed and release the lock."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> ChainWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _unfinished_creation_leftovers(store: Store) -> list[str] | None:
    """The objects of a creation that never created the root, or None if ``store`` holds more.

    Creation writes the anchor of step 0, record 1 and last the root (spec §7.4), so a
    directory without a root whose log holds at most record 1, with at most one anchor and no
    batch, is an unfinished creation. Anything else is refused: it may be someone's data.
    """
    paths = store.list("")
    rest = [p for p in paths if not p.startswith((".tmp-", "lock/"))]
    records = [p for p in rest if p.startswith("log/") and not p.split("/")[-1].startswith(".tmp-")]
    anchors = [p for p in rest if p.startswith("anchors/")]
    other = [p for p in rest if not p.startswith(("log/", "anchors/"))]
    if other or len(anchors) > 1 or records not in ([], ["log/000000000001.json"]):
        return None
    return rest


def _check_empty_or_unfinished(store: Store, where: str) -> None:
    if _unfinished_creation_leftovers(store) is None:
        _refuse_not_empty(store, where)


def _refuse_not_empty(store: Store, where: str) -> NoReturn:
    """Raise for a location that holds more than an unfinished creation.

    Listed first, the root checked after: a creator that won a concurrent race creates the
    root before anything else a listing could show, so a loser sees it here and is told
    that a chain exists, not that the location is not empty.
    """
    if store.exists(ROOT_FILE):
        raise ChainExistsError(f"{where}: another process created a chain here concurrently; use "
                               "ChainWriter.open to append")
    if store.exists(SHARDED_ROOT_FILE):
        raise UsageError(
            f"{where}: holds a sharded chain (spec §20), written by a job whose model was sharded across ranks; "
            "this run's model is not sharded that way (another world size, or a plain model), so its layout "
            "differs and it cannot append there. Resume from that chain (ldformat.resume reshards it) and "
            "checkpoint this run to a new path")
    raise UsageError(f"{where}: directory (or prefix) is not empty; create a chain in a new or empty one")


def _remove_unfinished_creation(store: Store, where: str, lock: WriterLock) -> None:
    """Holding the lock, remove what a crashed creation left (re-checked under the lock)."""
    leftovers = _unfinished_creation_leftovers(store)
    if leftovers is None or store.exists(ROOT_FILE):
        _refuse_not_empty(store, where)
    lock.check()
    for p in leftovers + [p for p in store.list("") if p.startswith(".tmp-")]:
        store.delete(p)


def _remove_creation(store: Store, owned_dir: Path | None) -> None:
    """Remove the directory a creation that never took the lock made, if it is still empty."""
    try:
        if owned_dir is not None:
            owned_dir.rmdir()
    except OSError:
        pass


def _undo_creation(store: Store, owned_dir: Path | None, lock: WriterLock, written: list[str]) -> None:
    """Undo a creation that failed before its root existed, deleting only what it wrote itself.

    Nothing is deleted once another process took the lock over (it may be creating the chain
    now), and never a name another process could reuse: the objects written have fresh names;
    record 1, if it exists, stays as an unfinished creation that the next creator reclaims
    (spec §7.4). The lock's own generations go too when no other holder checks them (this
    creation took over nobody), so that a refused creation leaves nothing behind.
    """
    try:
        if store.exists(ROOT_FILE):
            lock.release()
            return
        lock.check()
    except (LdformatError, OSError):
        return  # taken over, or unreachable: touch nothing, keep the lock as it is
    try:
        for p in written:
            store.delete(p)
    except OSError:
        pass  # best effort: what is left is an unfinished creation, which create() reclaims
    mine = lock.generation
    if lock.release() and lock.owner.takeover is False and lock.previous is None:
        try:
            for g in (mine, mine + 1):  # ours and the release: a taker starts again from nothing
                store.delete(lock_path(g))
        except OSError:
            pass
    _remove_creation(store, owned_dir)


def refuse_tensor_hyperparameters(optimizer: torch.optim.Optimizer, kind: str) -> None:
    """Gradient kinds replay ``torch.optim``, whose checks take Python numbers as hyperparameters."""
    for i, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k != "params" and isinstance(v, torch.Tensor):
                raise UnsupportedStateError(
                    f"param group {i} has a tensor-valued {k!r}; kind {kind!r} replays torch.optim, whose "
                    "checks take a Python number there: use a float, or mode='xor' (kind='state.xor'), "
                    "which stores tensor hyperparameters as they are")


def build_schema(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, kind: str, compressor: TopK | None
) -> dict[str, Any]:
    class_name, replayable = optimizer_class_name(optimizer)
    if kind.startswith("grad.") and not replayable:
        raise UnsupportedStateError(
            f"kind {kind!r} replays the optimizer, and {class_name} is not a torch.optim class; "
            "use mode='xor' (Checkpointer) or kind='state.xor' (ChainWriter) for other optimizers"
        )
    if kind.startswith("grad.") and isinstance(optimizer, torch.optim.LBFGS):
        raise UnsupportedStateError("LBFGS needs a closure to step, which replay cannot re-run; "
                                    "use mode='xor' (Checkpointer) or kind='state.xor' (ChainWriter)")
    encode_param_groups(optimizer, with_params=False)  # refuses hyperparameters JSON cannot hold, early
    if kind.startswith("grad."):
        refuse_tensor_hyperparameters(optimizer, kind)
    if not replayable:  # torch.optim classes keep storable state; others are probed before training
        probe_unstorable_state(optimizer)
    return {
        "model": model_schema(model),
        "optimizer": {
            "class": class_name,
            "params": optimizer_param_names(model, optimizer),
            "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        },
        "compressor": None
        if compressor is None
        else {"name": "topk", "ratio": compressor.ratio, "error_feedback": compressor.error_feedback},
    }
