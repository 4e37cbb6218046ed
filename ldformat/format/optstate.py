"""The optimizer's ``state_dict()`` as stored tensors plus a JSON structure (spec §8.2).

Most optimizers keep only tensors in their per-parameter state: those are stored as
``optimizer/<i>/<key>`` and need nothing else. Everything else an optimizer's
``state_dict()`` holds is kept, so that the round trip is structurally exact:

- per-parameter values that are not tensors (Python numbers, ``None``, strings, dtypes,
  tuples, nested lists and dicts, with any tensors inside them), and per-parameter state
  dicts that are empty;
- entries of ``state`` whose key is not a parameter index (an optimizer's global state);
- top-level entries besides ``state`` and ``param_groups``.

They form the *optimizer structure*, an encoded JSON object (§6) with members ``state`` and
``top``, stored in anchor and step entries as ``optimizer``. Tensors inside it are stored like
any state tensor, under ``optimizer/ref/<location>``, and referenced as ``{"$ref": name}``. A chain
whose optimizer keeps only tensors has no structure at all: its records are those of 1.1.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
import torch

from ..errors import CorruptChainError, UnsupportedStateError
from .dtensors import local
from .dtypes import dtype_name
from .jsonvalue import JSON, Decoded, TensorRef, decode, encode

REF_PREFIX = "optimizer/ref/"
_MEMBERS = ("state", "top", "absent")
_STANDARD = ("state", "param_groups")


def is_param_key(key: object, n_params: int) -> bool:
    """Whether ``key`` of ``state_dict()["state"]`` is a parameter index."""
    return isinstance(key, int) and not isinstance(key, bool) and 0 <= key < n_params


def _storable(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_sparse


def _checked(t: torch.Tensor, what: str) -> torch.Tensor:
    if not _storable(t):
        raise UnsupportedStateError(f"{what} is not a dense strided tensor; format 1.x stores dense tensors only")
    dtype_name(t.dtype)  # refuses dtypes the format has no name for
    return local(t).detach()  # a DTensor's local shard (spec §20)


def _segment(key: object) -> str:
    # A location segment of a reference name: '%' and '/' escaped, so names cannot run together.
    return quote(str(key), safe="")


def _with_refs(value: object, path: str, tensors: dict[str, torch.Tensor], named: dict[int, str]) -> object:
    """``value`` with each tensor replaced by a :class:`TensorRef` named by its location."""
    if isinstance(value, torch.Tensor):
        name = named.get(id(value))  # one tensor held in two places is stored once
        if name is None:
            if path in tensors:
                raise UnsupportedStateError(f"optimizer state: two locations map to {path!r} (keys that differ only "
                                            "in type, such as 0 and '0'); format 1.x cannot name them apart")
            tensors[path] = _checked(value, f"optimizer state tensor at {path[len(REF_PREFIX):]!r}")
            name = named[id(value)] = path
        return TensorRef(name)
    if isinstance(value, (list, tuple)):
        out = [_with_refs(v, f"{path}/{j}", tensors, named) for j, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, Mapping):
        return {k: _with_refs(v, f"{path}/{_segment(k)}", tensors, named) for k, v in value.items()}
    return value


def split_state(sd: Mapping[Any, Any], n_params: int) -> tuple[dict[str, torch.Tensor], JSON]:
    """``optimizer.state_dict()`` -> (stored tensors by name, the encoded structure or ``None``).

    The tensors are the state dict's own (no copies). A tensor inside the structure is named
    by where it is (``optimizer/ref/state/<key>/...``, ``optimizer/ref/top/<key>/...``), so
    its name stays the same from step to step. Raises UnsupportedStateError for a value the
    format cannot hold, naming where it is.
    """
    state = sd.get("state", {})
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(f"optimizer.state_dict()['state'] is a {type(state).__name__}, not a dict")
    tensors: dict[str, torch.Tensor] = {}
    named: dict[int, str] = {}
    rest: dict[object, object] = {}
    for key, value in state.items():
        if is_param_key(key, n_params) and isinstance(value, Mapping):
            leftover = {}
            for k, v in value.items():
                if isinstance(k, str) and _storable(v):
                    tensors[f"optimizer/{key}/{k}"] = _checked(v, f"optimizer state {k!r} of parameter {key}")
                else:
                    leftover[k] = v
            if leftover or not value:
                rest[key] = _with_refs(leftover, f"{REF_PREFIX}state/{_segment(key)}", tensors, named)
        else:
            rest[key] = _with_refs(value, f"{REF_PREFIX}state/{_segment(key)}", tensors, named)
    top = {k: _with_refs(v, f"{REF_PREFIX}top/{_segment(k)}", tensors, named)
           for k, v in sd.items() if k not in ("state", "param_groups")}
    structure: dict[str, JSON] = {}
    if rest:
        structure["state"] = encode(rest, "optimizer state")
    if top:
        structure["top"] = encode(top, "optimizer.state_dict()")
    absent = [k for k in _STANDARD if k not in sd]  # an optimizer whose state_dict is its own (Magma)
    if absent:
        structure["absent"] = list(absent)
    return tensors, (structure or None)


def live_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], JSON]:
    """:func:`split_state` of the live optimizer (its tensors, not copies)."""
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    return split_state(optimizer.state_dict(), n_params)


def decode_structure(data: JSON, n_params: int, where: str) -> tuple[dict[Decoded, Decoded], dict[Decoded, Decoded]]:
    """The decoded ``state`` and ``top`` members (with :class:`TensorRef` placeholders).

    Raises CorruptChainError when the structure is malformed (spec §8.2).
    """
    if data is None:
        return {}, {}
    if not isinstance(data, dict) or not set(data) <= set(_MEMBERS):
        raise CorruptChainError(f"{where}: the optimizer structure is not an object of 'state', 'top' and "
                                "'absent' (spec §8.2)")
    absent = data.get("absent", [])
    if not isinstance(absent, list) or not set(absent) <= set(_STANDARD) or len(set(absent)) != len(absent):
        raise CorruptChainError(f"{where}: the optimizer structure's absent must list 'state' or 'param_groups' "
                                "at most once each (spec §8.2)")
    state = decode(data.get("state", {}), f"{where} optimizer structure")
    top = decode(data.get("top", {}), f"{where} optimizer structure")
    if not isinstance(state, dict) or not isinstance(top, dict):
        raise CorruptChainError(f"{where}: the optimizer structure's state and top must be objects (spec §8.2)")
    if "state" in top or "param_groups" in top:
        raise CorruptChainError(f"{where}: the optimizer structure's top repeats 'state' or 'param_groups' (spec §8.2)")
    return state, top


def _refs(value: Decoded, out: list[str]) -> list[str]:
    if isinstance(value, TensorRef):
        out.append(value.name)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _refs(v, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _refs(k, out)
            _refs(v, out)
    return out


def check_structure(data: JSON, names: Collection[str], n_params: int, where: str) -> None:
    """What :func:`join_state` needs (spec §8.2): a well-formed structure whose references all
    name tensors of the state (``names``), and whose parameter entries are dicts wherever the
    state has ``optimizer/<i>/<key>`` tensors of that parameter."""
    state, top = decode_structure(data, n_params, where)
    referenced = set(_refs(state, _refs(top, [])))
    for name in sorted(referenced):
        if not name.startswith(REF_PREFIX) or name not in names:
            raise CorruptChainError(f"{where}: the optimizer structure references {name!r}, which is not an "
                                    f"{REF_PREFIX}... tensor of this step's state (spec §8.2)")
    for name in names:
        if name.startswith(REF_PREFIX) and name not in referenced:
            raise CorruptChainError(f"{where}: the state holds {name}, which the optimizer structure does not "
                                    "reference (spec §8.2)")
    direct = {n.split("/")[1] for n in names if n.startswith("optimizer/") and not n.startswith(REF_PREFIX)}
    for key, value in state.items():
        if is_param_key(key, n_params) and str(key) in direct and not isinstance(value, dict):
            raise CorruptChainError(f"{where}: the optimizer structure gives parameter {key} a "
                                    f"{type(value).__name__}, but it has state tensors (spec §8.2)")


def _resolve(value: Decoded, tensors: Mapping[str, torch.Tensor], where: str) -> Decoded:
    if isinstance(value, TensorRef):
        t = tensors.get(value.name)
        if t is None:
            raise CorruptChainError(f"{where}: the optimizer structure references {value.name}, which the state "
                                    "lacks (spec §8.2)")
        return t.detach()
    if isinstance(value, list):
        return [_resolve(v, tensors, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, tensors, where) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, tensors, where) for k, v in value.items()}
    return value


def join_state(tensors: Mapping[str, torch.Tensor], structure: JSON, param_groups: list[Any], n_params: int,
               where: str) -> dict[str, Any]:
    """The ``optimizer.state_dict()`` that ``tensors`` and ``structure`` stand for (checked by
    :func:`check_structure` first)."""
    check_structure(structure, tensors, n_params, where)
    state: dict[Any, Any] = {}
    for name, t in tensors.items():
        if name.startswith("optimizer/") and not name.startswith(REF_PREFIX):
            i_text, _, key = name[len("optimizer/"):].partition("/")
            state.setdefault(int(i_text), {})[key] = t.detach()
    rest, top = decode_structure(structure, n_params, where)
    resolved = _resolve(rest, tensors, where)
    assert isinstance(resolved, dict)  # _resolve keeps a dict a dict
    for key, value in resolved.items():
        if is_param_key(key, n_params) and isinstance(value, dict):
            state.setdefault(key, {}).update(value)
        else:
            state[key] = value
    params = sorted(k for k in state if is_param_key(k, n_params))
    ordered = {k: state[k] for k in params}
    ordered.update((k, v) for k, v in state.items() if not is_param_key(k, n_params))
    out: dict[Any, Any] = {"state": ordered, "param_groups": param_groups}
    out.update(_resolve(top, tensors, where))  # type: ignore[call-overload]
    for key in absent_members(structure):
        del out[key]
    return out


def absent_members(structure: JSON) -> list[str]:
    """The standard members (``state``, ``param_groups``) the optimizer's ``state_dict()`` lacks."""
    absent = structure.get("absent", []) if isinstance(structure, dict) else []
    return [k for k in absent if isinstance(k, str)] if isinstance(absent, list) else []


