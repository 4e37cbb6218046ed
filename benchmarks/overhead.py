"""Training-step overhead and training-thread stall, configurations interleaved.

Every configuration trains its own copy of the workload. A *round* runs each configuration
for one window of steps, in a rotated order; a window is a whole multiple of the
configuration's checkpoint interval and ends by draining background work (the drain is
timed, so work a window started is paid inside it). Per-step time = window time / steps.
Overhead is paired by round (``t_config / t_baseline - 1`` with the baseline's window of the
same round), reported as a median with a 95% bootstrap CI over rounds.

Intervals larger than ``max_window`` are not run; their figures are *derived* from the
largest measured interval of the same peer (one save per window): the cost per save
divided by the interval. They are marked as derived.
"""

from __future__ import annotations

import gc
import math
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .peers import Config, LdformatConfig, make_configs
from .stats import fmt_ci, summary, table, verdict
from .workload import ModelSize, n_params

LDFORMAT_BARS = {"ldformat lowdiff": 0.02, "ldformat lowdiff+": 0.05, "ldformat xor": 0.05}


def window_for(cfg: Config, window: int) -> int:
    return max(cfg.interval, math.ceil(window / cfg.interval) * cfg.interval)


def run_overhead(size: ModelSize, workdir: Path, *, intervals: list[int], derived_intervals: list[int], rounds: int,
                 window: int, log: Any = print, device: str | torch.device = "cpu") -> dict[str, Any]:
    warnings.filterwarnings("ignore", module="torch.distributed")
    configs = make_configs(size, workdir, intervals, window, device)
    log(f"  {len(configs)} configurations, model {size.name} ({n_params(configs[0].trainer.model) / 1e6:.1f}M "
        f"parameters), {rounds} rounds, windows of {window} steps (whole multiples of each interval)")
    return run_configs(configs, size, intervals=intervals, derived_intervals=derived_intervals, rounds=rounds,
                       window=window, log=log)


def prepare(cfg: Config) -> None:
    """Warm-up before timing: AdamW state, then checkpointing on and one checkpoint (untimed)."""
    cfg.warmup(2)  # AdamW state exists before any checkpoint is taken
    cfg.attach()
    # Untimed steps with checkpointing on: allocations, and the ldformat policy (auto
    # anchor_every is chosen after 8 measured steps), in whole batches.
    if isinstance(cfg, LdformatConfig):
        b = int(cfg.batch_steps) if isinstance(cfg.batch_steps, int) else 1
        cfg.warmup(math.ceil(9 / b) * b)
    elif cfg.family != "none":
        cfg.save()  # one untimed checkpoint: allocations, files, threads
    cfg.drain()
    cfg.release_grads()


