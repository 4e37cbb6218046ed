"""Sharded (FSDP2) checkpointing at world size 2: ldformat's sharded chains vs DCP ``async_save``.

    python -m benchmarks.sharded --quick      # the quick workload, about 2 minutes on 2 cores
    python -m benchmarks.sharded              # the fixed workload (29.5M GPT), about 15 minutes

Two ranks (``torch.multiprocessing`` spawn, gloo on 127.0.0.1, ``torch.set_num_threads(1)`` and
one blosc thread per rank: the machine's 2 cores) train the workload of :mod:`.workload` under
FSDP2 (``fully_shard`` on every transformer block, then on the root); each rank takes its half
of the workload's batch, so the global batch is the workload's. Every configuration trains
its own copy of the model in the same two processes and checkpoints every step:

* ``none``: no checkpointing (the baseline step time); ``none+topk``: the same with the 1% top-k
  gradient compression that ``lowdiff`` trains with (its baseline);
* ``ldformat <mode>``: every rank constructs ``ldformat.Checkpointer(path, model, optimizer,
  mode=...)`` with the same path (spec §20); ``lowdiff`` changes training by design (top-k with
  error feedback): the training loop compresses, timed apart, and passes ``compress=False``;
* ``dcp.async_save``: ``get_state_dict(model, optimizer)`` (sharded) and
  ``torch.distributed.checkpoint.async_save(state, checkpoint_id=dir/step_N)`` after every step,
  at most one in flight (the wait for the previous save is stall), on a gloo group of its own
  (its background thread runs collectives; on the training group they would interleave with
  FSDP's).

Rounds run every configuration for one window of steps, in a rotated order, after a barrier;
a window ends by draining background work (timed). The method, the statistics and the
output follow :mod:`.overhead`; see ``benchmarks/README.md`` ("Sharded (FSDP2)").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .stats import fmt_ci, human_bytes, median, public_command, summary, table
from .workload import QUICK_WORKLOAD, WORKLOAD, Data, ModelSize, configure_threads

if TYPE_CHECKING:
    from ldformat.capture.runtime import Mode

WORLD = 2
MAX_BATCH_BYTES = 1 << 30  # the runtime's cap for automatic batches (also bounds stated ones here)


@dataclass
class Plan:
    workload: ModelSize
    rounds: int
    window: int
    lowdiff: bool
    deadline_s: float  # the workers are stopped (and the run reported as hung) after this long
    batch_steps: int | None = None  # ldformat's; None: batch_steps_for()

    @classmethod
    def full(cls) -> Plan:
        return cls(WORKLOAD, rounds=6, window=5, lowdiff=True, deadline_s=2400.0)

    @classmethod
    def quick(cls) -> Plan:
        return cls(QUICK_WORKLOAD, rounds=6, window=4, lowdiff=True, deadline_s=600.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workload"] = self.workload.to_dict()
        return d


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100])."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(len(s) - 1, lo + 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def thread_cpu_s(thread: threading.Thread | None) -> float | None:
    """CPU seconds of a live thread (Linux: its per-thread CPU clock)."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return None


# -- one rank: the configurations ------------------------------------------------------------------
class ShardedTrainer:
    """The workload under FSDP2: a fresh seeded model (the same on every rank), sharded per block
    and at the root; AdamW as :class:`~benchmarks.workload.Trainer`; this rank's half of each batch."""

    def __init__(self, size: ModelSize, mesh: Any, rank: int, compressor: Any = None) -> None:
        from torch.distributed.fsdp import fully_shard

        from .workload import GPT

        torch.manual_seed(0)
        self.size = size
        self.rank = rank
        self.model = GPT(size)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-4, betas=(0.9, 0.95),
        )
        self.data = Data(size)
        self.per_rank = size.batch // WORLD
        self.compressor = compressor
        self.steps = 0
        self.compress_s = 0.0
        self.losses: dict[int, float] = {}
        self._batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(step % 64)
        rows = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        return x[rows].contiguous(), y[rows].contiguous()

    def prefetch(self, first: int, count: int) -> None:
        """Generate batches ahead (untimed), so that data generation is not part of a step."""
        self._batches = {s: self._batch(s) for s in range(first, first + count)}

    def step(self) -> None:
        self.steps += 1
        batch = self._batches.pop(self.steps, None)
        x, y = batch if batch is not None else self._batch(self.steps)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, self.size.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.compressor is not None:
            t0 = time.perf_counter()
            self.compressor.compress_(self.model)
            self.compress_s += time.perf_counter() - t0
        self.optimizer.step()
        self.losses[self.steps] = float(loss.detach())


