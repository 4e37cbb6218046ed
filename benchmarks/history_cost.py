"""What ``ldtools stats`` costs against ``materialize`` of the chain's last step.

``ldformat.export.history.step_history`` replays the range once and measures every step on the way
(update and weight norms per group, Adam's ``exp_avg_sq``); ``materialize`` of the last step
replays the same deltas from the same anchor without measuring. The issue's bar is a ratio
of at most 1.2 on the fixed 29.5M workload over 1,000 steps; this script measures the ratio
on a small chain that a laptop CPU records in a minute.

What it does: records ``--steps`` AdamW steps of an MLP of about ``--params`` parameters
(``Checkpointer``, one anchor at step 0 so that materialize replays every delta; ``xor`` and
``lowdiff+``, each its own chain), then times, ``--reps`` times each and alternating,
``ChainReader(chain).materialize(last)`` and ``list(step_history(chain))`` (a fresh reader
each time; the chain's files are in the page cache after the first run). On a shared machine
the fastest of the reps is the least disturbed, so the ratio is of the fastest runs. The CPU
time of the whole process (every thread) is reported too: other processes disturb it less than
the wall time. ``--threads N`` sets torch's intra-op threads (materialize's optimizer steps use
them; stats measures each parameter on one thread, large ones on a pool of that many threads)::

    python -m benchmarks.history_cost                          # 200 steps, ~1M parameters
    python -m benchmarks.history_cost --threads 1              # both on one torch thread
    python -m benchmarks.history_cost --out benchmarks/results/history_cost.md

Results are printed as a markdown table and, with ``--out``, written to that file.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ldformat
from ldformat.export.history import step_history


def mlp(params: int) -> nn.Module:
    width = int((params / 4) ** 0.5)  # four width x width layers
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())])


def record(chain: Path, mode: str, steps: int, params: int) -> int:
    torch.manual_seed(0)
    model = mlp(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    width = model[0].in_features
    with ldformat.Checkpointer(chain, model, opt, mode=mode, anchor_every=steps + 1, batch_steps=50) as ck:
        for _ in range(steps):
            x = torch.randn(32, width)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            ck.log(loss=loss)
            opt.step()
    return sum(p.numel() for p in model.parameters())


def timed(fn: object) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process: every thread) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start, time.process_time() - cpu


def measure(chain: Path, reps: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    def materialize() -> None:
        ldformat.ChainReader(chain).materialize()

    def stats() -> None:
        for _ in step_history(str(chain)):
            pass

    materialize()  # page cache
    m, s = [], []
    for _ in range(reps):
        m.append(timed(materialize))
        s.append(timed(stats))
    return m, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="xor,lowdiff+")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # other processes share the cores: say how busy they were
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            chain = Path(tmp) / mode
            n = record(chain, mode, args.steps, args.params)
            m, s = measure(chain, args.reps)
            # The fastest run is the one least disturbed by other processes (a shared machine).
            mw, sw = [w for w, _ in m], [w for w, _ in s]
            mc, sc = [c for _, c in m], [c for _, c in s]
            rows.append(f"| {mode} | {n:,} | {args.steps} | {min(mw):.2f} / {statistics.median(mw):.2f} | "
                        f"{min(sw):.2f} / {statistics.median(sw):.2f} | {min(sw) / min(mw):.2f} | "
                        f"{min(mc):.2f} / {min(sc):.2f} | {min(sc) / min(mc):.2f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# `ldtools stats` against `materialize` of the last step",
        "",
        f"`python -m benchmarks.history_cost --steps {args.steps} --params {args.params} --reps {args.reps}"
        f"{'' if args.threads is None else f' --threads {args.threads}'}`",
        f"({platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}). One anchor (step 0): both replay every delta; stats also "
        f"measures each step. Page cache warm; load average before the run {load:.1f} "
        f"on {os.cpu_count()} cores. Times: fastest / median of {args.reps} reps; the ratio is of the fastest. "
        "CPU: the process's CPU seconds (every thread), fastest of the reps.",
        "",
        "| mode | parameters | steps | materialize last s | stats s | ratio | CPU s materialize / stats | CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
