"""Build the golden sharded chains of format 1.3 or 1.4 (spec §20, §3.4).

Usage::

    python tests/golden/make_golden_sharded.py OUTDIR [VERSION]

VERSION is 1.3 (the default) or 1.4. Two CPU processes (gloo) train a sharded model and write
one sharded chain per kind: for 1.3 with FSDP2 on a 1-D mesh, for 1.4 with HSDP on a (2, 1)
mesh, where rank 1 holds rank 0's blocks and is a copy rank (spec §20.2 ``copies``):

    OUTDIR/sharded.json                       what each chain exercises, and its steps
    OUTDIR/<name>/chain/                      the sharded chain (sharded.json, commits/, ranks/)
    OUTDIR/<name>/expected/<step>.safetensors the full live state after <step>, gathered from the
                                              shards while the chain was written

An expected file has the layout of ``make_golden.py``'s: ``model.<FQN>`` and
``optimizer.<param index>.<key>``, with ``step``, ``model_keys`` and ``param_groups`` in its
metadata. The gradient chains use SGD with power-of-two learning rates, so that replay is
exact on every CPU (see ``make_golden.py``); the ``state.xor`` chain uses Adam.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ldformat

STEPS = 6
CHAINS = {
    "sharded.state.xor": ("xor", "adam", "FSDP2 at world size 2: 13 rows over 2 ranks (7/6), a LayerNorm, a buffer "
                          "that changes every step, tied embedding and head; Adam; anchors every 3 steps"),
    "sharded.grad.dense": ("lowdiff+", "sgd", "the same model, grad.dense: each rank records its gradient shard; "
                           "SGD with power-of-two learning rates"),
    "sharded.grad.topk": ("lowdiff", "sgd", "the same model, grad.topk: top-k per shard, residuals per rank in the "
                          "anchors; SGD with power-of-two learning rates"),
}
#: Format 1.4: copy ranks. HSDP on a (replicate 2, shard 1) mesh: each rank trains on its own
#: data, gradients are all-reduced over the replicas, and rank 1 writes no rank chain.
CHAINS_14 = {
    "sharded.copies.state.xor": ("xor", "adam", "HSDP at world size 2 on a (2, 1) mesh: rank 1 is a copy of rank 0 "
                                 "and writes no rank chain; its RNG states are in rank chain 0's extra.ranks; the "
                                 "model of the 1.3 chains; Adam; anchors every 3 steps"),
    "sharded.copies.grad.dense": ("lowdiff+", "sgd", "the same HSDP job, grad.dense; SGD with power-of-two learning "
                                  "rates"),
    "sharded.copies.grad.topk": ("lowdiff", "sgd", "the same HSDP job, grad.topk: rank 0's residuals stand for "
                                 "its copy's; SGD with power-of-two learning rates"),
}


class ShardedNet(nn.Module):
    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 4)
        self.up = nn.Linear(4, 13)
        self.norm = nn.LayerNorm(13)
        self.head = nn.Linear(4, 13, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.embed(tokens)
        return self.head(h) + self.norm(self.up(h))


def build(world: int, optimizer: str, hsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ShardedNet()
    mesh = (init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=2.0**-5, momentum=0.5)


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def gathered(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], step: int) -> dict[str, Any]:
    """The full state in the layout ``materialize`` returns (parameter indices, not FQNs)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    state = {i: {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                 for k, v in osd["state"][n].items()} for i, n in enumerate(names) if n in osd["state"]}
    return {"model": {k: v.detach().clone() for k, v in msd.items()}, "state": state, "step": step}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8), b.detach().reshape(-1).contiguous().view(torch.uint8))