def run_configs(configs: list[Config], size: ModelSize, *, rounds: int, window: int, intervals: list[int] | None = None,
                derived_intervals: list[int] | None = None, log: Any = print,
                keep_going: Callable[[int, list[float]], bool] | None = None, min_rounds: int = 2,
                isolate: bool = False, track_bytes: bool = False, log_windows: bool = False,
                step_sync: str = "stream", progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Interleaved rounds over ``configs`` (see the module docstring) and their analysis.

    ``keep_going(round, round_seconds)`` is asked before every round after ``min_rounds``; False
    ends the run early (a time or disk budget). ``isolate``: a configuration that raises is
    recorded under ``failures`` and dropped; the others go on. ``track_bytes``: record the bytes
    each window wrote (untimed). ``log_windows``: a log line per window. ``progress`` is filled
    with the windows as they are measured, so that a caller can still report them if the run is
    cut short. With CUDA, every window ends by synchronizing the device, and every step by
    waiting for the training stream (``step_sync="stream"``, what ``loss.item()`` does: the
    checkpointer's side-stream copies may overlap the next step) or for the whole device
    (``"device"``: no such overlap).
    """
    warnings.filterwarnings("ignore", module="torch.distributed")
    derived_intervals = derived_intervals or []
    started = time.perf_counter()
    cuda = any(c.device.type == "cuda" for c in configs)
    failures: dict[str, str] = {}
    progress = progress if progress is not None else {}
    progress["failures"] = failures

    def guarded(cfg: Config, what: str, fn: Callable[[], None]) -> bool:
        if not isolate:
            fn()
            return True
        try:
            fn()
            return True
        except Exception as e:
            log(f"    {cfg.name}: FAILED in {what}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            failures[cfg.name] = f"{what}: {type(e).__name__}: {e}"
            if cuda:
                try:
                    torch.cuda.empty_cache()  # an out-of-memory: room for the others
                except Exception:  # a sticky CUDA error: the next window reports it
                    pass
            return False

    step_estimate = float("nan")
    active: list[Config] = []
    for cfg in configs:
        t0 = time.perf_counter()
        if not guarded(cfg, "warm-up", partial(prepare, cfg)):
            guarded(cfg, "close", cfg.close)
            continue
        if cfg.name == "none":
            # Two plain steps came first in prepare(); the attach of "none" costs nothing.
            step_estimate = (time.perf_counter() - t0) / 2
        active.append(cfg)
        gc.collect()
        log(f"    {cfg.name}: ready ({time.perf_counter() - t0:.0f} s)")
    planned = rounds * sum(window_for(c, window) for c in active)
    log(f"  set-up and warm-up: {time.perf_counter() - started:.0f} s; {planned} timed steps to go, about "
        f"{planned * step_estimate / 60:.0f} min at {step_estimate:.2f} s/step before checkpoint costs")

    meta = {c.name: {"family": c.family, "interval": c.interval, "baseline": c.baseline} for c in configs}
    windows: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    progress.update({"windows": windows, "meta": meta})
    if step_sync not in ("stream", "device"):
        raise ValueError(f"step_sync must be 'stream' or 'device', not {step_sync!r}")
    sync_step: Callable[[], None] | None = None
    if cuda:
        sync_step = torch.cuda.current_stream().synchronize if step_sync == "stream" else torch.cuda.synchronize

    def run_window(cfg: Config, r: int) -> None:
        w = window_for(cfg, window)
        cfg.trainer.prefetch(cfg.trainer.steps + 1, w)
        gc.collect()
        c0 = cfg.counters()
        b0 = cfg.written_bytes() if track_bytes else 0
        if cuda:
            torch.cuda.synchronize()  # nothing left over from the previous window is timed here
        t0 = time.perf_counter()
        step_times = []
        for _ in range(w):
            ts = time.perf_counter()
            cfg.step()
            if sync_step is not None:
                sync_step()
            step_times.append(time.perf_counter() - ts)
        t_steps = time.perf_counter() - t0
        cfg.drain()
        if cuda:
            torch.cuda.synchronize()  # the checkpointer's side-stream copies are part of the window
        elapsed = time.perf_counter() - t0
        c1 = cfg.counters()
        cfg.release_grads()
        record = {
            "round": r, "steps": w, "seconds": elapsed, "drain_s": elapsed - t_steps,
            "step_s": elapsed / w, "step_times": step_times,
            **{f"d_{k}": (c1[k] - c0[k]) for k in c1},
        }
        if track_bytes:
            record["bytes"] = cfg.written_bytes() - b0
        windows[cfg.name].append(record)
        if log_windows:
            log(f"    {cfg.name}: {elapsed / w * 1000:.1f} ms/step (drain {(elapsed - t_steps) * 1000:.0f} ms)")

    round_seconds: list[float] = []
    rounds_done = 0
    for r in range(rounds):
        if r >= min_rounds and keep_going is not None and not keep_going(r, round_seconds):
            log(f"  stopping after {r} rounds (budget)")
            break
        if not active:
            break
        t_round = time.perf_counter()
        order = active[r % len(active):] + active[: r % len(active)]
        for cfg in order:
            if not guarded(cfg, f"round {r + 1}", partial(run_window, cfg, r)):
                active.remove(cfg)
                guarded(cfg, "close", cfg.close)
        round_seconds.append(time.perf_counter() - t_round)
        rounds_done = r + 1
        log(f"  round {r + 1}/{rounds}: {round_seconds[-1]:.0f} s")

    ld = [c for c in active if isinstance(c, LdformatConfig)]
    policies: dict[str, Any] = {}

    def policy(c: LdformatConfig) -> None:
        policies[c.name] = c.policy()

    for c in ld:
        guarded(c, "policy", partial(policy, c))
    create_s = {c.name: c.create_s for c in ld}
    chains = {c.name: str(c.chain) for c in ld}
    kinds = {c.name: c.kind for c in ld}
    for cfg in active:
        guarded(cfg, "close", cfg.close)
    lifetime = {c.name: c.lifetime for c in ld}
    configs.clear()  # frees the models (the caller's list too) before the analysis and later sections
    del active, ld
    gc.collect()
    measured = {k: v for k, v in windows.items() if v}
    result = analyse(measured, {k: meta[k] for k in measured}, derived_intervals)
    for name, life in lifetime.items():
        if not life or name not in result["rows"]:
            continue
        row = result["rows"][name]
        row["lifetime"] = life
        row["bg_cpu_per_step_lifetime_s"] = life["background_cpu_s"] / max(1, life["steps"])
    result.update({"model": size.to_dict(), "rounds": rounds_done, "window": window, "intervals": intervals,
                   "derived_intervals": derived_intervals, "policies": policies, "chain_create_s": create_s,
                   "chains": chains, "kinds": kinds, "windows": windows, "lifetime": lifetime,
                   "wall_s": time.perf_counter() - started})
    if rounds_done != rounds:
        result["rounds_planned"] = rounds
    if isolate:
        result["failures"] = failures
    return result


def analyse(windows: dict[str, list[dict[str, Any]]], meta: dict[str, dict[str, Any]],
            derived_intervals: list[int]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name, ws in windows.items():
        base = windows.get(meta[name]["baseline"], [])  # missing only if the baseline failed
        by_round = {w["round"]: w for w in base}
        ratios = [w["step_s"] / by_round[w["round"]]["step_s"] - 1 for w in ws if w["round"] in by_round]
        steps = sum(w["steps"] for w in ws)
        base_step = summary([w["step_s"] for w in base])["median"]
        stall = sum(w["d_stall_s"] for w in ws) / steps
        bytes_ = [w["bytes"] for w in ws if "bytes" in w]
        rows[name] = {
            **meta[name],
            "derived": False,
            "step_s": summary([w["step_s"] for w in ws]),
            "overhead": summary(ratios),
            "stall_per_step_s": stall,
            "stall_fraction": stall / base_step,
            "stall_fraction_windows": summary([w["d_stall_s"] / w["steps"] / by_round[w["round"]]["step_s"]
                                               for w in ws if w["round"] in by_round]),
            "bg_cpu_per_step_s": sum(w["d_bg_cpu_s"] for w in ws) / steps,
            "compress_per_step_s": sum(w["d_compress_s"] for w in ws) / steps,
            "drain_per_step_s": sum(w["drain_s"] for w in ws) / steps,
            "backpressure_per_step_s": sum(w.get("d_backpressure_s", 0.0) for w in ws) / steps,
            "commits_in_windows": sum(w.get("d_commits", 0) for w in ws),
            "steps": steps,
        }
        if bytes_:
            rows[name]["bytes_per_step"] = sum(bytes_) / steps
    if "none+topk" in rows and "none" in windows:
        none_by_round = {w["round"]: w for w in windows["none"]}
        rows["none+topk"]["vs_none"] = summary([w["step_s"] / none_by_round[w["round"]]["step_s"] - 1
                                                for w in windows["none+topk"] if w["round"] in none_by_round])
    # Intervals too long to run: scale the per-save cost of the largest measured interval.
    for family in sorted({m["family"] for m in meta.values()} - {"none", "ldformat"}):
        measured = [n for n, m in meta.items() if m["family"] == family]
        src = max(measured, key=lambda n: meta[n]["interval"])
        k0 = meta[src]["interval"]
        for k in derived_intervals:
            s = rows[src]
            f = k0 / k
            scaled = {key: s[key] * f for key in ("stall_per_step_s", "stall_fraction", "bg_cpu_per_step_s")}
            over = s["overhead"]
            rows[f"{family}/{k}"] = {
                "family": family, "interval": k, "baseline": s["baseline"], "derived": True, "derived_from": src,
                "step_s": None,
                "overhead": {"median": over["median"] * f, "ci95": [v * f for v in over["ci95"]], "n": over["n"],
                             "values": [v * f for v in over["values"]]},
                **scaled, "compress_per_step_s": 0.0, "drain_per_step_s": 0.0, "backpressure_per_step_s": 0.0,
                "steps": 0,
            }
    every_step_peers = [n for n, r in rows.items() if r["family"] not in ("none", "ldformat") and r["interval"] == 1]
    bars = {}
    for name, bar in LDFORMAT_BARS.items():
        if name in rows:
            r = rows[name]
            bars[name] = {
                "stall_bar": bar,
                "stall_fraction": r["stall_fraction"],
                "stall_met": r["stall_fraction"] <= bar,
                "overhead_below_every_peer": all(r["overhead"]["median"] < rows[p]["overhead"]["median"]
                                                 for p in every_step_peers),
                "peers_compared": every_step_peers,
            }
    return {"rows": rows, "bars": bars}


def report(res: dict[str, Any]) -> str:
    rows = res["rows"]
    base = rows["none"]["step_s"]["median"]
    lines = [
        f"Model {res['model']['name']}: {res['model']['layers']} layers, d={res['model']['width']}, vocab "
        f"{res['model']['vocab']}, seq {res['model']['seq']}, batch {res['model']['batch']}; AdamW; "
        f"{res['rounds']} rounds interleaved, windows of >= {res['window']} steps (whole multiples of each "
        f"interval), drain of background work timed inside the window. Baseline step (no checkpointing): "
        f"{base:.3f} s. Overhead = median over rounds of (t / t_baseline of the same round - 1), 95% bootstrap CI; "
        "stall = training-thread time inside the checkpoint path / baseline step time; background CPU in "
        "core-seconds per step.",
        "",
    ]
    headers = ["configuration", "every k", "step time s [95% CI]", "overhead % [95% CI]", "stall ms/step",
               "stall % of step", "bg CPU core-s/step", "commits in windows", "bar"]
    out = []
    for name, r in rows.items():
        bar = ""
        if name in res["bars"]:
            b = res["bars"][name]
            bar = (f"stall <= {b['stall_bar'] * 100:.0f}%: {verdict(b['stall_met'])}; below every every-step peer: "
                   f"{verdict(b['overhead_below_every_peer'])}")
        step = "derived" if r["derived"] else fmt_ci(r["step_s"], digits=3)
        over = fmt_ci(r["overhead"], 100, 1) + (f" (derived from {r['derived_from']})" if r["derived"] else "")
        if r["family"] == "none" and name == r["baseline"]:
            over = "baseline"
        label = name + (" (baseline: none+topk)" if r["baseline"] == "none+topk" and name != "none+topk" else "")
        bg = f"{r['bg_cpu_per_step_s']:.3f}"
        if "bg_cpu_per_step_lifetime_s" in r:
            bg += f" (lifetime {r['bg_cpu_per_step_lifetime_s']:.3f})"
        commits = str(r.get("commits_in_windows", "")) if r["family"] == "ldformat" else ""
        out.append([label, r["interval"], step, over, f"{r['stall_per_step_s'] * 1000:.1f}",
                    f"{r['stall_fraction'] * 100:.2f}", bg, commits, bar])
    lines.append(table(headers, out))
    topk = rows.get("none+topk")
    if topk:
        lines.append("")
        lines.append(
            f"Cost of the top-k compression itself (not checkpointing; the training's own choice): "
            f"{topk['compress_per_step_s'] * 1000:.0f} ms/step measured inside compress_(); none+topk vs none: "
            f"{fmt_ci(topk.get('vs_none', topk['overhead']), 100, 1)} % step time (paired by round).")
    pol = res.get("policies", {})
    if pol:
        lines.append("")
        lines.append("ldformat capture settings: anchor_every from the policy (auto); batch_steps stated as the "
                     "largest divisor of the window that fits the runtime's 1 GiB batch cap, so that every window "
                     "holds whole commits (the policy's own choice in brackets): " + "; ".join(
                         f"{n}: anchor_every={p['anchor_every']}, batch_steps={p['batch_steps']} "
                         f"(policy {p.get('policy_batch_steps')})" for n, p in pol.items())
                     + ". 'lifetime' background CPU = all background CPU of the run (final flush included) / "
                       "captured steps.")
    return "\n".join(lines)
