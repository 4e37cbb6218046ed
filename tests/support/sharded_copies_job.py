"""One rank of an HSDP job (copy ranks, spec §20.2 ``copies``), for tests/sharded/test_sharded_copies.py.

Run as ``python sharded_copies_job.py --rank R --world W --out DIR --job JOB.json`` with
``MASTER_ADDR``/``MASTER_PORT`` set (gloo on CPU). The job file holds a list of runs that this
process executes one after another in the same process group (a launch costs the import of
torch). Each run builds a fresh :class:`CopyNet` (it has dropout, so each step draws from the
rank's own torch RNG stream, seeded per rank) wrapped per ``layout``:

* ``hsdp``: FSDP2 ``fully_shard`` on a 2-D mesh ``(world // 2, 2)`` named
  ``("replicate", "shard")``: placements (Replicate(), Shard(0)), so ranks 2 and 3 hold ranks
  0 and 1's blocks (the copy ranks of a 4-rank job);
* ``fsdp``: FSDP2 on a 1-D mesh of the whole world.

Runs (``kind``):

* ``train``: fresh seeded weights, an ``ldformat.Checkpointer`` on ``DIR/<chain>`` (``mode``,
  ``anchor_every=3``, ``batch_steps=2``, a per-rank data position), ``steps`` steps, ``close()``;
* ``resume``: ``ldformat.resume(<chain>, step=<step>)`` (``data=`` too), then train on to
  ``until`` without a Checkpointer; ``reseed`` seeds the torch RNG afresh after the resume (at
  another world size the RNG states are not restored, spec §20.6);
* ``reopen``: rank 0 copies ``DIR/<src>`` to ``DIR/<chain>`` and truncates the copy after
  ``step`` (``ldformat.truncate``); every rank resumes it (``exact=True``) and records on into it
  with a new Checkpointer (the way README's ``lowdiff`` continuation goes) up to ``until``; with
  ``topk``, one ``ldformat.TopK`` is handed to both ``resume`` and the Checkpointer (``compressor=``);
* ``load``: the reference for a resume at another layout: the gathered full state that an
  earlier run saved (``load``, rank 0's record, at ``step``) is loaded with
  ``set_model_state_dict`` / ``set_optimizer_state_dict``; then as ``resume`` (``reseed`` alike).

At the start and after every step each rank gathers the full live state with
``get_state_dict(full_state_dict=True)`` (only the model while the optimizer has no state:
gathering an optimizer without state would run a hidden ``optimizer.step()``), and records its
own torch RNG state, its data position, and its local model shards; it saves the record to
``DIR/<run>.rank<R>.pt``. The checks run in the pytest process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ddp_replicated_worker import Position
from sharded_train import gather, load_gathered
from torch import nn

VOCAB = 13  # embedding rows: uneven shards (7/6 over the 2 shard ranks; 7/6 at FSDP world 2 too)
WIDTH = 6
HIDDEN = 10
CLASSES = 5  # head rows: 3/2
BATCH = 8
ANCHOR_EVERY = 3
BATCH_STEPS = 2


class CopyNet(nn.Module):
    """An embedding, a one-element parameter (an empty shard on rank 1 and its copy rank 3), an
    MLP with dropout (each rank's own RNG stream), a LayerNorm, a head and a buffer that changes
    on every forward."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gain = nn.Parameter(torch.full((1,), 1.25))
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(torch.tensor([1.0, 0.5]))
        h = self.embed(tokens) * self.gain
        h = h + self.down(self.drop(torch.relu(self.up(h))))
        return self.head(self.norm(h))


def build(layout: str, world: int, rank: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # every rank builds the same full weights before sharding
    model = CopyNet()
    if layout == "hsdp":
        assert world % 2 == 0, "HSDP needs an even world"
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    elif layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                             lr=0.02)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step for one (data-parallel) rank."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + step)
    return torch.randint(0, VOCAB, (BATCH,), generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, position: Position) -> None:
    x, y = batch(step, rank)
    torch.rand(1 + rank)  # the ranks' RNG streams move apart further
    model.train()
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    position.seen += BATCH
    optimizer.step()


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (t.to_local() if isinstance(t, DTensor) else t).detach().clone() for n, t in model.state_dict().items()}


