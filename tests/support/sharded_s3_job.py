"""One rank of a world-2 FSDP2 job that checkpoints to an object store, for tests/sharded/test_s3_sharded.py.

``python sharded_s3_job.py RANK WORLD URL OUTDIR STEPS``: the job of
tests/support/sharded_chain_maker.py (its model, optimizer, learning-rate schedule, data and
Checkpointer settings, gloo on CPU, MASTER_ADDR/MASTER_PORT from the environment), with the
sharded chain written directly to ``URL`` (``s3://...``; the store's settings come from the
environment). Before the first step and after every step each rank gathers the full live
state with ``get_state_dict(full_state_dict=True)``; rank 0 saves the list (index = step) to
``OUTDIR/gathered.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
from sharded_chain_maker import batch, full_state, new_model, new_optimizer, shard


def main() -> None:
    import torch.distributed as dist

    import ldformat

    torch.set_num_threads(1)
    rank, world, url, outdir, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(
        sys.argv[5])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = new_model()
    shard(model, world)
    optimizer = new_optimizer(model)
    # Gathered before the Checkpointer exists: gathering an optimizer without state steps it
    # once (with a learning rate of 0) to create the state, a step the Checkpointer would record.
    gathered = [full_state(model, optimizer)]
    ck = ldformat.Checkpointer(url, model, optimizer, mode="xor", anchor_every=3, batch_steps=2,
                               commit_timeout=30.0)
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.schedule.step()  # type: ignore[attr-defined]
        gathered.append(full_state(model, optimizer))
    print(f"closed {ck.close()}", flush=True)
    if rank == 0:
        torch.save(gathered, outdir / "gathered.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
