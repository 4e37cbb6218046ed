"""One rank of an HSDP job whose BatchNorm statistics differ between the replicas, for
tests/sharded/test_sharded_buffers.py.

Run as ``python sharded_bn_job.py RANK WORLD OUTDIR RUN [RUN ...]`` with ``MASTER_ADDR`` and
``MASTER_PORT`` set (gloo on CPU). The model is FSDP2 ``fully_shard`` on a mesh
``(WORLD, 1)`` named ``("replicate", "shard")``: every rank holds the same blocks, so the
layout alone would make every rank above 0 a copy rank (spec §20.2). Each rank trains on its
own data, so the BatchNorm running statistics, which FSDP2 does not synchronize, drift apart.
The runs, in order, in one process group:

* ``auto``: a Checkpointer with the default ``copy_ranks``, ``STEPS`` steps;
* ``resume``: ``ldformat.resume`` of that chain at the same layout, no training;
* ``forced``: a Checkpointer with ``copy_ranks=True`` on a new chain: rank 0 must stop at the
  first step (it must be the last run: the job fails there).

At world 4 the mesh is ``(2, 2)``: ranks 0 and 1 shard the model, ranks 2 and 3 are their
replicas, copy ranks of 0 and 1 when forced (``copy_ranks=True``). The runs:

* ``pairs``: each copy rank sees its source's data (rank ``r`` the data of ``r % 2``), so its
  statistics are its source's while rank 1's differ from rank 0's: the chain records them;
* ``stray``: rank 3 sees rank 0's data instead of rank 1's, its source's: rank 0 must stop at
  the first step (the last run).

After every step (and after ``resume``) each rank records the gathered full state and its own
buffers in ``OUTDIR/<run>.rank<R>.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sharded_train import gather
from torch import nn

STEPS = 5


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.lin2 = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = BNNet()
    shape = (2, 2) if world == 4 else (world, 1)
    fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def own_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def run(name: str, rank: int, world: int, out: Path) -> None:
    import ldformat

    model, optimizer = build(world)
    record: dict[str, Any] = {"steps": {}, "buffers": {}}
    if name == "resume":
        step = ldformat.resume(out / "auto", model, optimizer)
        record["steps"][step] = gather(model, optimizer)
        record["buffers"][step] = own_buffers(model)
    else:
        forced = name in ("forced", "pairs", "stray")
        ck = ldformat.Checkpointer(out / name, model, optimizer, mode="xor", anchor_every=3, batch_steps=1,
                                   copy_ranks=True if forced else None)
        seen = {"pairs": rank % 2, "stray": 0 if rank == 3 else rank % 2}.get(name, rank)  # whose data
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(1000 * seen + step)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            print(f"{name} step {step}", flush=True)
            record["steps"][step] = gather(model, optimizer)
            record["buffers"][step] = own_buffers(model)
        ck.close()
    torch.save(record, out / f"{name}.rank{rank}.pt")
    dist.barrier()


def main() -> None:
    rank, world, out, runs = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for name in runs:
            run(name, rank, world, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
