"""Replay: turn an anchor plus deltas into the state of a later step (spec §11.5, §11.6).

``grad.*`` deltas are replayed by rebuilding the recorded ``torch.optim`` optimizer over the
anchor's tensors, setting each parameter's ``grad`` to the recorded gradient (``None`` where
the step had none), restoring the hyperparameters the live optimizer used in that step, and
calling ``step()``. ``state.xor`` deltas are applied by XOR on the raw bits.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .delta import Segment, dense_view, fill_from_segment, segment_to_tensor, xor_into
from .errors import CorruptChainError, UnsupportedStateError
from .jsonvalue import decode, parse_dtype
from .manifest import RootMetadata, SlotInfo, StepEntry
from .state import bits_view, live_optimizer_tensors


def optimizer_class(root: RootMetadata) -> type[torch.optim.Optimizer]:
    name = root.schema["optimizer"]["class"]
    prefix = "torch.optim."
    cls = getattr(torch.optim, name[len(prefix):], None) if name.startswith(prefix) else None
    if cls is torch.optim.LBFGS:
        raise UnsupportedStateError("LBFGS needs a closure to step, so its gradient deltas cannot be replayed")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UnsupportedStateError(
            f"the chain's optimizer {name!r} is not a torch.optim class; gradient deltas can only "
            "be replayed with torch.optim optimizers (state.xor chains work with any optimizer)"
        )
    return cls


class Replayer:
    """A state being rolled forward, starting from an anchor."""

    def __init__(self, root: RootMetadata, tensors: dict[str, torch.Tensor], param_groups: Any, extra: Any) -> None:
        self.root = root
        self.tensors = tensors
        self.param_groups = param_groups
        self.extra = extra
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []
        self._grad_buffers: dict[int, torch.Tensor] = {}

    # -- gradient replay -------------------------------------------------------------
    def _build_optimizer(self) -> torch.optim.Optimizer:
        cls = optimizer_class(self.root)
        names = self.root.schema["optimizer"]["params"]
        params = []
        for n in names:
            t = self.tensors.get(f"model/{n}")
            if t is None:
                raise CorruptChainError(f"the anchor lacks model/{n}")
            params.append(t.requires_grad_(True))
        groups = decode(self.param_groups)
        built = []
        for g in groups:
            body = {k: v for k, v in g.items() if k != "params"}
            built.append({**body, "params": [params[i] for i in g["params"]]})
        opt = cls(built)  # type: ignore[call-arg]
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in self.tensors.items():
            if name.startswith("optimizer/"):
                _, i, key = name.split("/", 2)
                state.setdefault(int(i), {})[key] = t
        opt.load_state_dict({"state": state, "param_groups": groups})
        self._params = params
        return opt

    def apply_grad_step(
        self, entry: StepEntry, row: dict[str, Segment], slots: dict[str, SlotInfo], where: str
    ) -> None:
        if entry.stepped:
            if self._optimizer is None:
                self._optimizer = self._build_optimizer()
            opt = self._optimizer
            hyper = decode(entry.hyper)
            if not isinstance(hyper, list) or len(hyper) != len(opt.param_groups):
                raise CorruptChainError(f"{where}: step {entry.step} lacks the hyperparameters of its param groups")
            for group, used in zip(opt.param_groups, hyper, strict=True):
                params = group["params"]
                group.clear()
                group.update(used)
                group["params"] = params
            for i, p in enumerate(self._params):
                seg = row.get(f"grad/{i}")
                if seg is None:
                    p.grad = None
                    continue
                slot = slots[f"grad/{i}"]
                if seg[0] is None:  # dense: the decoded values are used once, so no copy
                    p.grad = dense_view(seg, slot)
                    continue
                buf = self._grad_buffers.get(i)
                if buf is None or tuple(buf.shape) != slot.shape or buf.dtype != parse_dtype(slot.dtype):
                    buf = self._grad_buffers[i] = segment_to_tensor(seg, slot)
                else:
                    fill_from_segment(buf, seg)  # reuse: replay allocates no gradient per step
                p.grad = buf
            with torch.no_grad():
                opt.step()
            for p in self._params:
                p.grad = None
        for name, seg in row.items():
            if name.startswith("model/"):
                self._overwrite(name, segment_to_tensor(seg, slots[name]), where)
        self.param_groups = entry.param_groups
        self.extra = entry.extra

    def _overwrite(self, name: str, value: torch.Tensor, where: str) -> None:
        target = self.tensors.get(name)
        if target is None or target.shape != value.shape or target.dtype != value.dtype:
            raise CorruptChainError(f"{where}: delta slot {name} does not match the anchor's tensor")
        with torch.no_grad():
            bits_view(target).copy_(bits_view(value))

    # -- xor replay --------------------------------------------------------------------
    def apply_xor_step(self, entry: StepEntry, row: dict[str, Segment], slots: dict[str, SlotInfo], where: str) -> None:
        self._optimizer = None  # xor rewrites state directly; never mixes with gradient replay
        for name in [n for n in self.tensors if n.startswith("optimizer/") and n not in row]:
            del self.tensors[name]
        for name, seg in row.items():
            slot = slots[name]
            current = self.tensors.get(name)
            if current is None:
                self.tensors[name] = segment_to_tensor(seg, slot)
            else:
                if tuple(current.shape) != slot.shape or current.dtype != parse_dtype(slot.dtype):
                    raise CorruptChainError(f"{where}: xor slot {name} changes shape")
                with torch.no_grad():
                    xor_into(current, seg)
        missing = [n for n in self.tensors if n.startswith("model/") and n not in row]
        if missing:
            raise CorruptChainError(f"{where}: step {entry.step} has no xor delta for {missing[0]}")
        self.param_groups = entry.param_groups
        self.extra = entry.extra

    # -- output ------------------------------------------------------------------------
    def sync_optimizer_tensors(self) -> None:
        if self._optimizer is not None:
            for name in [n for n in self.tensors if n.startswith("optimizer/")]:
                del self.tensors[name]
            self.tensors.update(live_optimizer_tensors(self._optimizer))

    def result(self, step: int) -> dict[str, Any]:
        self.sync_optimizer_tensors()
        model: OrderedDict[str, torch.Tensor] = OrderedDict()
        for e in self.root.schema["model"]:
            source = e["alias_of"] or e["name"]
            t = self.tensors.get(f"model/{source}")
            if t is None:
                raise CorruptChainError(f"the chain's state lacks model/{source} at step {step}")
            model[e["name"]] = t.detach()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in self.tensors.items():
            if name.startswith("optimizer/"):
                _, i, key = name.split("/", 2)
                state.setdefault(int(i), {})[key] = t.detach()
        optimizer = {"state": dict(sorted(state.items())), "param_groups": decode(self.param_groups)}
        return {"model": model, "optimizer": optimizer, "step": step, "extra": decode(self.extra)}
