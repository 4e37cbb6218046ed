"""Run the ldformat benchmark suite and write tables, JSON and plots.

    python -m benchmarks.run --quick            # small model, a few minutes
    python -m benchmarks.run                    # the fixed workload (~30M GPT), within an hour
    python -m benchmarks.run --only overhead,bytes --out benchmarks/results

Everything runs in one process: torch threads = 2, blosc threads = 1 in every configuration.
Results go to ``<out>/results.json``, ``<out>/RESULTS.md`` and ``<out>/*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import overhead, recovery, storage
from .stats import public_command
from .workload import (
    QUICK_SCALING_SIZES,
    QUICK_WORKLOAD,
    SCALING_SIZES,
    WORKLOAD,
    ModelSize,
    configure_threads,
)

SECTIONS = ("overhead", "bytes", "anchor", "recovery", "scaling", "chain")


@dataclass
class Plan:
    workload: ModelSize
    intervals: list[int]
    derived_intervals: list[int]
    rounds: int
    window: int
    anchor_reps: int
    recovery_ks: list[int]
    recovery_reps: int
    recovery_budget_s: float
    batch_steps: int
    scaling_sizes: list[ModelSize]
    scaling_steps: int
    chain_length: int
    chain_size: ModelSize = field(default_factory=lambda: QUICK_SCALING_SIZES[0])

    @classmethod
    def full(cls) -> Plan:
        return cls(workload=WORKLOAD, intervals=[1, 10], derived_intervals=[100], rounds=4, window=10,
                   anchor_reps=9, recovery_ks=[1, 10, 100], recovery_reps=3, recovery_budget_s=15.0, batch_steps=8,
                   scaling_sizes=SCALING_SIZES, scaling_steps=10, chain_length=1000)

    @classmethod
    def quick(cls) -> Plan:
        return cls(workload=QUICK_WORKLOAD, intervals=[1, 2, 4], derived_intervals=[], rounds=5, window=4,
                   anchor_reps=3, recovery_ks=[1, 4, 16], recovery_reps=3, recovery_budget_s=10.0, batch_steps=4,
                   scaling_sizes=QUICK_SCALING_SIZES, scaling_steps=4, chain_length=100)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["workload"] = self.workload.to_dict()
        d["scaling_sizes"] = [s.to_dict() for s in self.scaling_sizes]
        d["chain_size"] = self.chain_size.to_dict()
        return d


def machine() -> dict[str, Any]:
    cpu = "unknown"
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown":
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import numcodecs
    import numpy
    import safetensors
    import torch
    import zarr

    import ldformat

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_avx512": " avx512f" in flags,
        "memory_bytes": mem,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "ldformat": ldformat.__version__,
    }


def scrub(obj: Any, workdir: str) -> Any:
    """Drop machine paths from what is written (chain paths become relative to the work dir)."""
    if isinstance(obj, dict):
        return {str(k): scrub(v, workdir) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, workdir) for v in obj]
    if isinstance(obj, str) and workdir in obj:
        return obj.replace(workdir, "<workdir>")
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and few steps (a few minutes)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where chains and checkpoints are written (default: a temporary directory, removed)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    parser.add_argument("--rounds", type=int, default=None, help="overhead rounds (default: 4 full, 3 quick)")
    parser.add_argument("--window", type=int, default=None, help="overhead window in steps (default: 10 full, 4 quick)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    if "bytes" in sections and "overhead" not in sections:
        parser.error("the bytes section measures the chains of the overhead section: add overhead")

    def on_term(signum: int, frame: Any) -> None:  # timeout/kill: still remove the work directory
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    configure_threads()
    plan = Plan.quick() if args.quick else Plan.full()
    if args.rounds:
        plan.rounds = args.rounds
    if args.window:
        plan.window = args.window
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    command = public_command("benchmarks.run", argv if argv is not None else sys.argv[1:])

    started = time.perf_counter()
    info = machine()
    results: dict[str, Any] = {"command": command, "mode": "quick" if args.quick else "full", "machine": info,
                               "plan": plan.to_dict(), "sections": sections}
    md: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        md.append(text)

    def log(text: str) -> None:
        print(text, flush=True)

    emit("# ldformat benchmarks")
    emit()
    emit(f"Command: `{command}` ({results['mode']} mode)")
    emit()
    emit(f"Machine: {info['cpu']}, {info['cores']} cores, "
         f"{(info['memory_bytes'] or 0) / 2**30:.0f} GiB memory, GPU: {info['gpu'] or 'none'}; {info['os']}")
    emit(f"Versions: python {info['python']}, torch {info['torch']} (CPU capability {info['torch_cpu_capability']}), "
         f"zarr {info['zarr']}, numcodecs {info['numcodecs']}, safetensors {info['safetensors']}, numpy "
         f"{info['numpy']}, ldformat {info['ldformat']}")
    emit(f"Threads: torch {info['torch_threads']}, blosc 1. Workload: GPT {plan.workload.describe()}; AdamW "
         "(lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices), grad clipping 1.0, synthetic tokens.")
    failures: list[str] = []

    def section(name: str, title: str, fn: Any) -> None:
        if name not in sections:
            return
        emit()
        emit(f"## {title}")
        emit()
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # keep going: the other sections are still worth having
            traceback.print_exc()
            failures.append(f"{name}: {type(e).__name__}: {e}")
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            emit(f"**{name} failed**: {type(e).__name__}: {e}")
        results.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        log(f"  ({name}: {time.perf_counter() - t0:.0f} s)")

    def do_overhead() -> None:
        res = overhead.run_overhead(plan.workload, workdir, intervals=plan.intervals,
                                    derived_intervals=plan.derived_intervals, rounds=plan.rounds, window=plan.window,
                                    log=log)
        results["overhead"] = res
        emit(overhead.report(res))

    def do_bytes() -> None:
        if "overhead" not in results or "chains" not in results["overhead"]:
            raise RuntimeError("needs the chains of the overhead section")
        res = storage.run_bytes(plan.workload, results["overhead"], workdir, log=log)
        results["bytes"] = res
        emit(storage.report_bytes(res))

    def do_anchor() -> None:
        res = storage.run_anchor_throughput(plan.workload, workdir, plan.anchor_reps, log=log)
        results["anchor"] = res
        emit(storage.report_anchor(res))

    def do_recovery() -> None:
        res = recovery.run_recovery(plan.workload, plan.recovery_ks, workdir, batch_steps=plan.batch_steps,
                                    reps=plan.recovery_reps, budget_s=plan.recovery_budget_s, log=log)
        results["recovery"] = res
        emit(recovery.report_recovery(res))

    def do_scaling() -> None:
        known = {}
        entry = recovery.scaling_entry_from(plan.workload, plan.scaling_steps, results.get("bytes", {}),
                                            results.get("recovery", {}))
        if entry is not None:
            known[plan.workload.name] = entry
        res = recovery.run_scaling(plan.scaling_sizes, plan.scaling_steps, workdir, batch_steps=plan.batch_steps,
                                   reps=2, known=known, log=log)
        results["scaling"] = res
        emit(recovery.report_scaling(res))

    def do_chain() -> None:
        res = recovery.run_chain_length(plan.chain_size, plan.chain_length, workdir, log=log)
        results["chain_length"] = res
        emit(recovery.report_chain_length(res, results.get("recovery") if "error" not in results.get(
            "recovery", {}) else None))

    try:
        section("overhead", "1. Training-step overhead, checkpoint every step (and every k for peers)", do_overhead)
        section("bytes", "2. Bytes on disk", do_bytes)
        section("anchor", "3. Anchor write throughput", do_anchor)
        section("recovery", "4. Recovery: materialize anchor + K deltas", do_recovery)
        section("scaling", "5a. Scaling with model size", do_scaling)
        section("chain", "5b. Scaling with chain length", do_chain)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    emit()
    emit("## Bars")
    emit()
    emit(bar_summary(results))
    total = time.perf_counter() - started
    results["total_seconds"] = total
    emit()
    emit(f"Total time {total:.0f} s.")

    from .plots import make_plots

    clean = scrub(results, str(workdir))
    if "overhead" in clean and "chains" in clean["overhead"]:
        clean["overhead"]["chains"] = {k: Path(v).name for k, v in clean["overhead"]["chains"].items()}
    (out / "results.json").write_text(json.dumps(clean, indent=1, default=str) + "\n")
    plots = make_plots(results, out)
    if plots:
        md.append("")
        md.append("## Plots")
        md.append("")
        md.extend(f"![{p}]({p})" for p in plots)
    (out / "RESULTS.md").write_text("\n".join(md) + "\n")
    print(f"\nwrote {out / 'results.json'}, {out / 'RESULTS.md'}" + (f" and {len(plots)} plots" if plots else ""))
    if failures:
        print("FAILED sections:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def bar_summary(r: dict[str, Any]) -> str:
    from .stats import table, verdict

    rows: list[list[str]] = []
    ov = r.get("overhead", {})
    for name, b in ov.get("bars", {}).items():
        rows.append([f"stall per step, {name}", f"<= {b['stall_bar'] * 100:.0f}%", f"{b['stall_fraction'] * 100:.2f}%",
                     verdict(b["stall_met"])])
    an = r.get("anchor", {})
    lowdiff = ov.get("bars", {}).get("ldformat lowdiff")
    if lowdiff and "ldformat_parts_s" in an:
        a = ov["policies"]["ldformat lowdiff"]["anchor_every"]
        base = ov["rows"]["none+topk"]["step_s"]["median"]
        snap = an["ldformat_parts_s"]["snapshot copy"]
        frac = lowdiff["stall_fraction"] + snap / a / base
        rows.append([f"stall per step incl. the anchor snapshot on the training thread every {a} steps, lowdiff",
                     "<= 2%", f"{frac * 100:.2f}% (snapshot {snap:.2f} s per anchor)", verdict(frac <= 0.02)])
    for name, b in ov.get("bars", {}).items():
        med = ov["rows"][name]["overhead"]["median"]
        peers = min((ov["rows"][p]["overhead"]["median"] for p in b["peers_compared"]), default=float("nan"))
        rows.append([f"end-to-end overhead, {name}", "below every every-step peer",
                     f"{med * 100:.1f}% (best peer {peers * 100:.1f}%)", verdict(b["overhead_below_every_peer"])])
    for name, row in ov.get("rows", {}).items():
        if row["family"] == "ldformat":
            rows.append([f"background CPU per step, {name}", "reported", f"{row['bg_cpu_per_step_s']:.3f} core-s", "-"])
    by = r.get("bytes", {})
    if "kinds" in by:
        for b in by["kinds"].values():
            if b["kind"] == "grad.topk":
                rows.append(["grad.topk delta vs raw (int32 + fp32)", "<= 0.55x", f"{b['topk_ratio_vs_raw']:.3f}x",
                             verdict(by["bars"]["topk_vs_raw_le_0.55"])])
                rows.append(["lowdiff bytes/step vs full checkpoint (delta + log)", ">= 200x smaller",
                             f"{b['full_over_delta_with_log']:.0f}x (deltas only {b['full_over_delta']:.0f}x)",
                             verdict(by["bars"]["lowdiff_full_over_delta_ge_200"])])
                e = b["chain_1000_policy"]
                rows.append([f"1,000-step lowdiff chain (A={e['anchor_every']}) vs 1,000 full", "reported",
                             f"{e['ratio']:.1f}x smaller", "-"])
            if b["kind"] == "state.xor":
                rows.append(["state.xor delta vs raw state", "<= 0.7x", f"{b['ratio_vs_raw']:.3f}x",
                             verdict(by["bars"]["xor_vs_raw_le_0.7"])])
    if "ratios" in an:
        rows.append(["anchor write vs safetensors.save_file + fsync", ">= 0.95x",
                     f"{an['ratios']['ldformat_vs_safetensors']:.2f}x", verdict(an["bars"]["vs_safetensors_ge_0.95"])])
        rows.append(["anchor write vs raw sequential write + fsync", ">= 0.9x",
                     f"{an['ratios']['ldformat_vs_raw']:.2f}x", verdict(an["bars"]["vs_raw_ge_0.9"])])
        rows.append(["torch.save vs ldformat anchor (time ratio)", "reported",
                     f"{1 / an['ratios']['torch_save_vs_ldformat']:.2f}x slower", "-"])
    rec = r.get("recovery", {})
    if "kinds" in rec:
        for mode in ("lowdiff", "lowdiff+"):
            worst = max(v["ratio_vs_reference"] for v in rec["kinds"][mode]["per_k"].values())
            rows.append([f"materialize vs anchor load + K opt steps, {mode}", "<= 1.2x", f"worst {worst:.2f}x",
                         verdict(rec["bars"]["grad_kinds_le_1.2x"][mode])])
        rows.append(["xor decoding uses every core", f"{rec['bars']['xor_cores_used']:.2f} cores used",
                     f"{rec['bars']['xor_cores_used']:.2f}", verdict(rec["bars"]["xor_uses_every_core"])])
    if not rows:
        return "(no section ran)"
    return table(["figure", "bar", "measured", "met?"], rows)


if __name__ == "__main__":
    sys.exit(main())
