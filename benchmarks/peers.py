"""Checkpointing configurations run by the overhead benchmark.

Each configuration owns one training run (:class:`~benchmarks.workload.Trainer`) and a way
of checkpointing it. ``step()`` runs one training step and, when due, a checkpoint;
``drain()`` waits for background work; ``counters()`` returns cumulative training-thread
stall and background CPU seconds.

* ``none`` / ``none+topk``: no checkpointing (the second with the same 1% top-k gradient
  compression that ``lowdiff`` mode uses; the training's own compression is timed apart).
* ``ldformat <mode>``: :class:`ldformat.Checkpointer`, a checkpoint every step. Stall and
  background CPU come from ``ck.stats``.
* ``torch.save/k``, ``safetensors/k``: a synchronous save + fsync on the training thread every
  ``k`` steps (stall = the whole call).
* ``dcp.async_save/k``: :func:`torch.distributed.checkpoint.async_save` (no process group:
  single-process ``no_dist``), at most one in flight (stall = staging call + waiting for the
  previous save); background CPU = the CPU time of its writer thread.
* ``checkfreq/k``: CheckFreq's two phases: snapshot into reused CPU buffers on the training
  thread, persist (torch.save + fsync) in a background thread, at most one in flight.

Every configuration takes a ``device`` (default ``"cpu"``). With CUDA, the CheckFreq snapshot
buffers are pinned, and DCP stages into its cached pinned CPU copy (one writer per slot,
reused), as DCP recommends for repeated async saves. ``written_bytes()`` counts the bytes a
configuration has written (untimed: it walks directories).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .workload import ModelSize, Trainer


def drain_writer(ck: Any) -> None:
    """Wait for a Checkpointer's background writer without forcing a commit of a partial batch.

    xor's lazy snapshot (docs/capture-runtime.md "Lazy snapshot") keeps the writer waiting for the
    last step's fence, which only the next optimizer pre-hook (or flush) runs: fence it first, or
    the join never returns. Reaches private attributes: the runtime has no public drain."""
    lazy = getattr(ck, "_lazy", None)
    if lazy is not None:
        lazy.fence()
    q = getattr(ck, "_queue", None)
    if q is not None:
        q.join()
    else:  # pragma: no cover - private attribute renamed
        ck.flush()


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories holding them."""
    if path.is_file():
        fsync_file(path)
        fsync_file(path.parent)
        return
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fsync_file(os.path.join(dirpath, f))
        fsync_file(dirpath)
    fsync_file(path.parent)


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (a file: its size; missing: 0)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:  # a temporary file renamed meanwhile
                pass
    return total


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model + optimizer tensors as one flat dict, each storage once (safetensors refuses aliases)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if id(t) in seen or t.data_ptr() in seen:
            continue
        seen.add(id(t))
        seen.add(t.data_ptr())
        out[f"model/{name}"] = t.detach().contiguous()
    for i, st in optimizer.state_dict()["state"].items():
        for key, t in st.items():
            if isinstance(t, torch.Tensor):
                out[f"optimizer/{i}/{key}"] = t.detach().contiguous()
    return out


