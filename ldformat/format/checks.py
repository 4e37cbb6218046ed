"""What replay relies on, checked without replaying (spec §11, §14, §18).

Replay (:mod:`ldformat.format.replay`) and validation (:mod:`ldformat.chain.validate`) both call these
functions, so that a chain ``validate`` accepts is one that replay can use, and replay meets
anything malformed as a :class:`CorruptChainError` naming the file and step instead of a
raw exception from deep inside torch:

- :class:`Schema`: the root's ``schema`` (§5.6), parsed and checked once;
- :func:`replayable_optimizer` and :func:`group_defaults`: the ``torch.optim`` class gradient
  replay rebuilds, and the members (with their default values) of a fresh param group of it;
- :func:`check_param_groups`, :func:`check_hyper`, :func:`check_extra`: the JSON parts of
  anchor and step entries (§8, §10.4);
- :func:`check_anchor_tensors`: the stored names, dtypes and shapes of an anchor (§8, §9.1,
  §14);
- :func:`xor_step_changes`: the tensor bookkeeping of one ``state.xor`` step (§11.6).

Tagged values are decoded by :func:`ldformat.format.jsonvalue.decode`, which rejects malformed
tags; records are parsed with bounded nesting (§6.4) before any of this runs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch

from ..errors import CorruptChainError, UnsupportedStateError
from .dtypes import dtype_name
from .jsonvalue import JSON, Decoded, TensorRef, decode
from .manifest import KINDS, AnchorEntry, Kind, RootMetadata, SlotInfo, StepEntry
from .optstate import REF_PREFIX, check_structure
from .predict import PREDICT, moment_names, predicted_param
from .state import ParamGroup

#: (dtype name, shape) of a stored tensor.
TensorMeta = tuple[str, tuple[int, ...]]

_INDEX = re.compile(r"0|[1-9][0-9]{0,18}")
_RANK = re.compile(r"[1-9][0-9]{0,18}")
DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
_ROOT = "ldformat.json"
# torch.optim classes whose step gradient replay cannot re-run (spec §5.6.2, §11.5).
_NOT_REPLAYABLE = {
    "LBFGS": "it needs a closure that re-evaluates the loss",
    "SparseAdam": "it needs sparse gradients, and replay sets dense ones",
}


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_index(text: str) -> int | None:
    """A parameter index in decimal without leading zeros (spec §8), else None."""
    return int(text) if _INDEX.fullmatch(text) else None


# -- the root's schema ----------------------------------------------------------------------
@dataclass(frozen=True)
class Schema:
    """The root's ``schema`` as replay uses it (spec §5.6)."""

    kind: Kind
    #: stored ``model/<key>`` tensors (entries with ``alias_of: null``): key -> (dtype, shape)
    model: dict[str, TensorMeta]
    #: the order of ``schema.model`` with, for every key, the stored key it reads
    sources: tuple[tuple[str, str], ...]
    #: top-k residual names (stored entries of role ``parameter``) -> (dtype, shape)
    parameters: dict[str, TensorMeta]
    #: optimizer parameter index -> ``schema.model`` name
    params: tuple[str, ...]
    #: the parameter indices of each param group
    groups: tuple[range, ...]
    optimizer: str

    @property
    def gradient(self) -> bool:
        return self.kind.startswith("grad.")

    def param_meta(self, i: int) -> TensorMeta:
        return self.model[self.params[i]]

    @classmethod
    def of(cls, root: RootMetadata, where: str = "") -> Schema:
        """Parse and check ``root.schema``; raises CorruptChainError naming the member."""
        place = f"{where}/{_ROOT}" if where else _ROOT

        def bad(why: str) -> CorruptChainError:
            return CorruptChainError(f"{place}: schema {why} (spec §5.6); the root file was not written by a "
                                     "conforming writer")

        stored: JSON = root.schema
        schema: Mapping[str, JSON] = stored if isinstance(stored, dict) else {}
        kind = root.kind
        if kind not in KINDS:
            raise CorruptChainError(f"{place}: unknown delta kind {kind!r}")
        model_entries, optimizer = schema.get("model"), schema.get("optimizer")
        if not isinstance(model_entries, list) or not isinstance(optimizer, dict):
            raise bad("needs a model array and an optimizer object")
        model: dict[str, TensorMeta] = {}
        parameters: dict[str, TensorMeta] = {}
        sources: list[tuple[str, str]] = []
        names: set[str] = set()
        for n, e in enumerate(model_entries):
            name = e.get("name") if isinstance(e, dict) else None
            if not isinstance(e, dict) or not isinstance(name, str):
                raise bad(f"model[{n}] is not an object with a name")
            role, dtype, shape, alias = e.get("role"), e.get("dtype"), e.get("shape"), e.get("alias_of", ...)
            if name in names:
                raise bad(f"model names {name!r} twice")
            names.add(name)
            if role not in ("parameter", "buffer"):
                raise bad(f"model entry {name!r} has role {role!r}, not 'parameter' or 'buffer'")
            if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
                raise bad(f"model entry {name!r} has dtype {dtype!r}, not one of spec §5.6.4")
            dims = [d for d in shape if _is_int(d) and d >= 0] if isinstance(shape, list) else []
            if not isinstance(shape, list) or len(dims) != len(shape):
                raise bad(f"model entry {name!r} has shape {shape!r}, not a list of non-negative integers")
            meta: TensorMeta = (dtype, tuple(dims))
            if alias is None:
                model[name] = meta
                if role == "parameter":
                    parameters[name] = meta
                sources.append((name, name))
            elif isinstance(alias, str) and alias in model:
                if model[alias] != meta:
                    raise bad(f"model entry {name!r} aliases {alias!r} with another dtype or shape")
                sources.append((name, alias))
            elif alias is ...:
                raise bad(f"model entry {name!r} lacks alias_of")
            else:
                raise bad(f"model entry {name!r} has alias_of {alias!r}, which names no earlier stored entry")
        class_name, listed, sizes = optimizer.get("class"), optimizer.get("params"), optimizer.get("group_sizes")
        if not isinstance(class_name, str):
            raise bad("optimizer.class is not a string")
        params = [p for p in listed if isinstance(p, str)] if isinstance(listed, list) else []
        if not isinstance(listed, list) or len(params) != len(listed):
            raise bad("optimizer.params is not an array of strings")
        for p in params:
            if p not in parameters:
                raise bad(f"optimizer.params names {p!r}, which is no stored model entry of role 'parameter'")
        if len(set(params)) != len(params):
            raise bad("optimizer.params names a parameter twice")
        counts = [s for s in sizes if _is_int(s) and s >= 0] if isinstance(sizes, list) else []
        if not isinstance(sizes, list) or len(counts) != len(sizes) or sum(counts) != len(params):
            raise bad(f"optimizer.group_sizes {sizes!r} are not non-negative integers summing to "
                      f"{len(params)} (the length of optimizer.params)")
        groups, start = [], 0
        for size in counts:
            groups.append(range(start, start + size))
            start += size
        compressor = schema.get("compressor")
        if kind == "grad.topk":
            if not (isinstance(compressor, dict) and compressor.get("name") == "topk"):
                raise bad("compressor of a grad.topk chain is not a top-k compressor object")
        elif compressor is not None:
            raise bad(f"compressor is not null in a {kind} chain")
        return cls(kind=kind, model=model, sources=tuple(sources), parameters=parameters,
                   params=tuple(params), groups=tuple(groups), optimizer=class_name)


