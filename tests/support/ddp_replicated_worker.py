"""One rank of a DDP job in which every rank constructs a Checkpointer (``xor`` or ``lowdiff+``).

``python ddp_replicated_worker.py RANK WORLD OUTDIR MODE``: rank 0 records the replicated
state once, the other ranks' Checkpointers send it their RNG states and data positions; rank 0
saves the live state after every step to ``OUTDIR/live.pt``, and every rank its own RNG state
and data position (start and after every step) to ``OUTDIR/rank<R>.pt``.
"""

from __future__ import annotations

import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ldformat


class Position:
    """A data position of this rank's own (what a StatefulDataLoader would be)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen = rank, 0

    def state_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rank, self.seen = state["rank"], state["seen"]


def main() -> None:
    rank, world, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # "xor/epoch": a scheduler given to the Checkpointer but stepped every 3 steps only, so that
    # rank 0 finalizes a step at the next step's pre-hook, after the next step's all-reduce.
    mode, per_epoch = mode.split("/")[0], mode.endswith("/epoch")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    position = Position(rank)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9) if per_epoch else None
    ck = ldformat.Checkpointer(f"{out}/chain", ddp, optimizer, mode=mode, anchor_every=3, batch_steps=2,
                               data=position, scheduler=scheduler)
    states = []
    mine = [(torch.get_rng_state(), position.state_dict())]
    for step in range(1, 8):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        position.seen += 4
        optimizer.step()
        if scheduler is not None and step % 3 == 0:
            scheduler.step()
        states.append(({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(optimizer.state_dict())))
        mine.append((torch.get_rng_state(), position.state_dict()))
    print(f"rank {rank} closed {ck.close()}", flush=True)
    torch.save(mine, f"{out}/rank{rank}.pt")
    if rank == 0:
        torch.save(states, f"{out}/live.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
