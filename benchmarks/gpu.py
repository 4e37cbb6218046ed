"""Training-step overhead of checkpointing every step, on one CUDA device.

    python -m benchmarks.gpu                          # CUDA, gpt-30m, within about 4 minutes
    python -m benchmarks.gpu --size gpt-110m          # a bigger model (windows of 4 steps)
    python -m benchmarks.gpu --device cpu             # smoke test on the CPU (quick size)

Configurations, each training its own copy of the model and checkpointing every step:
``none``, ``none+topk`` (the baseline of ``lowdiff``), ``ldformat lowdiff`` / ``lowdiff+`` /
``xor``, ``checkfreq/1`` and ``dcp.async_save/1`` (``peers.py``; synchronous ``torch.save`` and
``safetensors`` are left out). The method is ``overhead.py``'s: interleaved rounds, windows
that end with a timed drain of background work, overhead paired by round with a 95% bootstrap
CI. With CUDA every window ends with ``torch.cuda.synchronize()`` before the clock is read, and
every step waits for the training stream (``--step-sync stream``, the default: what
``loss.item()`` does in a training loop, so the checkpointer's side-stream copies may overlap
the next step) or for the whole device (``--step-sync device``: no overlap across steps).
Bytes written per step: the growth of each ldformat chain's directory during the windows; for
the peers, the size of one checkpoint times the saves.

Budget (``--budget-s``, default 240): the whole run, from the start of the process. Rounds go
on (up to ``--rounds``) while the time used, plus the longest of the last two rounds, plus a
reserve for closing and writing, fits the budget, and while the work directory's disk keeps
room for another round; at least 2 rounds are started (a CI needs two). A watchdog writes what
was measured and exits with status 3 if the budget runs out anyway (a hung save, say).

Threads: ``torch.set_num_threads(--threads)`` (default 8, or the core count if fewer); blosc 1
thread (ldformat encodes on its one background writer thread and sets no blosc threads itself).

Output: ``<out>/gpu.md`` (the machine, the command, the table) and ``<out>/gpu.json`` (every
number, per-window and per-step times included); ``--out`` defaults to ``benchmarks/results``.
Chains and checkpoints go to ``--workdir`` (default: a temporary directory, removed).
Exit status: 0, 1 if a configuration failed (the others are still reported), 2 if CUDA was
asked for and is missing, 3 if the watchdog ended the run.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the budget counts from here: before torch is imported

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from .overhead import analyse, run_configs  # noqa: E402
from .peers import Config, config_factories  # noqa: E402
from .stats import fmt_ci, human_bytes, public_command, table  # noqa: E402
from .workload import QUICK_WORKLOAD, WORKLOAD, ModelSize, configure_threads, n_params  # noqa: E402

# GPT-2-small shape with the workload's smaller vocabulary: 110.4M parameters.
GPT_110M = ModelSize("gpt-110m", layers=12, width=768, heads=12, vocab=32768, seq=512, batch=8)
SIZES = {s.name: s for s in (QUICK_WORKLOAD, WORKLOAD, GPT_110M)}
ALIASES = {"gpt-125m": "gpt-110m", "quick": QUICK_WORKLOAD.name}
CONFIGS = ["none", "none+topk", "ldformat lowdiff", "ldformat lowdiff+", "ldformat xor", "checkfreq/1",
           "dcp.async_save/1"]
MIN_ROUNDS = 2


def now() -> float:
    return time.monotonic() - _T0


def log(text: str) -> None:
    print(f"[{now():6.1f} s] {text}", flush=True)


def copy_bandwidth(device: torch.device, mib: int = 256, reps: int = 5) -> dict[str, float]:
    """Host<->device copy bandwidth of one ``mib`` MiB tensor, GB/s (1e9 bytes), median of ``reps``."""
    n = mib << 20
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    dev = torch.empty(n, dtype=torch.uint8, device=device)

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)  # first copy: lazy set-up
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        return n / 1e9 / statistics.median(times)

    try:
        return {"mib": mib, "h2d_pinned_gbps": rate(dev, pinned), "d2h_pinned_gbps": rate(pinned, dev),
                "d2h_pageable_gbps": rate(pageable, dev)}
    finally:
        del pinned, pageable, dev
        torch.cuda.empty_cache()


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    import platform

    from .run import machine

    try:
        info = machine()
    except Exception as e:  # a missing optional package must not stop the benchmark
        info = {"cpu": "unknown", "cores": os.cpu_count(), "memory_bytes": None, "os": platform.platform(),
                "python": platform.python_version(), "torch": torch.__version__, "machine_error": repr(e)}
    info.update({"device": str(device), "torch_threads": torch.get_num_threads(), "torch_threads_asked": threads,
                 "blosc_threads": 1, "cuda_version": torch.version.cuda,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()})
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"gpu": torch.cuda.get_device_name(device), "gpu_memory_bytes": props.total_memory,
                     "gpu_capability": f"{props.major}.{props.minor}",
                     "cudnn_version": torch.backends.cudnn.version()})
    return info


class Run:
    """What has been measured so far, and the one writer of the outputs (main thread or watchdog)."""

    def __init__(self, args: argparse.Namespace, size: ModelSize, workdir: Path, command: str) -> None:
        self.args = args
        self.size = size
        self.workdir = workdir
        self.command = command
        self.info: dict[str, Any] = {}
        self.bandwidth: dict[str, Any] = {}
        self.params = 0
        self.construct_failures: dict[str, str] = {}
        self.progress: dict[str, Any] = {}
        self.result: dict[str, Any] | None = None
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self.written = False

    def disk_free(self) -> int:
        try:
            return shutil.disk_usage(self.workdir).free
        except OSError:
            return -1

    def keep_going(self, r: int, round_seconds: list[float]) -> bool:
        """Another round fits the time budget and the disk."""
        recent = max(round_seconds[-2:], default=0.0)
        reserve = 10.0 + 0.05 * self.args.budget_s  # closing the chains, the analysis, writing
        if now() + recent + reserve > self.args.budget_s:
            self.notes.append(f"stopped after {r} rounds: another round ({recent:.0f} s) would pass the "
                              f"{self.args.budget_s:.0f} s budget at {now():.0f} s")
            return False
        last = [w.get("bytes", 0) for ws in self.progress.get("windows", {}).values() for w in ws
                if w["round"] == r - 1]
        need = 1.5 * sum(last) + (2 << 30)
        free = self.disk_free()
        if 0 <= free < need:
            self.notes.append(f"stopped after {r} rounds: {human_bytes(free)} free on the work directory's disk, "
                              f"another round needs about {human_bytes(need)}")
            return False
        return True

    def partial_result(self) -> dict[str, Any]:
        windows = {k: list(v) for k, v in self.progress.get("windows", {}).items() if v}
        meta = self.progress.get("meta", {})
        res = analyse(windows, {k: meta[k] for k in windows}, [])
        res.update({"model": self.size.to_dict(), "rounds": max((w["round"] + 1 for ws in windows.values()
                                                                 for w in ws), default=0),
                    "window": self.args.window, "windows": windows, "policies": {}, "partial": True,
                    "failures": dict(self.progress.get("failures", {}))})
        return res

    def write(self, reason: str | None = None) -> bool:
        """Write gpu.md and gpu.json once; ``reason``: why the run is cut short (partial results)."""
        if not self._lock.acquire(timeout=30):
            return False
        try:
            if self.written:
                return True
            res = self.result
            if res is None:
                try:
                    res = self.partial_result()
                except Exception as e:
                    res = {"error": f"analysis failed: {type(e).__name__}: {e}", "rows": {}}
            if reason:
                res["cut_short"] = reason
            failures = {**self.construct_failures, **res.get("failures", {})}
            out: Path = self.args.out
            out.mkdir(parents=True, exist_ok=True)
            from .run import scrub

            doc = {"command": self.command, "machine": self.info, "copy_bandwidth": self.bandwidth,
                   "budget_s": self.args.budget_s, "step_sync": self.args.step_sync, "max_rounds": self.args.rounds,
                   "window": self.args.window,
                   "configurations": CONFIGS, "parameters": self.params, "failures": failures, "notes": self.notes,
                   "overhead": res, "total_seconds": now()}
            if "chains" in res:
                res["chains"] = {k: Path(v).name for k, v in res["chains"].items()}
            clean = scrub(doc, str(self.workdir))
            (out / "gpu.json").write_text(json.dumps(clean, indent=1, default=str) + "\n")
            (out / "gpu.md").write_text(self.markdown(res, failures, reason) + "\n")
            self.written = True
            log(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}")
            return True
        finally:
            self._lock.release()

    def markdown(self, res: dict[str, Any], failures: dict[str, str], reason: str | None) -> str:
        info, bw, size = self.info, self.bandwidth, self.size
        gpu = info.get("gpu") or "none"
        lines = ["# ldformat GPU benchmark", "", f"Command: `{self.command}`", ""]
        if info:
            mem = f"{info['gpu_memory_bytes'] / 2**30:.0f} GiB, " if "gpu_memory_bytes" in info else ""
            cap = f"compute capability {info['gpu_capability']}" if "gpu_capability" in info else ""
            cuda = (f"CUDA {info.get('cuda_version')}, cuDNN {info.get('cudnn_version')}" if "gpu_capability" in info
                    else "CUDA not used")
            lines.append(f"Device: {info['device']}; GPU: {gpu}" + (f" ({mem}{cap})" if mem or cap else "")
                         + f"; {cuda}.")
            lines.append(f"Machine: {info['cpu']}, {info['cores']} cores, {(info['memory_bytes'] or 0) / 2**30:.0f} "
                         f"GiB memory; {info['os']}.")
            lines.append(f"Versions: python {info['python']}, torch {info['torch']}, zarr {info.get('zarr')}, "
                         f"numcodecs {info.get('numcodecs')}, safetensors {info.get('safetensors')}, ldformat "
                         f"{info.get('ldformat')}.")
            lines.append(f"Threads: torch {info['torch_threads']} (torch.set_num_threads), blosc 1. float32 matmul "
                         f"precision: {info['float32_matmul_precision']}.")
        if bw.get("h2d_pinned_gbps"):
            lines.append(f"Copy bandwidth, one {bw['mib']} MiB tensor: host->device {bw['h2d_pinned_gbps']:.1f} GB/s, "
                         f"device->host {bw['d2h_pinned_gbps']:.1f} GB/s (pinned host memory); device->pageable host "
                         f"{bw['d2h_pageable_gbps']:.1f} GB/s.")
        elif bw.get("error"):
            lines.append(f"Copy bandwidth: not measured ({bw['error']}).")
        lines += ["", f"Workload: GPT {size.name}, {size.describe()}, {self.params / 1e6:.1f}M parameters; AdamW "
                      "(lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices), grad clipping 1.0, synthetic tokens; "
                      "fp32. Every configuration trains its own copy and checkpoints every step."]
        rows = res.get("rows", {})
        base = rows.get("none", {}).get("step_s", {}).get("median")
        waits = "the training stream (as loss.item() does)" if self.args.step_sync == "stream" else "the device"
        lines.append(
            f"Method: {res.get('rounds', 0)} rounds (budget {self.args.budget_s:.0f} s, at most {self.args.rounds}), "
            f"windows of {self.args.window} steps, configurations in a rotated order; with CUDA every step waits for "
            f"{waits} and a window ends with the drain of background work and torch.cuda.synchronize(), both timed. "
            "Overhead = median over rounds of (t / t_baseline of the same round - 1), 95% bootstrap CI. "
            "Stall = training-thread time inside the checkpoint path. Background CPU in core-seconds per step. "
            "Bytes: written during the windows / steps."
            + (f" Baseline step (none): {base * 1000:.1f} ms." if isinstance(base, float) else ""))
        if reason:
            lines += ["", f"**Cut short**: {reason}. The table holds what was measured before."]
        lines.append("")
        headers = ["configuration", "baseline", "mean step ms", "overhead % [95% CI]", "stall ms/step",
                   "bg CPU core-s/step", "bytes written/step", "notes"]
        out = []
        for name in CONFIGS:
            if name not in rows:
                out.append([name, "", "", "", "", "", "", "FAILED: " + failures.get(name, "no window measured")])
                continue
            r = rows[name]
            ws = res.get("windows", {}).get(name, [])
            steps = sum(w["steps"] for w in ws)
            mean = sum(w["seconds"] for w in ws) / steps if steps else float("nan")
            over = "baseline" if name == r["baseline"] else fmt_ci(r["overhead"], 100, 1)
            notes = []
            if r.get("compress_per_step_s"):
                notes.append(f"top-k {r['compress_per_step_s'] * 1000:.1f} ms/step")
            if "vs_none" in r:
                notes.append(f"vs none {fmt_ci(r['vs_none'], 100, 1)} %")
            if r.get("backpressure_per_step_s"):
                notes.append(f"back-pressure {r['backpressure_per_step_s'] * 1000:.1f} ms/step")
            pol = res.get("policies", {}).get(name)
            if pol:
                notes.append(f"anchor_every {pol['anchor_every']}, batch_steps {pol['batch_steps']}")
            if name in failures:
                notes.append(f"FAILED later: {failures[name]}")
            bytes_step = human_bytes(r["bytes_per_step"]) if "bytes_per_step" in r else ""
            out.append([name, r["baseline"], f"{mean * 1000:.1f}", over, f"{r['stall_per_step_s'] * 1000:.2f}",
                        f"{r['bg_cpu_per_step_s']:.3f}", bytes_step, "; ".join(notes)])
        lines.append(table(headers, out))
        if failures:
            lines += ["", "Failures:", ""] + [f"- {k}: {v}" for k, v in failures.items()]
        if self.notes:
            lines += [""] + self.notes
        lines += ["", f"Total wall time {now():.0f} s."]
        return "\n".join(lines)


def watchdog(run: Run, deadline: float, done: threading.Event) -> None:
    if done.wait(max(0.0, deadline - now())):
        return
    log(f"budget of {run.args.budget_s:.0f} s spent: writing what was measured and exiting")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it was stuck
    try:
        run.write(reason=f"the {run.args.budget_s:.0f} s budget ran out at {now():.0f} s")
    except Exception:
        traceback.print_exc()
    if run.args.workdir is None:
        shutil.rmtree(run.workdir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def build(run: Run, device: torch.device) -> list[Config]:
    """The configurations, one at a time: one that cannot be built is reported, not fatal."""
    factories = dict(config_factories(run.size, run.workdir, [1], run.args.window, device))
    configs: list[Config] = []
    for name in CONFIGS:
        t0 = time.perf_counter()
        try:
            configs.append(factories[name]())
        except Exception as e:
            traceback.print_exc()
            run.construct_failures[name] = f"construction: {type(e).__name__}: {e}"
            log(f"  {name}: FAILED to build: {type(e).__name__}: {e}")
            continue
        log(f"  {name}: built ({time.perf_counter() - t0:.1f} s)")
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a smoke test)")
    parser.add_argument("--size", default=None,
                        help=f"model size: {', '.join(SIZES)} (default {WORKLOAD.name}; {QUICK_WORKLOAD.name} on cpu)")
    parser.add_argument("--rounds", type=int, default=100, help="most rounds; the budget usually decides")
    parser.add_argument("--window", type=int, default=None,
                        help="steps per window (default 10; 4 for gpt-110m, whose chains grow by over 1 GB a step)")
    parser.add_argument("--step-sync", choices=("stream", "device"), default="stream",
                        help="CUDA: each step waits for the training stream (default) or the whole device")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-time budget of the whole run, seconds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 8, or the cores if fewer)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where chains and checkpoints are written (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device} but CUDA is not available (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}); use --device cpu for a smoke test", file=sys.stderr)
        return 2
    if device.type not in ("cuda", "cpu"):
        parser.error(f"unsupported device {args.device}")
    name = args.size or (WORKLOAD.name if device.type == "cuda" else QUICK_WORKLOAD.name)
    name = ALIASES.get(name, name)
    if name not in SIZES:
        parser.error(f"unknown size {args.size}: one of {', '.join(SIZES)}")
    size = SIZES[name]
    if args.window is None:
        args.window = 4 if size is GPT_110M else 10
    args.rounds = max(MIN_ROUNDS, args.rounds)
    threads = args.threads or min(8, os.cpu_count() or 1)
    configure_threads(threads)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-gpu-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    command = public_command("benchmarks.gpu", argv if argv is not None else sys.argv[1:])
    run = Run(args, size, workdir, command)
    done = threading.Event()
    threading.Thread(target=watchdog, args=(run, args.budget_s, done), name="gpu-bench-watchdog",
                     daemon=True).start()

    def on_term(signum: int, frame: Any) -> None:  # a timeout's kill: still write what was measured
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    reason: str | None = None
    try:
        log(f"ldformat GPU benchmark: device {device}, size {size.name}, window {args.window}, at most "
            f"{args.rounds} rounds, budget {args.budget_s:.0f} s, torch threads {threads}")
        if device.type == "cuda":
            torch.cuda.init()
        run.info = environment(device, threads)
        log(f"  GPU {run.info.get('gpu')}, torch {run.info['torch']}, CUDA {run.info['cuda_version']}, "
            f"{run.info['cores']} cores, {human_bytes(run.disk_free())} free in the work directory")
        if device.type == "cuda":
            try:
                run.bandwidth = copy_bandwidth(device)
                log(f"  copy bandwidth: H2D {run.bandwidth['h2d_pinned_gbps']:.1f} GB/s, D2H "
                    f"{run.bandwidth['d2h_pinned_gbps']:.1f} GB/s pinned, D2H pageable "
                    f"{run.bandwidth['d2h_pageable_gbps']:.1f} GB/s")
            except Exception as e:
                traceback.print_exc()
                run.bandwidth = {"error": f"{type(e).__name__}: {e}"}
        configs = build(run, device)
        built = len(configs)  # run_configs empties the list when it is done
        if configs:
            run.params = n_params(configs[0].trainer.model)
        log(f"  {len(configs)} of {len(CONFIGS)} configurations built, {run.params / 1e6:.1f}M parameters each; "
            "warming up")
        if configs:
            run.result = run_configs(configs, size, rounds=args.rounds, window=args.window, intervals=[1], log=log,
                                     keep_going=run.keep_going, min_rounds=MIN_ROUNDS, isolate=True,
                                     track_bytes=True, log_windows=True, step_sync=args.step_sync,
                                     progress=run.progress)
        if run.construct_failures or (run.result or {}).get("failures") or not built:
            rc = 1
    except BaseException as e:
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}"
        rc = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    finally:
        try:
            run.write(reason)
            if run.result is not None:
                print(Path(args.out, "gpu.md").read_text(), flush=True)
        except Exception:  # e.g. a full disk: the log still has every window
            traceback.print_exc()
            rc = rc or 1
        finally:
            done.set()
            if own_workdir:
                shutil.rmtree(workdir, ignore_errors=True)
    log(f"done, exit status {rc}")
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leftover non-daemon threads (a stuck DCP writer) must not hold the exit.
    os._exit(code)
