"""Replay: turn an anchor plus deltas into the state of a later step (spec §11.5, §11.6).

``grad.*`` deltas are replayed by rebuilding the recorded ``torch.optim`` optimizer over the
anchor's tensors, setting each parameter's ``grad`` to the recorded gradient (``None`` where
the step had none), restoring the hyperparameters the live optimizer used in that step, and
calling ``step()``. ``state.xor`` deltas are applied to the raw bits: by XOR, or by
addition for ``sub`` slots.

Everything replay relies on is checked by :mod:`ldformat.format.checks` before it is used, so a
malformed chain raises :class:`CorruptChainError` naming the file and step. The optimizer is
rebuilt, given its hyperparameters and stepped by three functions that
:class:`ProxyReplayer` (what ``validate`` runs) shares with :class:`Replayer`, so that
validation and replay cannot disagree about what a step does.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from ..errors import CorruptChainError
from .checks import (
    OptimizerRules,
    Schema,
    TensorMeta,
    check_extra,
    check_hyper,
    check_param_groups,
    parse_index,
    xor_step_changes,
)
from .delta import (
    PREDICTED,
    Segment,
    apply_state_delta,
    dense_view,
    fill_from_segment,
    segment_to_tensor,
    state_delta_tensor,
    undifference,
)
from .dtypes import dtype_name, parse_dtype
from .jsonvalue import JSON
from .manifest import RootMetadata, SlotInfo, StepEntry
from .optstate import REF_PREFIX, join_state, live_optimizer_state
from .predict import PREDICT, moment_names, predict_parameter, predict_second_moment, predicted_param
from .state import ParamGroup, bits_view


# -- the optimizer, shared by Replayer and ProxyReplayer ------------------------------------------
def optimizer_state(tensors: Mapping[str, torch.Tensor], where: str) -> dict[int, dict[str, torch.Tensor]]:
    """``{i: {key: tensor}}`` from the ``optimizer/<i>/<key>`` tensors of a state (not the
    tensors of the optimizer structure, ``optimizer/ref/...``)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("optimizer/") and not name.startswith(REF_PREFIX):
            i_text, sep, key = name[len("optimizer/"):].partition("/")
            i = parse_index(i_text)
            if i is None or not sep:
                raise CorruptChainError(f"{where}: {name!r} is not a stored name optimizer/<i>/<key> (spec §8)")
            state.setdefault(i, {})[key] = t
    return state


def _leaf(t: torch.Tensor) -> torch.Tensor:
    # Only floating-point tensors can require grad; a frozen integer parameter never has one.
    return t.requires_grad_(True) if t.is_floating_point() or t.is_complex() else t


def build_optimizer(cls: type[torch.optim.Optimizer], params: list[torch.Tensor], groups: list[ParamGroup],
                    state: Mapping[Any, Any], where: str) -> torch.optim.Optimizer:
    """``cls([{**group without params, "params": [p_i, ...]}, ...])`` then ``load_state_dict``
    (spec §11.5); ``groups`` passed :func:`~ldformat.format.checks.check_param_groups`."""
    # check_param_groups checked each group's params: a list of parameter indices.
    built = [{**{k: v for k, v in g.items() if k != "params"},
              "params": [params[i] for i in cast("list[int]", g["params"])]}
             for g in groups]
    try:
        # torch types group keys as str; a group's $items encoding may give it others, kept as they are.
        opt = cls(built)  # type: ignore[call-arg, arg-type]
        opt.load_state_dict({"state": state, "param_groups": groups})
    except Exception as e:  # torch's own checks of the stored state (types, sizes, keys)
        raise CorruptChainError(f"{where}: cannot rebuild torch.optim.{cls.__name__} from the anchor's optimizer "
                                f"state and param groups ({type(e).__name__}: {e})") from None
    return opt


def use_hyperparameters(opt: torch.optim.Optimizer, hyper: list[ParamGroup]) -> None:
    """Replace every member of each group except ``params`` by the members of ``hyper[g]``."""
    for group, used in zip(opt.param_groups, hyper, strict=True):
        params = group["params"]
        group.clear()
        group.update(used)  # type: ignore[arg-type]  # keys as in build_optimizer
        group["params"] = params