class Config:
    family = "none"
    kind: str | None = None

    def __init__(self, name: str, size: ModelSize, mesh: Any, rank: int, *, topk: bool = False) -> None:
        self.name = name
        self.rank = rank
        compressor = None
        if topk:
            from ldformat import TopK

            compressor = TopK(0.01)
        self.trainer = ShardedTrainer(size, mesh, rank, compressor)
        self.stall_s = 0.0
        self.bg_cpu_s = 0.0
        self.info: dict[str, Any] = {}

    @property
    def baseline(self) -> str:
        return "none+topk" if self.trainer.compressor is not None else "none"

    def warmup(self, steps: int) -> None:
        self.trainer.prefetch(self.trainer.steps + 1, steps)
        for _ in range(steps):
            self.step()

    def attach(self, workdir: Path, batch_steps: int) -> None:
        """Start checkpointing (collective)."""

    def step(self) -> None:
        self.trainer.step()

    def stall_now(self) -> float:
        return self.stall_s

    def drain(self) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {"stall_s": self.stall_now(), "bg_cpu_s": self.bg_cpu_s, "compress_s": self.trainer.compress_s}

    def after_window(self) -> dict[str, Any]:
        """Untimed housekeeping after a window (collective)."""
        return {}

    def release_grads(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class LdformatConfig(Config):
    family = "ldformat"

    def __init__(self, name: str, size: ModelSize, mesh: Any, rank: int, *, mode: Mode) -> None:
        super().__init__(name, size, mesh, rank, topk=(mode == "lowdiff"))
        from ldformat.capture.runtime import MODES

        self.mode = mode
        self.kind = MODES[mode]
        self.ck: Any = None
        self.chain: Path | None = None
        self.latency_from = 0

    def attach(self, workdir: Path, batch_steps: int) -> None:
        from ldformat import Checkpointer

        self.chain = workdir / f"chain-{self.mode}"
        t0 = time.perf_counter()
        compressor = self.trainer.compressor
        self.ck = Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer, mode=self.mode,
                               anchor_every="auto", batch_steps=batch_steps, max_batch_bytes=MAX_BATCH_BYTES,
                               compressor=compressor, compress=compressor is None)
        self.info["create_s"] = time.perf_counter() - t0
        self.info["batch_steps"] = batch_steps

    def stall_now(self) -> float:
        return float(self.ck.stats.stall_s) if self.ck is not None else 0.0

    def drain(self) -> None:
        # Wait for the background writer without forcing a commit of a partial batch.
        q = getattr(self.ck, "_queue", None)
        if q is not None:
            q.join()
        else:  # pragma: no cover - private attribute renamed
            self.ck.flush()

    def counters(self) -> dict[str, float]:
        st = self.ck.stats
        return {"stall_s": st.stall_s, "bg_cpu_s": st.background_cpu_s, "compress_s": self.trainer.compress_s,
                "backpressure_s": st.backpressure_s, "commits": st.commits, "anchors": st.anchors_written,
                "global_commits": st.global_commits}

    def start_timed(self) -> None:
        self.latency_from = len(self.ck.stats.commit_latency_s)

    def close(self) -> None:
        committer = getattr(self.ck, "_committer", None)
        committer_cpu = thread_cpu_s(getattr(committer, "_thread", None))
        t0 = time.perf_counter()
        self.ck.close()
        st = self.ck.stats
        self.info.update({
            "close_s": time.perf_counter() - t0,
            "anchor_every": self.ck.anchor_every, "policy": st.policy,
            "steps": st.steps, "stall_s": st.stall_s, "background_cpu_s": st.background_cpu_s,
            "background_wall_s": st.background_wall_s, "commits": st.commits,
            "anchors_written": st.anchors_written, "global_commits": st.global_commits,
            "commit_latency_s": list(st.commit_latency_s)[self.latency_from:],
            "commit_latency_all_s": list(st.commit_latency_s),
            "committer_cpu_s": committer_cpu, "chain": str(self.chain),
        })


