"""The lazy snapshot: training-thread stall of a captured step against the stop-the-world copy it replaces.

    python -m benchmarks.lazy_snapshot                      # both workloads (~15 minutes on 2 cores)
    python -m benchmarks.lazy_snapshot --workload fast      # the fast-step workload only (~6 minutes)
    python -m benchmarks.lazy_snapshot --quick              # a smoke run at tiny sizes (~1 minute)

The bar: "training-thread stall of a captured step, with the lazy snapshot, <= 10 % of
the stop-the-world copy it replaces" (docs/capture-runtime.md "Lazy snapshot").

Workloads (as in :mod:`benchmarks.interval`):

* ``fast``: :data:`~benchmarks.workload.FAST_WORKLOAD` (4.2M parameters) on ONE torch thread, the
  other core left to the checkpointer's threads;
* ``gpt-30m``: the fixed 29.5M workload (:data:`~benchmarks.workload.WORKLOAD`), two torch threads.

Configurations, each training its own copy of the model, in one process:

* ``none``: no checkpoint (the baseline step time, for context);
* ``lazy k=1`` / ``eager k=1``: ``Checkpointer(path, model, optimizer,
  options=CaptureOptions(capture_every=1, lazy_snapshot=True | False))``, mode ``xor``, every
  other setting at its default;
* ``lazy k=K`` / ``eager k=K``: the same with ``capture_every=K``, K large enough that the
  background writer has encoded a captured step before the next capture needs the buffer set
  (K from the eager configuration's background time per capture over the baseline step, measured
  in the warm-up; ``--every`` to set it): the snapshot's stall without back-pressure;
* ``copy``: the stop-the-world copy itself, measured directly: every state tensor (model state
  dict and AdamW state: what an ``xor`` step captures) ``.copy_`` into preallocated buffers on the
  training thread, ``--copy-reps`` times per round, on the ``none`` configuration's state.

Method. A *round* runs every configuration for one window, in a rotated order. Each window ends by
fencing the open snapshot and waiting for the background writer (outside the measured span). The
measured span of a window runs from the end of its first step's optimizer pre-hook to the end of
its last step's (a pre-hook the benchmark registers after the checkpointer's): so it holds, for
every step captured before the last, the whole cycle of that capture: its hooks, its lazy copy's
fence (at the next pre-hook) and the back-pressure it causes (the next capture waiting for its
buffer set), and no drain. Per window: stall per captured step = ``ck.stats.stall_s`` delta /
``ck.stats.captured`` delta over the span, back-pressure (``ck.stats.backpressure_s``) likewise;
step time = span / its step intervals (end to end, pre-hook to pre-hook). The benchmark also times
the lazy snapshot's parts by wrapping two private functions of ``ldformat.capture.snapshot``
(timing only): the fence's wait on the training thread and the copy thread's wall and CPU time.
Ratios are paired by round: lazy stall per captured step / the median copy time of the same
round. Medians over rounds with 95% bootstrap CIs (:mod:`benchmarks.stats`).

Output: ``<out>/lazy_snapshot.md`` and ``<out>/lazy_snapshot.json`` (``--out`` defaults to
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .peers import drain_writer
from .stats import fmt_ci, human_bytes, median, public_command, summary, table, verdict
from .workload import (
    FAST_WORKLOAD,
    QUICK_FAST_WORKLOAD,
    QUICK_WORKLOAD,
    WORKLOAD,
    ModelSize,
    Trainer,
    configure_threads,
    n_params,
)

BAR = 0.10  # lazy stall per captured step / the stop-the-world copy
COUNTERS = ("stall_s", "backpressure_s", "captured", "steps", "background_cpu_s", "background_wall_s", "commits")


@dataclass
class Plan:
    label: str  # "fast" or "gpt-30m"
    workload: ModelSize
    threads: int  # torch intra-op threads
    rounds: int  # rounds at most
    min_rounds: int  # rounds run whatever the time budget
    intervals: int  # measured step intervals per window at k = 1 (the window has one step more)
    k_intervals: int  # measured step intervals per window at k = K, at least (whole blocks of K)
    warmup_steps: int  # untimed steps with the checkpointer on, before the rounds
    copy_reps: int
    minutes: float  # wall budget of the workload: rounds stop when the next would not fit
    every: int | None = None  # K; None: from the warm-up
    with_k: bool = True  # run the k = K pair

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workload"] = self.workload.to_dict()
        return d


def plan_for(label: str, quick: bool) -> Plan:
    if label == "fast":
        if quick:
            return Plan("fast", QUICK_FAST_WORKLOAD, 1, rounds=3, min_rounds=2, intervals=8, k_intervals=8,
                        warmup_steps=6, copy_reps=3, minutes=0.5)
        return Plan("fast", FAST_WORKLOAD, 1, rounds=10, min_rounds=4, intervals=24, k_intervals=24,
                    warmup_steps=12, copy_reps=5, minutes=6.0)
    if label == "gpt-30m":
        if quick:
            return Plan("gpt-30m", QUICK_WORKLOAD, 2, rounds=2, min_rounds=2, intervals=4, k_intervals=4,
                        warmup_steps=3, copy_reps=3, minutes=0.5)
        return Plan("gpt-30m", WORKLOAD, 2, rounds=3, min_rounds=2, intervals=3, k_intervals=4, warmup_steps=2,
                    copy_reps=3, minutes=10.0)
    raise ValueError(f"unknown workload {label!r}")


# -- timing of the lazy snapshot's parts (wrappers around private functions: timing only) ----------

class SnapshotProbe:
    """Times the lazy snapshot's parts, by wrapping private functions of ``ldformat.capture.snapshot``
    (timing only): ``LazySnapshots.start`` (training thread, at a captured step's end), the copy
    thread's ``_copy_all`` and ``LazySnapshots.fence`` with a snapshot open (training thread, at the
    next optimizer pre-hook). One snapshot is open at a time, so the i-th start, copy and fence
    belong together. ``installed`` is False when those names moved."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []  # (begin, end) perf_counter
        self.copies: list[tuple[float, float, float]] = []  # (begin, end, thread CPU seconds)
        self.fences: list[tuple[float, float]] = []  # (begin, end)
        self.installed = False

    def install(self) -> None:
        try:
            from ldformat.capture import snapshot
        except ImportError:
            return
        lazy_cls = getattr(snapshot, "LazySnapshots", None)
        copy_all = getattr(snapshot, "_copy_all", None)
        if lazy_cls is None or copy_all is None or not all(hasattr(lazy_cls, n) for n in ("start", "fence")):
            return
        start, fence = lazy_cls.start, lazy_cls.fence
        probe = self

        def timed_copy(targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
            w0, c0 = time.perf_counter(), time.thread_time()
            copy_all(targets, tensors)
            probe.copies.append((w0, time.perf_counter(), time.thread_time() - c0))

        def timed_start(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = start(self, *args, **kwargs)
            probe.starts.append((t0, time.perf_counter()))
            return out

        def timed_fence(self: Any) -> None:
            if getattr(self, "_open", None) is None:
                fence(self)
                return
            t0 = time.perf_counter()
            try:
                fence(self)
            finally:
                probe.fences.append((t0, time.perf_counter()))

        snapshot._copy_all = timed_copy  # type: ignore[attr-defined]
        lazy_cls.start = timed_start
        lazy_cls.fence = timed_fence
        self.installed = True

    def marks(self) -> tuple[int, int, int]:
        return len(self.starts), len(self.copies), len(self.fences)

    def between(self, a: tuple[int, int, int], b: tuple[int, int, int]) -> dict[str, Any]:
        """The lazy snapshots started between two marks whose copy and fence were also seen."""
        n = min(b[0], b[1], b[2]) - a[0]
        rows = [(self.starts[a[0] + i], self.copies[a[0] + i], self.fences[a[0] + i]) for i in range(max(0, n))
                if a[0] + i < len(self.copies) and a[0] + i < len(self.fences)]
        if not rows:
            return {"snapshots": 0}
        return {
            "snapshots": len(rows),
            "start_s": median([s[1] - s[0] for s, _, _ in rows]),  # training thread: start() itself
            "copy_delay_s": median([c[0] - s[0] for s, c, _ in rows]),  # start() began -> the copy began
            "copy_wall_s": median([c[1] - c[0] for _, c, _ in rows]),
            "copy_cpu_s": median([c[2] for _, c, _ in rows]),
            "copy_done_before_fence_s": median([f[0] - c[1] for _, c, f in rows]),  # < 0: the fence waited
            "fence_s": median([f[1] - f[0] for _, _, f in rows]),
            "fence_waited_share": sum(1 for _, c, f in rows if c[1] > f[0]) / len(rows),
        }


PROBE = SnapshotProbe()


# -- configurations ---------------------------------------------------------------------------------

class Config:
    """One training run; ``lazy`` None: no checkpoint."""

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, lazy: bool | None = None, every: int = 1) -> None:
        self.name = name
        self.size = size
        self.lazy = lazy
        self.every = every
        self.trainer = Trainer(size)
        self.chain = workdir / name.replace(" ", "-").replace("=", "")
        self.ck: Any = None
        self.marks: list[tuple[float, dict[str, float], tuple[int, int, int]]] = []  # per step: time, counters, probe
        self.windows: list[dict[str, Any]] = []
        self.create_s = 0.0

    @property
    def checkpointed(self) -> bool:
        return self.lazy is not None

    def attach(self) -> None:
        """AdamW state first (two untimed steps), then the checkpointer, then the benchmark's pre-hook."""
        self.steps(2)
        if self.checkpointed:
            from ldformat import CaptureOptions, Checkpointer

            shutil.rmtree(self.chain, ignore_errors=True)
            t0 = time.perf_counter()
            self.ck = Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer,
                                   options=CaptureOptions(capture_every=self.every, lazy_snapshot=bool(self.lazy)))
            self.create_s = time.perf_counter() - t0
        # After the checkpointer's own: per-optimizer pre-hooks run in the order registered.
        self.trainer.optimizer.register_step_pre_hook(self._mark)

    def _mark(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.marks.append((time.perf_counter(), self.counters(), PROBE.marks()))

    def counters(self) -> dict[str, float]:
        if self.ck is None:
            return {}
        st = self.ck.stats
        return {key: float(getattr(st, key)) for key in COUNTERS}

    def steps(self, n: int) -> None:
        tr = self.trainer
        tr.prefetch(tr.steps + 1, n)
        for _ in range(n):
            tr.step()

    def drain(self) -> float:
        """Fence the open snapshot (else the writer waits for the next pre-hook) and wait for the writer."""
        t0 = time.perf_counter()
        if self.ck is not None:
            drain_writer(self.ck)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None


def state_tensors(tr: Trainer) -> dict[str, torch.Tensor]:
    """What an ``xor`` step captures: the model's state dict (a tied weight once) and the optimizer's tensors."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tr.model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[f"model/{name}"] = t
    for i, st in enumerate(tr.optimizer.state.values()):
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer/{i}/{key}"] = v
    return out


class EagerCopy:
    """The stop-the-world copy: every state tensor ``.copy_`` into preallocated buffers, timed."""

    def __init__(self, tr: Trainer) -> None:
        self.tensors = state_tensors(tr)
        self.buffers = {n: torch.empty_like(t, device="cpu") for n, t in self.tensors.items()}
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())

    def once(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, t in self.tensors.items():
                self.buffers[name].copy_(t)
        return time.perf_counter() - t0


def run_window(cfg: Config, phase: str, r: int, intervals: int) -> dict[str, Any]:
    """``intervals + 1`` steps; for k > 1, a whole number of blocks of k and never ending on a capture
    (its fence would fall into the drain)."""
    gc.collect()
    cfg.marks.clear()
    steps = intervals + 1
    t0 = time.perf_counter()
    cfg.steps(steps)
    if cfg.checkpointed and cfg.every > 1:
        extra = 0
        while cfg.ck.stats.captured != cfg.marks[-1][1]["captured"] and extra < cfg.every:  # the last step was captured
            cfg.steps(1)
            extra += 1
        steps += extra
    t_steps = time.perf_counter() - t0
    drain = cfg.drain()
    (a, ca, pa), (b, cb, pb) = cfg.marks[0], cfg.marks[-1]
    n = len(cfg.marks) - 1
    w: dict[str, Any] = {"phase": phase, "round": r, "steps": steps, "intervals": n, "span_s": b - a,
                         "step_s": (b - a) / n, "window_s": t_steps, "drain_s": drain}
    if cfg.checkpointed:
        d = {key: cb[key] - ca[key] for key in COUNTERS}
        captured = max(1.0, d["captured"])
        # The stall of the hooks of an uncaptured step: intervals i (post-hook of step i, pre-hook of
        # step i + 1) in which neither step i nor step i + 1 was captured.
        marks = cfg.marks
        steps_captured = [marks[i + 1][1]["captured"] > marks[i][1]["captured"] for i in range(n)]
        plain = [marks[i + 1][1]["stall_s"] - marks[i][1]["stall_s"] for i in range(n - 1)
                 if not steps_captured[i] and not steps_captured[i + 1]]
        uncaptured_s = median(plain) if plain else 0.0
        lazy = PROBE.between(pa, pb) if cfg.lazy else {}
        w.update({f"d_{key}": v for key, v in d.items()})
        w.update({
            "stall_per_capture_s": d["stall_s"] / captured,
            "backpressure_per_capture_s": d["backpressure_s"] / captured,
            "hooks_per_capture_s": (d["stall_s"] - d["backpressure_s"]) / captured,
            "uncaptured_step_stall_s": uncaptured_s if plain else None,
            "bg_cpu_per_capture_s": d["background_cpu_s"] / captured,
            "bg_wall_per_capture_s": d["background_wall_s"] / captured,
            "lazy": lazy,
            **{f"lazy_{k}": v for k, v in lazy.items() if k != "snapshots"},
        })
    cfg.windows.append(w)
    return w


def measure_workload(plan: Plan, workdir: Path, log: Any) -> dict[str, Any]:
    warnings.filterwarnings("ignore", module="torch.distributed")
    configure_threads(plan.threads)
    started = time.perf_counter()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    size = plan.workload
    none = Config("none", size, workdir)
    lazy1 = Config("lazy k=1", size, workdir, lazy=True)
    eager1 = Config("eager k=1", size, workdir, lazy=False)
    params = n_params(none.trainer.model)
    log(f"## workload {plan.label}: GPT {size.name} ({params / 1e6:.1f}M parameters), {plan.threads} torch thread(s)")
    configs = [none, lazy1, eager1]
    warm: dict[str, dict[str, float]] = {}

    def prepare(cfg: Config, steps: int) -> None:
        t0 = time.perf_counter()
        cfg.attach()
        c0 = cfg.counters()
        ts = time.perf_counter()
        cfg.steps(steps)
        warm[cfg.name] = {"steps": steps, "step_s": (time.perf_counter() - ts) / steps}
        cfg.drain()
        if cfg.checkpointed:
            c1 = cfg.counters()
            warm[cfg.name]["bg_wall_per_capture_s"] = ((c1["background_wall_s"] - c0["background_wall_s"])
                                                       / max(1.0, c1["captured"] - c0["captured"]))
        log(f"  {cfg.name}: ready ({time.perf_counter() - t0:.1f} s; checkpointer created in {cfg.create_s:.1f} s; "
            f"warm-up {warm[cfg.name]['step_s'] * 1000:.0f} ms/step)")

    for cfg in configs:
        prepare(cfg, plan.warmup_steps)
    copier = EagerCopy(none.trainer)
    for _ in range(2):
        copier.once()  # untimed: page faults of the buffers

    # K: the eager configuration's background time per capture over the baseline step (warm-up), so
    # that the writer is done with a capture well before the next one needs the buffer set.
    encode_s = warm[eager1.name]["bg_wall_per_capture_s"]
    auto_every = max(2, min(32, math.ceil(1.5 * encode_s / warm[none.name]["step_s"]) + 1))
    every = plan.every or auto_every
    log(f"  writer {encode_s * 1000:.0f} ms per capture (wall, eager k=1 warm-up), baseline "
        f"{warm[none.name]['step_s'] * 1000:.0f} ms/step -> K = {every}"
        + ("" if plan.every is None else f" (given; the warm-up suggests {auto_every})"))
    if plan.with_k:
        for lazy in (True, False):
            cfg = Config(f"{'lazy' if lazy else 'eager'} k={every}", size, workdir, lazy=lazy, every=every)
            prepare(cfg, max(plan.warmup_steps, 2 * every))
            configs.append(cfg)
    for cfg in configs:
        cfg.windows.clear()

    units: list[Any] = [*configs, copier]
    copy_samples: list[dict[str, Any]] = []
    took: list[float] = []
    deadline = started + plan.minutes * 60
    for r in range(plan.rounds):
        if r >= plan.min_rounds and took and time.perf_counter() + median(took) > deadline:
            log(f"  stopping after {r} rounds (time budget)")
            break
        t0 = time.perf_counter()
        order = units[r % len(units):] + units[: r % len(units)]
        for unit in order:
            if unit is copier:
                gc.collect()
                times = [copier.once() for _ in range(plan.copy_reps)]
                copy_samples.append({"round": r, "times_s": times, "median_s": median(times)})
                log(f"    round {r + 1} copy: {median(times) * 1000:.1f} ms (median of {len(times)})")
                continue
            k_int = plan.intervals if unit.every == 1 else unit.every * math.ceil(plan.k_intervals / unit.every)
            w = run_window(unit, "round", r, k_int)
            extra = ""
            if unit.checkpointed:
                extra = (f", stall {w['stall_per_capture_s'] * 1000:.1f} ms/capture (back-pressure "
                         f"{w['backpressure_per_capture_s'] * 1000:.1f}"
                         + (f", fence {w['lazy_fence_s'] * 1000:.1f}, copy thread {w['lazy_copy_wall_s'] * 1000:.1f} "
                            f"wall / {w['lazy_copy_cpu_s'] * 1000:.1f} CPU"
                            if w.get("lazy_fence_s") is not None else "")
                         + f"), {int(w['d_captured'])} captured")
            log(f"    round {r + 1} {unit.name}: {w['step_s'] * 1000:.1f} ms/step{extra} (drain {w['drain_s']:.2f} s)")
        took.append(time.perf_counter() - t0)
    for cfg in configs:
        cfg.close()
    res = analyse(configs, copy_samples)
    res.update({"plan": plan.to_dict(), "params": params, "state_bytes": copier.bytes, "every": every,
                "every_auto": auto_every, "warmup": warm,
                "probe_installed": PROBE.installed,
                "load_average": {"before": load_before,
                                 "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
                "wall_s": time.perf_counter() - started})
    configs.clear()
    gc.collect()
    return res


def _summ(ws: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    xs = [w[key] for w in ws if w.get(key) is not None]
    return summary(xs) if xs else None


def analyse(configs: list[Config], copy_samples: list[dict[str, Any]]) -> dict[str, Any]:
    none = configs[0]
    base = {w["round"]: w["step_s"] for w in none.windows}
    copy_by_round = {c["round"]: c["median_s"] for c in copy_samples}
    rows: dict[str, Any] = {}
    for cfg in configs:
        ws = cfg.windows
        row: dict[str, Any] = {"lazy": cfg.lazy, "every": cfg.every if cfg.checkpointed else None,
                               "rounds": len(ws), "step_s": _summ(ws, "step_s"),
                               "overhead": summary([w["step_s"] / base[w["round"]] - 1 for w in ws
                                                    if w["round"] in base]) if cfg is not none else None}
        if cfg.checkpointed:
            for key in ("stall_per_capture_s", "backpressure_per_capture_s", "hooks_per_capture_s",
                        "uncaptured_step_stall_s", "bg_cpu_per_capture_s", "lazy_start_s", "lazy_copy_delay_s",
                        "lazy_copy_wall_s", "lazy_copy_cpu_s", "lazy_copy_done_before_fence_s", "lazy_fence_s",
                        "lazy_fence_waited_share"):
                row[key] = _summ(ws, key)
            row["captured"] = sum(w["d_captured"] for w in ws)
            row["ratio_stall_to_copy"] = summary([w["stall_per_capture_s"] / copy_by_round[w["round"]]
                                                  for w in ws if w["round"] in copy_by_round])
            row["ratio_hooks_to_copy"] = summary([w["hooks_per_capture_s"] / copy_by_round[w["round"]]
                                                  for w in ws if w["round"] in copy_by_round])
            row["create_s"] = cfg.create_s
        rows[cfg.name] = row
    copy_all = [t for c in copy_samples for t in c["times_s"]]
    copy = {"per_round": copy_samples, "median_s": summary([c["median_s"] for c in copy_samples]),
            "all_s": summary(copy_all)}
    return {"rows": rows, "copy": copy,
            "windows": {cfg.name: cfg.windows for cfg in configs}}


# -- report -------------------------------------------------------------------------------------------

def _ms(s: dict[str, Any] | None, digits: int = 1) -> str:
    return "n/a" if s is None else fmt_ci(s, 1000, digits)


def _pct(s: dict[str, Any] | None, digits: int = 1) -> str:
    return "n/a" if s is None else fmt_ci(s, 100, digits)


def bar_rows(res: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(configuration, ratio of its whole stall, ratio of its stall without back-pressure) for the lazy rows."""
    return [(name, r["ratio_stall_to_copy"], r["ratio_hooks_to_copy"]) for name, r in res["rows"].items()
            if r["lazy"]]


def _m(row: dict[str, Any], key: str) -> float | None:
    s = row.get(key)
    return None if s is None else s["median"]


def why(res: dict[str, Any]) -> list[str]:
    """Where the lazy configurations' stall goes, from the measured parts (a plain reading of the numbers)."""
    rows = res["rows"]
    copy = res["copy"]["median_s"]["median"]
    out = []
    eager_by_k = {r["every"]: r for r in rows.values() if r["lazy"] is False}
    for name, r in rows.items():
        if not r["lazy"]:
            continue
        stall, bp, fence = _m(r, "stall_per_capture_s"), _m(r, "backpressure_per_capture_s"), _m(r, "lazy_fence_s")
        start, unc = _m(r, "lazy_start_s"), _m(r, "uncaptured_step_stall_s")
        wall, cpu, delay = _m(r, "lazy_copy_wall_s"), _m(r, "lazy_copy_cpu_s"), _m(r, "lazy_copy_delay_s")
        if stall is None or bp is None:
            continue
        k = r["every"]
        text = (f"`{name}`: {stall * 1000:.1f} ms of stall per captured step against a {copy * 1000:.1f} ms copy "
                f"({stall / copy:.2f}x): back-pressure {bp * 1000:.1f} ms")
        if fence is not None and start is not None:
            rest = stall - bp - fence - start - (k - 1) * (unc or 0.0)
            text += (f", the fence {fence * 1000:.1f} ms, `LazySnapshots.start` {start * 1000:.1f} ms"
                     + (f", the hooks of the {k - 1} uncaptured steps per capture {(k - 1) * unc * 1000:.1f} ms"
                        if k > 1 and unc is not None else "")
                     + f", the rest of the hooks {rest * 1000:.1f} ms")
        text += "."
        if wall is not None and cpu is not None and delay is not None:
            text += (f" The copy thread ran {wall * 1000:.1f} ms (wall) for {cpu * 1000:.1f} ms of CPU and began "
                     f"{delay * 1000:.1f} ms after `start()` did (medians), while `start()` went on with the training "
                     "thread's part")
            share = _m(r, "lazy_fence_waited_share")
            if share is not None:
                text += f"; the fence found the copy unfinished for {share * 100:.0f} % of the snapshots"
            text += "."
        eager = eager_by_k.get(k)
        if eager is not None and _m(eager, "hooks_per_capture_s") is not None:
            e_hooks = _m(eager, "hooks_per_capture_s") or 0.0
            text += (f" Eager at the same k: {(_m(eager, 'stall_per_capture_s') or 0) * 1000:.1f} ms per captured "
                     f"step, {e_hooks * 1000:.1f} ms without back-pressure, of which the copy is ~{copy * 1000:.1f} ms "
                     f"and the hooks ~{max(0.0, e_hooks - copy) * 1000:.1f} ms.")
        out.append(text)
    return out


def report_workload(res: dict[str, Any]) -> str:
    plan = res["plan"]
    size = ModelSize(**plan["workload"])
    rows = res["rows"]
    base = rows["none"]["step_s"]
    copy = res["copy"]["median_s"]
    lines = [
        f"## Workload `{plan['label']}`", "",
        f"GPT {size.name}: {size.describe()}; {res['params'] / 1e6:.1f}M parameters; AdamW; state captured per step "
        f"(fp32 weights + AdamW m, v, step) {human_bytes(res['state_bytes'])}. {plan['threads']} torch thread(s), "
        f"blosc 1. {rows['none']['rounds']} rounds; K = {res['every']}"
        + (" (from the warm-up)" if res["every"] == res["every_auto"]
           else f" (given; the warm-up gave {res['every_auto']})")
        + f"; {res['wall_s'] / 60:.1f} min"
        + (f"; machine load average (1, 5, 15 min) {_load(res['load_average']['before'])} before, "
           f"{_load(res['load_average']['after'])} after" if res.get("load_average", {}).get("before") else "")
        + ".", "",
        f"**Stop-the-world copy of the whole state, measured directly** (`.copy_` of every tensor into preallocated "
        f"buffers, on the training thread): {_ms(copy)} ms (median over rounds of each round's median [95% CI]).", "",
    ]
    headers = ["configuration", "step time, ms", "overhead vs none, %", "stall per captured step, ms",
               "of which back-pressure, ms", "stall without back-pressure, ms", "stall of an uncaptured step, ms",
               "writer CPU per capture, ms", "stall / copy", "stall without back-pressure / copy"]
    out = []
    for name, r in rows.items():
        if r["lazy"] is None:
            out.append([f"{name} (no checkpoint)", _ms(base), "baseline", "-", "-", "-", "-", "-", "-", "-"])
            continue
        out.append([f"{'lazy' if r['lazy'] else 'eager'}, capture_every={r['every']}", _ms(r["step_s"]),
                    _pct(r["overhead"]), _ms(r["stall_per_capture_s"]), _ms(r["backpressure_per_capture_s"]),
                    _ms(r["hooks_per_capture_s"]), "-" if r["every"] == 1 else _ms(r["uncaptured_step_stall_s"], 2),
                    _ms(r["bg_cpu_per_capture_s"], 0), _ratio(r["ratio_stall_to_copy"]),
                    _ratio(r["ratio_hooks_to_copy"])])
    lines.append(table(headers, out))
    lines.append("")
    if res.get("probe_installed"):
        lines.append("The lazy snapshot's parts (medians per window, then over rounds [95% CI]; ms):")
        lines.append("")
        headers = ["configuration", "`start()` on the training thread", "copy began after `start()` began",
                   "copy thread wall", "copy thread CPU", "copy done before the fence (< 0: the fence waited)",
                   "fence wait (training thread)"]
        out = [[f"lazy, capture_every={r['every']}", _ms(r["lazy_start_s"], 2), _ms(r["lazy_copy_delay_s"], 2),
                _ms(r["lazy_copy_wall_s"]), _ms(r["lazy_copy_cpu_s"]), _ms(r["lazy_copy_done_before_fence_s"]),
                _ms(r["lazy_fence_s"])] for r in rows.values() if r["lazy"]]
        lines.append(table(headers, out))
        lines.append("")
    for name, whole, hooks in bar_rows(res):
        lines.append(f"- **{name}**: stall per captured step / stop-the-world copy = {_ratio(whole)} (bar <= "
                     f"{BAR:.2f}: {verdict(whole['median'] <= BAR)}); without back-pressure: {_ratio(hooks)} "
                     f"({verdict(hooks['median'] <= BAR)}).")
    lines.append("")
    lines += [f"- {t}" for t in why(res)]
    return "\n".join(lines)


def _ratio(s: dict[str, Any] | None) -> str:
    return "n/a" if s is None else fmt_ci(s, 1, 3)


def _load(la: Any) -> str:
    return "n/a" if not la else "/".join(f"{x:.1f}" for x in la)


def machine_line(info: dict[str, Any]) -> str:
    vm = ""
    try:
        with open("/proc/cpuinfo") as f:
            vm = " VM" if " hypervisor" in f.read() else ""
    except OSError:
        pass
    return (f"{info['cores']} vCPU{vm} ({info['cpu']}), {(info['memory_bytes'] or 0) / 2**30:.0f} GiB, shared with "
            f"other work; CPU torch {info['torch']} (no GPU used: the CPU lazy snapshot copies on a thread, not on a "
            f"CUDA side stream); python {info['python']}, ldformat {info['ldformat']}")


METHOD = (
    "Each configuration trains its own copy of the model; a round runs every configuration for one window, in a "
    "rotated order. The measured span of a window runs from the end of its first step's optimizer pre-hook to the "
    "end of its last step's, so it holds, for each step captured in it, the whole cycle of that capture: its hooks, "
    "the fence of its lazy copy at the next pre-hook, and the back-pressure it causes (the next capture waiting for "
    "the buffer set); the drain that ends a window lies outside it. Stall per captured step = `ck.stats.stall_s` "
    "delta / `ck.stats.captured` delta over the span; back-pressure = `ck.stats.backpressure_s` likewise (part of the "
    "stall); fence wait and the copy thread's wall and CPU time are timed by wrapping `LazySnapshots.fence` and "
    "`_copy_all` of `ldformat/capture/snapshot.py`. Step time = span / step intervals (pre-hook to pre-hook), end to "
    "end. The copy is timed on the training thread, on the `none` configuration's state, once per round; ratios are "
    "paired by round (a lazy window's stall per captured step / that round's median copy time). Medians over rounds "
    "[95% bootstrap CI].")

HOW = (
    "How the runtime spends it (`ldformat/capture/`). The lazy snapshot moves the copy off the training thread, but "
    "not the rest of a captured step's hooks: `writer.live_state()` (the model's and the optimizer's `state_dict()` "
    "and the optimizer structure, every captured step), the param groups, RNG and extra state, and in "
    "`LazySnapshots.start` a Python loop over every state tensor (versions, buffers, `CapturedTensor.of`: 4 tensors "
    "per AdamW parameter, the `step` scalars included) after the copy thread was started, so the copy thread and "
    "the training thread take turns at the GIL (and at the 2 busy cores: the copy thread's wall time is 2-4x its "
    "CPU time). The fence (next optimizer pre-hook) checks every tensor's version and resolves the snapshot, which "
    "wakes the background writer: it costs milliseconds even when the copy ended long before (the column copy done "
    "before the fence), most likely the GIL going to the writer it woke. And an `xor` chain has one buffer set "
    "(`queue_depth` 0 by default), while the background writer does not start encoding a lazily copied step before "
    "the fence resolves the snapshot's validity (`background.py` waits on `valid`): at `capture_every=1` the "
    "pre-hook that fences step t needs the buffer set again for step t + 1 at once, so the training thread waits "
    "there for the writer to consume step t (back-pressure), and that encoding no longer overlaps a forward and "
    "backward as it does with the eager copy, which queues the step at once. At k = K the writer is done before the "
    "next capture, and the stall left is the snapshot's own: hooks, `start()` and the fence.")


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """Whether the bar holds, per workload, and the two measured reasons it does or does not."""
    out = []
    for label in ("fast", "gpt-30m"):
        res = doc["workloads"].get(label)
        if res is None:
            continue
        rows = res["rows"]
        copy = res["copy"]["median_s"]["median"]
        bars = bar_rows(res)
        met = bool(bars) and all(whole["median"] <= BAR for _, whole, _ in bars)
        text = (f"- **`{label}`**: bar {verdict(met)}. Copy {copy * 1000:.1f} ms; lazy stall per captured step "
                + "; ".join(f"{name} {(_m(rows[name], 'stall_per_capture_s') or 0) * 1000:.1f} ms = "
                            f"{whole['median']:.2f}x the copy ({hooks['median']:.2f}x without back-pressure)"
                            for name, whole, hooks in bars) + ".")
        one = {r["lazy"]: r for r in rows.values() if r["every"] == 1}
        if True in one and False in one:
            text += (f" At k = 1 back-pressure is {(_m(one[True], 'backpressure_per_capture_s') or 0) * 1000:.1f} ms "
                     f"per captured step with the lazy snapshot against "
                     f"{(_m(one[False], 'backpressure_per_capture_s') or 0) * 1000:.1f} ms with the eager copy.")
        for r in rows.values():
            start, fence = _m(r, "lazy_start_s"), _m(r, "lazy_fence_s")
            if r["lazy"] and r["every"] > 1 and start is not None and fence is not None:
                text += (f" At k = {r['every']} (no back-pressure) the lazy snapshot's own work on the training "
                         f"thread, `start()` {start * 1000:.1f} ms + fence {fence * 1000:.1f} ms, is "
                         f"{(start + fence) / copy:.2f}x the copy it takes off that thread, before the rest of the "
                         "hooks.")
        out.append(text)
    return out


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# Lazy snapshot: training-thread stall of a captured step", "",
        f"Machine: {doc['machine_line']}. Every window is in `lazy_snapshot.json`.", "",
        "Bar: training-thread stall of a captured step, with the lazy snapshot, <= 10 % of the "
        "stop-the-world copy it replaces. `Checkpointer(path, model, optimizer, options=CaptureOptions("
        "capture_every=k, lazy_snapshot=True | False))`, mode `xor`, defaults otherwise.", "",
        "## Summary", "",
        *summary_lines(doc), "",
        METHOD, "",
    ]
    for label in ("fast", "gpt-30m"):
        if label in doc["workloads"]:
            res = doc["workloads"][label]
            src = f"; ldformat from commit {res['ldformat_source']}" if res.get("ldformat_source") else ""
            lines += [f"Command: `{res['command']}` ({res['mode']} mode{src})", "", report_workload(res), ""]
    lines += [HOW, ""]
    if doc.get("notes"):
        lines += ["## Reading", "", doc["notes"], ""]
    lines += [
        "Caveats: a shared 2-vCPU VM with CPU-only torch: the lazy copy runs on a thread that needs a free core while "
        "the training thread and the background encoder use them (see the copy thread's wall time against its CPU "
        "time); on a GPU the copy runs on a CUDA side stream instead and the host does not wait at the fence. Window "
        "times move by tens of percent with the machine's load. `--quick` uses tiny models (a smoke run).",
    ]
    return "\n".join(lines) + "\n"


