"""One rank of a sharded (FSDP2 / tensor-parallel / 2-D) training run, for tests/sharded/test_sharded.py.

Run as ``python sharded_train.py --rank R --world W --out DIR --job JOB.json`` with
``MASTER_ADDR``/``MASTER_PORT`` set. The job file holds a list of runs that this process
executes one after another in the same process group (a launch costs the import of torch):
each run builds a fresh :class:`ShardNet`, wraps it (``layout``: plain, fsdp, fsdp-mp, tp, 2d,
hsdp), gets its
starting state (fresh seeded weights, ``ldformat.resume`` from a chain, a saved gathered full
state, or a ``torch.distributed.checkpoint`` directory), optionally records the chain
``DIR/<chain>`` with an ``ldformat.Checkpointer`` (``mode``; not with ``--no-checkpoint``, which
checks the harness alone) and trains ``steps`` optimizer steps. After the start and after
every step it gathers the full live state with ``get_state_dict(full_state_dict=True)``, and
records its own torch RNG state (seeded per rank under HSDP, so that the ranks' states
differ); every rank saves what it gathered to ``DIR/<run>.rank<R>.pt``; the checks run in
the pytest process.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB = 97  # embedding rows: uneven FSDP shards (49/48 at 2 ranks, 25/25/25/22 at 4)
WIDTH = 7  # odd: LayerNorm and the down projection shard unevenly too
HIDDEN = 24  # even: the tensor-parallel dimension (12 per rank at tp=2)
BATCH = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(h)))


class ShardNet(nn.Module):
    """Embedding tied to the output head, an MLP block (the TP part), a LayerNorm, a one-element
    parameter (a rank with 0 rows under FSDP) and a buffer that changes on every forward."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gain = nn.Parameter(torch.full((1,), 1.5))
        self.block = Block()
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("calls", torch.zeros(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(torch.tensor([1.0, 0.5, 0.25]))
        h = self.embed(tokens) * self.gain
        h = h + self.block(h)
        return self.head(self.norm(h))


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step for one data-parallel rank (every tensor-parallel rank of it alike)."""
    g = torch.Generator().manual_seed(7919 * (dp_rank + 1) + step)
    x = torch.randint(0, VOCAB, (BATCH,), generator=g)
    y = torch.randint(0, VOCAB, (BATCH,), generator=g)
    return x, y


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"block.up": ColwiseParallel(), "block.down": RowwiseParallel()}


def build(layout: str, world: int, rank: int) -> tuple[nn.Module, int]:
    """A fresh model wrapped per ``layout``; returns it and this rank's data-parallel index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)  # every rank builds the same full weights before sharding
    model = ShardNet()
    if layout == "plain":  # no sharding at all (world 1)
        return model, rank
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model.norm, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, rank
    if layout == "fsdp-mp":  # mixed precision: bf16 compute, fp32 sharded parameters and reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model.block, mesh=mesh, mp_policy=mp)
        fully_shard(model.norm, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, rank
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan())
        return model, 0
    if layout == "2d":
        assert world % 2 == 0, "2-D needs an even world"
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        fully_shard(model.block, mesh=mesh["dp"])
        fully_shard(model.norm, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank()
    if layout == "hsdp":  # hybrid sharding: replica groups of 2 ranks; ranks 2, 3 hold ranks 0, 1's blocks
        assert world % 2 == 0, "HSDP needs an even world"
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model.norm, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1000 + rank)  # each rank's own RNG stream (restored per rank on resume)
        return model, rank
    raise ValueError(f"unknown layout {layout!r}")


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n in ("embed.weight", "block.up.weight", "block.down.weight")]
    rest = [p for n, p in model.named_parameters() if n not in ("embed.weight", "block.up.weight", "block.down.weight")]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01)
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_detach(v) for v in obj]
    return obj