def step_optimizer(opt: torch.optim.Optimizer, step: int, where: str) -> None:
    """``opt.step()`` with gradient recording disabled; a failure is the chain's (spec §11.5)."""
    try:
        with torch.no_grad():
            opt.step()
    except Exception as e:  # what torch raises for hyperparameters or state it cannot step with
        raise CorruptChainError(f"{where}: torch.optim.{type(opt).__name__} cannot run step {step} with the "
                                f"recorded hyperparameters and state ({type(e).__name__}: {e})") from None


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def _bits_of(t: torch.Tensor | None) -> np.ndarray | None:
    """The flat uint32 bits of a float32 replay tensor (its own memory), None if absent."""
    return None if t is None else _own_bits(t)


def _bits_copy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else _own_bits(t).copy()


def _own_bits(t: torch.Tensor) -> np.ndarray:
    """A replay tensor's bits as a flat uint32 array sharing its memory (replay tensors are
    contiguous CPU tensors; checked, since writing into a copy would change nothing)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != torch.float32:
        raise CorruptChainError(f"a predicted tensor must be a contiguous CPU float32 tensor, not {t.dtype}")
    return t.detach().view(torch.int32).reshape(-1).numpy().view(np.uint32)


class _Metas(Mapping[str, TensorMeta]):
    """(dtype name, shape) of each tensor of a state, computed when asked."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> TensorMeta:
        t = self._tensors[name]
        return dtype_name(t.dtype), tuple(t.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class Replayer:
    """A state being rolled forward, starting from an anchor."""

    def __init__(self, root: RootMetadata, tensors: dict[str, torch.Tensor], param_groups: JSON, extra: JSON,
                 *, optimizer: JSON = None, chain: str = "", device: torch.device | str | None = None) -> None:
        """``device``: where gradient replay steps the optimizer (default the CPU). Gradient
        replay is bit-exact on the device type the chain was recorded on (spec §11.8, §13);
        the tensors of :meth:`result` are CPU tensors either way."""
        self.root = root
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.schema = Schema.of(root, chain)
        self.tensors = tensors
        self.param_groups = param_groups
        self.extra = extra
        self.optimizer_structure = optimizer  # spec §8.2
        self._rules: OptimizerRules | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._device_grads: dict[int, torch.Tensor] = {}
        self._m_before = np.empty(0, np.uint32)  # m before the row, reused for each adam.v

    # -- gradient replay -------------------------------------------------------------
    def rules(self, where: str) -> OptimizerRules:
        """The optimizer class and its param-group members (UnsupportedStateError if not replayable)."""
        if self._rules is None:
            self._rules = OptimizerRules.of(self.schema, self.root, where)
        return self._rules

    def _build_optimizer(self, where: str) -> torch.optim.Optimizer:
        rules = self.rules(where)
        groups = check_param_groups(self.schema, self.param_groups, where, rules)
        params = []
        for n in self.schema.params:
            t = self.tensors.get(f"model/{n}")
            if t is None:
                raise CorruptChainError(f"{where}: the anchor lacks model/{n}")
            if t.device != self.device:
                # The optimizer's load_state_dict moves its state to each parameter's device.
                t = self.tensors[f"model/{n}"] = t.to(self.device)
            params.append(_leaf(t))
        joined = join_state(self.tensors, self.optimizer_structure, groups, len(self.schema.params), where)
        state = joined.get("state", {})
        opt = build_optimizer(rules.cls, params, groups, state, where)
        self._params = params
        return opt

    def apply_grad_step(
        self, entry: StepEntry, row: dict[str, Segment], slots: dict[str, SlotInfo], where: str
    ) -> None:
        if entry.stepped:
            hyper = check_hyper(self.schema, entry, where, self.rules(where))
            if hyper is None:  # check_hyper refuses a stepped gradient step without hyper
                raise CorruptChainError(f"{where}: step {entry.step} lacks its hyperparameters")
            if self._optimizer is None:
                self._optimizer = self._build_optimizer(where)
            opt = self._optimizer
            use_hyperparameters(opt, hyper)
            for i, p in enumerate(self._params):
                seg = row.get(f"grad/{i}")
                if seg is None:
                    p.grad = None
                    continue
                slot = slots.get(f"grad/{i}")
                if slot is None or slot.shape != tuple(p.shape) or parse_dtype(slot.dtype) != p.dtype:
                    raise CorruptChainError(f"{where}: slot grad/{i} does not have the dtype and shape of optimizer "
                                            f"parameter {i} ({self.schema.params[i]}; spec §10.3)")
                if seg[0] is None:  # dense: the decoded values are used once, so no copy
                    p.grad = self._on_device(i, dense_view(seg, slot))
                    continue
                buf = self._grad_buffers.get(i)
                if buf is None or tuple(buf.shape) != slot.shape or buf.dtype != parse_dtype(slot.dtype):
                    buf = self._grad_buffers[i] = segment_to_tensor(seg, slot)
                else:
                    fill_from_segment(buf, seg)  # reuse: replay allocates no gradient per step
                p.grad = self._on_device(i, buf)
            try:
                step_optimizer(opt, entry.step, where)
            finally:
                for p in self._params:
                    p.grad = None
        else:
            check_hyper(self.schema, entry, where)
        for name, seg in row.items():
            if name.startswith("model/"):
                self._overwrite(name, segment_to_tensor(seg, slots[name]), where)
        self.param_groups = entry.param_groups
        self.extra = entry.extra

    def _on_device(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the replay device, in a buffer reused from step to step."""
        if self.device.type == "cpu":
            return grad
        buf = self._device_grads.get(i)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            buf = self._device_grads[i] = torch.empty(grad.shape, dtype=grad.dtype, device=self.device)
        buf.copy_(grad)
        return buf

    def _overwrite(self, name: str, value: torch.Tensor, where: str) -> None:
        target = self.tensors.get(name)
        if target is None or target.shape != value.shape or target.dtype != value.dtype:
            raise CorruptChainError(f"{where}: delta slot {name} does not match the anchor's tensor")
        with torch.no_grad():
            bits_view(target).copy_(bits_view(value))

    # -- xor replay --------------------------------------------------------------------
    def apply_xor_step(self, entry: StepEntry, row: dict[str, Segment], slots: dict[str, SlotInfo], where: str) -> None:
        self._optimizer = None  # xor rewrites state directly; never mixes with gradient replay
        check_hyper(self.schema, entry, where)
        removed, added = xor_step_changes(_Metas(self.tensors), [slots[n] for n in row], entry.step, where,
                                          self.schema.params)
        new = {slot.name for slot in added}
        predicted = {n: predicted_param(n, slots[n].encoding, self.schema.params)
                     for n in row if slots[n].encoding in PREDICTED}
        # Spec §11.6: an adam.v prediction takes m before and after the row, an adam.w one m and
        # v after it. Slots are independent otherwise, so each adam.v is applied right after
        # its m (one copy of m at a time), then every adam.w.
        second: dict[str, list[str]] = {}  # m -> the adam.v slots predicted from it
        for name, i in predicted.items():
            if slots[name].encoding == "adam.v":
                second.setdefault(moment_names(i)[0], []).append(name)
        # An m the row drops is removed before any slot is applied: keep what it was.
        first_moments = {m: _bits_copy(self.tensors.get(m)) for m in second if m not in row}
        for name in removed:
            del self.tensors[name]
        with torch.no_grad():
            for name, seg in row.items():
                if name in predicted or name.startswith(PREDICT):
                    continue
                m0 = self._copy_of_m(self.tensors.get(name)) if name in second else None
                if name in new:
                    self.tensors[name] = state_delta_tensor(seg, slots[name])
                else:
                    apply_state_delta(self.tensors[name], seg, slots[name].encoding)
                for v_name in second.get(name, ()):
                    self._apply_predicted(v_name, predicted[v_name], row, slots[v_name], m0)
            for m_name in first_moments:
                for v_name in second[m_name]:
                    self._apply_predicted(v_name, predicted[v_name], row, slots[v_name], first_moments[m_name])
            for name, i in predicted.items():
                if slots[name].encoding == "adam.w":
                    self._apply_predicted(name, i, row, slots[name], None)
        self.param_groups = entry.param_groups
        self.extra = entry.extra
        self.optimizer_structure = entry.optimizer

    def _copy_of_m(self, m: torch.Tensor | None) -> np.ndarray | None:
        """The bits of ``m`` before its slot is applied, in a buffer reused from tensor to tensor
        and step to step (fresh memory costs a page fault per page)."""
        if m is None:
            return None
        bits = _own_bits(m)
        if self._m_before.shape[0] < bits.shape[0]:
            self._m_before = np.empty(bits.shape[0], np.uint32)
        out = self._m_before[: bits.shape[0]]
        np.copyto(out, bits)
        return out

    def _apply_predicted(self, name: str, i: int, row: dict[str, Segment], slot: SlotInfo,
                         m0: np.ndarray | None) -> None:
        """Spec §11.6 step 3: the prediction from the coefficients and the other tensors of the
        row, plus the stored difference; an absent input is all-zero bits."""
        m_name, v_name = moment_names(i)
        coef = row[f"{PREDICT}{i}"][1].view(np.uint32)
        target = self.tensors.get(name)
        if target is None:
            target = self.tensors[name] = torch.zeros(slot.shape, dtype=torch.float32)
        out = _own_bits(target)
        m = _bits_of(self.tensors.get(m_name))
        if slot.encoding == "adam.v":
            predict_second_moment(m0, m, out, coef, out)
        else:
            predict_parameter(out, m, _bits_of(self.tensors.get(v_name)), coef, out)
        undifference(np.ascontiguousarray(row[name][1]), out, accumulate=True)

    # -- output ------------------------------------------------------------------------
    def sync_optimizer_tensors(self) -> None:
        """Take the optimizer state (tensors and structure) from the optimizer replay stepped."""
        if self._optimizer is not None:
            for name in [n for n in self.tensors if n.startswith("optimizer/")]:
                del self.tensors[name]
            tensors, self.optimizer_structure = live_optimizer_state(self._optimizer)
            self.tensors.update(tensors)

    # Any: a materialized state (ChainReader.materialize), whose values are torch state dicts.
    def result(self, step: int, where: str = "") -> dict[str, Any]:
        where = where or f"step {step}"
        self.sync_optimizer_tensors()
        model: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, source in self.schema.sources:
            t = self.tensors.get(f"model/{source}")
            if t is None:
                raise CorruptChainError(f"{where}: the chain's state lacks model/{source} at step {step}")
            model[key] = _on_cpu(t.detach())
        groups = check_param_groups(self.schema, self.param_groups, where)
        tensors = self.tensors if self.device.type == "cpu" else {n: _on_cpu(t) for n, t in self.tensors.items()}
        optimizer = join_state(tensors, self.optimizer_structure, groups, len(self.schema.params), where)
        return {"model": model, "optimizer": optimizer, "step": step, "extra": check_extra(self.extra, where)}


class ProxyReplayer:
    """Gradient replay of the optimizer alone, on one-element stand-ins (spec §18).

    Each parameter is a tensor of its dtype and number of dimensions with one element; each
    optimizer state tensor of the anchor likewise, except 0-dimensional ones (step counters),
    which keep their value. The optimizer is rebuilt, given each step's hyperparameters and
    stepped exactly as :class:`Replayer` does it, with a gradient of ones where the step
    recorded one. So whatever replay would fail on that does not depend on the tensors'
    sizes or values (a missing or mistyped hyperparameter, a flag that needs state the
    optimizer does not have, a class that cannot step here) fails here too, at a cost
    independent of the model's size.
    """

    def __init__(self, schema: Schema, rules: OptimizerRules, anchor: Mapping[str, torch.Tensor],
                 param_groups: JSON, where: str, optimizer: JSON = None) -> None:
        self.schema, self.rules = schema, rules
        self.params = [_leaf(torch.zeros((1,) * len(shape), dtype=parse_dtype(dtype)))
                       for dtype, shape in (schema.param_meta(i) for i in range(len(schema.params)))]
        stand_ins = {n: stand_in(t) for n, t in anchor.items() if n.startswith("optimizer/")}
        self.state = join_state(stand_ins, optimizer, [], len(schema.params), where).get("state", {})
        self.param_groups = param_groups
        self.optimizer: torch.optim.Optimizer | None = None

    def apply(self, entry: StepEntry, hyper: list[ParamGroup] | None, grads: Collection[int], where: str) -> None:
        """Step with ``hyper`` (from :func:`~ldformat.format.checks.check_hyper`) and gradients for ``grads``."""
        if entry.stepped and hyper is not None:
            if self.optimizer is None:
                groups = check_param_groups(self.schema, self.param_groups, where, self.rules)
                self.optimizer = build_optimizer(self.rules.cls, self.params, groups, self.state, where)
            use_hyperparameters(self.optimizer, hyper)
            for i, p in enumerate(self.params):
                p.grad = torch.ones_like(p) if i in grads else None
            try:
                step_optimizer(self.optimizer, entry.step, where)
            finally:
                for p in self.params:
                    p.grad = None
            live_optimizer_state(self.optimizer)  # what replay's result takes must be storable (spec §8.2)
        self.param_groups = entry.param_groups

    def copy(self) -> ProxyReplayer:
        """An independent copy (for a second delta based on the same step)."""
        twin = copy.copy(self)
        twin.params, twin.state, twin.optimizer = copy.deepcopy((self.params, self.state, self.optimizer))
        return twin


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A one-element tensor of ``t``'s dtype and number of dimensions; 0-dimensional tensors
    (step counters) are kept with their value."""
    if t.dim() == 0:
        return t.detach().clone()
    return torch.zeros((1,) * t.dim(), dtype=t.dtype)
