"""``lowdiff+``: the CPU replica of the training state (docs/capture-runtime.md "`lowdiff+`: the CPU replica").

The background writer applies every captured step to a :class:`~ldformat.format.replay.Replayer`
over a CPU copy of the state before it writes the step, so the replica is always the
chain's own replay of the last step written. Anchors are the replica's tensors, and
``Checkpointer.recover`` loads them into the live objects without reading storage.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from ..chain.captured import CapturedStep
from ..chain.writer import ChainWriter
from ..format.manifest import SlotInfo, StepEntry
from ..format.replay import Replayer
from ..format.state import encode_param_groups


class Replica:
    """The replica, seeded from the live state the writer sees (without top-k residuals)."""

    def __init__(self, writer: ChainWriter, optimizer: torch.optim.Optimizer) -> None:
        self._root = writer.root
        self._where = writer.path
        snapshot, structure = writer.snapshot_anchor()
        tensors = {n: t.clone() for n, t in snapshot.items() if not n.startswith("compressor/")}
        self._replayer = Replayer(self._root, tensors, encode_param_groups(optimizer, with_params=True), {},
                                  optimizer=structure)

    def apply(self, captured: CapturedStep) -> CapturedStep:
        """Step the replica with ``captured``; at an anchor step the anchor becomes the replica's state.

        Returns ``captured``, with ``anchor_tensors`` filled in at an anchor step that has
        none (an anchor that has them is a live snapshot: it re-seeds the replica).
        """
        row = {name: (ct.indices, ct.bits) for name, ct in captured.tensors.items()}
        slots = {name: SlotInfo(name=name, dtype=ct.dtype, shape=ct.shape, encoding="dense")
                 for name, ct in captured.tensors.items()}
        entry = StepEntry(step=captured.step, base=captured.step - 1, row=0, stepped=captured.stepped,
                          hyper=captured.hyper, param_groups=captured.param_groups, extra=captured.extra)
        self._replayer.apply_grad_step(entry, row, slots, f"{self._where} replica (step {captured.step})")
        if captured.anchor and captured.anchor_tensors is not None:
            self._replayer = Replayer(self._root, {n: t.clone() for n, t in captured.anchor_tensors.items()},
                                      captured.param_groups, captured.extra, optimizer=captured.optimizer)
        elif captured.anchor:
            self._replayer.sync_optimizer_tensors()
            return replace(captured, anchor_tensors={n: t.detach() for n, t in self._replayer.tensors.items()},
                           optimizer=self._replayer.optimizer_structure)
        return captured

    def load_into(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load the replica's model and optimizer state (that of ``step``) into the live objects."""
        state = self._replayer.result(step)
        model.load_state_dict(state["model"])
        # Optimizer.load_state_dict keeps the tensors it is given: hand it copies, or the
        # live optimizer and the replica would share (and both step) the same state.
        optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
