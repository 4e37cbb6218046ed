"""Checkpoint interval achieved at a fixed overhead budget: ldformat against its peers.

    python -m benchmarks.interval                     # both workloads (fast: ~20 min; gpt-30m: ~45 min)
    python -m benchmarks.interval --workload fast     # (a) only
    python -m benchmarks.interval --quick             # a smoke run at tiny sizes, ~2 minutes
    python -m benchmarks.interval --budget 0.05       # another overhead budget

Workloads:

* ``fast`` (a): a small GPT (:data:`~benchmarks.workload.FAST_WORKLOAD`) whose steps take <= 0.1 s
  on ONE torch thread, the other core left to the checkpointers' background threads, as on a GPU
  node where the host cores are spare;
* ``gpt-30m`` (b): the fixed 29.5M benchmark workload (:data:`~benchmarks.workload.WORKLOAD`),
  two torch threads as in ``benchmarks.run``.

Configurations, each training its own copy of the model:

* ``none``: no checkpointing (the baseline);
* ``torch.save``, ``checkfreq``, ``dcp.async_save``: the peers of :mod:`benchmarks.peers`, every
  ``k`` steps, each at the smallest ``k`` that fits the budget (below);
* ``ldformat``: ``Checkpointer(path, model, optimizer, options=CaptureOptions(max_overhead=budget))``
  with every other setting at its default (mode ``xor``): the runtime picks its own capture
  interval. (Without ``CaptureOptions``, an older ldformat, the plain defaults are run and the
  report says so.)

Method. A *round* runs every configuration for one window, in a rotated order; a window ends by
draining background work (timed), and overhead is paired by round: ``t_step / t_step(none, same
round) - 1``, reported as the median over rounds with a 95% bootstrap CI.

1. Calibration rounds: each peer saves every ``k0`` steps, ``k0`` spaced so that one save's
   background work (timed once, untimed warm-up) ends before the next save starts. Cost per save
   = (peer window time - none's step time x steps) / saves, paired by round; its median (at least
   the training-thread stall per save, measured directly) gives ``k = ceil(cost / (budget x
   baseline step time))``.
2. Verification rounds: each peer at its ``k``; the overhead reported is the one measured here.
   Peers save after the first step of each block of ``k`` steps, so an asynchronous save overlaps
   the rest of its block as it would in a long run (a save at a window's end would be drained at
   once, unoverlapped).

ldformat runs through untimed warm-up steps (its adaptation starts), then in every calibration and
verification round; its overhead is that of the verification rounds. Its interval is the median of
``ck.stats.capture_every`` sampled after every step of the run's second half, in steps and times its
step time in seconds. Seconds at risk: after every step, the seconds of training since the end of
the newest durable step, on a training clock that runs only inside the configuration's own windows
(so that other configurations' windows do not count); for ldformat the newest durable step is
``ck.durable_step``, for ``torch.save`` the last save, for the asynchronous peers the last save whose
background work has ended; ldformat's own ``ck.stats.seconds_at_risk`` (wall clock) is reported
too. Bytes written per step: bytes on disk after each window's drain minus before, over its steps.

Output: ``<out>/interval.md`` and ``<out>/interval.json`` (``--out`` defaults to
``benchmarks/results``, ``benchmarks/results/quick`` with ``--quick``). A run of one workload keeps
the other workload's section from an earlier run of the same mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .peers import CheckFreq, Config, DcpAsync, LdformatConfig, NoCheckpoint, TorchSave
from .stats import fmt_ci, human_bytes, median, public_command, summary, table, verdict
from .workload import (
    FAST_WORKLOAD,
    QUICK_FAST_WORKLOAD,
    QUICK_WORKLOAD,
    WORKLOAD,
    ModelSize,
    configure_threads,
    n_params,
)

BUDGET = 0.035
RATIO_BAR = 1 / 3
PEERS: list[tuple[str, type[Config]]] = [("torch.save", TorchSave), ("checkfreq", CheckFreq),
                                         ("dcp.async_save", DcpAsync)]
LD_STATS = ("capture_every", "captured", "seconds_at_risk", "overhead")


@dataclass
class Plan:
    label: str  # "fast" or "gpt-30m"
    workload: ModelSize
    threads: int  # torch intra-op threads
    cal_rounds: int
    rounds: int  # verification rounds (at most)
    min_rounds: int  # verification rounds run whatever the time budget
    window_s: float  # target seconds of training per verification window (calibration: half)
    cal_min_saves: int  # saves per calibration window, at least
    ld_warmup_steps: int  # untimed ldformat steps before the rounds
    minutes: float  # wall budget of the workload: verification rounds stop when the next would not fit

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workload"] = self.workload.to_dict()
        return d


def plan_for(label: str, quick: bool) -> Plan:
    if label == "fast":
        if quick:
            return Plan("fast", QUICK_FAST_WORKLOAD, 1, cal_rounds=2, rounds=3, min_rounds=2, window_s=1.5,
                        cal_min_saves=2, ld_warmup_steps=40, minutes=0.8)
        return Plan("fast", FAST_WORKLOAD, 1, cal_rounds=4, rounds=12, min_rounds=4, window_s=12.0, cal_min_saves=3,
                    ld_warmup_steps=100, minutes=20.0)
    if label == "gpt-30m":
        if quick:
            return Plan("gpt-30m", QUICK_WORKLOAD, 2, cal_rounds=2, rounds=2, min_rounds=2, window_s=1.0,
                        cal_min_saves=2, ld_warmup_steps=6, minutes=0.7)
        return Plan("gpt-30m", WORKLOAD, 2, cal_rounds=2, rounds=4, min_rounds=2, window_s=60.0, cal_min_saves=2,
                    ld_warmup_steps=20, minutes=45.0)
    raise ValueError(f"unknown workload {label!r}")


class AdaptiveLdformat(LdformatConfig):
    """``Checkpointer(path, model, optimizer, options=CaptureOptions(max_overhead=budget))``, defaults
    otherwise (mode ``xor``)."""

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, budget: float, gap_reset: bool = True) -> None:
        super().__init__(name, size, workdir, mode="xor")
        self.budget = budget
        self.with_options = False
        self.gap_reset = gap_reset
        self.gaps_reset = 0

    def forget_gap(self) -> None:
        """Before a window: the runtime times step intervals from one optimizer pre-hook to the next,
        and the interval spanning the other configurations' windows is not training. Dropping the
        runtime's previous pre-hook time (a private attribute; nothing else changes) leaves that one
        interval unmeasured, as the first interval after opening is.

        Still needed. The runtime takes a decision window's cost to be its time above ``n * tau0``,
        capped at its stall plus the background's CPU time; a gap makes that excess far larger than
        the cap, so the cap becomes the cost: a drained commit or anchor write charged to the
        window's one or two captures. Without this reset (``--no-gap-reset``, results/interval_no_gap_reset/, commit
        1ba1dbf) k went from 174 to 2380 at the first step after a gap that followed a window with
        3.45 s of background CPU (3.469 s per capture) and stayed there: every later decision came at
        the first step after a gap, with no capture in its window, and moves nothing. (Before commit
        2eacd28 the gap also entered ``tau0``, the mean of clean intervals: k fell to 1 in every other
        window, and the runtime's overhead estimate read 0.3 % against 16.5 % measured.)"""
        if self.gap_reset and hasattr(self.ck, "_last_pre"):
            self.ck._last_pre = None
            self.gaps_reset += 1

    def attach(self) -> None:
        import ldformat

        shutil.rmtree(self.chain, ignore_errors=True)
        options = getattr(ldformat, "CaptureOptions", None)
        t0 = time.perf_counter()
        if options is not None:
            self.ck = ldformat.Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer,
                                            options=options(max_overhead=self.budget))
            self.with_options = True
        else:  # an ldformat without the overhead budget: its plain defaults
            self.ck = ldformat.Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer)
        self.create_s = time.perf_counter() - t0

    def sample(self) -> dict[str, Any]:
        st = self.ck.stats
        out: dict[str, Any] = {}
        for key in LD_STATS:
            v = getattr(st, key, None)
            out[key] = v() if callable(v) else v
        return out

    def stats_dict(self) -> dict[str, Any]:
        d = self.ck.stats.to_dict()
        return {k: v for k, v in d.items() if not isinstance(v, (list, tuple)) or len(v) <= 16}