class DcpAsync(Config):
    family = "dcp.async_save"

    def __init__(self, name: str, size: ModelSize, mesh: Any, rank: int, *, group: Any) -> None:
        super().__init__(name, size, mesh, rank)
        self.group = group
        self.dir: Path | None = None
        self.future: Any = None
        self.saves = 0
        self.latencies: list[float] = []
        self.saved: list[Path] = []
        self._lock = threading.Lock()
        self.latency_from = 0

    def attach(self, workdir: Path, batch_steps: int) -> None:
        self.dir = workdir / "dcp"
        self.dir.mkdir(parents=True, exist_ok=True)

    def step(self) -> None:
        self.trainer.step()
        if self.dir is not None:  # checkpointing has started
            self.save()

    def _wait(self) -> None:
        if self.future is not None:
            getattr(self.future, "upload_completion", self.future).result()
            self.future = None

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.dir is not None
        t0 = time.perf_counter()
        self._wait()  # at most one in flight
        ended = time.monotonic()
        msd, osd = get_state_dict(self.trainer.model, self.trainer.optimizer)
        path = self.dir / f"step_{self.trainer.steps}"
        fut = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, process_group=self.group)
        upload: Any = getattr(fut, "upload_completion", fut)

        def done(_: Any) -> None:
            # Called in DCP's executor thread (a fresh one per save): its CPU time is the
            # background cost of this save; the time is when the save is complete.
            if threading.current_thread() is not threading.main_thread():
                with self._lock:
                    self.bg_cpu_s += time.thread_time()
                    self.latencies.append(time.monotonic() - ended)

        upload.add_done_callback(done)
        self.future = fut
        self.saved.append(path)
        self.saves += 1
        self.stall_s += time.perf_counter() - t0

    def drain(self) -> None:
        self._wait()

    def counters(self) -> dict[str, float]:
        with self._lock:
            return {**super().counters(), "saves": self.saves}

    def start_timed(self) -> None:
        self.latency_from = len(self.latencies)

    def after_window(self) -> dict[str, Any]:
        import torch.distributed as dist

        self._wait()
        mine, meta = [], []
        for path in self.saved:
            mine.append(sum(f.stat().st_size for f in path.glob(f"__{self.rank}_*.distcp")))
            meta.append((path / ".metadata").stat().st_size if (path / ".metadata").is_file() else 0)
        dist.barrier()  # every rank measured its files: rank 0 removes the checkpoints
        if self.rank == 0:
            for path in self.saved:
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        self.saved = []
        return {"dcp_rank_bytes": mine, "dcp_metadata_bytes": meta}

    def close(self) -> None:
        self._wait()
        with self._lock:
            self.info.update({"saves": self.saves, "commit_latency_s": self.latencies[self.latency_from:],
                              "background_cpu_s": self.bg_cpu_s})


def batch_steps_for(size: ModelSize, mode: str, window: int) -> int:
    """As :func:`benchmarks.peers.batch_steps_for`, with a rank's share of the captured bytes:
    the largest divisor of the window whose captured steps fit the 1 GiB batch cap, so that every
    window holds whole commits."""
    from .workload import GPT, n_params

    params = n_params(GPT(size)) / WORLD
    per_step = {"lowdiff": 0.01 * params * 8, "lowdiff+": params * 4, "xor": params * 12}[mode]
    fits = [b for b in range(1, window + 1) if window % b == 0 and b * per_step <= MAX_BATCH_BYTES]
    return max(fits, default=1)


def make_configs(plan: Plan, mesh: Any, rank: int, dcp_group: Any) -> list[Config]:
    size = plan.workload
    configs: list[Config] = [Config("none", size, mesh, rank)]
    if plan.lowdiff:
        configs.append(Config("none+topk", size, mesh, rank, topk=True))
    modes: list[Mode] = ["lowdiff", "lowdiff+", "xor"] if plan.lowdiff else ["lowdiff+", "xor"]
    configs += [LdformatConfig(f"ldformat {m}", size, mesh, rank, mode=m) for m in modes]
    configs.append(DcpAsync("dcp.async_save", size, mesh, rank, group=dcp_group))
    return configs