def probe_unstorable_state(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before training, an optimizer whose state the format cannot hold.

    An optimizer creates its state at its first step, so the state of a fresh optimizer says
    nothing. This steps a miniature twin (the same class and param groups, over small CPU
    stand-ins of the parameters, every dimension at most 4, with gradients of ones) once and
    splits its state. The twin shares nothing with the live objects, so training is not
    touched. A twin that cannot be built or stepped proves nothing and is ignored: the real
    state is still checked at every capture.

    Raises:
        UnsupportedStateError: naming the value the format cannot hold.
    """
    if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        split_state(optimizer.state_dict(), sum(len(g["params"]) for g in optimizer.param_groups))
        return
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):  # an optimizer that draws random numbers must not move the user's
            state_dict = _step_twin(optimizer)
    except Exception:  # the twin proves nothing: custom constructors, devices, closures...
        return
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    split_state(state_dict, sum(len(g["params"]) for g in optimizer.param_groups))


def _step_twin(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = []
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            twin = torch.ones([min(d, 4) for d in p.shape], dtype=p.dtype, device="cpu")
            params.append(twin.requires_grad_(p.requires_grad))
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    twin_optimizer = type(optimizer)(groups)  # type: ignore[call-arg]
    for g in twin_optimizer.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.ones_like(p)
    twin_optimizer.step()
    return twin_optimizer.state_dict()
