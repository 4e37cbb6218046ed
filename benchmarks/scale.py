"""How the checkpoint cost scales with model size: ``ldformat.Checkpointer`` at ~30M, ~120M, ~350M.

    python -m benchmarks.scale --quick                  # tiny sizes, a minute or two
    python -m benchmarks.scale                          # gpt-30m, gpt-120m, gpt-350m
    python -m benchmarks.scale --sizes gpt-30m,gpt-120m

Every size uses the GPT of ``workload.py`` with the same tokens per step (batch 2 x sequence
128), so the step time grows with the model. Each configuration (``none``, ``lowdiff``,
``lowdiff+``, ``xor``; a checkpoint every step) runs in a fresh child process, so that its
peak RSS is its own: untimed warm-up steps, the Checkpointer (its creation writes the first
anchor), one untimed batch with checkpointing on, then one timed window of steps that ends by
draining the background writer. A *round* runs every configuration once, in a rotated order;
overhead is paired by round with ``none``. After the window the child measures the pipeline's
host buffers, the process peak RSS, a timed ``ChainWriter.write_anchor`` of the live state, the
chain's bytes and (first round only) ``materialize`` of anchor + K deltas.

``lowdiff`` compresses in the training loop (1% top-k with error feedback, the training's own
choice, as in ``overhead.py``) and passes ``compress=False``; its overhead against ``none``
therefore includes the compression, which is also reported apart.

Output: ``<out>/scale.json``, ``<out>/scale.md`` and ``<out>/scale.png`` (``<out>`` defaults to
``benchmarks/results``, ``benchmarks/results/quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ldformat.capture.runtime import DEFAULT_QUEUE_DEPTH

from .stats import public_command
from .workload import ModelSize

# Same architecture family as workload.py; equal tokens per step (2 x 128) at every size.
SIZES = [
    ModelSize("gpt-30m", layers=8, width=512, heads=8, vocab=8192, seq=128, batch=2),
    ModelSize("gpt-120m", layers=16, width=768, heads=12, vocab=8192, seq=128, batch=2),
    ModelSize("gpt-350m", layers=27, width=1024, heads=16, vocab=8192, seq=128, batch=2),
]
QUICK_SIZES = [
    ModelSize("gpt-1m", layers=2, width=128, heads=4, vocab=2048, seq=32, batch=2),
    ModelSize("gpt-3m", layers=4, width=192, heads=6, vocab=4096, seq=64, batch=2),
]
MODES = ("lowdiff", "lowdiff+", "xor")
CONFIGS = ("none",) + MODES
QUEUE_DEPTH: dict[str, int] = dict(DEFAULT_QUEUE_DEPTH)  # the Checkpointer's defaults: queue_depth + 1 buffer sets
ANCHOR_EVERY = 1_000_000  # no scheduled anchor inside the run: anchors are timed apart
K = 4  # materialize anchor + K deltas

# Per size: rounds, timed steps per window, untimed steps before the Checkpointer.
PLAN = {"gpt-30m": (3, 6, 2), "gpt-120m": (2, 6, 2), "gpt-350m": (1, 4, 2)}
QUICK_PLAN = {"gpt-1m": (2, 6, 2), "gpt-3m": (2, 6, 2)}


def params_of(size: ModelSize) -> int:
    """Parameters of the GPT at ``size`` (counted without building it)."""
    d, v = size.width, size.vocab
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + size.seq * d + size.layers * block + 2 * d


def estimate_bytes(size: ModelSize, config: str, batch_steps: int) -> dict[str, float]:
    """Host memory the configuration should need, from the README's "Memory" description."""
    n = params_of(size)
    state = 12.0 * n  # fp32 weights + AdamW m, v
    train = 16.0 * n  # + the gradient
    sets = QUEUE_DEPTH.get(config, 0) + 1
    if config == "none":
        pipe = 0.0
    elif config == "lowdiff":
        train += 4.0 * n  # the training's own top-k residual (error feedback)
        pipe = sets * 0.01 * n * 8
    elif config == "lowdiff+":
        pipe = sets * 4.0 * n + state + batch_steps * 4.0 * n  # gradients, replica, compressed batch (bound)
    else:
        pipe = sets * state + state + batch_steps * state  # staged state, XOR base, compressed batch (bound)
    anchor = 2 * state  # creation: the anchor snapshot (+ the lowdiff+ replica's own copy), before any staging
    return {"params": n, "state": state, "training": train, "pipeline": pipe, "anchor_snapshot": anchor,
            "total": train + max(pipe, anchor)}


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def nbytes(tensors: Any) -> int:
    import numpy as np
    import torch

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, np.ndarray):
            total += t.nbytes
    return total