def _worker(rank: int, plan_d: dict[str, Any], port: int, workdir: str) -> None:
    """One rank: every configuration, rounds of windows; writes ``workdir/rank<R>.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", module="torch.distributed")
    warnings.filterwarnings("ignore", category=UserWarning)
    configure_threads()
    torch.set_num_threads(1)  # two ranks on two cores
    plan = Plan(ModelSize(**plan_d["workload"]), plan_d["rounds"], plan_d["window"], plan_d["lowdiff"],
                plan_d["deadline_s"], plan_d["batch_steps"])
    work = Path(workdir)

    def log(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    try:
        dcp_group = dist.new_group(backend="gloo")  # DCP's background collectives, apart from FSDP's
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        started = time.perf_counter()
        configs = make_configs(plan, mesh, rank, dcp_group)
        from .workload import GPT, n_params

        log(f"  {len(configs)} configurations, model {plan.workload.name} ({n_params(GPT(plan.workload)) / 1e6:.1f}M "
            f"parameters), FSDP2 world {WORLD}, {plan.rounds} rounds, windows of {plan.window} steps")
        step_estimate = float("nan")
        for cfg in configs:
            t0 = time.perf_counter()
            cfg.warmup(1)  # AdamW state exists before any checkpoint is taken
            t1 = time.perf_counter()
            cfg.warmup(1)
            if cfg.name == "none":
                step_estimate = time.perf_counter() - t1
            mode = getattr(cfg, "mode", None)
            b = (plan.batch_steps or batch_steps_for(plan.workload, mode, plan.window)) if mode else 1
            cfg.attach(work, b)
            if isinstance(cfg, LdformatConfig):
                # Untimed steps with checkpointing on: allocations, and the policy (auto anchor_every
                # is chosen after 8 measured steps), in whole batches.
                cfg.warmup(math.ceil(9 / b) * b)
            elif isinstance(cfg, DcpAsync):
                cfg.warmup(1)  # one untimed save: allocations, files, threads
            cfg.drain()
            cfg.after_window()
            cfg.release_grads()
            gc.collect()
            log(f"    {cfg.name}: ready ({time.perf_counter() - t0:.0f} s)")
        planned = plan.rounds * plan.window * len(configs)
        log(f"  set-up and warm-up: {time.perf_counter() - started:.0f} s; {planned} timed steps to go, about "
            f"{planned * step_estimate / 60:.1f} min at {step_estimate:.2f} s/step before checkpoint costs")
        for cfg in configs:
            if isinstance(cfg, (LdformatConfig, DcpAsync)):
                cfg.start_timed()
        first_timed = {c.name: c.trainer.steps + 1 for c in configs}

        windows: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
        for r in range(plan.rounds):
            t_round = time.perf_counter()
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for cfg in order:
                w = plan.window
                cfg.trainer.prefetch(cfg.trainer.steps + 1, w)
                gc.collect()
                dist.barrier()
                c0 = cfg.counters()
                t0 = time.perf_counter()
                step_times, stalls = [], []
                for _ in range(w):
                    s0 = cfg.stall_now()
                    ts = time.perf_counter()
                    cfg.step()
                    step_times.append(time.perf_counter() - ts)
                    stalls.append(cfg.stall_now() - s0)
                t_steps = time.perf_counter() - t0
                cfg.drain()
                elapsed = time.perf_counter() - t0
                c1 = cfg.counters()
                extra = cfg.after_window()
                cfg.release_grads()
                windows[cfg.name].append({
                    "round": r, "steps": w, "seconds": elapsed, "drain_s": elapsed - t_steps, "step_s": elapsed / w,
                    "step_times": step_times, "stalls": stalls, **{f"d_{k}": c1[k] - c0[k] for k in c1}, **extra,
                })
            log(f"  round {r + 1}/{plan.rounds}: {time.perf_counter() - t_round:.0f} s")
        for cfg in configs:
            cfg.close()
        dist.barrier()
        out = {
            "rank": rank, "windows": windows, "wall_s": time.perf_counter() - started,
            "configs": {c.name: {"family": c.family, "kind": c.kind, "baseline": c.baseline, "info": c.info,
                                 "first_timed_step": first_timed[c.name], "steps": c.trainer.steps,
                                 "losses": c.trainer.losses,
                                 "compress_s": c.trainer.compress_s} for c in configs},
        }
        (work / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


# -- the launcher ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(plan: Plan, workdir: Path) -> list[dict[str, Any]]:
    """Both ranks; raises if one fails or the run passes ``plan.deadline_s`` (a hang)."""
    import torch.multiprocessing as mp

    from . import sharded  # the workers import this module by name

    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.start_processes(sharded._worker, args=(plan.to_dict(), _free_port(), str(workdir)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + plan.deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not finish within {plan.deadline_s:.0f} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(10)
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(WORLD)]


# -- analysis ----------------------------------------------------------------------------------
def chain_bytes(chain: Path, world: int) -> dict[str, Any]:
    """Per rank: anchors/, deltas/ and everything else (log, root) under ``ranks/<r>``, and the
    rank chain's steps and anchors as its reader sees them."""
    import ldformat

    out: dict[str, Any] = {"ranks": [], "top_bytes": 0}
    rank_dirs = sorted((chain / "ranks").iterdir())
    for r, d in enumerate(rank_dirs[:world]):
        total = tree_bytes(d)
        anchors, deltas = tree_bytes(d / "anchors"), tree_bytes(d / "deltas")
        reader = ldformat.open_reader(d)
        steps = list(reader.steps)
        anchor_steps = list(reader.anchors)
        out["ranks"].append({"rank": r, "total": total, "anchors": anchors, "deltas": deltas,
                             "other": total - anchors - deltas, "steps": len(steps), "anchor_steps": anchor_steps,
                             "delta_steps": len(steps) - len(anchor_steps)})
    out["top_bytes"] = tree_bytes(chain) - sum(x["total"] for x in out["ranks"])
    out["commit_records"] = len(list((chain / "commits").glob("*.json"))) if (chain / "commits").is_dir() else 0
    return out


