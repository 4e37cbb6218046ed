"""Cost of recording every data-parallel rank's RNG states and data position (spec §19.1 ``ranks``).

``python -m benchmarks.rank_extras [--world 2 4] [--steps 300]``: for each world size, spawns
that many processes (gloo on 127.0.0.1, one torch thread each), and times the per-step exchange
a data-parallel Checkpointer makes when a step ends: :func:`ldformat.capture.rng.capture_rng`
and one :meth:`~ldformat.capture.ddp.RankExtras.exchange` (a ``gather_object`` to rank 0 on a
gloo side group). The loop does nothing else, so each exchange also waits for the slowest
rank: an upper bound on what a training step pays. Prints one line per world size.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, steps: int, out: dict[int, list[float]]) -> None:
    from ldformat.capture.ddp import RankExtras
    from ldformat.capture.rng import capture_rng

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    extras = RankExtras(None)
    times = []
    for i in range(steps + 10):
        started = time.perf_counter()
        extras.exchange(capture_rng(), {"seen": i})
        if i >= 10:  # warm-up
            times.append(time.perf_counter() - started)
    out[rank] = times
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for world in args.world:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(world, _free_port(), args.steps, out), nprocs=world)
            rank0 = list(out[0])
        print(f"world {world}: exchange per step, rank 0: median {statistics.median(rank0) * 1e3:.2f} ms, "
              f"p95 {sorted(rank0)[int(0.95 * len(rank0))] * 1e3:.2f} ms ({args.steps} steps, "
              f"{os.cpu_count()} cores)", flush=True)


if __name__ == "__main__":
    main()
