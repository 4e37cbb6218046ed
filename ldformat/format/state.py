"""What "state" means and how live objects map onto stored names (spec §8).

The training state ``M_s`` is the model's ``state_dict`` (parameters and persistent
buffers), the full optimizer state (per-parameter tensors and the param groups) and small
extra state. Stored tensor names are::

    model/<state_dict key>          one entry per storage; tied keys are aliases
    optimizer/<param index>/<key>   per-parameter optimizer state tensors, in optimizer order
    optimizer/ref/<location>        tensors inside the optimizer structure (spec §8.2)
    compressor/<parameter name>     top-k error-feedback residuals of rank 0 (anchors only)
    compressor@<r>/<parameter name> the residuals of rank r >= 1 (data-parallel lowdiff)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, TypedDict

import torch

from ..errors import UnsupportedStateError, UsageError
from .dtensors import local
from .dtypes import dtype_name
from .jsonvalue import JSON, Decoded, encode

Role = Literal["parameter", "buffer"]
"""The role of a ``schema.model`` entry (spec §5.6.1)."""


class ModelEntry(TypedDict):
    """One ``schema.model`` entry (spec §5.6.1), as :func:`model_schema` makes it."""

    name: str
    role: Role
    dtype: str
    shape: list[int]
    alias_of: str | None


ParamGroup: TypeAlias = dict[Decoded, Decoded]
"""A decoded param group (spec §8): ``Optimizer.param_groups[g]`` with ``params`` as indices.

Keys are strings, except in a group whose ``$items`` encoding gives it others.
"""


@dataclass
class TrainingState:
    """A materialized state: tensors keyed by stored name plus the decoded JSON parts."""

    tensors: dict[str, torch.Tensor]
    param_groups: list[ParamGroup]
    extra: dict[Decoded, Decoded] = field(default_factory=dict)


def model_schema(model: torch.nn.Module) -> list[ModelEntry]:
    """One entry per ``state_dict`` key: role, dtype, shape and the key it aliases."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: dict[int, str] = {}
    entries: list[ModelEntry] = []
    for name, value in model.state_dict(keep_vars=True).items():  # a DTensor: its local shard (spec §20)
        if not isinstance(value, torch.Tensor):
            raise UnsupportedStateError(
                f"model state {name!r} is a {type(value).__name__}, not a tensor; "
                "format 1.x stores tensors only (keep such state in `extra`)"
            )
        if value.is_sparse or value.layout != torch.strided:
            raise UnsupportedStateError(f"model state {name!r} is not a dense strided tensor")
        alias_of = seen.get(id(value))
        if alias_of is None:
            seen[id(value)] = name
        value = local(value)
        entries.append(
            {
                "name": name,
                "role": "parameter" if name in params else "buffer",
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
                "alias_of": alias_of,
            }
        )
    _refuse_partial_overlap(model, entries)
    return entries


def _refuse_partial_overlap(model: torch.nn.Module, entries: list[ModelEntry]) -> None:
    sd = model.state_dict(keep_vars=True)
    owners: dict[int, str] = {}
    for e in entries:
        if e["alias_of"] is not None:
            continue
        t = local(sd[e["name"]])
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in owners:
            raise UnsupportedStateError(
                f"model state {e['name']!r} shares storage with {owners[ptr]!r} without being the "
                "same tensor; format 1.x supports tied weights only as identical tensors"
            )
        owners[ptr] = e["name"]


def live_model_tensors(model: torch.nn.Module, schema: Sequence[ModelEntry]) -> dict[str, torch.Tensor]:
    """``model/<name>`` -> live tensor, for every non-alias entry."""
    sd = model.state_dict(keep_vars=True)
    out = {}
    for e in schema:
        if e["alias_of"] is None:
            out[f"model/{e['name']}"] = local(sd[e["name"]]).detach()
    return out


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model name of every optimizer parameter, in optimizer order."""
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise UnsupportedStateError(
                    "the optimizer holds a parameter that is not a parameter of the model; "
                    "pass the model that owns every optimized parameter"
                )
            names.append(by_id[id(p)])
    return names


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def encode_param_groups(optimizer: torch.optim.Optimizer, *, with_params: bool) -> list[JSON]:
    """The param groups as JSON: ``params`` as indices (as in ``Optimizer.state_dict``)."""
    out = []
    index = 0
    for i, group in enumerate(optimizer.param_groups):
        body: dict[str, object] = {}
        for k, v in group.items():
            if k == "params":
                continue
            body[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v  # tensors inline (spec §6.1)
        n = len(group["params"])
        if with_params:
            body["params"] = list(range(index, index + n))
        index += n
        out.append(encode(body, f"param_groups[{i}]"))
    return out


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> tuple[str, bool]:
    """(stored class name, whether a reader can rebuild it for gradient replay)."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}", True
    return f"{cls.__module__}.{cls.__qualname__}", False


def resolve_implementation(optimizer: torch.optim.Optimizer) -> list[JSON]:
    """The kernel path each param group takes: ``fused``, ``foreach`` or ``for-loop`` (strings,
    recorded in the root's ``environment``)."""
    out: list[JSON] = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            out.append("fused")
        elif group.get("foreach"):
            out.append("foreach")
        elif group.get("foreach") is None and "foreach" in group:
            try:
                from torch.optim.optimizer import _default_to_fused_or_foreach

                _, foreach = _default_to_fused_or_foreach(
                    group["params"], bool(group.get("differentiable", False)), use_fused=False
                )
            except Exception:  # private API; the recorded value is informative only
                foreach = False
            out.append("foreach" if foreach else "for-loop")
        else:
            out.append("for-loop")
    return out


def check_schema_matches(stored: Sequence[ModelEntry], live: Sequence[ModelEntry], where: str) -> None:
    if stored != live:
        s = {e["name"]: e for e in stored}
        lv = {e["name"]: e for e in live}
        for name in sorted(set(s) | set(lv)):
            if s.get(name) != lv.get(name):
                raise UsageError(
                    f"{where}: the model does not match the chain's schema at {name!r} "
                    f"(chain: {s.get(name)}, model: {lv.get(name)})"
                )
        raise UsageError(f"{where}: the model's state_dict order differs from the chain's schema")


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """An unsigned-integer view of the same bytes (what deltas store and tests compare)."""
    size = t.element_size()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if t.dtype == view_dtype:
        return t
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(view_dtype)
