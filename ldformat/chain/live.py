"""What a chain writer reads from the live training objects (spec §8 "State and stored names",
§8.2 "Optimizer structure", §10.4 "Step entries").

For a gradient kind, a step pre-hook on the optimizer copies the gradients and the
hyperparameters the optimizer is about to use (spec §11.5 "Gradient replay (`grad.topk`,
`grad.dense`)"): a loop that sets ``lr`` by hand, zeroes gradients early or runs an optimizer
that modifies ``grad`` in place still records what the step consumed; ``optimizer.step(closure)``
is captured once the closure ran. :meth:`LiveCapture.step` then turns what was captured, the
buffers and the param groups after the step into a :class:`~ldformat.chain.captured.CapturedStep`.
For ``state.xor`` the step holds copies of the whole state instead. The optimizer's param
groups are fixed at creation (the schema): a changed group is refused.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import LdformatError, UnsupportedStateError, UsageError
from ..format.jsonvalue import JSON, encode
from ..format.manifest import Kind, RootMetadata
from ..format.optstate import live_optimizer_state
from ..format.state import encode_param_groups, live_model_tensors, optimizer_params
from ..format.topk import TopK
from .anchors import anchor_copy
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
from .guard import WriterGuard
from .opening import refuse_tensor_hyperparameters


class LiveCapture:
    """The live model and optimizer, what the step pre-hook captured from them since the last
    recorded step, and the hook itself."""

    def __init__(self, root: RootMetadata, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compressor: TopK | None, guard: WriterGuard) -> None:
        self._root = root
        self._kind = root.kind
        self._path = path
        self._model = model
        self._optimizer = optimizer
        self._compressor = compressor
        self._guard = guard
        self._params = optimizer_params(optimizer)
        self._param_names: list[str] = root.schema["optimizer"]["params"]
        self._buffers = [e["name"] for e in root.schema["model"] if e["role"] == "buffer" and e["alias_of"] is None]
        self._captured: tuple[Any, dict[str, CapturedTensor]] | None = None  # (hyperparameters, gradients)
        self._since_record = 0  # optimizer steps since the last recorded step
        self._seen_generation = -1
        self._hook: RemovableHandle | None = None

    def add_hook(self) -> None:
        self._hook = self._optimizer.register_step_pre_hook(self._pre_hook)

    def remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def check_param_groups(self) -> None:
        """Refuse ``add_param_group`` or swapped parameters: the schema is fixed at creation."""
        live = [p for g in self._optimizer.param_groups for p in g["params"]]
        sizes = [len(g["params"]) for g in self._optimizer.param_groups]
        if sizes != self._root.schema["optimizer"]["group_sizes"] or any(
            a is not b for a, b in zip(live, self._params, strict=False)
        ):
            raise UnsupportedStateError(
                f"{self._path}: the optimizer's param groups changed since the chain was created "
                "(add_param_group?); format 1.x fixes them at creation: start a new chain"
            )
        if self._kind.startswith("grad."):
            refuse_tensor_hyperparameters(self._optimizer, self._kind)

    # -- the step pre-hook ---------------------------------------------------------------
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> StepArgs | None:
        if self._guard.failed is not None or nested_step(optimizer):
            return None
        self._since_record += 1
        if self._kind.startswith("grad."):
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
            self._captured = (encode_param_groups(optimizer, with_params=False), self.gradients())
        except LdformatError as e:
            self._guard.failed = e

    # -- copies of the live state --------------------------------------------------------
    def gradients(self) -> dict[str, CapturedTensor]:
        """The gradients the optimizer is about to consume, as ``grad/<index>`` tensors (see
        :meth:`ldformat.ChainWriter.capture_gradients`)."""
        kind = cast(Kind, self._kind)  # RootMetadata checked it
        topk = self._compressor if kind == "grad.topk" else None
        if topk is not None and any(p.grad is not None for p in self._params):
            if topk.generation == self._seen_generation:
                raise UsageError(
                    "optimizer.step() ran without TopK.compress_(model) before it; a grad.topk "
                    "chain records the compressed gradient, so compress every step"
                )
            self._seen_generation = topk.generation
        return capture_gradients(self._params, self._param_names, kind, topk)

    def buffers(self) -> dict[str, CapturedTensor]:
        """Copies of the model's buffers (``model/<key>``): the optimizer never touches them."""
        return capture_tensors(live_buffers(self._model, self._buffers))

    def state(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """Every state tensor under its stored name (live objects, not copies) and the
        optimizer structure (spec §8.2; encoded, so later changes do not reach it)."""
        tensors = live_model_tensors(self._model, self._root.schema["model"])
        optimizer_tensors, structure = live_optimizer_state(self._optimizer)
        tensors.update(optimizer_tensors)
        return tensors, structure

    def anchor(self) -> tuple[dict[str, torch.Tensor], JSON]:
        """CPU copies of the whole live state, plus top-k residuals, for an anchor; and the
        optimizer structure (spec §8.2)."""
        live, structure = self.state()
        return anchor_copy(live, self._compressor), structure

    # -- one recorded step ---------------------------------------------------------------
    def step(self, step: int, extra: dict[str, Any] | None, last_step: int | None,
             anchor_every: int | None) -> CapturedStep:
        """What :meth:`ldformat.ChainWriter.record_step` records for ``step``: what the hook
        captured (gradient kinds) or the whole state (``state.xor``), and an anchor when due."""
        try:
            self.check_param_groups()
        except UnsupportedStateError as e:
            self._guard.failed = e
            raise
        grad = self._kind.startswith("grad.")
        # A state.xor chain may skip steps (spec §11.3): then one optimizer step per step number.
        steps = 1 if grad or last_step is None else max(1, step - last_step)
        if self._since_record > steps:
            raise UsageError(
                f"{self._path}: optimizer.step() ran {self._since_record} times since the "
                "last record_step; call record_step after every optimizer step"
                f"{' (or record the step number it has reached)' if not grad else ''}"
            )
        hyper, grads = self._captured if self._captured is not None else (None, {})
        anchor = anchor_every is not None and step % anchor_every == 0
        tensors, anchor_tensors, structure = self._tensors(grads, anchor)
        captured = CapturedStep(
            step=step,
            stepped=self._captured is not None,
            hyper=hyper,
            param_groups=encode_param_groups(self._optimizer, with_params=True),
            extra=encode(extra or {}, "extra"),
            tensors=tensors,
            anchor_tensors=anchor_tensors,
            anchor=anchor,
            optimizer=structure,
            scratch=True,  # fresh host copies (capture_tensors, capture_gradients)
        )
        self._captured = None
        self._since_record = 0
        return captured

    def _tensors(self, grads: dict[str, CapturedTensor], anchor: bool
                 ) -> tuple[dict[str, CapturedTensor], dict[str, torch.Tensor] | None, JSON]:
        """A step's tensors, its anchor's (gradient kinds) and the optimizer structure."""
        if self._kind.startswith("grad."):
            tensors = {**grads, **self.buffers()}
            return (tensors, *self.anchor()) if anchor else (tensors, None, None)
        # state.xor: the hyperparameters are what Adam prediction uses (spec §11.3); the step entry's are null
        live, structure = self.state()
        return capture_tensors(live), None, structure