class Run:
    """One configuration of this benchmark: its :class:`~benchmarks.peers.Config`, its interval, a
    training clock (seconds inside its own windows) and the durability bookkeeping."""

    def __init__(self, cfg: Config, role: str) -> None:
        self.cfg = cfg
        self.role = role  # "none" | "peer" | "ldformat"
        self.name = cfg.name
        self.k = 1
        self.clock = 0.0
        self.durable_clock = 0.0  # training clock at the end of the newest durable step
        self.pending: float | None = None  # an asynchronous save in flight: the clock of its step
        self.step_clock: dict[int, float] = {}  # ldformat: trainer step -> clock at its end
        self.offset = 0  # ldformat: trainer steps before the Checkpointer (chain step 0)
        self.windows: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []  # ldformat: one per step
        self.probe: dict[str, Any] = {}

    # Peers: durability of saves.
    def _done(self) -> bool:
        cfg = self.cfg
        if isinstance(cfg, DcpAsync):
            fut = cfg.future
            return fut is None or getattr(fut, "upload_completion", fut).done()
        if isinstance(cfg, CheckFreq):
            return cfg._idle.is_set()
        return True

    def save(self, step_clock: float) -> None:
        if isinstance(self.cfg, TorchSave):
            self.cfg.save()  # synchronous: durable (fsynced) when it returns
            self.durable_clock = step_clock
            return
        previous = self.pending
        self.cfg.save()  # waits for the previous save first (at most one in flight)
        if previous is not None:
            self.durable_clock = previous
        self.pending = step_clock

    def poll(self) -> None:
        if self.pending is not None and self._done():
            self.durable_clock = self.pending
            self.pending = None

    def ld_durable(self) -> None:
        assert isinstance(self.cfg, LdformatConfig)
        d = self.cfg.ck.durable_step
        if d is not None:
            c = self.step_clock.get(int(d) + self.offset)
            if c is not None and c > self.durable_clock:
                self.durable_clock = c