def ldformat_source() -> str | None:
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


def main(argv: list[str] | None = None) -> int:
    from .run import machine, scrub

    parser = argparse.ArgumentParser(prog="python -m benchmarks.lazy_snapshot", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds (a smoke run, ~1 minute)")
    parser.add_argument("--workload", choices=("fast", "gpt-30m", "both"), default="both")
    parser.add_argument("--every", type=int, default=None,
                        help="K of the lazy/eager k=K pair (default: from the warm-up's encoding time)")
    parser.add_argument("--no-k", action="store_true", help="run capture_every=1 only (no k=K pair)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds at most")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall budget per workload (rounds stop early; default 6 fast, 10 gpt-30m)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default benchmarks/results, --quick: benchmarks/results/quick)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where chains are written (default: a temporary directory, removed)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite lazy_snapshot.md from the lazy_snapshot.json in --out (no measurement)")
    args = parser.parse_args(argv)
    if args.render_only:
        out_dir: Path = args.out or Path("benchmarks/results/quick" if args.quick else "benchmarks/results")
        doc = json.loads((out_dir / "lazy_snapshot.json").read_text())
        (out_dir / "lazy_snapshot.md").write_text(render(doc))
        return 0

    def on_term(signum: int, frame: Any) -> None:  # a kill still removes the work directory
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    out: Path = args.out or Path("benchmarks/results/quick" if args.quick else "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-lazy-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    command = public_command("benchmarks.lazy_snapshot", argv if argv is not None else sys.argv[1:])
    mode = "quick" if args.quick else "full"
    labels = ["fast", "gpt-30m"] if args.workload == "both" else [args.workload]
    configure_threads()
    info = machine()
    PROBE.install()
    doc: dict[str, Any] = {"workloads": {}}
    json_path, md_path = out / "lazy_snapshot.json", out / "lazy_snapshot.md"
    if json_path.exists():  # keep the other workload of an earlier run of the same mode
        try:
            old = json.loads(json_path.read_text())
            doc["workloads"] = {k: v for k, v in old.get("workloads", {}).items()
                                if v.get("mode") == mode and k not in labels}
            if old.get("notes"):
                doc["notes"] = old["notes"]
        except (OSError, ValueError):
            pass
    print(f"# {command}", flush=True)
    source = ldformat_source()
    status = 0
    try:
        for label in labels:
            plan = plan_for(label, args.quick)
            if args.minutes is not None:
                plan.minutes = args.minutes
            if args.rounds is not None:
                plan.rounds = args.rounds
                plan.min_rounds = min(plan.min_rounds, args.rounds)
            plan.every = args.every
            plan.with_k = not args.no_k
            wd = workdir / label
            wd.mkdir(parents=True, exist_ok=True)
            res = measure_workload(plan, wd, lambda s: print(s, flush=True))
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
