"""DTensors as the format sees them (spec §20): a rank stores the local shard of each DTensor.
"""

from __future__ import annotations

import torch


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


def local_shard(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of this rank's part of the DTensor ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    if tuple(lengths) != tuple(local(t).shape):  # padded shards would not match: refuse, never guess
        raise ValueError(f"the local shard of a DTensor has shape {tuple(local(t).shape)}, not {tuple(lengths)}")
    return tuple(int(o) for o in offsets), tuple(int(n) for n in lengths)
