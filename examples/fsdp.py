"""FSDP2 on a CPU: checkpoint every step at world size 2, resume exactly at world size 4.

    python examples/fsdp.py --out runs/fsdp

1. Two processes (gloo) train a small FSDP2-sharded MLP for ``--steps`` steps; every rank
   runs a ``Checkpointer`` on ``OUT/chain``.
2. Four processes resume from the chain's newest committed step, check that the restored
   state equals that step's full state (gathered from the shards) bit for bit, and train on,
   checkpointing to ``OUT/chain-w4`` (a chain keeps the layout it was written with).
3. The parent process, with no process group, validates both chains and materializes the
   last step of the first one as a plain ``state_dict``.

On GPUs the same code runs under ``torchrun`` with ``init_device_mesh("cuda", ...)``.
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ldformat


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 101)  # 101 rows: uneven shards (51/50 on 2 ranks, 26/25/25/25 on 4)
        self.norm = nn.LayerNorm(101)
        self.down = nn.Linear(101, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, start: int, stop: int) -> None:
    for step in range(start + 1, stop + 1):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank * 10_007 + step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def worker(rank: int, world: int, port: int, out: Path, steps: int, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        model, optimizer = build(world)
        if phase == "train":
            ck = ldformat.Checkpointer(out / "chain", model, optimizer, mode="xor")
            train(model, optimizer, rank, 0, steps)
            ck.close()
            return
        start = ldformat.resume(out / "chain", model, optimizer)  # each rank takes its slices
        check_restored(model, optimizer, out / "chain", start, rank)
        ck = ldformat.Checkpointer(out / "chain-w4", model, optimizer, mode="xor", step=start)  # numbering goes on
        train(model, optimizer, rank, start, start + steps // 2)
        ck.close()
    finally:
        dist.destroy_process_group()


def check_restored(model: nn.Module, optimizer: torch.optim.Optimizer, chain: Path, step: int, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # a collective
    if rank == 0:
        stored = ldformat.open_reader(chain).materialize(step)["model"]
        same = all(torch.equal(full[k].view(torch.int32), stored[k].view(torch.int32)) for k in stored)
        print(f"world 4 resumed step {step}: restored state equals the chain's bit for bit: {same}", flush=True)
        if not same:
            raise SystemExit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for chain in ("chain", "chain-w4"):
        if (args.out / chain).exists():
            raise SystemExit(f"{args.out / chain} exists; pass another --out")
    mp.spawn(worker, args=(2, free_port(), args.out, args.steps, "train"), nprocs=2)
    mp.spawn(worker, args=(4, free_port(), args.out, args.steps, "resume"), nprocs=4)
    for chain in ("chain", "chain-w4"):
        report = ldformat.validate(args.out / chain)
        verdict = "ok" if report.ok else "INVALID"
        print(f"{chain}: {verdict}, {report.steps} committed steps, latest {report.latest_step}")
        if not report.ok:
            raise SystemExit(1)
    state = ldformat.open_reader(args.out / "chain").materialize()
    print(f"materialized step {state['step']}: {sorted(state['model'])}")


if __name__ == "__main__":
    main()