def worker(rank: int, world: int, port: int, out: Path, version: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for name, (mode, opt_name, _) in (CHAINS_14 if version == "1.4" else CHAINS).items():
            model, optimizer = build(world, opt_name, hsdp=version == "1.4")
            names = param_names(model, optimizer)
            kwargs: dict[str, Any] = {"topk_ratio": 0.25} if mode == "lowdiff" else {}
            ck = ldformat.Checkpointer(out / name / "chain", model, optimizer, mode=mode, anchor_every=3,
                                       batch_steps=2, **kwargs)
            live = []
            for step in range(1, STEPS + 1):
                g = torch.Generator().manual_seed(rank * 1000 + step)
                optimizer.zero_grad()
                model(torch.randint(0, 13, (6,), generator=g)).square().mean().backward()
                optimizer.step()
                live.append(gathered(model, optimizer, names, step))
            ck.close()
            if rank == 0:
                torch.save({"live": live, "param_groups": copy.deepcopy(optimizer.state_dict()["param_groups"])},
                           out / name / "live.pt")
            else:  # every rank gathered the same full state: checked in main (a copy rank keeps its source's)
                torch.save(live, out / name / f"live.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[1:] not in ([], ["1.3"], ["1.4"]):
        print("usage: python tests/golden/make_golden_sharded.py OUTDIR [1.3|1.4]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    version = argv[1] if len(argv) == 2 else "1.3"
    chains = CHAINS_14 if version == "1.4" else CHAINS
    if (out / "sharded.json").exists():
        print(f"{out}: already holds sharded golden chains; they are never rewritten", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(worker, args=(2, port, out, version), nprocs=2)
    index: dict[str, Any] = {"format_version": version, "torch": torch.__version__, "chains": {}}
    for name, (_, _, description) in chains.items():
        chain = out / name / "chain"
        for lock in chain.glob("ranks/*/lock"):  # released locks name this host: not content
            shutil.rmtree(lock)
        saved = torch.load(out / name / "live.pt", weights_only=False)
        (out / name / "live.pt").unlink()
        for other in sorted((out / name).glob("live.rank*.pt")):
            for mine, theirs in zip(saved["live"], torch.load(other, weights_only=False), strict=True):
                for part in ("model", "state"):
                    flat = (lambda d: d.items()) if part == "model" else (
                        lambda d: [(f"{i}.{k}", v) for i, s in d.items() for k, v in s.items()])
                    for (key, a), (_, b) in zip(flat(mine[part]), flat(theirs[part]), strict=True):
                        if not same_bits(a, b):
                            raise AssertionError(f"{name} step {mine['step']}: {other.name} {part} {key} differs "
                                                 "from rank 0's")
            other.unlink()
        reader = ldformat.open_reader(chain)
        assert isinstance(reader, ldformat.ShardedReader)
        assert reader.root.format_version == version and bool(reader.root.copies) == (version == "1.4")
        expected = out / name / "expected"
        expected.mkdir()
        for state in saved["live"]:
            step = state["step"]
            got = reader.materialize(step)
            tensors = {f"model.{k}": v.contiguous() for k, v in state["model"].items()}
            for i, s in state["state"].items():
                for k, v in s.items():
                    tensors[f"optimizer.{i}.{k}"] = v.contiguous()
                    if not same_bits(got["optimizer"]["state"][i][k], v):
                        raise AssertionError(f"{name} step {step}: optimizer {i}.{k} differs")
            for k, v in state["model"].items():
                if not same_bits(got["model"][k], v):
                    raise AssertionError(f"{name} step {step}: model {k} differs")
            meta = {"ldformat.golden": "1", "step": str(step), "model_keys": json.dumps(list(state["model"])),
                    "param_groups": json.dumps(saved["param_groups"], default=str)}
            safetensors.torch.save_file(tensors, str(expected / f"{step}.safetensors"), metadata=meta)
        report = ldformat.validate(chain, deep=True)
        if not report.ok:
            raise AssertionError(f"{name}: {[str(p) for p in report.problems]}")
        index["chains"][name] = {"kind": reader.kind, "world_size": reader.world_size, "steps": reader.steps,
                                 "anchors": reader.anchors, "description": description}
    (out / "sharded.json").write_text(json.dumps(index, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(chains)} sharded golden chains of format {version} to {out} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