def pipeline_buffers(ck: Any) -> dict[str, int]:
    """Host buffers the runtime holds, by owner (private attributes; 0 where absent)."""
    pool = getattr(ck, "pool", None)
    sets = list(getattr(getattr(pool, "_free", None), "queue", []))  # drained: every set is free
    writer = ck.writer
    replica = getattr(ck, "_replica", None)
    out = {
        "buffer_sets": len(sets),
        "staging_bytes": sum(nbytes(s.tensors.values()) for s in sets),
        "xor_base_bytes": nbytes(getattr(writer, "_xor_base", {}).values()),
        "xor_scratch_bytes": nbytes([getattr(writer, "_xor_scratch", None)]),
        "replica_bytes": nbytes(replica._replayer.tensors.values()) if replica is not None else 0,
    }
    out["total_bytes"] = out["staging_bytes"] + out["xor_base_bytes"] + out["xor_scratch_bytes"] + out["replica_bytes"]
    return out


# --------------------------------------------------------------------------------------------
# The child: one configuration, one window.


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from .peers import LdformatConfig, NoCheckpoint, flat_state
    from .storage import chain_bytes
    from .workload import configure_threads, n_params

    configure_threads()
    size = ModelSize(**spec["size"])
    config, steps, warm, workdir = spec["config"], spec["steps"], spec["warmup"], Path(spec["workdir"])
    res: dict[str, Any] = {"config": config, "round": spec["round"], "steps": steps}
    t_start = time.perf_counter()
    if config == "none":
        cfg: Any = NoCheckpoint("none", size, workdir)
    else:
        cfg = LdformatConfig(f"ldformat {config}", size, workdir / f"r{spec['round']}", mode=config,
                             anchor_every=ANCHOR_EVERY, batch_steps=spec["batch_steps"])
        cfg.chain.parent.mkdir(parents=True, exist_ok=True)
    res["params"] = n_params(cfg.trainer.model)
    cfg.warmup(warm)  # AdamW state exists before the first anchor
    res["state_bytes"] = nbytes(flat_state(cfg.trainer.model, cfg.trainer.optimizer).values())
    settle = 0
    if config != "none":
        cfg.attach()
        res["create_s"] = cfg.create_s  # opens the chain and writes the first anchor
        settle = int(spec["batch_steps"])
        cfg.warmup(settle)  # one untimed batch with checkpointing on: buffers allocated, threads running
        cfg.drain()
    cfg.release_grads()
    gc.collect()
    res["untimed_steps"] = warm + settle
    cfg.trainer.prefetch(cfg.trainer.steps + 1, steps)
    gc.collect()
    c0 = cfg.counters()
    t0 = time.perf_counter()
    step_times = []
    for _ in range(steps):
        ts = time.perf_counter()
        cfg.step()
        step_times.append(time.perf_counter() - ts)
    t_steps = time.perf_counter() - t0
    cfg.drain()
    elapsed = time.perf_counter() - t0
    c1 = cfg.counters()
    res.update({"seconds": elapsed, "step_s": elapsed / steps, "drain_s": elapsed - t_steps, "step_times": step_times,
                **{f"d_{k}": c1[k] - c0[k] for k in c1}})
    cfg.release_grads()
    gc.collect()
    res["rss_after_window"] = rss_now()
    res["peak_rss"] = peak_rss()  # before the timed anchor and materialize below
    if config != "none":
        ck = cfg.ck
        res["pipeline"] = pipeline_buffers(ck)
        res["batch_steps"] = ck.batch_steps
        res["anchor_every"] = ck.anchor_every
        comp = cfg.compressor
        res["topk_residual_bytes"] = nbytes(comp.state_dict().values()) if comp is not None else 0
        # A full anchor of the live state through the writer: snapshot copy + encode + checksum
        # + write + fsync + commit record. The background writer is idle (drained, whole batches),
        # and no step follows: the staging buffers are dropped first (memory at the large sizes).
        for s in list(ck.pool._free.queue):
            s.tensors.clear()
        gc.collect()
        last = ck.writer.last_step
        t = time.perf_counter()
        ck.writer.write_anchor(last)
        res["anchor_write_s"] = time.perf_counter() - t
        res["anchor_step"] = last
        cfg.close()
        res["close_s"] = cfg.close_s
        res["lifetime"] = cfg.lifetime
        b = chain_bytes(cfg.chain)
        res["chain"] = {k: b[k] for k in ("kind", "steps", "delta_steps", "anchors", "anchor_bytes", "delta_bytes",
                                          "delta_bytes_per_step", "log_bytes_per_delta_step", "bytes_on_disk")}
        if spec["materialize"]:
            from ldformat import ChainReader

            del cfg.trainer, cfg.ck
            gc.collect()
            k = min(K, last)
            times = []
            for _ in range(spec["materialize_reps"]):
                t = time.perf_counter()
                state = ChainReader(cfg.chain).materialize(k)
                times.append(time.perf_counter() - t)
                del state
                gc.collect()
            res["materialize"] = {"k": k, "times_s": times, "median_s": statistics.median(times)}
        shutil.rmtree(cfg.chain, ignore_errors=True)
    res["child_wall_s"] = time.perf_counter() - t_start
    return res


