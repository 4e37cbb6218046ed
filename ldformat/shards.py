"""DTensors as the format sees them (spec §20): a rank stores its local shard, and a layout
says where each shard sits in the global tensor.

``torch.distributed.tensor`` is imported lazily: a process that never builds a DTensor never
pays for it, and a torch without distributed support still reads chains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptChainError


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (shares its storage), else ``t``."""
    if is_dtensor(t):
        return t.to_local()  # type: ignore[no-any-return,attr-defined]
    return t


def has_dtensors(model: torch.nn.Module) -> bool:
    """Whether any model state is a DTensor (FSDP2, tensor parallel): then the chain is sharded."""
    return any(is_dtensor(t) for t in model.state_dict(keep_vars=True).values())


@dataclass(frozen=True)
class Shard:
    """Where one rank's local tensor sits in the global tensor."""

    rank: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "offsets": list(self.offsets), "lengths": list(self.lengths)}

    def region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))


@dataclass(frozen=True)
class Layout:
    """A global tensor and the shards that hold it (spec §20.2 ``tensors``)."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "shards": [s.to_dict() for s in self.shards]}

    def of_rank(self, rank: int) -> Shard | None:
        return next((s for s in self.shards if s.rank == rank), None)

    @property
    def split(self) -> bool:
        """Whether some rank holds less than the whole tensor."""
        return any(s.lengths != self.shape for s in self.shards)


def local_shard(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of this rank's part of the DTensor ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    if tuple(lengths) != tuple(local(t).shape):  # padded shards would not match: refuse, never guess
        raise ValueError(f"the local shard of a DTensor has shape {tuple(local(t).shape)}, not {tuple(lengths)}")
    return tuple(int(o) for o in offsets), tuple(int(n) for n in lengths)


def assemble(layout: Layout, pieces: Mapping[int, torch.Tensor], where: str) -> torch.Tensor:
    """The global tensor from each rank's local piece: every element covered, overlaps identical."""
    from .jsonvalue import parse_dtype
    from .state import bits_view

    dtype = parse_dtype(layout.dtype)
    out = torch.empty(layout.shape, dtype=dtype)
    covered = torch.zeros(layout.shape, dtype=torch.bool)
    for shard in layout.shards:
        piece = pieces.get(shard.rank)
        if piece is None:
            raise CorruptChainError(f"{where}: rank {shard.rank}'s shard is missing")
        if tuple(piece.shape) != shard.lengths or piece.dtype != dtype:
            raise CorruptChainError(f"{where}: rank {shard.rank}'s shard is {tuple(piece.shape)} {piece.dtype}, "
                                    f"the layout says {shard.lengths} {dtype}")
        region = shard.region()
        seen = covered[region]
        if bool(seen.any()):  # a replicated part: the copies must agree bit for bit
            if not torch.equal(bits_view(out[region].contiguous())[seen], bits_view(piece.contiguous())[seen]):
                raise CorruptChainError(f"{where}: rank {shard.rank}'s copy differs from an earlier rank's")
        out[region] = piece
        covered[region] = True
    if not bool(covered.all()):
        raise CorruptChainError(f"{where}: the shards do not cover the tensor")
    return out


def parse_shape(v: object, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v):
        raise CorruptChainError(f"{where}: a shape, offset or length is not a list of non-negative integers")
    return tuple(v)


def check_within(shape: Sequence[int], shard: Shard, where: str) -> None:
    if len(shard.offsets) != len(shape) or len(shard.lengths) != len(shape) or any(
            o + n > s for o, n, s in zip(shard.offsets, shard.lengths, shape, strict=True)):
        raise CorruptChainError(f"{where}: rank {shard.rank}'s shard lies outside the global shape {list(shape)}")