def gather(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full live state keyed by FQN (collective). Before the optimizer has any state only the
    model is gathered: get_optimizer_state_dict would run a hidden step to create it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    if not optimizer.state:
        names: dict[int, str] = {}
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return {"model": _detach(get_model_state_dict(model, options=options)),
                "optimizer": {"state": {}, "param_groups": _detach(groups)}}
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": _detach(msd), "optimizer": _detach(osd)}


def local_layout(model: nn.Module) -> dict[str, Any]:
    """This rank's local shapes and placements, to check that the run covers what it claims."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for n, t in model.state_dict().items():
        if isinstance(t, DTensor):
            out[n] = {"local": tuple(t.to_local().shape), "placements": [repr(p) for p in t.placements]}
        else:
            out[n] = {"local": tuple(t.shape), "placements": None}
    return out


def load_gathered(model: nn.Module, optimizer: torch.optim.Optimizer, saved: str | Path, step: int) -> None:
    """Load step ``step`` of a run's saved gathered full states (``"steps"``) into a model of any
    layout with ``set_state_dict``: the reference that a resume from a chain is compared with."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = torch.load(saved, weights_only=True)["steps"][step]
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full["model"], options=options)
    set_optimizer_state_dict(model, optimizer, full["optimizer"], options=options)


def run(spec: dict[str, Any], rank: int, world: int, out: Path, checkpoint: bool = True) -> None:
    import ldformat

    model, dp_rank = build(spec["layout"], world, rank)
    optimizer = make_optimizer(model, spec["optim"])
    step = 0
    if spec.get("resume"):
        step = ldformat.resume(spec["resume"], model, optimizer, step=spec.get("resume_step"))
    elif spec.get("load"):  # a gathered full state saved by an earlier run: the reference resume
        step = int(spec["load_step"])
        load_gathered(model, optimizer, spec["load"], step)
    elif spec.get("dcp"):  # a torch.distributed.checkpoint directory written by `ldtools materialize`
        from sharded_chain_maker import load_into

        load_into(model, optimizer, spec["dcp"])
        step = int(spec.get("load_step", 0))
    ck = None
    if spec.get("lagging_commits") and rank == 0:
        from ldformat.capture.sharded import Committer

        # No global commit while training: only close() commits, after every rank's last commit,
        # as when rank 0's commits fall far behind.
        Committer._run = lambda self: None  # type: ignore[method-assign]
    if spec.get("mode") and checkpoint:
        ck = ldformat.Checkpointer(out / spec["chain"], model, optimizer, mode=spec["mode"],
                                   anchor_every=4, batch_steps=2, max_bytes=spec.get("max_bytes"))
        writer = getattr(ck, "writer", None)  # copy ranks write no rank chain
        if spec.get("snapshots") == "eager" and writer is not None:
            from ldformat.chain.writer import SnapshotPolicy

            # A segmented snapshot (spec §7.9) after every second record of each rank chain.
            writer.snapshot_policy = SnapshotPolicy(ratio=0.5, min_bytes=0, min_records=2)
    record: dict[str, Any] = {"start": step, "layout": local_layout(model), "steps": {step: gather(model, optimizer)},
                              "rng": {step: torch.get_rng_state()}}
    for _ in range(int(spec["steps"])):
        step += 1
        x, y = batch(step, dp_rank)
        torch.rand(1 + rank)  # the ranks' RNG streams move apart (the chain records them as the step ends)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        record["steps"][step] = gather(model, optimizer)
        record["rng"][step] = torch.get_rng_state()
    if ck is not None:
        ck.close()
    torch.save(record, out / f"{spec['name']}.rank{rank}.pt")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--no-checkpoint", action="store_true", help="train without a Checkpointer (the harness alone)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60))
    try:
        for spec in json.loads(args.job.read_text()):
            try:
                run(spec, args.rank, args.world, args.out, checkpoint=not args.no_checkpoint)
            except BaseException:
                print(f"sharded_train: run {spec['name']!r} failed on rank {args.rank}", file=sys.stderr, flush=True)
                raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
