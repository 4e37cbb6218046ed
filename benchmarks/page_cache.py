"""What the page cache costs a checkpoint writer: objects kept cached against dropped once durable.

    python -m benchmarks.page_cache                 # 40 steps of 45 objects of 2.2 MiB, about 1 minute
    python -m benchmarks.page_cache --steps 80 --dir /mnt/fast

Each "step" writes 45 new objects of 2.2 MiB (about 100 MiB, what an every-step ``xor`` chain of
the fixed 29.5M workload writes), then fsyncs each, as ``LocalStore.write`` and ``sync`` do.
``kept``: the objects stay in the page cache (``LocalStore(drop_cache=False)``); ``dropped``:
each is dropped after its fsync (``POSIX_FADV_DONTNEED``, the default). Each variant runs in a
process of its own, twice, alternating (run in one process, each reuses the pages the other
freed). Reported: the writing thread's CPU per step (``time.thread_time``) and wall time,
medians over the steps after the first two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OBJECTS, OBJECT_BYTES = 45, 2_300_000


def one_run(directory: Path, steps: int, drop: bool) -> tuple[float, float]:
    data = os.urandom(OBJECT_BYTES)
    cpu, wall = [], []
    for s in range(steps):
        step_dir = directory / str(s)
        step_dir.mkdir()
        c0, t0 = time.thread_time(), time.perf_counter()
        paths = []
        for i in range(OBJECTS):
            fd = os.open(step_dir / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)
            paths.append(step_dir / str(i))
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(cpu[2:]), statistics.median(wall[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.page_cache", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    ap.add_argument("--dir", default=None, help="directory to write in (default: a temporary one)")
    ap.add_argument("--child", choices=("kept", "dropped"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not hasattr(os, "posix_fadvise"):
        print("this platform has no posix_fadvise: nothing to compare")
        return 2
    if args.child:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            cpu, wall = one_run(Path(d), args.steps, args.child == "dropped")
        print(f"{cpu} {wall}")
        return 0
    print(f"{OBJECTS} objects of {OBJECT_BYTES / 2**20:.1f} MiB per step, {args.steps} steps per run; "
          "medians per step")
    print(f"{'variant':<8} {'writer CPU ms':>14} {'wall ms':>8}")
    for variant in ("kept", "dropped", "kept", "dropped"):
        cmd = [sys.executable, "-m", "benchmarks.page_cache", "--child", variant, "--steps", str(args.steps)]
        if args.dir:
            cmd += ["--dir", args.dir]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout.split()
        print(f"{variant:<8} {float(out[0]) * 1e3:>14.0f} {float(out[1]) * 1e3:>8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
