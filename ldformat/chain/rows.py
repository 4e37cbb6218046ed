"""A chain writer's rows: each captured step becomes one row of the pending batch and its step
entry, coded by the chain's kind (spec §10.4 "Step entries", §11 "Delta kinds and replay").

* ``grad.topk`` / ``grad.dense`` (spec §11.1, §11.2): the captured gradients and buffers go
  into the row as they are, sparse or dense.
* ``state.xor`` (spec §11.3 "`state.xor`"): every state tensor is coded against the *base*,
  the bits of the state last recorded (what replay produces at the previous step), by XOR
  before format 1.6 and by difference from 1.6 on; the second moment and parameter of an Adam
  parameter by difference from a prediction (spec §11.3.1), with its coefficients in a
  ``predict/<i>`` slot. :mod:`ldformat.chain.state_delta` computes the values.

Every check of a step runs before any part of its row is made, so a refused step leaves no
row behind. A failure after that (the batch or the base holds part of a row) poisons the
writer (:meth:`~ldformat.chain.guard.WriterGuard.broken`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedStateError, UsageError
from ..format.delta import DIFFERENCE_VALUE_CODECS, PREDICTED, EncodePool, encode_pool, tensor_bits
from ..format.dtypes import dtype_name
from ..format.jsonvalue import JSON
from ..format.manifest import Encoding, RootMetadata, StepEntry, minor_version, state_delta_encoding
from ..format.predict import COEFFICIENTS, PREDICT, predicted_param
from .batches import PendingBatch
from .captured import CapturedStep, CapturedTensor
from .guard import WriterGuard
from .state_delta import NO_PREDICTION, row_values, wanted_encodings

#: Fits the Adam coefficients of a row (``state_delta.coefficients(optimizer, tensors, groups)``).
Coefficients = Callable[[torch.optim.Optimizer, Mapping[str, CapturedTensor], JSON], dict[int, np.ndarray]]
#: Reads a row's tensors piece by piece: ``read(order)`` (see :meth:`RowBuilder.add_in_pieces`).
PieceReader = Callable[[list[str]], Iterable[Mapping[str, CapturedTensor]]]


class RowBuilder:
    """Makes the row and step entry of each recorded step; keeps the ``state.xor`` base."""

    def __init__(self, root: RootMetadata, path: str, optimizer: torch.optim.Optimizer, batch: PendingBatch,
                 guard: WriterGuard, coefficients: Coefficients) -> None:
        self._root = root
        self._kind = root.kind
        self._xor = root.kind == "state.xor"
        self._path = path
        self._optimizer = optimizer
        self._param_names: list[str] = root.schema["optimizer"]["params"]
        self._batch = batch
        self._guard = guard
        self._coefficients = coefficients
        self.last_step: int | None = guard.state.latest_step  # the newest step recorded, committed or not
        self.last_extra: Any = {}
        self.xor_base: dict[str, np.ndarray] = {}
        self.xor_meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # (dtype, shape) of each base
        #: How state.xor slots are coded: ``sub`` (differences) from format 1.6 on, else ``xor``.
        self.state_encoding: Encoding = state_delta_encoding(root.format_version)
        #: Code Adam's second moment and parameter as differences from a prediction (1.6 chains).
        self.predict_state = True

    # -- checks before any part of a row -------------------------------------------------
    def check_next(self, captured: CapturedStep) -> int:
        """Refuse a step that cannot follow the last one (before any part of its row is made);
        returns the step it follows."""
        step = captured.step
        self.refuse_structure_in_old_chain(captured.optimizer, step)
        xor = self._xor
        # A state delta may span steps that were not captured (spec §11.3); a gradient delta may not.
        if self.last_step is None or step <= self.last_step or (step != self.last_step + 1 and not xor):
            raise UsageError(
                f"{self._path}: step {step} recorded out of order; the next step is "
                f"{None if self.last_step is None else self.last_step + 1}"
                f"{' or, in a state.xor chain, a later one' if xor and self.last_step is not None else ''}"
            )
        return self.last_step

    def refuse_structure_in_old_chain(self, structure: JSON, step: int) -> None:
        """Records of a chain created as format 1.0 or 1.1 cannot carry an optimizer structure
        (spec §3.1): its readers would refuse them."""
        if structure is not None and minor_version(self._root.format_version) < 2:
            raise self._guard.fail(UnsupportedStateError(
                f"{self._path}: step {step}: the optimizer's state holds values that are not tensors (or empty "
                f"per-parameter states), which format {self._root.format_version} chains cannot store; this chain "
                "was created by an older ldformat: start a new chain to keep this optimizer's whole state"))

    # -- one row -------------------------------------------------------------------------
    def add(self, captured: CapturedStep) -> StepEntry:
        """Check ``captured`` and add its row to the batch; returns its step entry."""
        base = self.check_next(captured)
        values: dict[str, np.ndarray] = {}
        slots: list[tuple[int, str, CapturedTensor | None]]
        if self._xor:
            self._state_row(captured, values)  # checks and codes every tensor of the row
            slots = [(self._batch.slot_index[name], name, None) for name in values]
        else:
            # Check every tensor before encoding any: a refused step must leave no part of a row behind.
            slots = [(self._batch.slot(name, ct, "dense" if ct.indices is None else "sparse"), name, ct)
                     for name, ct in captured.tensors.items()]
        entry = self._step_entry(captured, base)
        try:
            self._batch.start_row()
            for j, name, ct in sorted(slots, key=lambda s: s[0]):  # segment order is slot order (spec §10.1)
                # The encoder consumes or copies what it is given, so reused buffers are fine.
                if ct is None:  # state.xor
                    self._batch.add(j, values[name], None)
                else:
                    self._batch.add(j, ct.bits, ct.indices)
        except Exception as e:
            # Part of this row is encoded already: the pending batch can no longer be committed.
            raise self._guard.broken(f"encoding step {captured.step}", e) from e
        return entry

    def add_in_pieces(self, captured: CapturedStep, read: PieceReader) -> StepEntry:
        """Add a ``state.xor`` row whose tensors ``read`` yields piece by piece, in slot order
        (see :meth:`ldformat.ChainWriter.append_in_pieces`); returns its step entry."""
        if not self._xor or self.predict_state:
            raise UsageError(f"{self._path}: a row in pieces needs a state.xor chain with predict_state off")
        base = self.check_next(captured)
        encodings, _ = self._state_slots(captured)
        order = sorted(captured.tensors, key=self._batch.slot_index.__getitem__)
        entry = self._step_entry(captured, base)
        done = 0
        try:
            for name in [n for n in self.xor_base if n not in captured.tensors]:
                del self.xor_base[name]
            self._batch.start_row()
            pool = encode_pool(self._batch.encode_threads)
            for piece in read(order):
                done = self._add_piece(captured, piece, order, done, encodings, pool)
            if done != len(order):
                raise ValueError(f"the pieces ended after {done} of the row's {len(order)} tensors")
        except Exception as e:
            # The base and the batch hold part of this row: neither can take another step.
            raise self._guard.broken(f"coding step {captured.step} in pieces", e) from e
        self.xor_meta = {name: (ct.dtype, tuple(ct.shape)) for name, ct in captured.tensors.items()}
        return entry

    def _add_piece(self, captured: CapturedStep, piece: Mapping[str, CapturedTensor], order: list[str], done: int,
                   encodings: dict[str, str], pool: EncodePool | None) -> int:
        """Code one piece (the next tensors of ``order``) into the row; returns the tensors done."""
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
                            self.xor_base, {}, True, pool)
        for name in names:  # segment order is slot order (spec §10.1); the piece may be reused after
            self._batch.add(self._batch.slot_index[name], values[name], None)
        return done + len(names)

    def _step_entry(self, captured: CapturedStep, base: int) -> StepEntry:
        return StepEntry(
            step=captured.step,
            base=base,
            row=self._batch.rows,
            stepped=captured.stepped,
            hyper=None if self._xor else captured.hyper,
            param_groups=captured.param_groups,
            extra=captured.extra,
            optimizer=captured.optimizer if self._xor else None,
        )

    def row_added(self, captured: CapturedStep, entry: StepEntry) -> None:
        """The step's row is in the batch: its entry joins the batch, and it is the last step."""
        self._batch.steps.append(entry)
        self.last_step = captured.step
        self.last_extra = captured.extra

    # -- state.xor -----------------------------------------------------------------------
    def _state_row(self, captured: CapturedStep, values: dict[str, np.ndarray]) -> None:
        """Fill ``values`` with every slot of a ``state.xor`` row (spec §11.3) and move the
        base on to this step's bits. Slots are checked first (a refused step leaves no part of
        a row behind); a tensor keeps the encoding its slot has in the batch.

        ``captured.scratch``: its bits are staging buffers, which receive the values (no
        copy of the state is needed besides the base); otherwise each value gets its own array.
        """
        tensors = captured.tensors
        encodings, coefs = self._state_slots(captured)
        # A tensor absent at this step is absent in the replayed state too: forget its base
        # (after keeping what the predictions of this row read from the previous state).
        prior = dict(self.xor_base)
        try:
            for name in [n for n in self.xor_base if n not in tensors]:
                del self.xor_base[name]
            values.update(row_values(tensors, encodings, self._param_names, coefs, self.xor_base, prior,
                                     captured.scratch, encode_pool(self._batch.encode_threads)))
        except Exception as e:
            # The base has partly moved on to this step: no later step can be coded against it.
            raise self._guard.broken(f"coding step {captured.step}", e) from e
        self.xor_meta = {name: (ct.dtype, tuple(ct.shape)) for name, ct in tensors.items()}

    def _state_slots(self, captured: CapturedStep) -> tuple[dict[str, str], dict[int, np.ndarray]]:
        """Check every tensor of a ``state.xor`` row against its slot and the base, give the new
        ones slots, and return each tensor's encoding in the batch and the Adam coefficients."""
        tensors = captured.tensors
        for name, ct in tensors.items():  # replay applies a slot only to a tensor like it (spec §11.6)
            meta = self.xor_meta.get(name)
            if meta is not None and meta != (ct.dtype, tuple(ct.shape)):
                raise UnsupportedStateError(
                    f"{self._path}: step {captured.step}: {name} changed from {meta[0]} {list(meta[1])} to "
                    f"{ct.dtype} {list(ct.shape)} during training; format 1.x refuses that: start a new chain")
        params = self._param_names
        coefs = self._adam_coefficients(captured)
        wanted = wanted_encodings(tensors, params, self.state_encoding, coefs)
        if self._batch.rows == 0 and any(e in PREDICTED for e in wanted.values()):
            # A batch of Adam-predicted rows: lz4 stores them at half zstd's CPU for 10% more bytes.
            self._batch.encoder.value_codecs = DIFFERENCE_VALUE_CODECS
        encodings: dict[str, str] = {}
        for name, ct in tensors.items():
            encodings[name] = self._batch.slots[self._batch.slot(name, ct, wanted[name])].encoding
        for i in sorted({predicted_param(n, e, params) for n, e in encodings.items() if e in PREDICTED}):
            coef = coefs.get(i, NO_PREDICTION)
            self._batch.slot(f"{PREDICT}{i}", CapturedTensor(bits=coef, dtype="float32", shape=(COEFFICIENTS,)),
                             "dense")
        return encodings, coefs

    def _adam_coefficients(self, captured: CapturedStep) -> dict[int, np.ndarray]:
        """The Adam prediction's coefficients of the row (spec §11.3.1); none when it is off.
        The prediction models one optimizer step: a row spanning several is coded by ``sub``."""
        spans_one_step = self.last_step is None or captured.step == self.last_step + 1
        if self.state_encoding != "sub" or not self.predict_state or not spans_one_step:
            return {}
        groups = captured.hyper if captured.stepped and captured.hyper is not None else captured.param_groups
        return self._coefficients(self._optimizer, captured.tensors, groups)

    def reset_base(self, live: Mapping[str, torch.Tensor]) -> None:
        """The base from the live state tensors (by their stored names)."""
        self.xor_base = {n: tensor_bits(t.to("cpu", copy=True)) for n, t in live.items()}
        self.xor_meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in live.items()}

    def set_base(self, stored: Mapping[str, torch.Tensor]) -> None:
        """The base from the chain's own tensors (by their stored names) at its latest step."""
        state = {n: t for n, t in stored.items() if n.startswith(("model/", "optimizer/"))}
        self.xor_base = {n: tensor_bits(t.detach().clone()) for n, t in state.items()}
        self.xor_meta = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()}

    def base_tensors(self, captured: CapturedStep) -> dict[str, torch.Tensor]:
        """The state at the step just added, from the base (which holds its bits now; the
        captured tensors may hold the row's values)."""
        return {n: replace(ct, bits=self.xor_base[n]).to_tensor() for n, ct in captured.tensors.items()}