class Config:
    """A training run plus a checkpointing method."""

    family = "none"
    interval = 1
    kind: str | None = None  # ldformat chain kind, if any

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, topk: bool = False,
                 device: str | torch.device = "cpu") -> None:
        self.name = name
        self.size = size
        self.workdir = workdir
        self.device = torch.device(device)
        self.compressor = None
        if topk:
            from ldformat import TopK

            self.compressor = TopK(0.01)
        self.trainer = Trainer(size, compressor=self.compressor, device=self.device)
        self.stall_s = 0.0
        self.bg_cpu_s = 0.0
        self.saves = 0

    @property
    def baseline(self) -> str:
        return "none+topk" if self.compressor is not None else "none"

    def warmup(self, steps: int) -> None:
        """Untimed steps before checkpointing starts (lazy AdamW state, allocations)."""
        self.trainer.prefetch(self.trainer.steps + 1, steps)
        for _ in range(steps):
            self.trainer.step()

    def attach(self) -> None:
        """Start checkpointing."""

    def step(self) -> None:
        self.trainer.step()
        if self.trainer.steps % self.interval == 0:
            self.save()

    def save(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {"stall_s": self.stall_s, "bg_cpu_s": self.bg_cpu_s, "compress_s": self.trainer.compress_s,
                "saves": self.saves}

    def written_bytes(self) -> int:
        """Bytes written so far (call after ``drain()``)."""
        return 0

    def release_grads(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class NoCheckpoint(Config):
    family = "none"


class LdformatConfig(Config):
    family = "ldformat"

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, mode: str, anchor_every: int | str = "auto",
                 batch_steps: int | str = "auto", device: str | torch.device = "cpu") -> None:
        super().__init__(name, size, workdir, topk=(mode == "lowdiff"), device=device)
        from ldformat.capture.runtime import MODES

        self.mode = mode
        self.kind = MODES[mode]
        self.anchor_every = anchor_every
        self.batch_steps = batch_steps
        self.chain = workdir / f"chain-{mode}"
        self.ck: Any = None
        self.create_s = 0.0
        self.close_s = 0.0
        self.lifetime: dict[str, Any] = {}

    def attach(self) -> None:
        from ldformat import Checkpointer

        shutil.rmtree(self.chain, ignore_errors=True)
        t0 = time.perf_counter()
        # lowdiff: the training loop compresses (it is the training's own choice); the
        # checkpointer only reuses the compressor's indices (compress=False).
        self.ck = Checkpointer(self.chain, self.trainer.model, self.trainer.optimizer, mode=self.mode,
                               anchor_every=self.anchor_every, batch_steps=self.batch_steps,
                               compressor=self.compressor, compress=False if self.compressor is not None else True)
        self.create_s = time.perf_counter() - t0

    def step(self) -> None:
        self.trainer.step()  # the optimizer hooks capture the step

    def drain(self) -> None:
        drain_writer(self.ck)

    def counters(self) -> dict[str, float]:
        st = self.ck.stats
        return {"stall_s": st.stall_s, "bg_cpu_s": st.background_cpu_s, "compress_s": self.trainer.compress_s,
                "saves": st.steps, "backpressure_s": st.backpressure_s, "commits": st.commits,
                "anchors": st.anchors_written}

    def written_bytes(self) -> int:
        return dir_bytes(self.chain)  # the chain only grows: anchors, deltas, logs, commit records

    def policy(self) -> dict[str, Any]:
        from ldformat.capture import optimal_batch_steps

        inputs = self.ck.policy_inputs()
        per_step = max(1, self.ck._last_step_bytes)
        auto_batch = None if inputs is None else optimal_batch_steps(
            inputs, upper=max(1, min(256, self.ck.max_batch_bytes // per_step)))
        return {"anchor_every": self.ck.anchor_every, "batch_steps": self.ck.batch_steps,
                "auto_anchor": self.anchor_every == "auto", "auto_batch": self.batch_steps == "auto",
                "policy_batch_steps": auto_batch, "stats_policy": self.ck.stats.policy}

    def close(self) -> None:
        if self.ck is not None:
            t0 = time.perf_counter()
            self.ck.close()
            self.close_s = time.perf_counter() - t0
            st = self.ck.stats
            # Lifetime averages: every captured step, every commit (the final flush included).
            self.lifetime = {"steps": st.steps, "stall_s": st.stall_s, "background_cpu_s": st.background_cpu_s,
                             "background_wall_s": st.background_wall_s, "commits": st.commits,
                             "anchors_written": st.anchors_written, "close_s": self.close_s}


class EveryK(Config):
    """A peer that saves every ``interval`` steps into its own directory."""

    suffix = ""

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, interval: int,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(name, size, workdir, device=device)
        self.interval = interval
        self.dir = workdir / name.replace("/", "-")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._save_bytes: int | None = None

    def slot(self, i: int) -> Path:
        """Saves alternate between two slots, so that one complete checkpoint always exists."""
        return self.dir / f"ckpt-{i % 2}{self.suffix}"

    def written_bytes(self) -> int:
        # Every save has the same size: measure one finished save once.
        if self.saves == 0:
            return 0
        if self._save_bytes is None:
            self._save_bytes = dir_bytes(self.slot(0))
        return self.saves * self._save_bytes


class TorchSave(EveryK):
    family = "torch.save"
    suffix = ".pt"

    def save(self) -> None:
        t0 = time.perf_counter()
        path = self.slot(self.saves)
        with open(path, "wb") as f:
            torch.save(self.trainer.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_file(self.dir)
        self.saves += 1
        self.stall_s += time.perf_counter() - t0


class SafetensorsSave(EveryK):
    family = "safetensors"
    suffix = ".safetensors"

    def save(self) -> None:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        path = self.slot(self.saves)
        tensors = flat_state(self.trainer.model, self.trainer.optimizer)
        if self.device.type != "cpu":  # not every safetensors version copies device tensors itself
            tensors = {k: v.cpu() for k, v in tensors.items()}
        save_file(tensors, str(path))
        fsync_file(path)
        fsync_file(self.dir)
        self.saves += 1
        self.stall_s += time.perf_counter() - t0


class DcpAsync(EveryK):
    family = "dcp.async_save"

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, interval: int,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(name, size, workdir, interval=interval, device=device)
        self.future: Any = None
        self._lock = threading.Lock()
        # CUDA: DCP's cached pinned staging copy needs the same writer reused, so one per slot.
        self._cache = self.device.type == "cuda"
        self._writers: dict[Path, Any] = {}

    def _writer(self, path: Path) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        if path in self._writers:
            return self._writers[path]
        config = self

        class TimedWriter(FileSystemWriter):
            # DCP's thread executor runs the whole save (plan, write, fsync, finish) in a
            # fresh thread per call: its thread CPU time at finish() is the background cost.
            def finish(self, *args: Any, **kwargs: Any) -> Any:
                result = super().finish(*args, **kwargs)
                if threading.current_thread() is not threading.main_thread():
                    with config._lock:
                        config.bg_cpu_s += time.thread_time()
                return result

        if not self._cache:
            return TimedWriter(str(path), sync_files=True)
        self._writers[path] = TimedWriter(str(path), sync_files=True, cache_staged_state_dict=True)
        return self._writers[path]

    def _wait(self) -> None:
        if self.future is not None:
            fut = getattr(self.future, "upload_completion", self.future)
            fut.result()
            self.future = None

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self._wait()  # at most one in flight
        path = self.slot(self.saves)
        self.future = dcp.async_save(self.trainer.state_dict(), storage_writer=self._writer(path), no_dist=True)
        self.saves += 1
        self.stall_s += time.perf_counter() - t0

    def drain(self) -> None:
        self._wait()

    def counters(self) -> dict[str, float]:
        with self._lock:
            return super().counters()

    def close(self) -> None:
        self._wait()


class CheckFreq(EveryK):
    family = "checkfreq"
    suffix = ".pt"

    def __init__(self, name: str, size: ModelSize, workdir: Path, *, interval: int,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(name, size, workdir, interval=interval, device=device)
        self.snapshot: dict[str, Any] | None = None
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._persist_loop, name="checkfreq-persist", daemon=True)
        self._thread.start()

    def _copy_into(self, dst: Any, src: Any) -> Any:
        if isinstance(src, torch.Tensor):
            if dst is None:
                if src.device.type == "cuda":  # pinned: a fast device-to-host copy, as CheckFreq does
                    return torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src.detach())
                return src.detach().to("cpu", copy=True)
            dst.copy_(src.detach())  # blocking: the snapshot is complete when save() returns
            return dst
        if isinstance(src, dict):
            return {k: self._copy_into(None if dst is None else dst.get(k), v) for k, v in src.items()}
        if isinstance(src, list):
            return [self._copy_into(None if dst is None else dst[i], v) for i, v in enumerate(src)]
        return src

    def save(self) -> None:
        t0 = time.perf_counter()
        self._idle.wait()  # at most one persist in flight; the snapshot buffers are reused
        if self._error is not None:
            raise self._error
        self.snapshot = self._copy_into(self.snapshot, self.trainer.state_dict())
        self._idle.clear()
        self._jobs.put(self.slot(self.saves))
        self.saves += 1
        self.stall_s += time.perf_counter() - t0

    def _persist_loop(self) -> None:
        cpu0 = time.thread_time()
        while True:
            path = self._jobs.get()
            if path is None:
                return
            try:
                with open(path, "wb") as f:
                    torch.save(self.snapshot, f)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_file(path.parent)
            except BaseException as e:  # surfaced at the next save
                self._error = e
            finally:
                self.bg_cpu_s = time.thread_time() - cpu0
                self._idle.set()

    def drain(self) -> None:
        self._idle.wait()

    def close(self) -> None:
        self._idle.wait()
        self._jobs.put(None)
        self._thread.join()


def step_bytes(size: ModelSize, mode: str) -> float:
    """Bytes one captured step holds in a writer batch (before encoding)."""
    from .workload import GPT, n_params

    params = n_params(GPT(size))
    return {"lowdiff": 0.01 * params * 8, "lowdiff+": params * 4, "xor": params * 12}[mode]


def batch_steps_for(size: ModelSize, mode: str, window: int, max_batch_bytes: int = 1 << 30,
                    divides: bool = True) -> int:
    """The largest batch (a divisor of ``window`` when ``divides``, else at most ``window``) whose
    captured steps fit ``max_batch_bytes``, the runtime's own cap for automatic batches. A stated
    batch_steps is not capped by ldformat, and an unbounded batch of full-state xor deltas
    exhausts memory (spec'd cap applies to 'auto' only)."""
    per_step = step_bytes(size, mode)
    fits = [b for b in range(1, window + 1) if (not divides or window % b == 0) and b * per_step <= max_batch_bytes]
    return max(fits, default=1)


def config_factories(size: ModelSize, workdir: Path, intervals: list[int], window: int,
                     device: str | torch.device = "cpu") -> list[tuple[str, Callable[[], Config]]]:
    """(name, constructor) of every configuration of the overhead benchmark, in a fixed order;
    construction is deferred so that a caller can pick some or survive one that fails."""
    out: list[tuple[str, Callable[[], Config]]] = [
        ("none", partial(NoCheckpoint, "none", size, workdir, device=device)),
        ("none+topk", partial(NoCheckpoint, "none+topk", size, workdir, topk=True, device=device)),
    ]
    for mode in ("lowdiff", "lowdiff+", "xor"):
        out.append((f"ldformat {mode}", partial(
            LdformatConfig, f"ldformat {mode}", size, workdir, mode=mode, anchor_every="auto",
            batch_steps=batch_steps_for(size, mode, window), device=device)))
    classes: list[tuple[type[EveryK], str]] = [(TorchSave, "torch.save"), (SafetensorsSave, "safetensors"),
                                               (DcpAsync, "dcp.async_save"), (CheckFreq, "checkfreq")]
    for cls, label in classes:
        for k in intervals:
            out.append((f"{label}/{k}", partial(cls, f"{label}/{k}", size, workdir, interval=k, device=device)))
    return out


def make_configs(size: ModelSize, workdir: Path, intervals: list[int], window: int,
                 device: str | torch.device = "cpu") -> list[Config]:
    """Every configuration of the overhead benchmark, in a fixed order."""
    return [make() for _name, make in config_factories(size, workdir, intervals, window, device)]
