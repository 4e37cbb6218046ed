"""Top-k compression as a DDP communication hook (LowDiff; spec §20.5).

Each rank selects the top-k entries of every parameter's gradient (with its own
per-parameter residual, not per bucket: DDP rebuilds its buckets after the first
iteration), all ranks all-gather the (index, value) pairs, and every rank rebuilds the same
dense average. The union of the gathered indices is what the optimizer consumes: it is
handed to the :class:`~ldformat.TopK` so that a ``grad.topk`` chain records exactly that.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

from ..topk import TopK


class TopKCommState:
    """State of :func:`topk_comm_hook`: the compressor and parameter names.

    Args:
        topk: the compressor (its residuals are this rank's).
        model: the module wrapped by DDP (for parameter names).
        process_group: defaults to the world.
    """

    def __init__(self, topk: TopK, model: torch.nn.Module, process_group: Any = None) -> None:
        self.topk = topk
        self.process_group = process_group
        self.names = {id(p): name for name, p in model.named_parameters()}


def topk_comm_hook(state: TopKCommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``ddp_model.register_comm_hook(state, topk_comm_hook)``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    params = bucket.parameters()
    grads = bucket.gradients()
    names = [state.names[id(p)] for p in params]
    selected = [state.topk.select(name, g.reshape(-1).clone()) for name, g in zip(names, grads, strict=True)]
    sizes = [idx.numel() for idx, _ in selected]
    indices = torch.cat([idx for idx, _ in selected])
    values = torch.cat([v for _, v in selected])
    gathered_idx = [torch.empty_like(indices) for _ in range(world)]
    gathered_val = [torch.empty_like(values) for _ in range(world)]
    # On gloo, chain the two futures with collect_all: a wait() nested in then() can hang.
    f_idx = dist.all_gather(gathered_idx, indices, group=group, async_op=True).get_future()
    f_val = dist.all_gather(gathered_val, values, group=group, async_op=True).get_future()
    buffer = bucket.buffer()
    numels = [g.numel() for g in grads]

    def decompress(_: Any) -> torch.Tensor:
        out = torch.zeros_like(buffer)
        offset = 0
        starts = []
        for n in numels:
            starts.append(offset)
            offset += n
        for r in range(world):  # same order on every rank: identical bits everywhere
            pos = 0
            for j, k in enumerate(sizes):
                seg = out[starts[j] : starts[j] + numels[j]]
                seg.index_add_(0, gathered_idx[r][pos : pos + k], gathered_val[r][pos : pos + k])
                pos += k
        out.div_(world)
        pos = 0
        for j, k in enumerate(sizes):
            union = torch.cat([gathered_idx[r][pos : pos + k] for r in range(world)])
            state.topk.indices[names[j]] = torch.unique(union, sorted=True)
            pos += k
        state.topk.generation += 1
        return out

    return torch.futures.collect_all([f_idx, f_val]).then(decompress)