def analyse(ranks: list[dict[str, Any]], workdir: Path) -> dict[str, Any]:
    import ldformat

    names = list(ranks[0]["windows"])
    meta = ranks[0]["configs"]
    # A round's step time: the slower rank's window (the ranks run in lock-step anyway).
    step_s = {n: {w["round"]: max(rk["windows"][n][i]["step_s"] for rk in ranks)
                  for i, w in enumerate(ranks[0]["windows"][n])} for n in names}
    rows: dict[str, dict[str, Any]] = {}
    for n in names:
        base = meta[n]["baseline"]
        ratios = [s / step_s[base][r] - 1 for r, s in step_s[n].items() if r in step_s[base]]
        vs_none = [s / step_s["none"][r] - 1 for r, s in step_s[n].items()]
        base_step = median(list(step_s[base].values()))
        per_rank = []
        for rk in ranks:
            ws = rk["windows"][n]
            steps = sum(w["steps"] for w in ws)
            stalls = [s for w in ws for s in w["stalls"]]
            per_rank.append({
                "rank": rk["rank"], "steps": steps,
                "stall_median_s": median(stalls), "stall_p95_s": percentile(stalls, 95),
                "stall_mean_s": sum(stalls) / max(1, steps), "stall_max_s": max(stalls, default=0.0),
                "bg_cpu_per_step_s": sum(w["d_bg_cpu_s"] for w in ws) / max(1, steps),
                "compress_per_step_s": sum(w["d_compress_s"] for w in ws) / max(1, steps),
                "drain_per_step_s": sum(w["drain_s"] for w in ws) / max(1, steps),
                "backpressure_per_step_s": sum(w.get("d_backpressure_s", 0.0) for w in ws) / max(1, steps),
                "commits_in_windows": sum(w.get("d_commits", 0) for w in ws),
            })
        losses = meta[n]["losses"]
        ref_losses = meta[base]["losses"]
        same = [k for k in losses if k in ref_losses]
        row: dict[str, Any] = {
            "family": meta[n]["family"], "kind": meta[n]["kind"], "baseline": base,
            "step_s": summary([step_s[n][r] for r in sorted(step_s[n])]),
            "overhead": summary(ratios), "vs_none": summary(vs_none),
            "per_rank": per_rank,
            "stall_fraction": max(p["stall_mean_s"] for p in per_rank) / base_step,
            "losses_equal_baseline": all(losses[k] == ref_losses[k] for k in same) if same else None,
            "losses_compared": len(same),
            "info": [rk["configs"][n]["info"] for rk in ranks],
        }
        if meta[n]["family"] == "dcp.async_save":
            rb = [[b for w in rk["windows"][n] for b in w["dcp_rank_bytes"]] for rk in ranks]
            md = [b for w in ranks[0]["windows"][n] for b in w["dcp_metadata_bytes"]]
            row["bytes"] = {"per_rank_per_step": [median(x) for x in rb], "metadata_per_step": median(md),
                            "saves_measured": len(rb[0])}
            row["bytes_per_rank_step"] = max(median(x) for x in rb)
            lat = ranks[0]["configs"][n]["info"]["commit_latency_s"]
            row["commit_latency"] = {"median": median(lat), "p95": percentile(lat, 95), "n": len(lat),
                                     "what": "rank 0: from the end of the step (the save call) to the save's "
                                             "completion (metadata written)"}
            row["commit_latency"]["any_step_mean_s"] = row["commit_latency"]["median"]
        if meta[n]["family"] == "ldformat":
            info0 = ranks[0]["configs"][n]["info"]
            chain = Path(info0["chain"])
            b = chain_bytes(chain, WORLD)
            anchor_every = max(int(rk["configs"][n]["info"]["anchor_every"]) for rk in ranks)
            for x in b["ranks"]:
                x["delta_per_step"] = x["deltas"] / max(1, x["delta_steps"])
                x["anchor_bytes"] = x["anchors"] / max(1, len(x["anchor_steps"]))
                x["total_per_step"] = x["total"] / max(1, x["steps"])
                # Steady state: a delta every step, an anchor every anchor_every steps (the policy's).
                x["steady_per_step"] = x["delta_per_step"] + x["anchor_bytes"] / anchor_every + \
                    x["other"] / max(1, x["steps"])
            row["bytes"] = b
            row["anchor_every"] = anchor_every
            row["bytes_per_rank_step"] = max(x["steady_per_step"] for x in b["ranks"])
            lat = info0["commit_latency_s"]
            row["commit_latency"] = {"median": median(lat), "p95": percentile(lat, 95), "n": len(lat),
                                     "what": "rank 0: ck.stats.commit_latency_s (end of the committed step on "
                                             "rank 0 to its global commit record), timed phase and close"}
            row["global_commits"] = info0["global_commits"]
            row["batch_steps"] = info0["batch_steps"]
            # Only a batch's last step gets a commit record: an earlier step of the batch waits for
            # the rest of its batch too; averaged over the steps of a batch (derived):
            row["commit_latency"]["any_step_mean_s"] = (row["commit_latency"]["median"] + (row["batch_steps"] - 1)
                                                        / 2 * row["step_s"]["median"])
            row["committer_cpu_per_step_s"] = (info0["committer_cpu_s"] / max(1, info0["steps"])
                                               if info0["committer_cpu_s"] is not None else None)
            t0 = time.perf_counter()
            try:
                rep = ldformat.validate(chain)
                row["validate"] = {"ok": rep.ok, "steps": rep.steps, "anchors": list(rep.anchors),
                                   "latest_step": rep.latest_step, "problems": [str(p) for p in rep.problems[:5]],
                                   "seconds": time.perf_counter() - t0}
            except Exception as e:  # reported, not raised: the benchmark's other numbers stand
                row["validate"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                   "seconds": time.perf_counter() - t0}
            row["validate"]["expected_latest_step"] = info0["steps"]  # every captured step, committed at close
        rows[n] = row
    return {"rows": rows}