class Record:
    def __init__(self, start: int) -> None:
        self.data: dict[str, Any] = {"start": start, "steps": {}, "rng": {}, "data": {}, "local": {}}

    def add(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, position: Position) -> None:
        self.data["steps"][step] = gather(model, optimizer)
        self.data["rng"][step] = torch.get_rng_state()
        self.data["data"][step] = position.state_dict()
        self.data["local"][step] = local_shards(model)


def run(spec: dict[str, Any], rank: int, world: int, out: Path) -> None:
    import ldformat

    kind = spec["kind"]
    model = build(spec["layout"], world, rank)
    optimizer = make_optimizer(model)
    position = Position(rank if kind in ("train", "load") else -1)  # resumed: must come back
    chain = out / spec["chain"] if spec.get("chain") else None
    extra: dict[str, Any] = {}
    ck = None
    if kind == "train":
        assert chain is not None
        step = 0
        record = Record(step)
        record.add(step, model, optimizer, position)  # before the Checkpointer: see gather()
        ck = ldformat.Checkpointer(chain, model, optimizer, mode=spec["mode"], anchor_every=ANCHOR_EVERY,
                                   batch_steps=BATCH_STEPS, data=position)
        until = int(spec["steps"])
    elif kind in ("resume", "reopen"):
        assert chain is not None
        if kind == "reopen":
            if rank == 0:
                shutil.copytree(out / spec["src"], chain)
                ldformat.truncate(chain, int(spec["step"]))
            dist.barrier()
        extra["rng_before"] = torch.get_rng_state()
        topk = ldformat.TopK(0.01) if spec.get("topk") else None  # one compressor for resume and Checkpointer
        if kind == "reopen":
            step = ldformat.resume(chain, model, optimizer, data=position, exact=True, compressor=topk)
        else:
            step = ldformat.resume(chain, model, optimizer, data=position, step=spec.get("step"))
        extra["rng_after_resume"] = torch.get_rng_state()
        extra["data_after_resume"] = position.state_dict()
        if spec.get("reseed"):
            torch.manual_seed(2000 + rank)
            position.load_state_dict({"rank": rank, "seen": 0})
        record = Record(step)
        record.add(step, model, optimizer, position)
        if kind == "reopen":
            ck = ldformat.Checkpointer(chain, model, optimizer, mode=spec["mode"], anchor_every=ANCHOR_EVERY,
                                       batch_steps=BATCH_STEPS, data=position, compressor=topk)
        until = int(spec["until"])
    elif kind == "load":
        step = int(spec["step"])
        load_gathered(model, optimizer, spec["load"], step)
        if spec.get("reseed"):
            torch.manual_seed(2000 + rank)
        record = Record(step)
        record.add(step, model, optimizer, position)
        until = int(spec["until"])
    else:
        raise ValueError(f"unknown run kind {kind!r}")
    while step < until:
        step += 1
        train_step(model, optimizer, step, rank, position)
        record.add(step, model, optimizer, position)
    if ck is not None:
        extra["closed"] = ck.close()
    record.data.update(extra)
    torch.save(record.data, out / f"{spec['name']}.rank{rank}.pt")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60))
    try:
        for spec in json.loads(args.job.read_text()):
            try:
                run(spec, args.rank, args.world, args.out)
            except BaseException:
                print(f"sharded_copies_job: run {spec['name']!r} failed on rank {args.rank}", file=sys.stderr,
                      flush=True)
                raise
            print(f"sharded_copies_job: run {spec['name']!r} done on rank {args.rank}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
