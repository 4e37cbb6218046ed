"""Makes a small FSDP2 sharded chain, and loads a DCP export of it on other meshes, for
tests/sharded/test_cli_sharded.py.

``python sharded_chain_maker.py make RANK WORLD OUTDIR STEPS [MIRROR]``: one rank of an FSDP2
job (gloo, CPU, MASTER_ADDR/MASTER_PORT from the environment) that trains ``STEPS`` steps with
a Checkpointer (xor, anchor_every=3, batch_steps=2) into ``OUTDIR/chain``, mirrored to
``MIRROR`` when given. AdamW with two
param groups and a learning-rate schedule, so that a hyperparameter changes every step.

``python sharded_chain_maker.py load DCP_DIR RESULT``: loads the DCP directory twice, with
DCP's own state-dict tools, in this one process: into the plain (unsharded) model without
a process group, and into an FSDP2 model on a world-1 mesh (gloo, world 1). Saves
``{"plain": ..., "fsdp": ...}`` to ``RESULT``, each ``{"model", "optimizer"}`` as
``get_state_dict(..., full_state_dict=True)`` gives it (optimizer state keyed by FQN), and
``"plain_torch"``: the plain optimizer's own ``state_dict()`` (parameter indices).
"""

from __future__ import annotations

import copy
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from sharded_crash_worker import Net  # the same uneven model as the crash trials
from torch import nn


def new_model() -> Net:
    torch.manual_seed(0)
    return Net()


def shard(model: Net, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)


def new_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with different hyperparameters (2-D weights, and the rest), and a
    learning-rate schedule (it adds ``initial_lr`` to the groups; a job that loads builds it
    before it loads, so that DCP finds that key to load too)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.05},
                                   {"params": rest, "weight_decay": 0.0, "betas": (0.8, 0.95)}], lr=1e-2)
    optimizer.schedule = torch.optim.lr_scheduler.LambdaLR(  # type: ignore[attr-defined]
        optimizer, lambda s: 1.0 / (1 + s))
    return optimizer


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(4, 16, generator=g)


def make(rank: int, world: int, outdir: Path, steps: int, mirror: str | None = None) -> None:
    import torch.distributed as dist

    import ldformat

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = new_model()
    shard(model, world)
    optimizer = new_optimizer(model)
    ck = ldformat.Checkpointer(outdir / "chain", model, optimizer, mode="xor", anchor_every=3, batch_steps=2,
                               commit_timeout=30.0, mirror=mirror)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.schedule.step()  # type: ignore[attr-defined]
    print(f"closed {ck.close()}", flush=True)
    dist.destroy_process_group()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    model_state: dict[str, Any] = dict(msd)
    return {"model": {k: v.detach().clone() for k, v in model_state.items()}, "optimizer": copy.deepcopy(osd)}


def load_into(model: nn.Module, optimizer: torch.optim.Optimizer, dcp_dir: str) -> None:
    """What the docstring of ldformat.export.dcp tells a user to do."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd: dict[str, Any] = {"model": get_model_state_dict(model),
                          "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sd, checkpoint_id=dcp_dir)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optimizer"])


def load(dcp_dir: str, result: Path) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*single process.*")
    out: dict[str, Any] = {}
    plain = new_model()
    plain_opt = new_optimizer(plain)
    load_into(plain, plain_opt, dcp_dir)  # no process group
    out["plain"] = full_state(plain, plain_opt)
    out["plain_torch"] = copy.deepcopy(plain_opt.state_dict())

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    model = new_model()
    shard(model, 1)
    optimizer = new_optimizer(model)
    load_into(model, optimizer, dcp_dir)
    out["fsdp"] = full_state(model, optimizer)
    dist.destroy_process_group()
    torch.save(out, result)
    print("loaded", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "make":
        make(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]),
             sys.argv[6] if len(sys.argv) > 6 else None)
    elif sys.argv[1] == "load":
        load(sys.argv[2], Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
