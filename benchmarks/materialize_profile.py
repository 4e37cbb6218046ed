"""Where materialize's time goes: grad.dense and state.xor, anchor + K deltas (issue 13, item 3).

    python -m benchmarks.materialize_profile            # gpt-30m (29.5M parameters), K=10
    python -m benchmarks.materialize_profile --quick    # gpt-3m, a few seconds a run
    python -m benchmarks.materialize_profile --cprofile # also the top functions of one run
    python -m benchmarks.materialize_profile --baseline DIR
        # also time DIR/ldformat_base (another version of the package, renamed, e.g. from
        # `git archive <rev> ldformat`), interleaved with this one

Chains are built once (as section 4 "Recovery" of the benchmark builds them, by
:func:`benchmarks.recovery.build_chain`) and cached under the temporary directory, so runs
after the first only time reading. ``materialize(K)`` and the reference of the recovery
section (``torch.load`` of a full checkpoint + the K optimizer steps alone, on decoded
gradients, for grad kinds; ``torch.load`` + K x one AdamW step for xor) are timed
interleaved, in one process. The breakdown adds up the time spent in each phase of one
materialize, in every thread (so with overlap the phases may sum to more than the wall time).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import importlib
import io
import pstats
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .recovery import MODES, bit_exact, build_chain, optimizer_step_time, replay_steps_only_s
from .workload import QUICK_WORKLOAD, WORKLOAD, ModelSize, configure_threads, n_params

KINDS = {"grad.dense": "lowdiff+", "state.xor": "xor"}


def chain_dir(base: Path, size: ModelSize, k: int, mode: str) -> Path:
    return base / f"{size.name}-k{k}" / mode


def ensure_chains(size: ModelSize, k: int, base: Path, batch_steps: int) -> dict[str, Any]:
    """Build (or reuse) one chain per kind, a full checkpoint, and the AdamW step time."""
    data = dataclasses.replace(size, batch=2, seq=min(32, size.seq))
    info: dict[str, Any] = {}
    for kind, mode in KINDS.items():
        chain = chain_dir(base, size, k, mode)
        done = chain.parent / f"{mode}.done"
        full = chain.parent / "full.pt"
        if not done.exists():
            print(f"building the {kind} chain of {size.name} ({k} steps) in {chain} ...", flush=True)
            built = build_chain(size, data, mode, k, chain, batch_steps=batch_steps, keep_full=full)
            t_opt = optimizer_step_time(built["trainer"])
            torch.save(built["live"], chain.parent / f"{mode}.live.pt")
            done.write_text(f"{t_opt!r}\n")
            del built
            gc.collect()
        info[kind] = {"chain": chain, "full": full, "t_opt": float(done.read_text()),
                      "live": chain.parent / f"{mode}.live.pt"}
    return info


# -- phase accounting ---------------------------------------------------------------------------
class Phases:
    """Seconds spent in wrapped functions, summed over threads; nested phases are not subtracted."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, label: str) -> Callable[[], None]:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.seconds[label] += dt
                    self.calls[label] += 1

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, original)


@contextmanager
def instrumented() -> Iterator[Phases]:
    import google_crc32c
    import numcodecs

    from ldformat import anchor, delta, reader, replay

    phases = Phases()
    undo = []
    targets: list[tuple[Any, str, str]] = [
        (reader.ChainReader, "load_anchor_tensors", "anchor load (read + crc + decode)"),
        (reader.ChainReader, "read_object", "delta objects: read + object crc32c"),
        (reader, "object_checksum", "  of which object crc32c"),
        (delta, "decode_batch", "delta decode (all of it)"),
        (delta._ProfileArray, "decode_chunk", "  chunk crc32c + blosc decompress"),
        (numcodecs.Blosc, "decode", "    blosc decompress"),
        (delta, "_segments", "  segments (views)"),
        (delta, "dense_view", "to torch: dense_view"),
        (replay, "dense_view", "to torch: dense_view"),
        (reader, "decode_batch", "delta decode (all of it)"),
        (delta, "segment_to_tensor", "to torch: segment_to_tensor"),
        (delta, "xor_into", "xor apply"),
        (replay, "xor_into", "xor apply"),
        (replay, "step_optimizer", "optimizer step"),
        (replay.Replayer, "apply_grad_step", "apply_grad_step (incl. step)"),
        (replay.Replayer, "apply_xor_step", "apply_xor_step (incl. xor)"),
        (replay.Replayer, "result", "result (sync optimizer tensors)"),
    ]
    del anchor, google_crc32c
    for owner, attr, label in targets:
        if hasattr(owner, attr):
            undo.append(phases.wrap(owner, attr, label))
    try:
        yield phases
    finally:
        for u in reversed(undo):
            u()