def state_bytes(cfg: Config) -> int:
    tr = cfg.trainer
    n = sum(t.numel() * t.element_size() for t in tr.model.state_dict().values())
    n += sum(v.numel() * v.element_size() for st in tr.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor))
    return n


def run_window(run: Run, steps: int, phase: str, r: int) -> dict[str, Any]:
    cfg = run.cfg
    tr = cfg.trainer
    tr.prefetch(tr.steps + 1, steps)
    gc.collect()
    c0 = cfg.counters()
    b0 = cfg.written_bytes()
    risk: list[float] = []
    ld = cfg if isinstance(cfg, AdaptiveLdformat) else None
    if ld is not None:
        ld.forget_gap()
    t0 = time.perf_counter()
    for i in range(steps):
        ts = time.perf_counter()
        tr.step()
        end_clock = run.clock + (time.perf_counter() - ts)
        if run.role == "peer":
            if i % run.k == 0:  # the first step of each block of k: the save overlaps the block
                run.save(end_clock)
            run.poll()
        run.clock += time.perf_counter() - ts
        if ld is not None:
            run.step_clock[tr.steps] = end_clock
            run.ld_durable()
            s = ld.sample()
            s.update(phase=phase, round=r, step=tr.steps, at_risk_s=run.clock - run.durable_clock)
            run.samples.append(s)
        risk.append(run.clock - run.durable_clock)
    t_steps = time.perf_counter() - t0
    cfg.drain()
    elapsed = time.perf_counter() - t0
    if run.pending is not None:  # drained: durable now
        run.durable_clock = run.pending
        run.pending = None
    if ld is not None:
        run.ld_durable()
    c1 = cfg.counters()
    cfg.release_grads()
    w = {"phase": phase, "round": r, "steps": steps, "k": run.k, "seconds": elapsed, "drain_s": elapsed - t_steps,
         "step_s": elapsed / steps, "bytes": cfg.written_bytes() - b0, "at_risk_s": risk,
         **{f"d_{key}": c1[key] - c0[key] for key in c1}}
    run.windows.append(w)
    return w


