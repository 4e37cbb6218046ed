"""The ``xor`` pipeline's depth: host memory against stall, interleaved in one process.

    python -m benchmarks.queue_depth                 # the fixed 29.5M workload, 3 rounds
    python -m benchmarks.queue_depth --quick         # the quick workload, a minute

Configurations: ``none`` (no checkpointing) and ``Checkpointer(mode="xor")`` with
``queue_depth`` 0 (the default: one staging set, 2x the state with the XOR base) and 2 (three
sets, 4x; the default before). Every configuration has its own model, built from the same
seed, and trains the same batches; a round runs a window of steps of each, in a rotated
order, and each window ends by draining the background writer (timed inside the window).
With ``--prediction`` the two ``xor`` configurations are depth 0 with Adam prediction (the
default of format 1.6) and without it (``ChainWriter.predict_state = False``: every slot a
plain difference). Checkpoints every step, ``anchor_every`` out of reach (anchors are timed elsewhere),
``batch_steps=2``. Reported: step time and overhead against ``none`` of the same round
(median over rounds, bootstrap CI), the training thread's stall and back-pressure per step,
background CPU per step, and the pipeline's host buffers after the run (counted from the
runtime's objects, as in ``benchmarks.scale``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ldformat

from .scale import pipeline_buffers
from .stats import bootstrap_ci, human_bytes, median
from .workload import QUICK_WORKLOAD, WORKLOAD, ModelSize, Trainer, configure_threads, n_params

DEPTHS = (0, 2)


class Run:
    def __init__(self, name: str, size: ModelSize, workdir: Path, depth: int | None, predict: bool = True) -> None:
        self.name, self.depth, self.predict = name, depth, predict
        self.trainer = Trainer(size)
        self.ck: Any = None
        self.chain = workdir / name
        self.windows: list[dict[str, float]] = []

    def attach(self) -> None:
        if self.depth is not None:
            self.ck = ldformat.Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer, mode="xor",
                                            anchor_every=1_000_000, batch_steps=2, queue_depth=self.depth)
            self.ck.writer.predict_state = self.predict  # Adam prediction (format 1.6 default) or plain sub

    def counters(self) -> dict[str, float]:
        if self.ck is None:
            return {"stall_s": 0.0, "backpressure_s": 0.0, "bg_cpu_s": 0.0}
        s = self.ck.stats
        return {"stall_s": s.stall_s, "backpressure_s": s.backpressure_s, "bg_cpu_s": s.background_cpu_s}

    def drain(self) -> None:
        if self.ck is not None:
            self.ck._background.join()


def delta_bytes_per_step(run: Run) -> float:
    """Every delta object of the run's chain, over the steps it recorded."""
    size = sum(p.stat().st_size for p in (run.chain / "deltas").rglob("*") if p.is_file())
    return size / max(1, run.ck.stats.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=8, help="steps per configuration per round (even)")
    parser.add_argument("--prediction", action="store_true",
                        help="compare Adam prediction on and off (ChainWriter.predict_state) at depth 0 instead")
    args = parser.parse_args()
    configure_threads()
    size = QUICK_WORKLOAD if args.quick else WORKLOAD
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-queue-depth-"))
    try:
        runs = [Run("none", size, workdir, None)]
        if args.prediction:
            runs += [Run("xor predicted", size, workdir, 0), Run("xor sub", size, workdir, 0, predict=False)]
        else:
            runs += [Run(f"xor q={d}", size, workdir, d) for d in DEPTHS]
        print(f"model {size.name} ({n_params(runs[0].trainer.model) / 1e6:.1f}M parameters), {args.rounds} rounds "
              f"of {args.window} steps per configuration", flush=True)
        for run in runs:
            run.trainer.prefetch(1, 2)
            run.trainer.step()
            run.trainer.step()  # AdamW state exists before the chain's first anchor
            run.attach()
            run.trainer.prefetch(3, 4)
            for _ in range(4):  # untimed: allocations, the first commits
                run.trainer.step()
            run.drain()
        for r in range(args.rounds):
            order = runs[r % len(runs):] + runs[: r % len(runs)]
            for run in order:
                run.trainer.prefetch(run.trainer.steps + 1, args.window)
                gc.collect()
                c0 = run.counters()
                t0 = time.perf_counter()
                for _ in range(args.window):
                    run.trainer.step()
                run.drain()
                elapsed = time.perf_counter() - t0
                c1 = run.counters()
                run.windows.append({"step_s": elapsed / args.window,
                                    **{k: (c1[k] - c0[k]) / args.window for k in c1}})
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
        state = sum(t.numel() * t.element_size() for t in runs[1].ck.writer.live_state_tensors().values())
        base = [w["step_s"] for w in runs[0].windows]
        print(f"\nraw state {human_bytes(state)}; overhead = step time / none's of the same round - 1\n")
        print("| configuration | step s | overhead % [95% CI] | stall ms/step | back-pressure ms/step | "
              "bg CPU core-s/step | pipeline host buffers | delta bytes/step |")
        print("|---|---|---|---|---|---|---|---|")
        for run in runs:
            steps = [w["step_s"] for w in run.windows]
            if run.ck is None:
                print(f"| none | {median(steps):.3f} | baseline | 0 | 0 | 0 | - | - |")
                continue
            over = [100 * (t / b - 1) for t, b in zip(steps, base, strict=True)]
            lo, hi = bootstrap_ci(over)
            buffers = pipeline_buffers(run.ck)
            print(f"| {run.name} | {median(steps):.3f} | {median(over):.1f} [{lo:.1f}, {hi:.1f}] | "
                  f"{1000 * median([w['stall_s'] for w in run.windows]):.1f} | "
                  f"{1000 * median([w['backpressure_s'] for w in run.windows]):.1f} | "
                  f"{median([w['bg_cpu_s'] for w in run.windows]):.3f} | "
                  f"{buffers['total_bytes'] / state:.2f}x ({human_bytes(buffers['total_bytes'])}, "
                  f"{buffers['buffer_sets']} sets) | {human_bytes(delta_bytes_per_step(run))} |")
        for run in runs:
            if run.ck is not None:
                run.ck.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
