"""One rank of an FSDP2 job (gloo, CPU) that checkpoints every step, for the crash tests.

``python sharded_crash_worker.py RANK WORLD OUTDIR STEPS [--resume] [--reference] [--fault-after N]``

The data of step ``s`` on rank ``r`` comes from a generator seeded by ``(r, s)``, so that a
resumed run sees what the uninterrupted one saw without any data position. ``--reference``
trains without a Checkpointer and saves the gathered full state after every step (rank 0);
``--fault-after N`` makes this rank's object writes fail after its first N (a full disk).
The worker prints ``step S`` after each step, so that the test can kill it mid-run.
"""

from __future__ import annotations

import copy
import errno
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

STEPS_DEFAULT = 30


class Net(nn.Module):
    """Uneven rows (97 over 2 ranks: 49/48), a LayerNorm, a buffer that changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 97)
        self.norm = nn.LayerNorm(97)
        self.b = nn.Linear(97, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(torch.relu(self.norm(self.a(x))))


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(4, 16, generator=g)


def gathered(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in msd.items()}, copy.deepcopy(osd)


def inject_write_fault(after: int) -> None:
    """This rank's data-object writes (anchors, deltas) fail with ENOSPC after its first ``after``."""
    from ldformat.stores import LocalStore

    calls = {"n": 0}

    def failing(original: Callable[..., None]) -> Callable[..., None]:
        def write(self: LocalStore, path: str, data: object) -> None:
            if path.startswith(("anchors/", "deltas/")):
                calls["n"] += 1
                if calls["n"] > after:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            original(self, path, data)

        return write

    LocalStore.write = failing(LocalStore.write)  # type: ignore[method-assign]
    LocalStore.write_parts = failing(LocalStore.write_parts)  # type: ignore[method-assign]


def main() -> None:
    import torch.distributed as dist

    import ldformat

    rank, world, outdir, steps = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    flags = sys.argv[5:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    model, optimizer = build(world)
    chain = outdir / "chain"
    start = 0
    ck = None
    if "--fault-after" in flags:
        inject_write_fault(int(flags[flags.index("--fault-after") + 1]))
    if "--reference" not in flags:
        if "--resume" in flags:
            start = ldformat.resume(chain, model, optimizer)
        ck = ldformat.Checkpointer(chain, model, optimizer, mode="xor", anchor_every=4, batch_steps=2,
                                   commit_timeout=10.0)
    states = []
    for step in range(start + 1, steps + 1):
        optimizer.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()
        if "--reference" in flags:
            states.append(gathered(model, optimizer))
        print(f"step {step}", flush=True)
    if ck is not None:
        print(f"closed {ck.close()}", flush=True)
    if rank == 0 and "--reference" in flags:
        torch.save(states, outdir / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