def measure_workload(plan: Plan, workdir: Path, budget: float, log: Callable[[str], None], *,
                     gap_reset: bool = True) -> dict[str, Any]:
    warnings.filterwarnings("ignore", module="torch.distributed")
    configure_threads(plan.threads)
    started = time.perf_counter()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    size = plan.workload
    runs = [Run(NoCheckpoint("none", size, workdir), "none")]
    runs += [Run(cls(name, size, workdir, interval=1), "peer") for name, cls in PEERS]
    ld_cfg = AdaptiveLdformat("ldformat", size, workdir, budget=budget, gap_reset=gap_reset)
    runs.append(Run(ld_cfg, "ldformat"))
    none = runs[0]
    params = n_params(none.cfg.trainer.model)
    log(f"## workload {plan.label}: GPT {size.name} ({params / 1e6:.1f}M parameters), {plan.threads} torch "
        f"thread(s), budget {budget * 100:.1f} %")

    # Warm-up (untimed): AdamW state, checkpointing attached, one save timed to space the calibration saves.
    for run in runs:
        cfg = run.cfg
        t0 = time.perf_counter()
        cfg.warmup(2)
        cfg.attach()
        if run.role == "none":
            cfg.trainer.prefetch(cfg.trainer.steps + 1, 8)
            ts = time.perf_counter()
            for _ in range(8):
                cfg.trainer.step()
            run.probe = {"step_s": (time.perf_counter() - ts) / 8}
        elif run.role == "peer":
            ts = time.perf_counter()
            cfg.save()
            call = time.perf_counter() - ts
            cfg.drain()
            run.probe = {"save_call_s": call, "save_wall_s": time.perf_counter() - ts}
        cfg.drain()
        cfg.release_grads()
        log(f"  {run.name}: ready ({time.perf_counter() - t0:.1f} s) {run.probe}")
    step_est = none.probe["step_s"]
    raw_state = state_bytes(none.cfg)

    ld = runs[-1]
    ld.offset = ld_cfg.trainer.steps
    ld.step_clock = {s: 0.0 for s in range(ld.offset + 1)}
    if plan.ld_warmup_steps:
        t0 = time.perf_counter()
        run_window(ld, plan.ld_warmup_steps, "warmup", -1)
        log(f"  ldformat: {plan.ld_warmup_steps} untimed warm-up steps ({time.perf_counter() - t0:.1f} s), "
            f"last sample {ld.samples[-1] if ld.samples else {}}")
    ld.clock = 0.0
    ld.durable_clock = 0.0
    ld.step_clock = {s: 0.0 for s in ld.step_clock}

    def rounds(phase: str, n: int, window_of: Callable[[Run], int], keep_going: Callable[[int, list[float]], bool]
               ) -> None:
        took: list[float] = []
        for r in range(n):
            if not keep_going(r, took):
                log(f"  {phase}: stopping after {r} rounds (time budget)")
                return
            t0 = time.perf_counter()
            order = runs[r % len(runs):] + runs[: r % len(runs)]
            for run in order:
                w = run_window(run, window_of(run), phase, r)
                k = run.samples[-1]["capture_every"] if run.samples else run.k
                log(f"    {phase} {r + 1}/{n} {run.name}: {w['steps']} steps, {w['step_s'] * 1000:.1f} ms/step "
                    f"(drain {w['drain_s'] * 1000:.0f} ms, k {k})")
            took.append(time.perf_counter() - t0)

    # 1. Calibration: cost per save at k0.
    cal_target = max(1, math.ceil(plan.window_s / 2 / step_est))
    for run in runs:
        if run.role == "peer":
            run.k = max(1, math.ceil(1.25 * run.probe["save_wall_s"] / step_est))

    def cal_window(run: Run) -> int:
        if run.role != "peer":
            return cal_target
        return run.k * max(plan.cal_min_saves, math.ceil(cal_target / run.k))

    rounds("calibration", plan.cal_rounds, cal_window, lambda r, took: True)
    base_cal = [w for w in none.windows if w["phase"] == "calibration"]
    base_by_round = {w["round"]: w for w in base_cal}
    base_step = median([w["step_s"] for w in base_cal])
    calibration: dict[str, Any] = {}
    for run in runs:
        if run.role != "peer":
            continue
        ws = [w for w in run.windows if w["phase"] == "calibration"]
        cost = [(w["step_s"] - base_by_round[w["round"]]["step_s"]) * w["steps"] / max(1, w["d_saves"])
                for w in ws if w["round"] in base_by_round]
        stall = [w["d_stall_s"] / max(1, w["d_saves"]) for w in ws]
        used = max(median(cost), median(stall))
        k = max(1, math.ceil(used / (budget * base_step)))
        calibration[run.name] = {"probe": run.probe, "k0": run.k, "cost_per_save_s": summary(cost),
                                 "stall_per_save_s": summary(stall), "cost_used_s": used,
                                 "k_exact": used / (budget * base_step), "k": k}
        log(f"  {run.name}: cost per save {fmt_ci(summary(cost), 1000, 0)} ms (stall {median(stall) * 1000:.0f} ms) "
            f"at k0={run.k} -> k = {k}")
        run.k = k

    # 2. Verification at k (ldformat and none: windows of about window_s).
    target = max(1, math.ceil(plan.window_s / base_step))

    def verify_window(run: Run) -> int:
        if run.role != "peer":
            return target
        return run.k * max(1, math.ceil(target / run.k))

    deadline = started + plan.minutes * 60

    def keep_going(r: int, took: list[float]) -> bool:
        if r < plan.min_rounds or not took:
            return True
        return time.perf_counter() + median(took) <= deadline

    rounds("verification", plan.rounds, verify_window, keep_going)

    ld_stats: dict[str, Any] = {}
    try:
        ld_stats = ld_cfg.stats_dict()
    except Exception as e:  # pragma: no cover - reported, not fatal
        ld_stats = {"error": repr(e)}
    for run in runs:
        run.cfg.close()
    res = analyse(plan, runs, budget, calibration, base_step)
    res.update({"params": params, "state_bytes": raw_state, "step_estimate_s": step_est,
                "ldformat_with_options": ld_cfg.with_options, "ldformat_stats": ld_stats,
                "load_average": {"before": load_before,
                                 "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
                "ldformat_gap_reset": ld_cfg.gap_reset, "ldformat_gaps_reset": ld_cfg.gaps_reset,
                "ldformat_lifetime": ld_cfg.lifetime, "wall_s": time.perf_counter() - started})
    runs.clear()
    gc.collect()
    return res


def analyse(plan: Plan, runs: list[Run], budget: float, calibration: dict[str, Any], base_cal: float
            ) -> dict[str, Any]:
    none = runs[0]
    base = [w for w in none.windows if w["phase"] == "verification"]
    by_round = {w["round"]: w for w in base}
    base_step = summary([w["step_s"] for w in base])
    rows: dict[str, Any] = {}
    for run in runs:
        ws = [w for w in run.windows if w["phase"] == "verification"]
        steps = sum(w["steps"] for w in ws)
        risk = [x for w in ws for x in w["at_risk_s"]]
        row: dict[str, Any] = {
            "role": run.role,
            "step_s": summary([w["step_s"] for w in ws]),
            "overhead": summary([w["step_s"] / by_round[w["round"]]["step_s"] - 1
                                 for w in ws if w["round"] in by_round]),
            "bytes_per_step": sum(w["bytes"] for w in ws) / max(1, steps),
            "stall_per_step_s": sum(w["d_stall_s"] for w in ws) / max(1, steps),
            "bg_cpu_per_step_s": sum(w["d_bg_cpu_s"] for w in ws) / max(1, steps),
            "drain_per_step_s": sum(w["drain_s"] for w in ws) / max(1, steps),
            "at_risk_s": {"median": median(risk), "p95": quantile(risk, 0.95), "max": max(risk, default=float("nan"))},
            "steps": steps, "rounds": len(ws),
        }
        if run.role == "peer":
            row["k"] = run.k
            row["interval_s"] = run.k * row["step_s"]["median"]
            row["saves"] = sum(w["d_saves"] for w in ws)
        if run.role == "ldformat":
            samples = run.samples
            half = samples[len(samples) // 2:]
            ks = [s["capture_every"] for s in half if s["capture_every"] is not None]
            k = median(ks) if ks else None
            verify = [s for s in samples if s["phase"] == "verification"]
            runtime_risk = [s["seconds_at_risk"] for s in verify if s["seconds_at_risk"] is not None]
            runtime_over = [s["overhead"] for s in verify if s["overhead"] is not None]
            captured = [s["captured"] for s in samples if s["captured"] is not None]
            row.update({
                "k": k, "k_min_max_second_half": [min(ks), max(ks)] if ks else None,
                "k_last": samples[-1]["capture_every"] if samples else None,
                "interval_s": None if k is None else k * row["step_s"]["median"],
                "steps_sampled": len(samples), "second_half_steps": len(half),
                "captured_total": captured[-1] if captured else None,
                "captured_fraction_second_half": ((captured[-1] - half[0]["captured"]) / len(half)
                                                  if captured and half and half[0]["captured"] is not None else None),
                "runtime_seconds_at_risk": {"median": median(runtime_risk), "p95": quantile(runtime_risk, 0.95)}
                if runtime_risk else None,
                "runtime_overhead": ({"median": median(runtime_over), "last": runtime_over[-1]}
                                     if runtime_over else None),
                "k_trace": [s["capture_every"] for s in samples],
            })
        rows[run.name] = row
    peers = {n: r for n, r in rows.items() if r["role"] == "peer"}
    ld = rows.get("ldformat", {})
    ratio: dict[str, Any] = {}
    if peers and ld.get("k") is not None:
        best = min(peers, key=lambda n: (peers[n]["k"], peers[n]["interval_s"]))
        best_s = min(peers, key=lambda n: peers[n]["interval_s"])
        ratio = {"best_peer": best, "steps": ld["k"] / peers[best]["k"],
                 "best_peer_seconds": best_s, "seconds": ld["interval_s"] / peers[best_s]["interval_s"]}
        ratio["met"] = ratio["steps"] <= RATIO_BAR
    return {"plan": plan.to_dict(), "budget": budget, "baseline_step_s": base_step,
            "baseline_step_calibration_s": base_cal, "calibration": calibration, "rows": rows, "ratio": ratio,
            "windows": {run.name: [{k: v for k, v in w.items() if k != "at_risk_s"} for w in run.windows]
                        for run in runs}}


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt_load(la: Any) -> str:
    return "n/a" if not la else "/".join(f"{x:.1f}" for x in la)


def fmt_s(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def report_workload(res: dict[str, Any]) -> str:
    plan = res["plan"]
    budget = res["budget"]
    rows = res["rows"]
    size = ModelSize(**plan["workload"])
    title = {"fast": "(a) fast steps, one torch thread", "gpt-30m": "(b) the fixed 29.5M workload"}[plan["label"]]
    base = rows["none"]["step_s"]
    lines = [
        f"## Workload {title}: `{plan['label']}`", "",
        f"GPT {size.name}: {size.describe()}; {res['params'] / 1e6:.1f}M parameters; AdamW; raw state (fp32 weights "
        f"+ AdamW m, v) {human_bytes(res['state_bytes'])}. {plan['threads']} torch thread(s), blosc 1. Baseline step "
        f"(no checkpoint): {fmt_ci(base, 1000, 1)} ms (median of verification windows [95% CI]). "
        f"{res['verification_rounds']} verification rounds"
        f" after {plan['cal_rounds']} calibration rounds; {res['wall_s'] / 60:.1f} min"
        + (f"; machine load average (1, 5, 15 min) {fmt_load(res['load_average']['before'])} before, "
           f"{fmt_load(res['load_average']['after'])} after" if res.get("load_average", {}).get("before") else "")
        + ".", "",
    ]
    headers = ["configuration", "interval (steps)", "interval (s of training)", "seconds at risk, median (p95)",
               f"overhead % [95% CI] (budget {budget * 100:.1f} %)", "bytes written per step", "k from"]
    out = []
    out.append(["none (baseline)", "-", "-", "-", "baseline", "0", ""])
    for name, r in rows.items():
        if r["role"] == "peer":
            cal = res["calibration"][name]
            label = f"{name} every k"
            how = (f"cost per save {fmt_ci(cal['cost_per_save_s'], 1000, 0)} ms at k0={cal['k0']} (stall "
                   f"{cal['stall_per_save_s']['median'] * 1000:.0f} ms); k = ceil({cal['cost_used_s'] * 1000:.0f} ms / "
                   f"({budget * 100:.1f} % x {res['baseline_step_calibration_s'] * 1000:.1f} ms))")
            k = str(r["k"])
        elif r["role"] == "ldformat":
            label = ("ldformat `Checkpointer` defaults (xor), `CaptureOptions(max_overhead="
                     f"{budget})`" if res["ldformat_with_options"] else "ldformat `Checkpointer` defaults (xor; "
                     "no CaptureOptions in this version)")
            rng = r.get("k_min_max_second_half")
            k = "n/a" if r["k"] is None else f"{r['k']:g}" + (f" (range {rng[0]}-{rng[1]})" if rng else "")
            how = "the runtime's own (median of `ck.stats.capture_every`, second half of the run)"
        else:
            continue
        risk = f"{fmt_s(r['at_risk_s']['median'])} ({fmt_s(r['at_risk_s']['p95'])})"
        if r["role"] == "ldformat" and r.get("runtime_seconds_at_risk"):
            risk += f"; runtime's own: {fmt_s(r['runtime_seconds_at_risk']['median'])}"
        out.append([label, k, fmt_s(r["interval_s"]), risk, fmt_ci(r["overhead"], 100, 1),
                    human_bytes(r["bytes_per_step"]), how])
    lines.append(table(headers, out))
    lines.append("")
    ratio = res["ratio"]
    ld = rows.get("ldformat", {})
    if ratio:
        lines.append(
            f"**ldformat interval / best peer's interval: {ld['k']:g} / {rows[ratio['best_peer']]['k']} steps "
            f"({ratio['best_peer']}) = {ratio['steps']:.3f}** (bar <= 1/3: {verdict(ratio['met'])}); in seconds of "
            f"training: {fmt_s(ld['interval_s'])} / {fmt_s(rows[ratio['best_peer_seconds']]['interval_s'])} s "
            f"({ratio['best_peer_seconds']}) = {ratio['seconds']:.3f}.")
    else:
        lines.append("ldformat interval / best peer's interval: n/a (ldformat reported no capture interval).")
    if ld:
        over = ld["overhead"]["median"]
        lines.append("")
        lines.append(
            f"ldformat end-to-end overhead {fmt_ci(ld['overhead'], 100, 1)} % against the {budget * 100:.1f} % budget: "
            f"{verdict(over <= budget)}; the runtime's own overhead estimate: "
            + (f"median {ld['runtime_overhead']['median'] * 100:.1f} %, last "
               f"{ld['runtime_overhead']['last'] * 100:.1f} %" if ld.get("runtime_overhead") else "none reported")
            + "; steps captured in the second half: "
            + (f"{ld['captured_fraction_second_half'] * 100:.0f} %" if ld.get("captured_fraction_second_half")
               is not None else "n/a")
            + f"; training-thread stall {ld['stall_per_step_s'] * 1000:.1f} ms/step, background CPU "
              f"{ld['bg_cpu_per_step_s'] * 1000:.0f} ms/step.")
    over_budget = [n for n, r in rows.items() if r["role"] == "peer" and r["overhead"]["ci95"][0] > budget]
    if over_budget:
        lines.append("")
        lines.append(f"Measured above the budget at the computed k (CI entirely above): {', '.join(over_budget)}; "
                     "their k is then a lower bound of the interval that fits.")
    return "\n".join(lines)


def ldformat_source() -> str | None:
    """The commit ldformat was imported from, and whether its files differed from it (a git checkout)."""
    import subprocess

    import ldformat

    root = Path(ldformat.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ldformat"], cwd=root, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" with uncommitted changes to ldformat/" if dirty else "")


def machine_line(info: dict[str, Any]) -> str:
    vm = ""
    try:
        with open("/proc/cpuinfo") as f:
            vm = " VM" if " hypervisor" in f.read() else ""
    except OSError:
        pass
    gpu = "" if not info.get("gpu") else f", GPU {info['gpu']} (unused)"
    return (f"{info['cores']} vCPU{vm} ({info['cpu']}), {(info['memory_bytes'] or 0) / 2**30:.0f} GiB, shared with "
            f"other work; CPU torch {info['torch']}{gpu}; python {info['python']}, ldformat {info['ldformat']}")


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# Checkpoint interval at a fixed overhead budget", "",
        f"Machine: {doc['machine_line']}. Every workload's commands, plans and windows are in `interval.json`.", "",
        "Each configuration trains its own copy of the model; rounds run every configuration for one window in a "
        "rotated order, a window ending by draining background work (timed); overhead = median over rounds of "
        "(step time / step time of `none` in the same round - 1), 95% bootstrap CI. Peers (`torch.save` + fsync, "
        "CheckFreq-style snapshot + background persist, `dcp.async_save` with at most one in flight; "
        "`benchmarks/peers.py`) save every k steps, k derived from their cost per save measured in calibration "
        "rounds (k = ceil(cost per save / (budget x baseline step))), then verified: the overhead shown is measured "
        "at that k. ldformat runs `Checkpointer(path, model, optimizer, options=CaptureOptions(max_overhead=budget))` "
        "and chooses its own interval. Interval in seconds = k x the configuration's median step time (derived). "
        "Seconds at risk: sampled after every step, seconds of training since the end of the newest durable step "
        "(training clock inside the configuration's own windows; for the asynchronous peers a save is durable when "
        "its background write and fsync have ended). Bytes written per step: bytes on disk after each window minus "
        "before, over its steps. ldformat's own `ck.stats.seconds_at_risk` runs on the wall clock, the other "
        "configurations' windows included, so it reads higher.", "",
    ]
    for label in ("fast", "gpt-30m"):
        if label in doc["workloads"]:
            res = doc["workloads"][label]
            gap = ("ldformat's runtime times step intervals from one optimizer pre-hook to the next; before each of "
                   "its windows the harness dropped the runtime's previous pre-hook time, so that the interval "
                   "spanning the other configurations' windows (not training) was not measured as a step "
                   f"({res.get('ldformat_gaps_reset', 0)} times)." if res.get("ldformat_gap_reset") else
                   "ldformat timed the intervals spanning the other configurations' windows as steps "
                   "(`--no-gap-reset`).")
            if res.get("ldformat_gap_reset"):
                gap += (" Still needed: a decision window spanning such a gap measures far more than the runtime's "
                        "cap on the cost (its stall plus the background's CPU time), so the cap becomes the cost; "
                        "a run without the reset (`--no-gap-reset`, `interval_no_gap_reset/interval.md`) went to "
                        "k = 2380 after one gap (3.47 s per capture: a window's drained background work) and "
                        "stayed there.")
            src = f"; ldformat from commit {res['ldformat_source']}" if res.get("ldformat_source") else ""
            lines += [f"Command: `{res['command']}` ({res['mode']} mode{src})", "", report_workload(res), "", gap, ""]
    lines += [
        f"Caveats: a shared {doc['machine'].get('cores')}-core machine (see the load averages): window times move "
        "by tens of percent, far more than the budget, so an overhead CI spans several budgets, and the peers' k "
        "inherit the calibration's noise (a k lands either side of the budget: see the measured overhead at it). "
        "The 'spare' core of workload (a) is spare only when the machine is otherwise idle. ldformat's k is what its "
        "runtime chose from its own online measurements on the same noisy machine. Measured: overheads, costs per "
        "save, ldformat's k, seconds at risk, bytes. Derived: the peers' k (from the measured cost per save) and "
        "intervals in seconds (k x median step time). `--quick` uses tiny models (a smoke run), not these "
        "workloads' figures.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .run import machine, scrub

    parser = argparse.ArgumentParser(prog="python -m benchmarks.interval", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds (a smoke run, ~2 minutes)")
    parser.add_argument("--workload", choices=("fast", "gpt-30m", "both"), default="both")
    parser.add_argument("--budget", type=float, default=BUDGET, help="overhead budget (default 0.035)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall budget per workload (verification rounds stop early; default 20 fast, 45 gpt-30m)")
    parser.add_argument("--rounds", type=int, default=None, help="verification rounds at most")
    parser.add_argument("--no-gap-reset", action="store_true",
                        help="let ldformat time the interval spanning the other configurations' windows as a step "
                             "(the runtime then charges a window's capped cost to it: see AdaptiveLdformat.forget_gap)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default benchmarks/results, --quick: benchmarks/results/quick)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where checkpoints are written (default: a temporary directory, removed)")
    args = parser.parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:  # a kill still removes the work directory
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    out: Path = args.out or Path("benchmarks/results/quick" if args.quick else "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-interval-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    command = public_command("benchmarks.interval", argv if argv is not None else sys.argv[1:])
    mode = "quick" if args.quick else "full"
    labels = ["fast", "gpt-30m"] if args.workload == "both" else [args.workload]
    configure_threads()
    info = machine()
    doc: dict[str, Any] = {"workloads": {}}
    json_path, md_path = out / "interval.json", out / "interval.md"
    if json_path.exists():  # keep the other workload of an earlier run of the same mode
        try:
            old = json.loads(json_path.read_text())
            doc["workloads"] = {k: v for k, v in old.get("workloads", {}).items()
                                if v.get("mode") == mode and k not in labels}
        except (OSError, ValueError):
            pass
    print(f"# {command}", flush=True)
    source = ldformat_source()  # what is imported now, before anyone changes the checkout
    status = 0
    try:
        for label in labels:
            plan = plan_for(label, args.quick)
            if args.minutes is not None:
                plan.minutes = args.minutes
            if args.rounds is not None:
                plan.rounds = args.rounds
                plan.min_rounds = min(plan.min_rounds, args.rounds)
            wd = workdir / label
            wd.mkdir(parents=True, exist_ok=True)
            res = measure_workload(plan, wd, args.budget, lambda s: print(s, flush=True),
                                   gap_reset=not args.no_gap_reset)
            res["verification_rounds"] = res["rows"]["none"]["rounds"]
            res.update({"command": command, "mode": mode, "ldformat_source": source})
            doc["workloads"][label] = scrub(res, str(workdir))
            shutil.rmtree(wd, ignore_errors=True)
            doc["machine"] = info
            doc["machine_line"] = machine_line(info)
            json_path.write_text(json.dumps(doc, indent=1) + "\n")
            md_path.write_text(render(doc))
            print(report_workload(res), flush=True)
        print(f"wrote {md_path} and {json_path}", flush=True)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