def materialize(chain: Path, k: int, package: str = "ldformat") -> dict[str, Any]:
    reader: Any = importlib.import_module(package).ChainReader(chain)
    return reader.materialize(k)  # type: ignore[no-any-return]


def time_once(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="gpt-3m instead of gpt-30m")
    p.add_argument("-k", type=int, default=10, help="deltas after the anchor (default 10)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median reported)")
    p.add_argument("--batch-steps", type=int, default=8)
    p.add_argument("--kinds", default="grad.dense,state.xor")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ldformat-materialize-profile")
    p.add_argument("--cprofile", action="store_true", help="print the top functions of one materialize per kind")
    p.add_argument("--baseline", type=Path, help="a directory holding ldformat_base, timed interleaved")
    p.add_argument("--no-check", action="store_true", help="skip the bit-exactness check")
    args = p.parse_args(argv)

    configure_threads()
    warnings.filterwarnings("ignore", message=".*replaying in a different environment.*")
    if args.baseline is not None:
        sys.path.insert(0, str(args.baseline))
    size = QUICK_WORKLOAD if args.quick else WORKLOAD
    info = ensure_chains(size, args.k, args.cache, args.batch_steps)
    from .workload import GPT

    print(f"model {size.name} ({n_params(GPT(size)) / 1e6:.1f}M parameters), K={args.k}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    for kind in args.kinds.split(","):
        chain, full, t_opt = info[kind]["chain"], info[kind]["full"], info[kind]["t_opt"]
        if not args.no_check:
            live = torch.load(info[kind]["live"], weights_only=True)
            exact = bit_exact(materialize(chain, args.k), live)
            del live
        else:
            exact = None
        m_runs, b_runs, load_runs, steps_runs = [], [], [], []
        for _ in range(args.reps):  # interleaved
            m_runs.append(time_once(lambda chain=chain: materialize(chain, args.k)))
            if args.baseline is not None:
                b_runs.append(time_once(lambda chain=chain: materialize(chain, args.k, "ldformat_base")))
            load_runs.append(time_once(lambda full=full: torch.load(full, weights_only=True)))
            if kind.startswith("grad."):
                steps_runs.append(replay_steps_only_s(chain, args.k, 1))
            else:
                steps_runs.append(args.k * t_opt)
        ref = statistics.median(load_runs) + statistics.median(steps_runs)
        print(f"\n{kind} ({MODES[KINDS[kind]]}): reference {ref:.3f} s = torch.load {statistics.median(load_runs):.3f} "
              f"+ steps {statistics.median(steps_runs):.3f} (runs {', '.join(f'{x:.3f}' for x in steps_runs)})")
        for label, runs in [("baseline", b_runs), ("this", m_runs)]:
            if runs:
                m = statistics.median(runs)
                rows.append((f"{kind} ({label})", m, ref, m / ref, exact if label == "this" else None))
                print(f"  materialize ({label}) {m:.3f} s (runs {', '.join(f'{x:.3f}' for x in runs)}); "
                      f"ratio {m / ref:.2f}x; bit-exact {exact if label == 'this' else '-'}", flush=True)
        with instrumented() as phases:
            wall = time_once(lambda chain=chain: materialize(chain, args.k))
        print(f"  breakdown of one instrumented materialize ({wall:.3f} s wall; seconds summed over threads):")
        for label, s in phases.seconds.items():
            print(f"    {label:<44} {s:8.3f} s  ({phases.calls[label]} calls)")
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            materialize(chain, args.k)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue())
    print("\n| kind | model | K | materialize s | reference s | ratio | bit-exact |\n|---|---|---|---|---|---|---|")
    for kind, m, ref, ratio, exact in rows:
        print(f"| {kind} | {size.name} | {args.k} | {m:.3f} | {ref:.3f} | {ratio:.2f}x | {exact} |")


if __name__ == "__main__":
    main()
