"""Where materialize's time goes: grad.dense and state.xor, anchor + K deltas.

    python -m benchmarks.materialize_profile            # gpt-30m (29.5M parameters), K=10
    python -m benchmarks.materialize_profile --quick    # gpt-3m, a few seconds a run
    python -m benchmarks.materialize_profile --cprofile # also the top functions of one run
    python -m benchmarks.materialize_profile --floor    # also the lowest time the parts allow here
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

KINDS = {"grad.topk": "lowdiff", "grad.dense": "lowdiff+", "state.xor": "xor"}
#: materialize / reference (the bars of RESULTS.md section 4)
BARS = {"grad.topk": 1.2, "grad.dense": 1.2, "state.xor": 2.0}


def chain_dir(base: Path, size: ModelSize, k: int, mode: str) -> Path:
    return base / f"{size.name}-k{k}" / mode


def ensure_chains(size: ModelSize, k: int, base: Path, batch_steps: int, kinds: list[str]) -> dict[str, Any]:
    """Build (or reuse) one chain per kind, a full checkpoint, and the AdamW step time."""
    data = dataclasses.replace(size, batch=2, seq=min(32, size.seq))
    info: dict[str, Any] = {}
    for kind in kinds:
        mode = KINDS[kind]
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

    from ldformat.chain import reader
    from ldformat.format import anchor, delta, replay

    phases = Phases()
    undo = []
    targets: list[tuple[Any, str, str]] = [
        (reader.ChainReader, "load_anchor_tensors", "anchor load (read + crc + decode)"),
        (reader.ChainReader, "read_object", "delta objects: read + object crc32c"),
        (reader, "object_checksum", "  of which object crc32c"),
        (delta, "decode_batch", "delta decode (all of it)"),
        (delta.ProfileArray, "decode_chunk", "  chunk crc32c + blosc decompress"),
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


# -- the floor: what this machine needs at least ------------------------------------------------
def two_thread_speedup(rounds: int = 7) -> dict[str, float]:
    """Work done by two threads over one in the same time, for an element-wise numpy loop whose
    arrays stay in the L2 cache (compute-bound) and one streaming 128 MiB arrays (memory-bound);
    one and two threads alternate, best of ``rounds`` each (a shared VM's second vCPU comes and
    goes). No overlap of decoding with replay can gain more than this on this machine."""
    import numpy as np

    def seconds(threads: int, a: np.ndarray, outs: list[np.ndarray], reps: int) -> float:
        def work(out: np.ndarray) -> None:
            for _ in range(reps):
                np.multiply(a, np.float32(1.0001), out=out)

        pool = [threading.Thread(target=work, args=(o,)) for o in outs[:threads]]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return time.perf_counter() - t0

    out: dict[str, float] = {}
    for what, n in (("compute", 1 << 16), ("memory", 1 << 25)):
        a = np.random.default_rng(0).random(n, dtype=np.float32)
        outs = [np.empty_like(a), np.empty_like(a)]
        reps = max(1, int(2e8 // n))  # about 0.1 s of one thread
        one = two = float("inf")
        for _ in range(rounds):
            one = min(one, seconds(1, a, outs, reps))
            two = min(two, seconds(2, a, outs, reps))
        out[what] = 2 * one / two
    return out


def best_of(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def serial_parts(chain: Path, k: int, reps: int = 3) -> dict[str, float]:
    """Seconds of each part of materialize(k) done alone on one thread (best of ``reps``): the
    anchor, then, over the K deltas, reading their objects from the page cache, their crc32c,
    decoding the rows (the chunks' own crc32c, blosc, segment views) and applying them (the
    optimizer step or the state delta, one torch thread). Every part is work any reader of
    these bytes does; the sum, divided by the two-thread speedup, bounds materialize below."""
    from ldformat import ChainReader
    from ldformat.format.checksum import object_checksum
    from ldformat.format.delta import RowDecoder

    reader = ChainReader(chain)
    anchor_step, path = reader.state.replay_path(k)
    entries = list({reader.state.deltas[s][0].path: reader.state.deltas[s][0] for s in path}.values())
    store = reader.store
    objects = {(e.path, o.path): f"{e.path}/{o.path}" for e in entries for o in e.objects}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = {"anchor (read + crc32c + parse)": best_of(lambda: reader.load_anchor_tensors(anchor_step), reps),
                 "read objects (page cache)": best_of(lambda: [store.read_buffer(p) for p in objects.values()], reps)}
        data = {key: store.read_buffer(p) for key, p in objects.items()}
        parts["object crc32c"] = best_of(lambda: [object_checksum(p, data[key]) for key, p in objects.items()], reps)
        decode = apply = float("inf")
        for _ in range(reps):
            replayer = reader.start_replay(anchor_step)
            gc.collect()
            t_decode = t_apply = 0.0
            decoders: dict[str, RowDecoder] = {}
            for s in path:
                entry, step_entry = reader.state.deltas[s]
                if entry.path not in decoders:
                    decoders.clear()  # one batch's buffers at a time
                    rows = [reader.state.deltas[x][1].row for x in path if reader.state.deltas[x][0].path == entry.path]
                    mine = {o.path: data[(entry.path, o.path)] for o in entry.objects}
                    decoders[entry.path] = RowDecoder(mine, entry.slots, entry.rows, entry.path,
                                                      range(min(rows), max(rows) + 1))
                slots = {slot.name: slot for slot in entry.slots}
                t0 = time.perf_counter()
                row = decoders[entry.path].row(step_entry.row).row(step_entry.row)
                t1 = time.perf_counter()
                if reader.kind == "state.xor":
                    replayer.apply_xor_step(step_entry, row, slots, "floor")
                else:
                    replayer.apply_grad_step(step_entry, row, slots, "floor")
                t_decode, t_apply = t_decode + t1 - t0, t_apply + time.perf_counter() - t1
            decode, apply = min(decode, t_decode), min(apply, t_apply)
        parts["decode rows (chunk crc32c + blosc)"] = decode
        parts["apply (" + ("state delta" if reader.kind == "state.xor" else "optimizer steps") + ")"] = apply
    finally:
        torch.set_num_threads(threads)
    return parts


def report_floor(kind: str, k: int, parts: dict[str, float], speedup: dict[str, float], reference: float,
                 measured: float, bar: float) -> list[str]:
    """Lines saying what the parts imply: the lowest materialize time any overlap of them could
    reach here (their sum over the best two-thread speedup measured) and with two ideal cores."""
    total = sum(parts.values())
    best = max(speedup.values())
    lines = [f"  floor of {kind}, K={k}: every part alone on one thread (best of 3):"]
    for label, s in parts.items():
        per_delta = "" if label.startswith("anchor") else f"  ({s / k * 1e3:6.1f} ms per delta)"
        lines.append(f"    {label:<44} {s:8.3f} s{per_delta}")
    for label, divisor in [("sum (one core)", 1.0), (f"sum / best two-thread speedup here ({best:.2f}x)", best),
                           ("sum / two ideal cores (2.00x)", 2.0)]:
        lines.append(f"    {label:<44} {total / divisor:8.3f} s  -> {total / divisor / reference:.2f}x the reference "
                     f"{reference:.3f} s")
    lines.append(f"    (bar {bar:.1f}x; materialize measured {measured / reference:.2f}x)")
    return lines


ROW_CODECS: dict[str, dict[str, Any]] = {  # numcodecs Blosc settings (1 MiB blocks, as the writer's)
    "lz4 3 shuffle (the writer's)": {"cname": "lz4", "clevel": 3, "shuffle": 1},
    "lz4 3 no shuffle": {"cname": "lz4", "clevel": 3, "shuffle": 0},
    "zstd 1 shuffle": {"cname": "zstd", "clevel": 1, "shuffle": 1},
    "stored (blosc memcpy)": {"cname": "lz4", "clevel": 0, "shuffle": 0},
}


def writer_coding(chain: Path, k: int, reps: int = 3) -> float:
    """Seconds the writer takes, on one thread (best of ``reps``), to turn step ``k``'s state into
    its ``state.xor`` row values: the Adam predictions from the coefficients the row stores, the
    differences, zigzag and moving the base on (:func:`ldformat.chain.state_delta.row_values`, as
    :class:`~ldformat.chain.writer.ChainWriter` calls it), from the states of steps ``k - 1`` and ``k``
    as the chain replays them. Compression, crc32c and the writes come on top."""
    import numpy as np

    from ldformat import ChainReader
    from ldformat.chain.captured import CapturedTensor
    from ldformat.chain.state_delta import row_values
    from ldformat.format.checks import Schema
    from ldformat.format.delta import tensor_bits
    from ldformat.format.predict import PREDICT

    reader = ChainReader(chain)
    entry, step_entry = reader.state.deltas[k]
    row = reader.load_batch(entry, k).row(step_entry.row)
    coefs = {int(n[len(PREDICT):]): np.ascontiguousarray(seg[1]).view(np.uint32)
             for n, seg in row.items() if n.startswith(PREDICT)}
    encodings = {slot.name: slot.encoding for slot in entry.slots if slot.name in row and
                 not slot.name.startswith(PREDICT)}
    before = {n: tensor_bits(t) for n, t in reader.stored_tensors(k - 1).items() if n in encodings}
    after = {n: tensor_bits(t) for n, t in reader.stored_tensors(k).items() if n in encodings}
    params = list(Schema.of(reader.root, str(chain)).params)
    best = float("inf")
    for _ in range(reps):
        tensors = {n: CapturedTensor(bits=b.copy(), dtype="float32", shape=b.shape) for n, b in after.items()}
        base = {n: b.copy() for n, b in before.items()}
        gc.collect()
        t0 = time.perf_counter()
        values = row_values(tensors, encodings, params, coefs, base, dict(base), in_place=True)
        best = min(best, time.perf_counter() - t0)
    expected = {n: np.ascontiguousarray(seg[1]).view(values[n].dtype) for n, seg in row.items() if n in encodings}
    if any(not np.array_equal(values[n], v) for n, v in expected.items()):
        raise RuntimeError(f"{chain}: the recomputed values of step {k} differ from the stored row")
    return best


def row_codecs(chain: Path, k: int) -> list[str]:
    """The writer's side of the floor: the last ``state.xor`` row's values by role (the ``adam.w``
    and ``adam.v`` residuals, ``m``'s differences), each coded alone by each codec of
    :data:`ROW_CODECS` in 8 MiB chunks, one blosc thread, best of 3: compression is the part of
    the writer's CPU a cheaper codec can move; prediction, differences, crc32c and the writes stay."""
    import numcodecs
    import numpy as np
    from numcodecs import blosc

    from ldformat import ChainReader

    reader = ChainReader(chain)
    entry, step_entry = reader.state.deltas[k]
    row = reader.load_batch(entry, k).row(step_entry.row)
    roles: dict[str, list[np.ndarray]] = defaultdict(list)
    for slot in entry.slots:
        if slot.name in row:
            role = slot.encoding if slot.encoding in ("adam.w", "adam.v") else (
                "m (sub)" if slot.name.endswith("/exp_avg") else "other")
            roles[role].append(np.ascontiguousarray(row[slot.name][1]).view(np.uint32))
    previous = blosc.get_nthreads()
    blosc.set_nthreads(1)
    lines = [f"  state.xor row of step {k} by role, each codec alone (one thread, best of 3): stored / raw, "
             "encode ms, decode ms"]
    try:
        for role, arrays in sorted(roles.items()):
            values = np.concatenate(arrays)
            if role == "other":
                continue
            chunks = [values[i:i + (1 << 21)] for i in range(0, values.shape[0], 1 << 21)]
            cells = []
            for label, settings in ROW_CODECS.items():
                codec = numcodecs.Blosc(blocksize=1 << 20, **settings)
                frames = [codec.encode(c) for c in chunks]
                enc = best_of(lambda codec=codec, chunks=chunks: [codec.encode(c) for c in chunks], 3)
                dec = best_of(lambda codec=codec, frames=frames: [codec.decode(f) for f in frames], 3)
                ratio = sum(len(f) for f in frames) / values.nbytes
                cells.append(f"{label}: {ratio:.3f}, {enc * 1e3:.0f}, {dec * 1e3:.0f}")
            zeros = 1 - np.count_nonzero(values) / values.shape[0]
            lines.append(f"    {role} ({values.nbytes / 2**20:.1f} MiB, {zeros:.1%} zero): " + "; ".join(cells))
    finally:
        blosc.set_nthreads(previous)
    return lines


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
    p.add_argument("--kinds", default="grad.dense,state.xor", help=f"comma-separated, among {', '.join(KINDS)}")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ldformat-materialize-profile")
    p.add_argument("--cprofile", action="store_true", help="print the top functions of one materialize per kind")
    p.add_argument("--baseline", type=Path, help="a directory holding ldformat_base, timed interleaved")
    p.add_argument("--no-check", action="store_true", help="skip the bit-exactness check")
    p.add_argument("--floor", action="store_true",
                   help="also time every part alone on one thread and the machine's two-thread speedup: the "
                        "lowest materialize time these parts allow here")
    args = p.parse_args(argv)

    configure_threads()
    warnings.filterwarnings("ignore", message=".*replaying in a different environment.*")
    if args.baseline is not None:
        sys.path.insert(0, str(args.baseline))
    size = QUICK_WORKLOAD if args.quick else WORKLOAD
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"unknown kinds {unknown}; choose among {', '.join(KINDS)}")
    info = ensure_chains(size, args.k, args.cache, args.batch_steps, kinds)
    from .workload import GPT

    print(f"model {size.name} ({n_params(GPT(size)) / 1e6:.1f}M parameters), K={args.k}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    floors: list[str] = []
    speedup: dict[str, float] = {}
    for kind in kinds:
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
        if args.floor:
            parts = serial_parts(chain, args.k)
            speedup = speedup or two_thread_speedup()
            m = statistics.median(m_runs)
            lines = report_floor(kind, args.k, parts, speedup, ref, m, BARS[kind])
            if kind == "state.xor":
                lines.append(f"  writer, step {args.k}: predictions + differences of the row (row_values, one thread, "
                             f"best of 3): {writer_coding(chain, args.k) * 1e3:.0f} ms; then compression:")
                lines += row_codecs(chain, args.k)
            floors.extend(lines)
            print("\n".join(lines), flush=True)
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
    if speedup:
        print(f"\ntwo threads over one on this machine: {speedup['compute']:.2f}x (compute-bound numpy), "
              f"{speedup['memory']:.2f}x (memory-bound)")
        print("\n".join(floors))


if __name__ == "__main__":
    main()
