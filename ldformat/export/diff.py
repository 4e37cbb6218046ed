"""Comparing two states tensor by tensor (``ldtools diff``), by stored name (spec §8 "State and stored names").

:func:`diff_steps` replays a step of a chain, or of two chains, and :func:`diff_states` says,
per tensor, whether its bits changed, in how many elements, and by how much.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..chain.reader import ChainReader
from ..sharded.chain import ShardedReader, open_reader

__all__ = ["TensorDiff", "diff_states", "diff_steps", "diff_tensor", "stored_tensors"]


def change_ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (0.0 if a == 0 else math.inf)


@dataclass(frozen=True, kw_only=True)
class TensorDiff:
    """How tensor ``name`` differs between state A and state B.

    ``status``: ``"same"``, ``"changed"``, ``"only_a"``, ``"only_b"`` or ``"mismatch"`` (dtype or
    shape differ: no numbers). ``changed_fraction`` counts elements whose bits differ;
    ``first_index`` is the first such element (flat index, row-major).
    """

    name: str
    status: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    max_abs: float | None = None
    relative_norm: float | None = None
    changed_fraction: float | None = None
    first_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "dtype": self.dtype, "shape": list(self.shape),
                "max_abs": self.max_abs, "relative_norm": self.relative_norm,
                "changed_fraction": self.changed_fraction, "first_index": self.first_index}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def diff_tensor(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Compare one tensor of two states (bits for what changed, float64 for the sizes)."""
    dtype = str(a.dtype).removeprefix("torch.")
    if a.dtype != b.dtype or a.shape != b.shape:
        return TensorDiff(name=name, status="mismatch", dtype=f"{dtype} / {str(b.dtype).removeprefix('torch.')}",
                          shape=tuple(a.shape))
    changed = _bits(a) != _bits(b)
    n = int(changed.sum())
    if n == 0:
        return TensorDiff(name=name, status="same", dtype=dtype, shape=tuple(a.shape), max_abs=0.0,
                          relative_norm=0.0, changed_fraction=0.0)
    first = int(changed.nonzero()[0, 0])
    fa = a.detach().reshape(-1).to(torch.float64) if not a.is_complex() else a.detach().reshape(-1).abs().double()
    fb = b.detach().reshape(-1).to(torch.float64) if not b.is_complex() else b.detach().reshape(-1).abs().double()
    d = fa - fb
    return TensorDiff(name=name, status="changed", dtype=dtype, shape=tuple(a.shape),
                      max_abs=float(d.abs().max()), relative_norm=change_ratio(float(d.norm()), float(fa.norm())),
                      changed_fraction=n / changed.numel(), first_index=first)


def diff_states(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[TensorDiff]:
    """Every tensor of ``a`` and ``b`` (stored names, spec §8), in ``a``'s order then ``b``'s extras."""
    out = [diff_tensor(n, t, b[n]) if n in b else TensorDiff(name=n, status="only_a") for n, t in a.items()]
    out += [TensorDiff(name=n, status="only_b") for n in b if n not in a]
    return out


def diff_steps(chain: str | os.PathLike[str] | ChainReader | ShardedReader, step_a: int, step_b: int,
               other: str | os.PathLike[str] | ChainReader | ShardedReader | None = None) -> list[TensorDiff]:
    """:func:`diff_states` of ``step_a`` of ``chain`` and ``step_b`` of ``other`` (default the
    same chain). A sharded chain's state is the full one (spec §20.4), by FQN."""
    ra = chain if isinstance(chain, (ChainReader, ShardedReader)) else open_reader(chain)
    rb = ra if other is None else other if isinstance(other, (ChainReader, ShardedReader)) else open_reader(other)
    a = {n: t.clone() for n, t in stored_tensors(ra, step_a).items()}  # a replayer's own tensors
    return diff_states(a, stored_tensors(rb, step_b))


def stored_tensors(reader: ChainReader | ShardedReader, step: int) -> dict[str, torch.Tensor]:
    """The tensors of ``step``'s state by stored name (spec §8): ``model/<FQN>`` and
    ``optimizer/<i>/<key>``. A sharded chain's are the full tensors, assembled from the shards
    (:meth:`ShardedReader.materialize`), under the names a plain chain of the same model has."""
    if isinstance(reader, ChainReader):
        return reader.stored_tensors(step)
    state = reader.materialize(step)
    schema = reader.ranks[0].root.schema
    aliases = {e["name"] for e in schema["model"] if e.get("alias_of") is not None}
    out = {f"model/{n}": t for n, t in state["model"].items() if n not in aliases and isinstance(t, torch.Tensor)}
    for i, entry in state["optimizer"].get("state", {}).items():
        if isinstance(entry, dict):
            out.update({f"optimizer/{i}/{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out