# -- the optimizer class -------------------------------------------------------------------
def replayable_optimizer(schema: Schema, where: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class gradient replay rebuilds (spec §5.6.2, §11.5).

    Raises:
        UnsupportedStateError: the class is not a public ``torch.optim`` optimizer of this
            torch, or one whose step replay cannot re-run (LBFGS, SparseAdam).
    """
    name = schema.optimizer
    prefix = "torch.optim."
    short = name[len(prefix):] if name.startswith(prefix) else ""
    cls = getattr(torch.optim, short, None) if short.isidentifier() and not short.startswith("_") else None
    if short in _NOT_REPLAYABLE:
        raise UnsupportedStateError(f"{where}: the chain's optimizer {name} cannot be replayed: "
                                    f"{_NOT_REPLAYABLE[short]} (use kind 'state.xor' for it)")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise UnsupportedStateError(
            f"{where}: the chain's optimizer {name!r} is not a torch.optim optimizer class of torch "
            f"{torch.__version__}; gradient deltas are replayed with torch.optim optimizers only "
            "(state.xor chains work with any optimizer)"
        )
    group_defaults(cls)  # it must construct with its defaults
    return cls


_DEFAULTS: dict[type[torch.optim.Optimizer], dict[str, object] | str] = {}


def _defaults(cls: type[torch.optim.Optimizer]) -> dict[str, object] | str:
    got = _DEFAULTS.get(cls)
    if got is None:
        p = torch.zeros((1, 1), requires_grad=True)  # a matrix: some optimizers (Muon) take only those
        try:
            group = cls([p]).param_groups[0]  # type: ignore[call-arg]
            got = {k: v for k, v in group.items() if k != "params"}
        except Exception as e:  # any failure means: this class cannot be rebuilt by replay
            got = f"{type(e).__name__}: {e}"
        _DEFAULTS[cls] = got
    return got


def group_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, object]:
    """The members of a fresh param group of ``cls`` (``cls([p]).param_groups[0]`` without
    ``params``) with their default values."""
    got = _defaults(cls)
    if isinstance(got, str):
        raise UnsupportedStateError(f"torch.optim.{cls.__name__} cannot be constructed with its default "
                                    f"arguments ({got}), so replay cannot rebuild it")
    return copy.deepcopy(got)


def _fits(default: object, value: object) -> bool:
    """Whether ``value`` has the type of a hyperparameter whose default is ``default``."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, tuple):
        return (isinstance(value, (tuple, list)) and len(value) == len(default)
                and all(_fits(d, v) for d, v in zip(default, value, strict=True)))
    if default is None:
        return value is None or isinstance(value, (bool, int, float, str))
    return True


def _type_name(default: object) -> str:
    if isinstance(default, bool):
        return "a boolean"
    if isinstance(default, (int, float)):
        return "a number"
    if isinstance(default, str):
        return "a string"
    if isinstance(default, tuple):
        return f"a tuple of {len(default)} ({', '.join(_type_name(d) for d in default)})"
    if default is None:
        return "null, a boolean, a number or a string"
    return type(default).__name__


def _recorded_torch(root_environment: JSON) -> str:
    version = root_environment.get("torch") if isinstance(root_environment, dict) else None
    if isinstance(version, str) and version != torch.__version__:
        return f" (the chain was recorded with torch {version}, this is torch {torch.__version__}: replay it there)"
    return ""


def _check_members(group: Mapping[Decoded, Decoded], defaults: Mapping[str, object], what: str, where: str,
                   cls_name: str, environment: JSON) -> None:
    for key, default in defaults.items():
        if key not in group:
            raise CorruptChainError(f"{where}: {what} lacks {key!r}, which a torch.optim.{cls_name} param group "
                                    f"holds{_recorded_torch(environment)}")
        if not _fits(default, group[key]):
            raise CorruptChainError(f"{where}: {what} has {key!r} = {group[key]!r}; torch.optim.{cls_name} "
                                    f"takes {_type_name(default)} there")


@dataclass(frozen=True)
class OptimizerRules:
    """What a param group of a gradient chain must hold: the class and its fresh group."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, object]
    environment: JSON = None  # the root's environment (names the torch a chain was recorded with)

    @classmethod
    def of(cls, schema: Schema, root: RootMetadata, where: str) -> OptimizerRules:
        optimizer = replayable_optimizer(schema, where)
        return cls(optimizer, group_defaults(optimizer), root.environment)


# -- JSON parts of entries -------------------------------------------------------------------
def check_param_groups(schema: Schema, data: JSON, where: str,
                       rules: OptimizerRules | None = None) -> list[ParamGroup]:
    """Decode and check ``param_groups`` (spec §8): one object per group of the schema, ``params``
    exactly the group's parameter indices; with ``rules`` (gradient kinds), every member of a
    fresh param group of the class, of its type. Returns the decoded groups."""
    groups = _no_refs(decode(data, f"{where}: param_groups"), "param_groups", where)
    if not isinstance(groups, list) or len(groups) != len(schema.groups):
        raise CorruptChainError(f"{where}: param_groups is not an array of {len(schema.groups)} param groups "
                                "(schema.optimizer.group_sizes)")
    for g, (group, indices) in enumerate(zip(groups, schema.groups, strict=True)):
        if not isinstance(group, dict):
            raise CorruptChainError(f"{where}: param group {g} is not an object")
        params = group.get("params")
        if not (isinstance(params, list) and all(_is_int(i) for i in params) and params == list(indices)):
            raise CorruptChainError(f"{where}: param group {g} has params {params!r}; the schema's group "
                                    f"{g} holds the parameter indices {list(indices)!r}")
        if rules is not None:
            _check_members(group, rules.defaults, f"param group {g}", where, rules.cls.__name__, rules.environment)
    return groups


def check_hyper(schema: Schema, entry: StepEntry, where: str,
                rules: OptimizerRules | None = None) -> list[ParamGroup] | None:
    """Decode and check a step entry's ``hyper`` (spec §10.4, §11.5): an array with one object per
    param group, without ``params``, when a gradient chain's optimizer stepped; null otherwise.
    With ``rules``, every member of a fresh param group of the class, of its type."""
    if schema.gradient and entry.optimizer is not None:
        raise CorruptChainError(f"{where}: step {entry.step} of a gradient chain carries an optimizer structure; "
                                "only anchors and state.xor steps do (spec §8.2, §10.4)")
    if not (schema.gradient and entry.stepped):
        if entry.hyper is not None:
            why = "the optimizer did not step in it" if schema.gradient else "state.xor steps carry none"
            raise CorruptChainError(f"{where}: step {entry.step} has hyperparameters although {why}; "
                                    "hyper must be null (spec §10.4)")
        return None
    if entry.hyper is None:
        raise CorruptChainError(f"{where}: step {entry.step} ran the optimizer (stepped) but lacks the "
                                "hyperparameters of its param groups (hyper is null)")
    hyper = _no_refs(decode(entry.hyper, f"{where}: hyper of step {entry.step}"), "hyper", where)
    if not isinstance(hyper, list) or len(hyper) != len(schema.groups):
        raise CorruptChainError(f"{where}: step {entry.step} has hyper for "
                                f"{len(hyper) if isinstance(hyper, list) else 'no'} param groups; the optimizer "
                                f"has {len(schema.groups)}")
    for g, group in enumerate(hyper):
        if not isinstance(group, dict):
            raise CorruptChainError(f"{where}: hyper of step {entry.step}, group {g}, is not an object")
        if "params" in group:
            raise CorruptChainError(f"{where}: hyper of step {entry.step}, group {g}, holds 'params'; hyper "
                                    "holds hyperparameters only (spec §10.4)")
        if rules is not None:
            _check_members(group, rules.defaults, f"hyper of step {entry.step}, group {g},", where,
                           rules.cls.__name__, rules.environment)
    return hyper


def _no_refs(value: Decoded, what: str, where: str) -> Decoded:
    """``value``, refusing ``$ref``: it is only meaningful inside the optimizer structure (spec §6.1)."""
    if isinstance(value, TensorRef):
        raise CorruptChainError(f"{where}: {what} holds a $ref value ({value.name!r}); $ref is only valid in the "
                                "optimizer structure (spec §6.1, §8.2)")
    if isinstance(value, (list, tuple)):
        for v in value:
            _no_refs(v, what, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_refs(k, what, where)
            _no_refs(v, what, where)
    return value


def check_extra(data: JSON, where: str) -> dict[Decoded, Decoded]:
    """Decode ``extra``; it must decode to a dict (spec §9.3, §10.4)."""
    extra = _no_refs(decode(data, f"{where}: extra"), "extra", where)
    if not isinstance(extra, dict):
        raise CorruptChainError(f"{where}: extra decodes to a {type(extra).__name__}, not a dict (spec §10.4)")
    return extra


# -- stored names ----------------------------------------------------------------------------
def residual_rank(name: str) -> tuple[int, str] | None:
    """(rank, parameter name) of a residual's stored name (spec §8, §14.1), None for other names.

    Raises:
        CorruptChainError: a ``compressor@…`` name whose rank is not decimal >= 1 without
            leading zeros, or that has no ``/<name>``.
    """
    if name.startswith("compressor/"):
        return 0, name[len("compressor/"):]
    if not name.startswith("compressor@"):
        return None
    rank, sep, param = name[len("compressor@"):].partition("/")
    if not sep or not _RANK.fullmatch(rank):
        raise CorruptChainError(f"residual {name!r} is not of the form compressor@<r>/<name> with <r> >= 1 in "
                                "decimal without leading zeros (spec §14.1)")
    return int(rank), param


#: ``torch.optim`` classes whose per-parameter state is scalars (``step``, ASGD's ``eta``/``mu``)
#: or tensors of the parameter's shape; replay of another shape would fail inside the step.
PARAM_SHAPED_STATE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                                "Adadelta", "ASGD", "Rprop"})


def _short_class(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def check_anchor_tensors(schema: Schema, tensors: Mapping[str, TensorMeta], where: str) -> None:
    """The stored names of an anchor (spec §8, §9.1, §14): every ``model/<key>`` of the schema
    with its dtype and shape; ``optimizer/<i>/<key>`` for parameter indices ``i``; in
    ``grad.topk`` chains residuals, each a 1-D tensor of its parameter's element count and
    dtype; nothing else."""
    for name, (dtype, shape) in tensors.items():
        space, _, rest = name.partition("/")
        if space == "model":
            want = schema.model.get(rest)
            if want is None:
                raise CorruptChainError(f"{where}: the anchor holds {name}, which names no stored schema.model "
                                        "entry (spec §9.1)")
            if (dtype, shape) != want:
                raise CorruptChainError(f"{where}: the anchor's {name} is {dtype} {list(shape)}; the schema says "
                                        f"{want[0]} {list(want[1])} (spec §9.1)")
            continue
        if space == "optimizer" and name.startswith(REF_PREFIX) and len(name) > len(REF_PREFIX):
            continue  # a tensor of the optimizer structure: check_structure checks it is referenced
        if space == "optimizer":
            i_text, sep, _key = rest.partition("/")
            i = parse_index(i_text)
            if i is None or i >= len(schema.params) or not sep:
                raise CorruptChainError(f"{where}: the anchor holds {name}, which names no optimizer parameter "
                                        f"(the chain has {len(schema.params)}; spec §8)")
            if schema.gradient and _short_class(schema.optimizer) in PARAM_SHAPED_STATE:
                param_shape = schema.param_meta(i)[1]
                numel = 1
                for d in shape:
                    numel *= d
                if shape != param_shape and numel > 1:
                    raise CorruptChainError(
                        f"{where}: the anchor's {name} has shape {list(shape)}; {schema.optimizer} keeps scalars "
                        f"or tensors of its parameter's shape {list(param_shape)} (spec §11.5)")
            continue
        try:
            residual = residual_rank(name)
        except CorruptChainError as e:
            raise CorruptChainError(f"{where}: {e}") from None
        if residual is None:
            raise CorruptChainError(f"{where}: the anchor holds {name!r}, which is not a stored name of format 1 "
                                    "(spec §8)")
        if schema.kind != "grad.topk":
            raise CorruptChainError(f"{where}: the anchor holds the residual {name}, but only grad.topk chains "
                                    "have residuals (spec §14)")
        param = schema.parameters.get(residual[1])
        if param is None:
            raise CorruptChainError(f"{where}: the residual {name} names no parameter of the model (spec §8)")
        numel = 1
        for d in param[1]:
            numel *= d
        if (dtype, shape) != (param[0], (numel,)):
            raise CorruptChainError(f"{where}: the residual {name} is {dtype} {list(shape)}; a residual is the "
                                    f"flattened gradient, {param[0]} [{numel}] (spec §14)")
    missing = [k for k in schema.model if f"model/{k}" not in tensors]
    if missing:
        raise CorruptChainError(f"{where}: the anchor lacks model/{missing[0]} (spec §9.1)")


def tensor_metas(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
    """(dtype name, shape) of each tensor."""
    return {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}


# -- state.xor bookkeeping -----------------------------------------------------------------
def xor_step_changes(current: Mapping[str, TensorMeta], row: Iterable[SlotInfo], step: int,
                     where: str, params: Sequence[str] = ()) -> tuple[list[str], list[SlotInfo]]:
    """What one ``state.xor`` step does to the set of tensors (spec §11.6): the names it removes
    (``optimizer/…`` tensors without a slot in the row) and the slots it adds as new tensors
    (``predict/<i>`` slots hold coefficients, not tensors). ``params``: the schema's
    ``optimizer.params``, which name the parameter of an ``adam.w`` slot.

    Raises:
        CorruptChainError: a slot of a tensor that exists with another dtype or shape, a
            ``model/…`` tensor without a slot in the row, or a predicted slot (spec §11.3)
            without its coefficients or with an input of another dtype or shape.
    """
    slots = list(row)
    present: dict[str, SlotInfo] = {s.name: s for s in slots if not s.name.startswith(PREDICT)}
    removed = [n for n in current if n.startswith("optimizer/") and n not in present]
    added = []
    for name, slot in present.items():
        meta = current.get(name)
        if meta is None:
            added.append(slot)
        elif meta != (slot.dtype, slot.shape):
            raise CorruptChainError(f"{where}: xor slot {name} is {slot.dtype} {list(slot.shape)}, but the tensor "
                                    f"it applies to at step {step} is {meta[0]} {list(meta[1])} (spec §11.6)")
    for name in current:
        if name.startswith("model/") and name not in present:
            raise CorruptChainError(f"{where}: step {step} has no xor delta for {name}; every model tensor has "
                                    "a slot in every row (spec §11.3)")
    coefficients = {s.name for s in slots if s.name.startswith(PREDICT)}
    for name, slot in present.items():
        if slot.encoding not in ("adam.v", "adam.w"):
            continue
        i = predicted_param(name, slot.encoding, params)
        if f"{PREDICT}{i}" not in coefficients:
            raise CorruptChainError(f"{where}: step {step}: slot {name} is predicted ({slot.encoding}) but the row "
                                    f"has no coefficients {PREDICT}{i} (spec §11.3)")
        m_name, v_name = moment_names(i)
        # adam.v reads m before and after the step; adam.w the new m and v (spec §11.3.1).
        inputs: list[tuple[str, SlotInfo | TensorMeta | None]] = [(m_name, present.get(m_name))]
        if slot.encoding == "adam.v":
            inputs.append((m_name, current.get(m_name)))
        else:
            inputs.append((v_name, present.get(v_name)))
        for input_name, have in inputs:
            meta = have if have is None or isinstance(have, tuple) else (have.dtype, have.shape)
            if meta is not None and meta != ("float32", slot.shape):
                raise CorruptChainError(f"{where}: step {step}: slot {name} is predicted from {input_name}, which is "
                                        f"{meta[0]} {list(meta[1])}, not float32 {list(slot.shape)} (spec §11.3)")
    return removed, added


def check_anchor(schema: Schema, entry: AnchorEntry, tensors: Mapping[str, TensorMeta], where: str,
                 rules: OptimizerRules | None = None) -> None:
    """An anchor entry and the tensors of its object: :func:`check_anchor_tensors`,
    :func:`check_param_groups` (with ``rules`` for gradient kinds) and :func:`check_extra`."""
    check_anchor_tensors(schema, tensors, where)
    check_structure(entry.optimizer, tensors, len(schema.params), where)
    check_param_groups(schema, entry.param_groups, where, rules)
    check_extra(entry.extra, where)
