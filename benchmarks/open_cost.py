"""ChainReader open time, commit time and record/snapshot sizes against the length of the log.

Issue 13, item 4 ("O(1) open"): opening a chain should read the newest snapshot plus a bounded
tail, so that it costs the same at 1,000 and 10,000 commits (bar: <= 100 ms at 10,000).

What it does: one ``ChainWriter`` (``grad.dense``, a tiny model: Linear(8, 8) + Linear(8, 4),
AdamW) records one optimizer step per commit (``batch_steps=1``, so N commits = N steps, the
worst case for the log: every record is a commit, as in ``recovery.py``'s chain-length
section). After N = 10, 100, 1,000 and 10,000 commits it opens the chain with ``ChainReader``
several times and reports the median; it reports the median and p99 commit time
(``last_commit_seconds``: fsync of the batch + creating the record) over the last commits
before each N, the worst commit (which writes a snapshot), the size of the newest snapshot
record and of the tail since it.

Two variants, each its own chain (written one after the other):

- ``plain``: ``extra`` empty;
- ``extra``: the extra state the Checkpointer writes (spec §19): the torch, Python and NumPy
  RNG states (``ldformat.capture.rng.capture_rng``), a scheduler, a sampler position and the
  policy, about 17 KB of tagged JSON per step.

``--snapshots`` picks the writer's snapshots:

- ``segmented`` (the default, as a 1.5 chain is written): segmented snapshots (spec §7.9), whose
  record holds one reference per segment;
- ``inline``: a 1.4 chain with the same policy; each snapshot restates every step entry inline;
- ``off``: no writer snapshots; an open folds every record::

    python -m benchmarks.open_cost                                   # segmented (the default)
    python -m benchmarks.open_cost --snapshots inline --max-n 1000   # before 1.5
    python -m benchmarks.open_cost --max-n 1000 --variants plain     # quicker

Besides the open it times an open followed by the materialization of the latest step (which
reads the segments holding its replay path), so that laziness is not mistaken for speed.

Results are printed as a markdown table and, with ``--out``, written to that file.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def _log_sizes(chain: Path) -> dict[str, Any]:
    """Newest snapshot record size, and the number/bytes of the records after it."""
    from ldformat.chain.records import LOG_DIR, log_sequence_numbers, read_record
    from ldformat.stores import LocalStore

    store = LocalStore(chain)
    seqs = log_sequence_numbers(store)
    tail_n = tail_b = 0
    snap_b = 0
    snap_seq = None
    for seq in reversed(seqs):
        size = (chain / LOG_DIR / f"{seq:012d}.json").stat().st_size
        if read_record(store, seq, str(chain)).type == "snapshot":
            snap_b, snap_seq = size, seq
            break
        tail_n += 1
        tail_b += size
    return {"records": len(seqs), "snapshot_seq": snap_seq, "snapshot_bytes": snap_b, "tail_records": tail_n,
            "tail_bytes": tail_b}


def run_variant(name: str, checkpoints: list[int], workdir: Path, snapshots: str, reps: int,
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    from ldformat import ChainReader, ChainWriter, ResumableSampler
    from ldformat.capture.extra import loop_extra
    from ldformat.capture.rng import capture_rng
    from ldformat.chain.writer import SnapshotPolicy

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.9)
    sampler = ResumableSampler(1 << 20, seed=0)
    it = iter(sampler)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    chain = workdir / f"chain-{name}"
    # An anchor every 100 steps bounds the replay of the latest step, as in a real run.
    writer = ChainWriter.create(chain, model, opt, kind="grad.dense", batch_steps=1, anchor_every=100,
                                format_version="1.4" if snapshots == "inline" else "1.5")
    writer.snapshot_policy = None if snapshots == "off" else SnapshotPolicy()
    commit_ms: list[float] = []
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    n_max = max(checkpoints)
    for step in range(1, n_max + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x + 0.01 * random.random()), y)
        loss.backward()
        opt.step()
        sched.step()
        next(it)
        np.random.rand()  # the loop uses numpy's and Python's generators too
        extra: dict[str, Any] | None = None
        if name == "extra":
            extra = loop_extra(rng=capture_rng(), scheduler=sched, scaler=None, data=sampler.state_dict(),
                               policy={"anchor_every": 1000, "batch_steps": 1}, user={})
        writer.record_step(step, extra=extra)
        commit_ms.append(writer.last_commit_seconds * 1000)
        if step in checkpoints:
            build_s = time.perf_counter() - started
            open_ms = _median_ms(lambda: ChainReader(chain), reps)
            latest_ms = _median_ms(lambda: ChainReader(chain).materialize(), reps)
            reader = ChainReader(chain)
            assert reader.latest_step == step and len(reader.steps) == step + 1, (reader.latest_step, step)
            window = commit_ms[-max(1, min(len(commit_ms), step // 2)):]
            sizes = _log_sizes(chain)
            row = {"variant": name, "n": step, "open_ms": open_ms, "latest_ms": latest_ms,
                   "segments": len(reader.state.segments), "commit_median_ms": statistics.median(window),
                   "commit_p99_ms": _p99(window), "commit_max_ms": max(commit_ms), "build_s": build_s,
                   **sizes}
            rows.append(row)
            log(f"  {name:5} N={step:>6}: open {open_ms:8.1f} ms, open+latest {latest_ms:8.1f} ms, "
                f"commit median {row['commit_median_ms']:.2f} ms "
                f"p99 {row['commit_p99_ms']:.2f} max {row['commit_max_ms']:.1f}, snapshot {sizes['snapshot_bytes']} B "
                f"(seq {sizes['snapshot_seq']}), tail {sizes['tail_records']} records / {sizes['tail_bytes']} B, "
                f"built in {build_s:.0f} s")
    writer.close()
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace, total_s: float) -> str:
    head = ("| variant | N commits | open ms (median) | open + materialize latest ms | commit ms median / p99 | "
            "worst commit ms | newest snapshot bytes | segments | tail records / bytes | build s |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['n']:,} | {r['open_ms']:.1f} | {r['latest_ms']:.1f} | "
            f"{r['commit_median_ms']:.2f} / "
            f"{r['commit_p99_ms']:.2f} | {r['commit_max_ms']:.1f} | "
            f"{r['snapshot_bytes']:,} | {r['segments']:,} | {r['tail_records']:,} / {r['tail_bytes']:,} | "
            f"{r['build_s']:.0f} |")
    env = (f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}; "
           f"writer snapshots: {args.snapshots}; open = median of {args.reps}; "
           f"commit window = the last N/2 commits before N; total {total_s:.0f} s.")
    cmd = "python -m benchmarks.open_cost " + " ".join(sys.argv[1:])
    return "\n".join(lines) + "\n\n" + env + f"\n\nCommand: `{cmd.strip()}`\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-n", type=int, default=10_000)
    p.add_argument("--variants", default="plain,extra")
    p.add_argument("--snapshots", choices=["segmented", "inline", "off"], default="segmented")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    checkpoints = [n for n in (10, 100, 1_000, 10_000, 100_000) if n <= args.max_n]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.variants.split(","):
            rows += run_variant(name, checkpoints, Path(tmp), args.snapshots, args.reps, print)
    text = report(rows, args, time.perf_counter() - started)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
