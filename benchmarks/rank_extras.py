"""Cost of recording every data-parallel rank's RNG states and data position (spec §19.1 ``ranks``).

``python -m benchmarks.rank_extras [--world 2 4] [--steps 300] [--compute-ms 20]``: for each
world size, spawns that many processes (gloo on 127.0.0.1, one torch thread each) and times,
on rank 0, what a data-parallel step pays for it:

* ``gather``: :func:`ldformat.capture.rng.capture_rng` and one
  :meth:`~ldformat.capture.ddp.RankExtras.exchange` (a ``gather_object`` to rank 0 on a gloo
  side group) on the training thread, as the Checkpointer did before the exchange thread. The
  loop does nothing else, so each exchange also waits for the slowest rank: an upper bound.
* ``thread``: what the training thread pays now: ``capture_rng`` and
  :meth:`~ldformat.capture.ddp.ExchangeThread.submit` as a step ends, then, after
  ``--compute-ms`` of torch matrix products (which release the GIL) standing for the next
  step's forward and backward, the :meth:`~ldformat.capture.ddp.ExchangeThread.settle` that
  rank 0 makes at the next ``optimizer.step()``.

Prints one line per world size.
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


def _busy(seconds: float) -> None:
    """Compute as training does: torch kernels, which release the GIL while they run."""
    a = torch.ones(192, 192)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.mm(a, a).clamp_(-1.0, 1.0)


def _worker(rank: int, world: int, port: int, steps: int, compute_s: float,
            out: dict[int, tuple[list[float], list[float]]]) -> None:
    from ldformat.capture.ddp import ExchangeThread, RankExtras
    from ldformat.capture.rng import capture_rng

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    extras = RankExtras(None)
    gather = []
    for i in range(steps + 10):
        started = time.perf_counter()
        extras.exchange(capture_rng(), {"seen": i})
        if i >= 10:  # warm-up
            gather.append(time.perf_counter() - started)
    thread, exchanges = [], ExchangeThread(extras)
    for i in range(steps + 10):
        started = time.perf_counter()
        exchanges.submit(capture_rng(), {"seen": i})
        paid = time.perf_counter() - started
        _busy(compute_s)
        started = time.perf_counter()
        exchanges.settle()
        if i >= 10:
            thread.append(paid + time.perf_counter() - started)
    exchanges.close(60.0)
    out[rank] = (gather, thread)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compute-ms", type=float, default=20.0,
                        help="busy work between a step's end and the next optimizer.step() (default 20)")
    args = parser.parse_args()
    for world in args.world:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(world, _free_port(), args.steps, args.compute_ms / 1e3, out), nprocs=world)
            gather, thread = (list(t) for t in out[0])

        def ms(t: list[float]) -> str:
            return f"median {statistics.median(t) * 1e3:.3f} ms, p95 {sorted(t)[int(0.95 * len(t))] * 1e3:.3f} ms"

        print(f"world {world}, rank 0's training thread per step: gather {ms(gather)}; thread {ms(thread)} "
              f"({args.steps} steps, {args.compute_ms:g} ms of compute between steps, {os.cpu_count()} cores)",
              flush=True)


if __name__ == "__main__":
    main()