# --------------------------------------------------------------------------------------------
# The parent: rounds of child processes, then the tables.


def batch_steps_of(size: ModelSize, mode: str, steps: int) -> int:
    """The largest divisor of the window whose captured steps fit the runtime's 1 GiB batch cap."""
    per_step = {"lowdiff": 0.01 * 8, "lowdiff+": 4.0, "xor": 12.0}[mode] * params_of(size)
    return max([b for b in range(1, steps + 1) if steps % b == 0 and b * per_step <= 1 << 30], default=1)


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [sys.executable, "-m", "benchmarks.scale", "--child", json.dumps(spec), "--child-out", out]
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            reason = "killed (out of memory?)" if proc.returncode < 0 else "failed"
            return {"error": f"{reason}, exit {proc.returncode}: {' / '.join(tail)}"}
        return json.loads(Path(out).read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        Path(out).unlink(missing_ok=True)


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def analyse(size: ModelSize, runs: dict[str, list[dict[str, Any]]], estimates: dict[str, Any]) -> dict[str, Any]:
    ok = {c: [r for r in rs if "error" not in r] for c, rs in runs.items()}
    base = {r["round"]: r for r in ok.get("none", [])}
    base_step = med([r["step_s"] for r in base.values()])
    base_peak = med([r["peak_rss"] for r in base.values()])
    base_rss = med([r["rss_after_window"] for r in base.values()])
    out: dict[str, Any] = {"model": size.to_dict(), "params": None, "state_bytes": None, "estimates": estimates,
                           "none": {"step_s": base_step, "peak_rss": base_peak, "rss_after_window": base_rss,
                                    "rounds": len(base)},
                           "modes": {}}
    for rs in ok.values():
        if rs:
            out["params"] = rs[0]["params"]
            out["state_bytes"] = rs[0]["state_bytes"]
    state = out["state_bytes"]
    for mode in MODES:
        rs = ok.get(mode, [])
        errors = [r["error"] for r in runs.get(mode, []) if "error" in r]
        if not rs:
            out["modes"][mode] = {"measured": False, "why": "; ".join(errors) or "not run"}
            continue
        steps = sum(r["steps"] for r in rs)
        paired = [r["step_s"] / base[r["round"]]["step_s"] - 1 for r in rs if r["round"] in base]
        stall = sum(r["d_stall_s"] for r in rs) / steps
        compress = sum(r["d_compress_s"] for r in rs) / steps
        paired_net = [(r["step_s"] - r["d_compress_s"] / r["steps"]) / base[r["round"]]["step_s"] - 1
                      for r in rs if r["round"] in base]
        chain = rs[0]["chain"]
        anchor_s = med([r["anchor_write_s"] for r in rs])
        pipe = rs[0]["pipeline"]
        peak = med([r["peak_rss"] for r in rs])
        rss = med([r["rss_after_window"] for r in rs])
        mat = next((r["materialize"] for r in rs if "materialize" in r), None)
        out["modes"][mode] = {
            "measured": True, "rounds": len(rs), "steps": steps, "errors": errors,
            "batch_steps": rs[0]["batch_steps"], "anchor_every": rs[0]["anchor_every"],
            "step_s": med([r["step_s"] for r in rs]),
            "overhead": {"median": med(paired), "values": paired},
            "overhead_without_compression": ({"median": med(paired_net), "values": paired_net}
                                             if mode == "lowdiff" else None),
            "compress_per_step_s": compress,
            "stall_per_step_s": stall,
            "stall_fraction": stall / base_step if base_step else None,
            "backpressure_per_step_s": sum(r["d_backpressure_s"] for r in rs) / steps,
            "bg_cpu_per_step_s": sum(r["d_bg_cpu_s"] for r in rs) / steps,
            "drain_per_step_s": sum(r["drain_s"] for r in rs) / steps,
            "delta_bytes_per_step": chain["delta_bytes_per_step"],
            "log_bytes_per_delta_step": chain["log_bytes_per_delta_step"],
            "delta_over_state": chain["delta_bytes_per_step"] / state,
            "anchor_bytes": chain["anchor_bytes"],
            "anchor_write_s": anchor_s,
            "anchor_write_mb_s": chain["anchor_bytes"] / anchor_s / 1e6 if anchor_s else None,
            "anchor_write_state_mb_s": state / anchor_s / 1e6 if anchor_s else None,
            "create_s": med([r["create_s"] for r in rs]),
            "materialize": mat,
            "pipeline_buffers": pipe,
            "pipeline_buffers_over_state": pipe["total_bytes"] / state,
            "topk_residual_bytes": rs[0]["topk_residual_bytes"],
            "peak_rss": peak,
            "peak_rss_over_none": (peak - base_peak) if base_peak else None,
            "peak_rss_over_none_per_state": (peak - base_peak) / state if base_peak else None,
            "rss_after_window_over_none": (rss - base_rss) if base_rss else None,
            "rss_after_window_over_none_per_state": (rss - base_rss) / state if base_rss else None,
            "chain": chain,
            "windows": [{k: r[k] for k in ("round", "steps", "step_s", "drain_s", "d_stall_s", "d_bg_cpu_s",
                                           "d_compress_s", "step_times", "peak_rss", "rss_after_window",
                                           "anchor_write_s", "create_s", "child_wall_s")} for r in rs],
        }
    out["none"]["windows"] = [{k: r[k] for k in ("round", "steps", "step_s", "drain_s", "step_times", "peak_rss",
                                                 "rss_after_window", "child_wall_s")} for r in base.values()]
    out["none"]["errors"] = [r["error"] for r in runs.get("none", []) if "error" in r]
    return out


def report(res: dict[str, Any]) -> str:
    from .stats import human_bytes, table

    sizes = res["sizes"]

    def label(s: dict[str, Any]) -> str:
        p = s["params"] or params_of(ModelSize(**s["model"]))
        return f"{s['model']['name']} ({p / 1e6:.1f}M)"

    def grid(title: str, fn: Any, note: str = "") -> list[str]:
        rows = []
        for s in sizes:
            row = [label(s)]
            for mode in MODES:
                m = s["modes"].get(mode, {})
                row.append(fn(m, s) if m.get("measured") else "not measured")
            rows.append(row)
        return [f"### {title}", "", *([note, ""] if note else []), table(["size"] + list(MODES), rows), ""]

    def pct(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None else f"{100 * x:.{digits}f}%"

    lines = ["# Checkpoint cost against model size", "",
             f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, "
             f"{res['machine']['memory_bytes'] / 2**30:.0f} GiB memory, no GPU; python {res['machine']['python']}, "
             f"torch {res['machine']['torch']}; torch threads 2, blosc 1. Timings on a few cores vary by tens of "
             "percent between runs (compare the rounds below); byte counts and buffer sizes are exact.", "",
             f"Run time: {res['total_seconds'] / 60:.1f} min (started {res['started_utc']}).", "",
             "## Method", "",
             "GPT of `workload.py` (pre-LN, tied embedding/head, AdamW, grad clipping 1.0, synthetic tokens), the "
             "same tokens per step at every size (batch 2 x sequence 128), so the step time grows with the model. "
             "Each configuration runs in its own child process: "
             "untimed steps, `Checkpointer(mode=..., anchor_every=1000000, batch_steps=b)` (its creation writes "
             "the first anchor; no other anchor is scheduled), one untimed batch of b steps with checkpointing, "
             "then one timed window of steps, ending with a drain of the background writer (timed inside the "
             "window). b is the largest divisor of the window whose captured steps fit the runtime's 1 GiB batch "
             "cap. A round runs `none` and the three modes once, in a rotated order; overhead = "
             "t_mode / t_none of the same round - 1, median over rounds. "
             "`lowdiff` compresses in the training loop (1% top-k with error feedback, `compress=False`, as "
             "in `overhead.py`); its overhead against `none` includes that compression (also shown without it).",
             "",
             table(["size", "model", "rounds", "timed steps per window", "untimed steps (none / + one batch)",
                    "none step s", "raw state (weights + m + v)"],
                   [[label(s), ModelSize(**s["model"]).describe(), s["plan"]["rounds"], s["plan"]["steps"],
                     s["plan"]["warmup"], "n/a" if s["none"]["step_s"] is None else f"{s['none']['step_s']:.2f}",
                     human_bytes(s["state_bytes"] or 0)] for s in sizes]),
             ""]
    lines += grid("Training-thread stall per step / `none` step time",
                  lambda m, s: f"{pct(m['stall_fraction'], 2)} ({m['stall_per_step_s'] * 1000:.0f} ms)",
                  "`ck.stats.stall_s` over the timed steps (hooks, copies into the host buffers, back-pressure), "
                  "divided by the median `none` step time of the size.")
    lines += grid("End-to-end overhead vs `none` (paired by round)",
                  lambda m, s: pct(m["overhead"]["median"]) + (f" (n={len(m['overhead']['values'])}: "
                  + ", ".join(pct(v) for v in m["overhead"]["values"]) + ")")
                  + (f"; without the top-k compression {pct(m['overhead_without_compression']['median'])}"
                     if m.get("overhead_without_compression") else ""),
                  "Window time (steps + drain) per step. With one or two rounds these are single or paired "
                  "samples on a shared machine, not confidence intervals.")
    lines += grid("Background CPU per step (core-seconds)", lambda m, s: f"{m['bg_cpu_per_step_s']:.3f}",
                  "`ck.stats.background_cpu_s` (the writer thread's CPU time) over the timed window / steps.")
    lines += grid("Delta bytes per step (and / raw state)",
                  lambda m, s: f"{human_bytes(m['delta_bytes_per_step'])} ({m['delta_over_state']:.4f}x)",
                  "Delta objects of the chain written (log records apart) / delta steps; raw state = fp32 weights "
                  "+ AdamW m and v.")
    lines += grid("Anchor write", lambda m, s: f"{m['anchor_write_s']:.2f} s, {human_bytes(m['anchor_bytes'])}, "
                  f"{m['anchor_write_mb_s']:.0f} MB/s on disk ({m['anchor_write_state_mb_s']:.0f} MB/s of raw state)",
                  "`ck.writer.write_anchor(last_step)` after the window (background writer idle): snapshot copy "
                  "+ encode + checksum + write + fsync + commit record; median over rounds. MB/s = anchor bytes "
                  "on disk / time, and raw state bytes / time.")
    lines += grid(f"Materialize anchor + {K} deltas",
                  lambda m, s: "not measured" if not m.get("materialize") else
                  f"{m['materialize']['median_s']:.2f} s (K={m['materialize']['k']})",
                  "`ChainReader(chain).materialize(K)` on the chain written (first round), in the child after the "
                  "training objects were freed; single run at the large sizes.")
    lines += grid("Pipeline host buffers / raw state",
                  lambda m, s: f"{m['pipeline_buffers_over_state']:.2f}x "
                  f"({human_bytes(m['pipeline_buffers']['total_bytes'])}: "
                  + ", ".join(f"{k.replace('_bytes', '')} {human_bytes(v)}" for k, v in m["pipeline_buffers"].items()
                              if k.endswith("_bytes") and k != "total_bytes" and v)
                  + f"; {m['pipeline_buffers']['buffer_sets']} buffer sets)",
                  "Counted from the runtime's objects after the window: the tensors of every BufferSet of "
                  "`ck.pool` (staging: `queue_depth + 1` captured steps, the default: 3 for `lowdiff` and "
                  "`lowdiff+`, 1 for `xor`), the writer's XOR base and XOR scratch, and the `lowdiff+` "
                  "replica's tensors. Transient buffers (the compressed chunks of the batch being written, "
                  "the anchor snapshot) are not in this count.")
    lines += grid("Peak RSS above `none` / raw state",
                  lambda m, s: "n/a" if m["peak_rss_over_none"] is None else
                  f"{m['peak_rss_over_none_per_state']:.2f}x ({human_bytes(m['peak_rss_over_none'])}); "
                  f"RSS after the window {m['rss_after_window_over_none_per_state']:.2f}x",
                  "`resource.getrusage(RUSAGE_SELF).ru_maxrss` of the child (taken after the window, before the "
                  "timed anchor and materialize) minus the same for `none` of the same size; includes the "
                  "first anchor's snapshot at creation and, for `lowdiff`, the training's own top-k residual "
                  "(4 bytes/parameter, not part of the pipeline). 'RSS after the window': resident set at the "
                  "end of the drained window, minus `none`'s.")
    skipped = [(label(s), mode, m["why"]) for s in sizes for mode, m in s["modes"].items() if not m.get("measured")]
    lines += ["## Not measured", ""]
    lines += [f"- {sz} {mode}: {why}" for sz, mode, why in skipped] or ["Everything planned was measured."]
    lines += ["", "## Reading", "", res.get("reading", "")]
    return "\n".join(lines).rstrip() + "\n"


def reading(res: dict[str, Any]) -> str:
    """A short summary computed from the numbers (the trend of the stall; what holds the host memory)."""
    parts = []
    for mode in MODES:
        xs = [(s["params"], s["modes"][mode]["stall_fraction"]) for s in res["sizes"]
              if s["modes"].get(mode, {}).get("measured") and s["modes"][mode]["stall_fraction"] is not None]
        if len(xs) >= 2:
            trend = ", ".join(f"{p / 1e6:.0f}M {100 * f:.2f}%" for p, f in xs)
            first, last = xs[0][1], xs[-1][1]
            word = "falls" if last < 0.8 * first else "rises" if last > 1.25 * first else "stays about flat"
            parts.append(f"`{mode}` stall fraction {word} with size ({trend})")
    mem = []
    for s in res["sizes"]:
        for mode in MODES:
            m = s["modes"].get(mode, {})
            if m.get("measured"):
                pb = m["pipeline_buffers"]
                held = ", ".join(f"{k.replace('_bytes', '')} {v / s['state_bytes']:.2f}x" for k, v in pb.items()
                                 if k.endswith("_bytes") and k != "total_bytes" and v)
                rss = m["peak_rss_over_none_per_state"]
                mem.append(f"{s['model']['name']} {mode}: buffers {m['pipeline_buffers_over_state']:.2f}x"
                           + (f" ({held})" if held else "") + (f", peak RSS +{rss:.2f}x" if rss is not None else ""))
    return ("; ".join(parts) + ".\n\nPipeline host memory as a multiple of the raw state: " + "; ".join(mem) + ".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a minute or two)")
    parser.add_argument("--sizes", default=None, help="comma-separated size names (default: all of the mode)")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--workdir", type=Path, default=None, help="where chains are written (default: a temp dir)")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="stop starting new child runs after this many minutes (they are reported as not measured)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        res = child(json.loads(args.child))
        Path(args.child_out).write_text(json.dumps(res))
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    from .run import machine, scrub

    all_sizes, plan = (QUICK_SIZES, QUICK_PLAN) if args.quick else (SIZES, PLAN)
    by_name = {s.name: s for s in all_sizes}
    names = [n.strip() for n in args.sizes.split(",")] if args.sizes else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(by_name)}")
    out: Path = args.out or (Path("benchmarks/results/quick") if args.quick else Path("benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-scale-")) if own else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    command = public_command("benchmarks.scale", given)
    started = time.perf_counter()
    res: dict[str, Any] = {"command": command, "machine": machine(), "queue_depth": QUEUE_DEPTH, "k": K,
                           "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sizes": []}
    deadline = started + args.budget_min * 60 if args.budget_min else None
    try:
        for name in names:
            size = by_name[name]
            rounds, steps, warm = plan[name]
            bsteps = {m: batch_steps_of(size, m, steps) for m in MODES}
            estimates = {c: estimate_bytes(size, c, bsteps.get(c, 1)) for c in CONFIGS}
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
            print(f"{name}: {params_of(size) / 1e6:.1f}M parameters, {rounds} rounds x {steps} steps; batch_steps "
                  f"{bsteps}", flush=True)
            for r in range(rounds):
                order = list(CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)])
                for c in order:
                    if deadline and time.perf_counter() > deadline:
                        runs[c].append({"error": "not run: the run's time budget was spent", "round": r})
                        continue
                    est = estimates[c]["total"]
                    avail = mem_available()
                    if avail and est > 0.85 * avail:
                        runs[c].append({"error": f"not run: estimated {est / 2**30:.1f} GiB of host memory "
                                                 f"(training 16 B/param + the larger of pipeline and anchor snapshots) "
                                                 f"> 85% of the "
                                                 f"{avail / 2**30:.1f} GiB available", "round": r})
                        print(f"  round {r}: {c} skipped (memory estimate {est / 2**30:.1f} GiB)", flush=True)
                        continue
                    spec = {"size": size.to_dict(), "config": c, "round": r, "steps": steps, "warmup": warm,
                            "batch_steps": bsteps.get(c, 1), "workdir": str(workdir), "materialize": r == 0,
                            "materialize_reps": 1 if params_of(size) > 50e6 else 3}
                    t0 = time.perf_counter()
                    timeout = 600.0 if deadline is None else max(60.0, deadline + 600 - time.perf_counter())
                    rr = run_child(spec, timeout)
                    rr.setdefault("round", r)
                    runs[c].append(rr)
                    msg = rr.get("error") or (
                        f"{rr['step_s']:.2f} s/step, stall {rr.get('d_stall_s', 0) / steps * 1000:.0f} ms/step, "
                        f"bg cpu {rr.get('d_bg_cpu_s', 0) / steps:.2f} s/step, "
                        f"peak rss {rr['peak_rss'] / 2**30:.2f} GiB")
                    print(f"  round {r}: {c}: {msg} ({time.perf_counter() - t0:.0f} s)", flush=True)
            entry = analyse(size, runs, estimates)
            entry["plan"] = {"rounds": rounds, "steps": steps, "warmup": warm, "batch_steps": bsteps}
            res["sizes"].append(entry)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    res["total_seconds"] = time.perf_counter() - started
    res["reading"] = reading(res)
    clean = scrub(res, str(workdir))
    (out / "scale.json").write_text(json.dumps(clean, indent=1, default=str) + "\n")
    (out / "scale.md").write_text(report(clean))
    print(report(clean))
    from .plots import make_scale_plot

    plot = make_scale_plot(clean, out)
    print(f"wrote {out / 'scale.json'} and {out / 'scale.md'}" + (f" and {out / plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
