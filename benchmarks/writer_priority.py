"""Would a lower CPU priority for the background writer cut xor's overhead? (Linux only.)

    python -m benchmarks.writer_priority                # 4 rounds, windows of 10 steps, about 8 minutes
    python -m benchmarks.writer_priority --rounds 6 --nice 10

The overhead benchmark's harness (:func:`benchmarks.overhead.run_configs`: interleaved rounds,
drain of background work inside each window) on the fixed workload with four configurations:
no checkpointing, ``ldformat xor`` every step, the same with its writer thread reniced
(``setpriority`` on the thread: Linux nices threads one by one) and CheckFreq-style every step.
The question: on a machine whose cores training keeps busy, does a niced writer take only the
cycles training leaves idle? If training leaves none, the writer falls behind, the bounded queue
fills, and training waits for it (the stall column).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from . import peers
from .overhead import report, run_configs
from .workload import WORKLOAD, configure_threads


class NicedLdformat(peers.LdformatConfig):
    """``ldformat <mode>`` whose background writer thread runs at niceness ``nice``."""

    def __init__(self, *args: object, nice: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.nice = nice

    def attach(self) -> None:
        super().attach()
        os.setpriority(os.PRIO_PROCESS, self.ck._thread.native_id, self.nice)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.writer_priority", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=int, default=10, help="steps per window (default 10)")
    ap.add_argument("--nice", type=int, default=19, help="niceness of the writer thread (default 19)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the chains go (default: a temporary directory)")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("threads have a niceness of their own on Linux only: nothing to compare here")
        return 2
    configure_threads()
    size, window = WORKLOAD, args.window
    batch = peers.batch_steps_for(size, "xor", window)
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        work = Path(d)
        (work / "niced").mkdir()
        configs: list[peers.Config] = [
            peers.NoCheckpoint("none", size, work),
            peers.LdformatConfig("ldformat xor", size, work, mode="xor", batch_steps=batch),
            NicedLdformat(f"ldformat xor, writer nice {args.nice}", size, work / "niced", mode="xor",
                          batch_steps=batch, nice=args.nice),
            peers.CheckFreq("checkfreq/1", size, work, interval=1),
        ]
        print(report(run_configs(configs, size, rounds=args.rounds, window=window)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