def report(res: dict[str, Any], plan: Plan) -> str:
    rows = res["rows"]
    base = rows["none"]["step_s"]["median"]
    s = plan.workload
    lines = [
        f"Model {s.name}: {s.layers} layers, d={s.width}, vocab {s.vocab}, seq {s.seq}, global batch {s.batch} "
        f"({s.batch // WORLD} per rank); AdamW; FSDP2 (fully_shard per block, then the root), world {WORLD}, gloo, "
        f"1 torch thread per rank; {plan.rounds} rounds interleaved (rotated order), windows of {plan.window} steps "
        f"after a barrier, drain of background work timed inside the window; a round's time is the slower rank's. "
        f"Baseline step (no checkpointing): {base:.3f} s. Overhead = median over rounds of (t / t_baseline of the "
        "same round - 1), 95% bootstrap CI. Stall = training-thread time inside the checkpoint path, measured "
        "around every step on each rank (median and p95 over the timed steps); background CPU in core-seconds per "
        "step per rank.",
        "",
    ]
    headers = ["configuration", "step time s [95% CI]", "overhead % [95% CI]", "stall ms r0 med / p95",
               "stall ms r1 med / p95", "stall % of step", "bytes/rank/step", "commit latency s med / p95",
               "bg CPU s/step/rank", "valid"]
    out = []
    for name, r in rows.items():
        over = "baseline" if name in ("none", "none+topk") and r["baseline"] == name else fmt_ci(r["overhead"], 100, 1)
        label = name + (" (baseline none+topk; changes training)" if r["baseline"] == "none+topk"
                        and name != "none+topk" else "") + (" (changes training)" if name == "none+topk" else "")
        pr = r["per_rank"]
        stall = [f"{p['stall_median_s'] * 1000:.1f} / {p['stall_p95_s'] * 1000:.1f}" for p in pr]
        nbytes = human_bytes(r["bytes_per_rank_step"]) if "bytes_per_rank_step" in r else ""
        lat = r.get("commit_latency")
        latency = f"{lat['median']:.2f} / {lat['p95']:.2f} (n={lat['n']})" if lat else ""
        bg = "/".join(f"{p['bg_cpu_per_step_s']:.3f}" for p in pr) if r["family"] != "none" else ""
        valid = ""
        if "validate" in r:
            v = r["validate"]
            valid = ("ok" if v["ok"] else "**FAILED**") + (f" ({v.get('steps')} steps)" if "steps" in v else "")
        out.append([label, fmt_ci(r["step_s"], digits=3), over, *stall, f"{r['stall_fraction'] * 100:.2f}", nbytes,
                    latency, bg, valid])
    lines.append(table(headers, out))

    dcp = rows.get("dcp.async_save")
    if dcp:
        lines += ["", "Ratios vs `dcp.async_save` (ldformat / DCP; below 1 is better for ldformat): step time "
                  "(medians), checkpoint overhead (medians; its own baseline for lowdiff), mean stall per step "
                  "(slower rank), bytes per rank per step (ldformat: steady state, see below), commit latency "
                  "(medians; ldformat commits a batch at once and records the latency of its last step: 'any step' "
                  "adds the mean wait for the rest of the batch), background CPU per step (mean of the ranks).", ""]
        rrows = []

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.3g}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"

        def mean_bg(r: dict[str, Any]) -> float:
            return sum(p["bg_cpu_per_step_s"] for p in r["per_rank"]) / len(r["per_rank"])

        def mean_stall(r: dict[str, Any]) -> float:
            return max(p["stall_mean_s"] for p in r["per_rank"])

        for name, r in rows.items():
            if r["family"] != "ldformat":
                continue
            rrows.append([name, ratio(r["step_s"]["median"], dcp["step_s"]["median"]),
                          ratio(r["overhead"]["median"], dcp["overhead"]["median"]),
                          ratio(mean_stall(r), mean_stall(dcp)),
                          ratio(r["bytes_per_rank_step"], dcp["bytes_per_rank_step"]),
                          ratio(r["commit_latency"]["median"], dcp["commit_latency"]["median"]),
                          ratio(r["commit_latency"]["any_step_mean_s"], dcp["commit_latency"]["any_step_mean_s"]),
                          ratio(mean_bg(r), mean_bg(dcp))])
        lines.append(table(["configuration", "step time", "overhead", "stall", "bytes/rank/step",
                            "commit latency (committed step)", "commit latency (any step, derived)", "bg CPU"], rrows))

    lines += ["", "Bytes per rank (ldformat: from the rank chains `ranks/<r>/` after close; DCP: each rank's "
              "`__<r>_*.distcp` per save, median over the timed saves; its `.metadata`, rank 0, apart). "
              "ldformat's steady state per step = delta bytes per delta step + anchor bytes / anchor_every (the "
              "policy's) + log and root bytes per step; 'all files / steps' divides everything (the first anchor "
              "included) by the steps of this short chain.", ""]
    brows = []
    for name, r in rows.items():
        if r["family"] == "ldformat":
            for x in r["bytes"]["ranks"]:
                brows.append([name, x["rank"], f"{x['steps']} ({len(x['anchor_steps'])} anchors)",
                              human_bytes(x["delta_per_step"]), human_bytes(x["anchor_bytes"]),
                              human_bytes(x["other"]), f"{r['anchor_every']}", human_bytes(x["steady_per_step"]),
                              human_bytes(x["total_per_step"])])
        elif r["family"] == "dcp.async_save":
            for rank, b in enumerate(r["bytes"]["per_rank_per_step"]):
                meta = f" + {human_bytes(r['bytes']['metadata_per_step'])} .metadata" if rank == 0 else ""
                brows.append([name, rank, f"{r['bytes']['saves_measured']} saves", human_bytes(b) + meta, "", "",
                              "every step", human_bytes(b), human_bytes(b)])
    lines.append(table(["configuration", "rank", "steps", "delta (DCP: save) / step", "anchor", "log + root",
                        "anchor_every", "steady / step", "all files / steps"], brows))

    lines += ["", "Details:"]
    for name, r in rows.items():
        pr = r["per_rank"]
        bits = [f"vs none {fmt_ci(r['vs_none'], 100, 1)} %"]
        if r["family"] == "ldformat":
            v = r["validate"]
            how = ("stated" if plan.batch_steps else "stated: the largest divisor of the window within the 1 GiB "
                   "batch cap")
            bits.append(f"batch_steps {r['batch_steps']} ({how}), anchor_every {r['anchor_every']} (policy); commit "
                        f"latency averaged over the steps of a batch (derived: latency + (batch_steps - 1) / 2 x step "
                        f"time) {r['commit_latency']['any_step_mean_s']:.2f} s")
            bits.append(f"global commits {r['global_commits']} (rank 0)")
            if r.get("committer_cpu_per_step_s") is not None:
                bits.append(f"rank 0 committer thread CPU {r['committer_cpu_per_step_s'] * 1000:.1f} ms/step")
            bits.append(f"validate: {'ok' if v['ok'] else 'FAILED ' + str(v.get('problems') or v.get('error'))}, "
                        f"{v.get('steps')} steps, latest {v.get('latest_step')} (expected "
                        f"{v['expected_latest_step']}), anchors {v.get('anchors')}, {v['seconds']:.1f} s")
        if r["family"] != "none":
            bits.append("drain ms/step " + "/".join(f"{p['drain_per_step_s'] * 1000:.1f}" for p in pr))
            bits.append("mean stall ms/step " + "/".join(f"{p['stall_mean_s'] * 1000:.1f}" for p in pr))
        if any(p["compress_per_step_s"] for p in pr):
            bits.append("top-k compression in the training loop ms/step "
                        + "/".join(f"{p['compress_per_step_s'] * 1000:.0f}" for p in pr))
        if r["losses_equal_baseline"] is not None and name != r["baseline"]:
            bits.append(f"losses bit-identical to {r['baseline']}'s: {r['losses_equal_baseline']} "
                        f"({r['losses_compared']} steps)")
        lines.append(f"- {name}: " + "; ".join(bits))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .run import machine, scrub

    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick workload and few steps (about 2 minutes)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per configuration (rounds x window; default 30 full, 24 quick)")
    parser.add_argument("--window", type=int, default=None, help="steps per window (default 5 full, 4 quick)")
    parser.add_argument("--batch-steps", type=int, default=None,
                        help="ldformat batch_steps (default: the largest divisor of the window within the 1 GiB cap)")
    parser.add_argument("--no-lowdiff", action="store_true", help="leave out none+topk and ldformat lowdiff")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default benchmarks/results, --quick: benchmarks/results/quick)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where chains and checkpoints are written (default: a temporary directory, removed)")
    args = parser.parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:  # timeout/kill: still remove the work directory
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    plan = Plan.quick() if args.quick else Plan.full()
    if args.window:
        plan.window = args.window
    if args.steps:
        plan.rounds = max(1, round(args.steps / plan.window))
    if args.no_lowdiff:
        plan.lowdiff = False
    if args.batch_steps:
        plan.batch_steps = args.batch_steps
    out: Path = args.out or Path("benchmarks/results/quick" if args.quick else "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ldformat-sharded-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    command = public_command("benchmarks.sharded", given)
    configure_threads()
    torch.set_num_threads(1)
    info = machine()
    info["torch_threads"] = 1
    started = time.perf_counter()
    print(f"# ldformat sharded benchmark ({'quick' if args.quick else 'full'}): {command}", flush=True)
    try:
        ranks = launch(plan, workdir)
        run_s = time.perf_counter() - started
        print("  analysing and validating the chains", flush=True)
        res = analyse(ranks, workdir)
    except BaseException:
        traceback.print_exc()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return 1
    res.update({"command": command, "mode": "quick" if args.quick else "full", "machine": info,
                "plan": plan.to_dict(), "world_size": WORLD, "run_s": run_s,
                "wall_s": time.perf_counter() - started, "windows": {rk["rank"]: rk["windows"] for rk in ranks}})
    md = [
        "# ldformat benchmarks: sharded (FSDP2)", "",
        f"Command: `{command}` ({res['mode']} mode; {res['wall_s'] / 60:.1f} min, validation included)", "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {(info['memory_bytes'] or 0) / 2**30:.0f} GiB memory, GPU: "
        f"{info['gpu'] or 'none'}; {info['os']}",
        f"Versions: python {info['python']}, torch {info['torch']} (CPU capability {info['torch_cpu_capability']}), "
        f"zarr {info['zarr']}, numcodecs {info['numcodecs']}, numpy {info['numpy']}, ldformat {info['ldformat']}",
        f"Threads: torch 1 per rank, blosc 1; {WORLD} ranks (torch.multiprocessing spawn), gloo on 127.0.0.1. "
        f"Workload: GPT {plan.workload.describe()} (global; {plan.workload.batch // WORLD} sequences per rank); "
        "AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices), grad clipping 1.0, synthetic tokens.",
        "", report(res, plan),
    ]
    text = "\n".join(md) + "\n"
    print(text, flush=True)
    (out / "sharded.md").write_text(text)
    (out / "sharded.json").write_text(json.dumps(scrub(res, str(workdir)), indent=1) + "\n")
    print(f"wrote {out / 'sharded.md'} and {out / 'sharded.json'}", flush=True)
    if own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = all(r["validate"]["ok"] for r in res["rows"].values() if "validate" in r)
    return 0 if ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
