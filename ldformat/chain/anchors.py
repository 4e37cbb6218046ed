"""A chain writer's anchors: what an anchor of the live state holds, and how its object is
written (spec §9 "Anchors", §9.1 "Object", §9.3 "Anchor entries").

An anchor holds every state tensor under its stored name (spec §8 "State and stored names")
and, in a ``grad.topk`` chain, the compressor's residuals (spec §14 "Top-k residuals"),
copied to the host so training may go on while it is written. Its object is streamed to the
store (never joined in memory) with its checksum computed on the way; its entry is pending
until the next commit record references it (spec §7.4 "Commit protocol": data first).
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.anchor import anchor_parts, write_anchor_parts
from ..format.jsonvalue import JSON
from ..format.manifest import AnchorEntry, ObjectRef
from ..format.topk import TopK
from .guard import WriterGuard
from .records import anchor_object_path


def anchor_copy(live: dict[str, torch.Tensor], compressor: TopK | None) -> dict[str, torch.Tensor]:
    """CPU copies of the live state tensors, plus the top-k residuals of ``compressor``."""
    tensors = {n: t.to("cpu", copy=True).contiguous() for n, t in live.items()}
    if compressor is not None:
        for name, r in compressor.state_dict().items():
            tensors[f"compressor/{name}"] = r.to("cpu", copy=True).contiguous()
    return tensors


def write_anchor_object(guard: WriterGuard, written: list[str], step: int, tensors: dict[str, torch.Tensor],
                        param_groups: Any, extra: Any, optimizer: JSON) -> AnchorEntry:
    """Write the anchor object of ``step`` (its path appended to ``written``); returns its entry."""
    path = anchor_object_path(step)
    anchor = anchor_parts(tensors, step)  # streamed: the object is never joined in memory
    checksums: list[str] = []  # computed while the object is written
    guard.io(path, lambda: checksums.append(write_anchor_parts(guard.store, path, anchor)))
    written.append(path)
    return AnchorEntry(
        step=step,
        object=ObjectRef(path=path, size=anchor.size, crc32c=checksums[0]),
        param_groups=param_groups,
        extra=extra,
        optimizer=optimizer,
    )
