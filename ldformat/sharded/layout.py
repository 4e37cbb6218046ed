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

from ..errors import CorruptChainError


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


def assemble(layout: Layout, pieces: Mapping[int, torch.Tensor], where: str,
             region: tuple[Sequence[int], Sequence[int]] | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The global tensor, or the block ``region`` = (offsets, lengths) of it, from the ranks'
    local pieces. ``pieces`` must hold every rank whose shard overlaps the block
    (:func:`overlapping`); the layout covers every element (checked when it was parsed). Where
    shards overlap (replicated placements) the first listed wins, and validation compares the
    copies (spec §20.4). ``out``: a tensor of the block's shape and dtype to write it into
    (a new one otherwise)."""
    from ..format.dtypes import parse_dtype

    dtype = parse_dtype(layout.dtype)
    offsets, lengths = (tuple(0 for _ in layout.shape), layout.shape) if region is None else region
    if out is None or tuple(out.shape) != tuple(lengths) or out.dtype != dtype:
        out = torch.empty(tuple(lengths), dtype=dtype)
    for shard in reversed(layout.shards):  # the first listed is written last, so it wins
        block = _intersection(shard, offsets, lengths)
        if block is None:
            continue
        piece = pieces.get(shard.rank)
        if piece is None:
            raise CorruptChainError(f"{where}: rank {shard.rank}'s shard is missing")
        if tuple(piece.shape) != shard.lengths or piece.dtype != dtype:
            raise CorruptChainError(f"{where}: rank {shard.rank}'s shard is {tuple(piece.shape)} {piece.dtype}, "
                                    f"the layout says {shard.lengths} {dtype}")
        lo, hi = block
        out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))] = piece[
            tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, shard.offsets, strict=True))]
    return out


def _intersection(shard: Shard, offsets: Sequence[int], lengths: Sequence[int]
                  ) -> tuple[list[int], list[int]] | None:
    lo = [max(a, b) for a, b in zip(shard.offsets, offsets, strict=True)]
    hi = [min(a + m, b + n) for a, m, b, n in zip(shard.offsets, shard.lengths, offsets, lengths, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def overlapping(layout: Layout, region: tuple[Sequence[int], Sequence[int]] | None) -> set[int]:
    """The ranks whose shard holds part of ``region`` (all of them for the whole tensor)."""
    if region is None:
        return {s.rank for s in layout.shards}
    if any(n == 0 for n in region[1]):
        return set()
    return {s.rank for s in layout.shards if _intersection(s, *region) is not None}


def overlaps_differ(layout: Layout, pieces: Mapping[int, torch.Tensor]) -> list[int]:
    """The ranks whose piece differs, where it overlaps, from a piece listed before it (ranks
    without a piece, such as copy ranks, are skipped)."""
    from ..format.state import bits_view

    differ = []
    shards = [s for s in layout.shards if s.rank in pieces]
    for j, b in enumerate(shards):
        for a in shards[:j]:
            lo = [max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True)]
            hi = [min(x + m, y + n) for x, m, y, n in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            pa = pieces[a.rank][tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, a.offsets, strict=True))]
            pb = pieces[b.rank][tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, b.offsets, strict=True))]
            if not torch.equal(bits_view(pa.contiguous()), bits_view(pb.contiguous())):
                differ.append(b.rank)
                break
    return differ


#: The most cells a layout's coverage check examines (spec §20.2): more fragmented layouts are refused.
MAX_COVERAGE_CELLS = 1 << 20


def check_covered(shape: Sequence[int], shards: Sequence[Shard], where: str) -> None:
    """Every element of ``shape`` lies in some shard. Checked on the grid the shard boundaries
    make, never by allocating the tensor (its shape comes from a file)."""
    if any(n == 0 for n in shape):
        return
    cuts = [sorted({0, n, *(s.offsets[d] for s in shards), *(s.offsets[d] + s.lengths[d] for s in shards)})
            for d, n in enumerate(shape)]
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells * max(len(shards), 1) > MAX_COVERAGE_CELLS:
        raise CorruptChainError(f"{where}: the layout is split into too many pieces to check ({cells} cells)")
    grids = [list(zip(c[:-1], c[1:], strict=True)) for c in cuts]

    def walk(d: int, start: list[int]) -> None:
        if d == len(shape):
            if not any(all(o <= x < o + n for x, o, n in zip(start, s.offsets, s.lengths, strict=True))
                       for s in shards):
                raise CorruptChainError(f"{where}: no shard covers the element at {start}")
            return
        for lo, _ in grids[d]:
            walk(d + 1, [*start, lo])

    walk(0, [])


def parse_shape(v: object, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v):
        raise CorruptChainError(f"{where}: a shape, offset or length is not a list of non-negative integers")
    return tuple(v)


def check_within(shape: Sequence[int], shard: Shard, where: str) -> None:
    if len(shard.offsets) != len(shape) or len(shard.lengths) != len(shape) or any(
            o + n > s for o, n, s in zip(shard.offsets, shard.lengths, shape, strict=True)):
        raise CorruptChainError(f"{where}: rank {shard.rank}'s shard lies outside the global shape {list(shape)}")
