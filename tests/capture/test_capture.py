"""The capture runtime: ``ldformat.Checkpointer``, ``ldformat.resume`` and ``ResumableSampler``.

What is checked, bit for bit wherever a state is compared:

1. kill -9 and resume, per mode: a run killed at a random step after some commits and
   resumed in a new process continues exactly like an uninterrupted run (loss, parameters,
   buffers, optimizer state, scheduler and sampler state) at every later step, and the
   chain then materializes that run at every step. A ``lowdiff`` resume from a delta step
   (``exact=False``) legitimately diverges (its top-k residuals restart at zero), yet its
   chain stays valid and exact for the run it records. These runs live in
   ``capture_trainer.py``, started once per module in the background.
2. GradScaler with a fused and a non-fused optimizer, with skipped steps.
3. Gradient accumulation and clipping.
4. ``lowdiff+`` ``recover()`` from the in-memory replica, storage unreadable.
5. Back-pressure from a slow store (bounded buffer sets, no growth); writer errors (ENOSPC)
   surface in the training thread and leave the chain valid at its last commit.
6. ``close()`` flushes a partial batch and stops the writer thread; a process that exits
   without ``close()`` still commits.
7. ``ResumableSampler`` state round trips, also across epoch boundaries.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import capture_trainer as ct
import pytest
import torch
from models import TinyNet, assert_state_bits_equal, batch, bits, snapshot
from paths import SUPPORT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ldformat
from ldformat import ChainReader, LdformatError, ResumableSampler
from ldformat.format.state import bits_view
from ldformat.stores import LocalStore

MODES = ct.MODES
# The crash step of each mode: random, but the same in every run of the suite.
KILL_AT = {mode: random.Random(f"ldformat-capture-{mode}").randint(ct.MIN_DURABLE_BEFORE_KILL + 4, 24)
           for mode in MODES}
TRAINER_TIMEOUT_S = 240.0

pytestmark = pytest.mark.filterwarnings(
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`",
)


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Torch on one thread here (tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing here is about power loss (tests/chain/test_crash.py is); fsync would only cost time.
    monkeypatch.setattr(LocalStore, "_fsync_fd", lambda self, fd: None)


@pytest.fixture(autouse=True)
def _close_leftover_checkpointers(close_leftover_checkpointers: None) -> None:
    """tests/conftest.py: a failed test leaves no hooks, writer threads or locks behind."""


class Trainer:
    """``capture_trainer.py`` running in the background (started once per module)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.log = open(work.parent / "capture_trainer.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT / "capture_trainer.py"), str(work), json.dumps(KILL_AT)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=str(SUPPORT),
            start_new_session=True,  # its own process group: stop() can end the runs it forked
        )
        self.exits: dict[str, Any] | None = None

    def output(self) -> str:
        self.log.flush()
        return (self.work.parent / "capture_trainer.log").read_text(errors="replace")[-6000:]

    def wait(self) -> dict[str, Any]:
        if self.exits is None:
            try:
                code = self.proc.wait(timeout=TRAINER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"capture_trainer.py timed out\n{self.output()}") from None
            assert code == 0, f"capture_trainer.py exited {code}\n{self.output()}"
            self.exits = json.loads((self.work / "exits.json").read_text())
        return self.exits

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    work = tmp_path_factory.mktemp("capture_trainer") / "work"
    t = Trainer(work)
    yield t
    t.stop()


@pytest.fixture(scope="module", autouse=True)
def _trainer_starts_with_the_module(request: pytest.FixtureRequest) -> None:
    """The subprocess runs start with the module and overlap the in-process tests, unless no
    test that reads them is selected (``-m "not procs"``): then they do not start at all."""
    if any(item.module is request.module and "trainer" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("trainer")


# -- helpers -------------------------------------------------------------------------------
def load_dumps(directory: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for p in directory.glob("*.pt"):
        out[int(p.stem)] = torch.load(p, weights_only=True)
    return out


def assert_dump_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert_state_bits_equal(got["state"], want["state"], where)
    if got["loss"] is not None and want["loss"] is not None:
        assert torch.equal(bits(got["loss"]), bits(want["loss"])), f"{where}: loss {got['loss']} != {want['loss']}"
    assert got["scheduler"] == want["scheduler"], f"{where}: scheduler state"
    assert got["sampler"] == want["sampler"], f"{where}: sampler state"


def assert_chain_matches_dumps(chain: Path, dumps: dict[int, dict[str, Any]], label: str) -> None:
    reader = ChainReader(chain)
    assert reader.steps == sorted(dumps), f"{label}: chain steps {reader.steps}"
    for step in reader.steps:
        got = reader.materialize(step)
        want = dumps[step]
        where = f"{label} step {step}"
        assert_state_bits_equal(got, want["state"], where)
        assert got["extra"]["scheduler"] == want["scheduler"], f"{where}: scheduler state"
        assert got["extra"]["data"] == want["sampler"], f"{where}: sampler state"
    report = ldformat.validate(chain)
    assert report.ok, f"{label}: {report.problems}"


def assert_chain_matches(path: str | Path, refs: dict[int, dict[str, Any]], label: str,
                         extras: dict[int, dict[str, Any]] | None = None) -> ChainReader:
    """Every committed step materializes to the recorded live state (and extra state)."""
    reader = ChainReader(path)
    assert reader.steps == sorted(refs), f"{label}: chain steps {reader.steps} != {sorted(refs)}"
    for step in reader.steps:
        got = reader.materialize(step)
        assert_state_bits_equal(got, refs[step], f"{label} step {step}")
        for key, value in (extras or {}).get(step, {}).items():
            assert got["extra"][key] == value, f"{label} step {step}: extra {key}"
    report = ldformat.validate(path)
    assert report.ok, f"{label}: {report.problems}"
    return reader


def make_objects(fused: bool = False) -> tuple[TinyNet, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01, fused=fused)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, sched: Any = None) -> None:
    model.train()
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ldformat-writer" and t.is_alive()]


# -- 2. GradScaler -----------------------------------------------------------------------------
SKIPPED = {3, 6, 7}  # steps whose gradients get an inf, so GradScaler skips them


def scaler_run(tmp_path: Path, mode: str, fused: bool, skipped: set[int], steps: int = 10,
               staged: bool | None = None) -> None:
    model, opt, sched = make_objects(fused)
    # growth_interval 2: the scale grows as well as backs off, always by powers of two.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, scheduler=sched, scaler=scaler, anchor_every=4,
                               batch_steps=3, topk_ratio=0.2, stage_during_backward=staged)
    refs = {0: snapshot(model, opt)}
    extras: dict[int, dict[str, Any]] = {0: {"scaler": scaler.state_dict(), "scheduler": sched.state_dict()}}
    scales = set()
    for step in range(1, steps + 1):
        model.train()
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        if step in skipped:
            grad = model.hidden.weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        scales.add(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        sched.step()
        refs[step] = snapshot(model, opt)
        extras[step] = {"scaler": scaler.state_dict(), "scheduler": sched.state_dict()}
    ck.close()
    assert len(scales) > 2, "the scale should both grow and back off"
    reader = assert_chain_matches(path, refs, f"{mode} fused={fused}", extras)
    stepped = {s: reader.state.deltas[s][1].stepped for s in range(1, steps + 1)}
    assert stepped == {s: s not in skipped for s in range(1, steps + 1)}


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_with_skipped_steps(tmp_path: Path, mode: str, fused: bool) -> None:
    scaler_run(tmp_path, mode, fused, SKIPPED)


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_grad_scaler_with_gradients_staged_during_backward(tmp_path: Path, fused: bool) -> None:
    """The CUDA staging path, forced on the CPU: unscale_ rewrites staged gradients."""
    scaler_run(tmp_path, "lowdiff+", fused, SKIPPED, staged=True)


@pytest.mark.parametrize("mode", MODES)
def test_fused_optimizer_skipping_its_first_step(tmp_path: Path, mode: str) -> None:
    """A fused optimizer creates its (zero) state even in a step GradScaler skips.

    GradScaler's usual huge initial scale makes the first steps overflow, so this is the
    common case: step 1 is skipped, yet Adam's state exists from then on.
    """
    scaler_run(tmp_path, mode, True, {1, 2}, steps=4)


# -- 3. gradient accumulation and clipping -----------------------------------------------------
@pytest.mark.parametrize("mode,staged", [(m, False) for m in MODES] + [("lowdiff+", True)])
def test_gradient_accumulation_and_clipping(tmp_path: Path, mode: str, staged: bool) -> None:
    model, opt, sched = make_objects()
    path = tmp_path / "chain"
    # staged: the CUDA path's copies during backward, forced on the CPU.
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, scheduler=sched, anchor_every=4, batch_steps=3,
                               topk_ratio=0.2, stage_during_backward=staged)
    refs = {0: snapshot(model, opt)}
    clipped = 0
    for step in range(1, 10):
        model.train()
        opt.zero_grad(set_to_none=True)
        for micro in range(3):  # lowdiff+ stages every micro-batch's accumulated gradient
            x, y = batch(100 * step + micro)
            (nn.functional.cross_entropy(model(x), y) / 3).backward()
        if step % 3:  # clipping changes the gradients after the last staging copy
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            clipped += int(norm > 0.5)
        opt.step()
        sched.step()
        refs[step] = snapshot(model, opt)
    ck.close()
    assert clipped >= 3, "max_norm should actually clip"
    assert_chain_matches(path, refs, f"{mode} accumulation + clipping")


# -- 4. lowdiff+ recover() ----------------------------------------------------------------------
class UnreadableStore(LocalStore):
    """A LocalStore whose reads fail once ``locked`` (recover must not need storage)."""

    locked = False

    def _check(self, path: str) -> None:
        if self.locked:
            raise OSError(errno.EIO, f"storage is unreadable ({path})")

    def read(self, path: str) -> bytes:
        self._check(path)
        return super().read(path)

    def list(self, prefix: str) -> list[str]:
        self._check(prefix)
        return super().list(prefix)

    def size(self, path: str) -> int:
        self._check(path)
        return super().size(path)


def corrupt(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        tensors = list(model.state_dict().values()) + [t for st in opt.state.values() for t in st.values()]
        for t in tensors:
            t.fill_(float("nan") if t.is_floating_point() else 7)


def recover_setup(tmp_path: Path) -> tuple[TinyNet, torch.optim.Optimizer, Any, ldformat.Checkpointer,
                                           UnreadableStore, dict[int, dict[str, Any]]]:
    model, opt, sched = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    store = UnreadableStore(path)
    ck = ldformat.Checkpointer(path, model, opt, mode="lowdiff+", scheduler=sched, anchor_every=4, batch_steps=3,
                               store=store)
    refs = {0: snapshot(model, opt)}
    for step in range(1, 7):
        plain_step(model, opt, step, sched)
        refs[step] = snapshot(model, opt)
    return model, opt, sched, ck, store, refs


def test_lowdiff_plus_recover_without_reading_storage(tmp_path: Path) -> None:
    model, opt, _, ck, store, refs = recover_setup(tmp_path)
    store.locked = True
    corrupt(model, opt)
    assert ck.recover(model, opt) == 6
    assert_state_bits_equal(snapshot(model, opt), refs[6], "recovered in place")
    other = TinyNet()  # into fresh objects too
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2, weight_decay=0.01)
    ck.recover(other, other_opt)
    assert_state_bits_equal(snapshot(other, other_opt), refs[6], "recovered into new objects")
    store.locked = False
    ck.close()
    assert_chain_matches(tmp_path / "chain", refs, "lowdiff+ after recover")


def test_lowdiff_plus_training_continues_exactly_after_recover(tmp_path: Path) -> None:
    """After recover() the live state must be the live state's own, not the replica's tensors."""
    model, opt, sched, ck, store, refs = recover_setup(tmp_path)
    corrupt(model, opt)
    ck.recover(model, opt)
    for step in range(7, 14):
        plain_step(model, opt, step, sched)
        refs[step] = snapshot(model, opt)
    store.locked = True
    other = TinyNet()
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2, weight_decay=0.01)
    assert ck.recover(other, other_opt) == 13
    assert_state_bits_equal(snapshot(other, other_opt), refs[13], "replica after training on from a recover")
    corrupt(model, opt)
    ck.recover(model, opt)
    assert_state_bits_equal(snapshot(model, opt), refs[13], "second recover in place")
    store.locked = False
    ck.close()
    assert_chain_matches(tmp_path / "chain", refs, "lowdiff+ trained on after recover")


# -- 5. back-pressure and writer errors -----------------------------------------------------------
class SlowStore(LocalStore):
    """Every commit takes a while: the writer falls behind a fast training loop."""

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        time.sleep(0.002)
        super().write(path, data)

    def sync(self, paths: Any) -> None:
        time.sleep(0.05)
        super().sync(paths)


@pytest.mark.parametrize("mode", MODES)
def test_back_pressure_bounds_buffers_in_flight(tmp_path: Path, mode: str) -> None:
    queue_depth = 2
    model, opt, _ = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=100, batch_steps=1, topk_ratio=0.2,
                               queue_depth=queue_depth, store=SlowStore(path))
    # Count buffer sets out of the pool (acquired by training, released by the writer thread).
    lock = threading.Lock()
    in_flight = [0, 0]  # now, max
    seen_sets: dict[int, Any] = {}
    acquire, release = ck.pool.acquire, ck.pool.release

    def counting_acquire() -> Any:
        got = acquire()
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            seen_sets[id(got[0])] = got[0]
        return got

    def counting_release(buffers: Any) -> None:
        with lock:
            in_flight[0] -= 1
        release(buffers)

    ck.pool.acquire, ck.pool.release = counting_acquire, counting_release  # type: ignore[method-assign]
    def layout() -> dict[int, dict[str, tuple[int, int]]]:
        return {i: {n: (t.data_ptr(), t.numel()) for n, t in s.tensors.items()} for i, s in seen_sets.items()}

    layout_after_warmup: dict[int, dict[str, tuple[int, int]]] = {}
    refs = {0: snapshot(model, opt)}
    training_s = 0.0
    for step in range(1, 13):
        started = time.perf_counter()
        plain_step(model, opt, step)
        training_s += time.perf_counter() - started
        refs[step] = snapshot(model, opt)
        assert ck._queue.qsize() <= queue_depth + 1
        if step == 6:
            layout_after_warmup = layout()
    ck.close()
    assert ck.stats.backpressure_s > 0, ck.stats.to_dict()
    # The stall includes the back-pressure once: it is part of the training loop's time.
    assert ck.stats.backpressure_s <= ck.stats.stall_s <= training_s, (ck.stats.to_dict(), training_s)
    assert in_flight[0] == 0
    assert in_flight[1] == queue_depth + 1, f"at most queue_depth+1 buffer sets, and the bound was reached: {in_flight}"
    # The same queue_depth+1 buffer sets all along, their buffers allocated once and reused:
    # nothing was added or reallocated after warm-up.
    assert len(seen_sets) == queue_depth + 1
    assert all(s.tensors for s in seen_sets.values())
    assert layout() == layout_after_warmup
    assert not ck._thread.is_alive()
    assert_chain_matches(path, refs, f"{mode} under back-pressure")


@pytest.mark.parametrize("mode", MODES)
def test_each_step_fences_its_staging_copies_before_training_goes_on(tmp_path: Path, mode: str) -> None:
    """When ``optimizer.step()`` returns, every copy into a host buffer made for that step is
    behind a fence (on CUDA: the training's stream waits for the side stream's event), so no
    kernel queued afterwards can change a tensor being copied. On the CPU the fence is a
    no-op; this checks that the runtime places it (tests/capture/test_cuda.py checks the effect)."""
    model, opt, _ = make_objects()
    ck = ldformat.Checkpointer(tmp_path / "chain", model, opt, mode=mode, anchor_every=100, batch_steps=2,
                               topk_ratio=0.2, queue_depth=2,
                               options=ldformat.CaptureOptions(lazy_snapshot=False))  # test_lazy_snapshot.py
    events: list[str] = []
    copy, mark, fence = ck.stager.copy, ck.stager.mark, ck.stager.fence

    def recording(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            events.append(name)
            return fn(*args)
        return call

    ck.stager.copy = recording("copy", copy)  # type: ignore[method-assign]
    ck.stager.mark = recording("mark", mark)  # type: ignore[method-assign]
    ck.stager.fence = recording("fence", fence)  # type: ignore[method-assign]
    for step in range(1, 6):
        del events[:]
        plain_step(model, opt, step)
        assert "copy" in events, (step, events)
        last_copy = max(i for i, e in enumerate(events) if e == "copy")
        assert events[last_copy + 1:][:2] == ["mark", "fence"], (step, events)
    ck.close()


class RecordingStore(LocalStore):
    """Notes every object write, in order with the pool's releases (``events``)."""

    events: list[str]

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.events.append(f"write {path.split('/')[0]}")
        super().write(path, data)

    def write_parts(self, path: str, parts: Any) -> None:
        self.events.append(f"write {path.split('/')[0]}")
        super().write_parts(path, parts)


@pytest.mark.parametrize("mode", MODES)
def test_default_queue_depth_by_mode_and_buffers_back_before_disk_writes(tmp_path: Path, mode: str) -> None:
    """xor holds one staging set (its steps are the whole state: 2x the state with the XOR base),
    the gradient modes three; a set goes back to training once its step is encoded, before the
    batch or anchor it belongs to is written, so a slow disk does not hold it."""
    model, opt, _ = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    store = RecordingStore(path)
    store.events = []
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=3, batch_steps=1, topk_ratio=0.2,
                               store=store)
    assert ck.pool._free.qsize() == (1 if mode == "xor" else 3)
    store.events.clear()  # the chain's creation
    release = ck.pool.release

    def noting_release(buffers: Any) -> None:
        store.events.append("release")
        release(buffers)

    ck.pool.release = noting_release  # type: ignore[method-assign]
    refs = {0: snapshot(model, opt)}
    for step in range(1, 8):
        plain_step(model, opt, step)
        refs[step] = snapshot(model, opt)
    ck.close()
    events = [e for e in store.events if e in ("release", "write deltas", "write anchors")]
    assert events.count("release") == 7, events
    # Each step: its set is released, then its batch (and at steps 3 and 6 its anchor) is written.
    steps, i = [], 0
    while i < len(events):
        assert events[i] == "release", events
        j = i + 1
        while j < len(events) and events[j] != "release":
            j += 1
        steps.append(events[i + 1:j])
        i = j
    assert [("write anchors" in w) for w in steps] == [False, False, True, False, False, True, False], steps
    assert all("write deltas" in w for w in steps), steps
    assert_chain_matches(path, refs, f"{mode} with the default queue depth")


@pytest.mark.parametrize("option,bad", [("queue_depth", b) for b in (-1, 1.5, True, "2")]
                         + [("encode_threads", b) for b in (0, 1.5, True, "2")])
def test_counts_are_checked_before_anything_is_written(tmp_path: Path, option: str, bad: Any) -> None:
    model, opt, _ = make_objects()
    with pytest.raises(ldformat.UsageError, match=option):
        ldformat.Checkpointer(tmp_path / "chain", model, opt, **{option: bad})
    assert not (tmp_path / "chain").exists()


@pytest.mark.parametrize("mode", MODES)
def test_encode_threads_compress_on_a_pool_and_stay_exact(tmp_path: Path, mode: str) -> None:
    model, opt, sched = make_objects()
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, scheduler=sched, anchor_every=4, batch_steps=3,
                               topk_ratio=0.2, encode_threads=3)
    assert ck.writer.encode_threads == 3
    refs = {0: snapshot(model, opt)}
    for step in range(1, 8):
        plain_step(model, opt, step, sched)
        refs[step] = snapshot(model, opt)
    ck.close()
    assert [t for t in threading.enumerate() if t.name.startswith("ldformat-encode")], "no pool thread ran"
    assert_chain_matches(path, refs, f"{mode} with encode_threads=3")


def test_explicit_anchor_every_and_batch_steps_are_kept(tmp_path: Path) -> None:
    """The stall tuner may move "auto" values only.

    Explicit intervals are a contract: in data-parallel lowdiff, rank 0's anchors must fall
    on the steps where every ResidualPeer (same ``anchor_every``) joins the residual
    all-gather.
    """
    model, opt, _ = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    ck = ldformat.Checkpointer(path, model, opt, mode="lowdiff", anchor_every=4, batch_steps=2, topk_ratio=0.2,
                               store=SlowStore(path))
    for step in range(1, 25):  # the tuner looks at the stall every 20 steps
        plain_step(model, opt, step)
    ck.close()
    assert ck.stats.policy["last_stall_fraction"] > ck.tuner.max_stall, "the slow store should stall training"
    assert (ck.anchor_every, ck.batch_steps) == (4, 2)
    reader = ChainReader(path)
    assert reader.anchors == list(range(0, 25, 4))
    assert [e.rows for e in reader.state.delta_entries()] == [2] * 12


class FullStore(LocalStore):
    """A LocalStore that runs out of space for objects whose path starts with ``fail_prefix``."""

    def __init__(self, root: Path, fail_prefix: str | None = None) -> None:
        super().__init__(root)
        self.fail_prefix = fail_prefix
        self.failures = 0

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        if self.fail_prefix is not None and path.startswith(self.fail_prefix):
            self.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        super().write(path, data)


def assert_enospc(error: BaseException) -> None:
    causes = []
    e: BaseException | None = error
    while e is not None:
        causes.append(e)
        e = e.__cause__
    assert any(isinstance(c, ldformat.WriterIOError) and c.errno == errno.ENOSPC for c in causes), causes


def assert_closed_cleanly(ck: ldformat.Checkpointer, opt: torch.optim.Optimizer, path: Path) -> None:
    assert not ck._thread.is_alive()
    assert not writer_threads()
    assert not (path / "writer.lock").exists(), "the lock of a failed writer must be released"
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks, "hooks left behind"


@pytest.mark.parametrize("mode", MODES)
def test_disk_full_surfaces_at_a_later_optimizer_step(tmp_path: Path, mode: str) -> None:
    model, opt, _ = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    # Batches are steps 1-3, 4-6, 7-9, ...: the third commit fails.
    store = FullStore(path, fail_prefix="deltas/7-")
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, anchor_every=100, batch_steps=3, topk_ratio=0.2,
                               queue_depth=1, store=store)
    refs = {0: snapshot(model, opt)}
    raised_at, error = None, None
    for step in range(1, 20):
        try:
            plain_step(model, opt, step)
        except LdformatError as e:
            raised_at, error = step, e
            break
        refs[step] = snapshot(model, opt)
    # Back-pressure bounds how far training runs ahead of the failed commit (step 9).
    assert raised_at is not None and 9 < raised_at <= 9 + 3, raised_at
    assert error is not None
    assert_enospc(error)
    assert store.failures == 1
    with pytest.raises(LdformatError) as closing:
        ck.close()  # the error is not swallowed at close either
    assert_enospc(closing.value)
    assert_closed_cleanly(ck, opt, path)
    plain_step(model, opt, 99)  # training itself goes on without the hooks
    assert_chain_matches(path, {s: refs[s] for s in range(7)}, f"{mode} after ENOSPC")


@pytest.mark.parametrize("where", ["writer-thread", "final-commit"])
def test_disk_full_surfaces_at_close(tmp_path: Path, where: str) -> None:
    """No optimizer step follows the failure: close() must raise it."""
    model, opt, _ = make_objects()
    path = tmp_path / "chain"
    path.mkdir()
    if where == "writer-thread":  # the background thread fails committing steps 3-4
        store = FullStore(path, fail_prefix="deltas/3-")
        batch_steps = 2
    else:  # nothing is committed until close() commits the partial batch
        store = FullStore(path, fail_prefix="deltas/1-")
        batch_steps = 100
    ck = ldformat.Checkpointer(path, model, opt, mode="lowdiff+", anchor_every=100, batch_steps=batch_steps,
                               store=store)
    refs = {0: snapshot(model, opt)}
    for step in range(1, 5):  # the failing batch is the last one: no optimizer step follows it
        plain_step(model, opt, step)
        refs[step] = snapshot(model, opt)
    with pytest.raises(LdformatError) as closing:
        ck.close()
    assert_enospc(closing.value)
    assert store.failures == 1
    assert_closed_cleanly(ck, opt, path)
    last = 2 if where == "writer-thread" else 0
    assert_chain_matches(path, {s: refs[s] for s in range(last + 1)}, f"ENOSPC {where}")


# -- 6. close() and exit -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_close_flushes_partial_batch_and_stops_writer(tmp_path: Path, mode: str) -> None:
    model, opt, sched = make_objects()
    path = tmp_path / "chain"
    ck = ldformat.Checkpointer(path, model, opt, mode=mode, scheduler=sched, anchor_every=100, batch_steps=4,
                               topk_ratio=0.2)
    assert ck._thread.name == "ldformat-writer" and ck._thread.is_alive()
    refs = {0: snapshot(model, opt)}
    for step in range(1, 8):  # batches 1-4 (committed by the writer) and 5-7 (partial)
        plain_step(model, opt, step, sched)
        refs[step] = snapshot(model, opt)
    assert ck.step == 7
    assert (ck.durable_step or 0) <= 4
    assert ck.close() == 7
    assert ck.close() == 7  # idempotent
    assert not ck._thread.is_alive() and not writer_threads()
    assert not (path / "writer.lock").exists()
    assert_chain_matches(path, refs, f"{mode} closed with a partial batch")
    # The hooks are gone: training goes on without capturing (or failing).
    plain_step(model, opt, 8, sched)
    assert ChainReader(path).latest_step == 7


# -- 7. ResumableSampler ---------------------------------------------------------------------------
def test_sampler_state_round_trip_mid_epoch() -> None:
    sampler = ResumableSampler(10, seed=5)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert state == {"epoch": 0, "position": 4, "seed": 5, "n": 10}
    rest = list(it)
    assert sorted(head + rest) == list(range(10)) and head + rest != list(range(10))
    resumed = ResumableSampler(10, seed=5)
    resumed.load_state_dict(state)
    assert len(resumed) == 6
    assert list(resumed) == rest
    assert resumed.state_dict() == sampler.state_dict() == {"epoch": 1, "position": 0, "seed": 5, "n": 10}
    # The next epochs match too, and differ from each other.
    assert list(resumed) == list(sampler)
    assert list(ResumableSampler(10, seed=5)) != list(sampler)
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="n="):
        ResumableSampler(11, seed=5).load_state_dict(state)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_resumes_a_dataloader_across_epoch_boundaries(drop_last: bool) -> None:
    """State taken after any batch (epoch ends included) continues the same batch stream."""
    n, batch_size = 10, 4  # 2 full batches and a partial one per epoch
    data = TensorDataset(torch.arange(n))

    def stream(sampler: ResumableSampler) -> Iterator[list[int]]:
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=0, drop_last=drop_last,
                            generator=torch.Generator())
        while True:
            for (x,) in loader:
                yield x.tolist()

    total = 3 * (n // batch_size + (0 if drop_last else 1))
    sampler = ResumableSampler(n, seed=11)
    source = stream(sampler)
    reference = []
    states = []
    for _ in range(total):
        reference.append(next(source))
        states.append(sampler.state_dict())
    assert {s["epoch"] for s in states} >= {0, 1, 2}
    for k, state in enumerate(states[:-1]):
        resumed = ResumableSampler(n, seed=11)
        resumed.load_state_dict(state)
        again = stream(resumed)
        assert [next(again) for _ in range(total - k - 1)] == reference[k + 1:], f"resumed after batch {k}"


# -- 1 and 6. the subprocess runs (last: the background trainer has had the longest to finish) --
@pytest.mark.procs
@pytest.mark.parametrize("mode", MODES)
def test_kill_and_resume_continues_bit_exact(trainer: Trainer, mode: str) -> None:
    exits = trainer.wait()[mode]
    assert exits["ref"] == {"signal": None, "code": 0}, trainer.output()
    assert exits["crash"]["signal"] == signal.SIGKILL, f"{exits}\n{trainer.output()}"
    assert exits["resume"] == {"signal": None, "code": 0}, trainer.output()
    work = trainer.work / mode
    result = json.loads((work / "result.json").read_text())
    after_crash = result["after_crash"]
    kill_at = KILL_AT[mode]

    # What the killed process had reported durable survived it.
    events = (work / "crash.events").read_text().split()
    assert events[-2:] == ["K", str(kill_at)], events
    reported = [int(v) for k, v in zip(events[::2], events[1::2], strict=True) if k == "D" and v != "None"]
    assert reported and max(reported) >= ct.MIN_DURABLE_BEFORE_KILL
    assert set(reported) <= set(after_crash["steps"]), (reported, after_crash)
    assert after_crash["steps"] == list(range(after_crash["latest"] + 1))
    assert ct.MIN_DURABLE_BEFORE_KILL <= after_crash["latest"] <= kill_at

    # lowdiff resumes from the latest anchor (the only exact point), the others from the latest step.
    resumed = result["resumed"]
    if mode == "lowdiff":
        assert resumed == after_crash["anchors"][-1] and resumed >= ct.ANCHOR_EVERY, result
    else:
        assert resumed == after_crash["latest"], result

    ref = load_dumps(work / "ref")
    assert sorted(ref) == list(range(ct.STEPS + 1))
    crash = load_dumps(work / "crash")
    assert sorted(crash) == list(range(kill_at + 1))
    for step in crash:  # the crashed run trained like the reference up to its death
        assert_dump_equal(crash[step], ref[step], f"{mode} crashed run, step {step}")
    after = load_dumps(work / "resumed")
    assert sorted(after) == list(range(resumed, ct.STEPS + 1))
    for step in after:  # step `resumed`: the state resume() restored, before any training
        assert_dump_equal(after[step], ref[step], f"{mode} resumed run, step {step}")

    # The chain: steps up to `resumed` from the crashed run, the rest re-recorded after it.
    assert_chain_matches_dumps(work / "chain", ref, f"{mode} resumed chain")
    assert not (work / "chain" / "writer.lock").exists()
    assert_chain_matches_dumps(work / "chain-ref", ref, f"{mode} uninterrupted chain")


@pytest.mark.procs
def test_lowdiff_resume_from_delta_step_restarts_residuals(trainer: Trainer) -> None:
    """``exact=False`` from a delta step: training diverges, the chain stays exact for it.

    Only anchors hold the top-k residuals. From a delta step they restart at zero, so the
    first resumed step already applies a different compressed gradient than the
    uninterrupted run did. That is the documented price of a non-anchor resume; the chain
    must still be valid and materialize what the resumed run really did.
    """
    trainer.wait()
    work = trainer.work / "lowdiff"
    result = json.loads((work / "result.json").read_text())
    resumed = result["inexact_resumed"]
    latest = result["after_crash"]["latest"]
    assert resumed not in result["after_crash"]["anchors"] and resumed in (latest, latest - 1), result

    ref = load_dumps(work / "ref")
    run = load_dumps(work / "inexact")
    assert sorted(run) == list(range(resumed, ct.STEPS + 1))
    assert_dump_equal(run[resumed], ref[resumed], "state restored by resume(exact=False)")
    first = run[resumed + 1]
    # The loss of the first resumed step comes from the restored (exact) state...
    assert torch.equal(bits(first["loss"]), bits(ref[resumed + 1]["loss"]))
    # ... but the update it applies does not: the residuals were zero.
    with pytest.raises(AssertionError, match="differs in bits"):
        assert_state_bits_equal(first["state"], ref[resumed + 1]["state"])
    assert not torch.equal(bits(run[ct.STEPS]["loss"]), bits(ref[ct.STEPS]["loss"]))

    expected = {s: ref[s] for s in range(resumed + 1)} | run
    assert_chain_matches_dumps(work / "chain-inexact", expected, "lowdiff chain resumed from a delta step")


@pytest.mark.procs
@pytest.mark.parametrize("how", ["normal", "exception"])
def test_exit_without_close_still_commits(trainer: Trainer, how: str) -> None:
    """A process that never calls close() commits its last (partial) batch at exit."""
    exits = trainer.wait()["atexit"]
    assert exits[how] == {"signal": None, "code": 0 if how == "normal" else 1}, trainer.output()
    work = trainer.work / "atexit"
    durable_before_exit = int((work / f"{how}.durable").read_text())
    assert durable_before_exit < ct.ATEXIT_STEPS
    dumps = load_dumps(work / how)
    assert sorted(dumps) == list(range(ct.ATEXIT_STEPS + 1))
    chain = work / f"chain-{how}"
    assert ChainReader(chain).latest_step == ct.ATEXIT_STEPS, trainer.output()
    assert_chain_matches_dumps(chain, dumps, f"exit ({how}) without close")
    assert not (chain / "writer.lock").exists()


def test_default_mode_never_changes_training(tmp_path: Path) -> None:
    """20 steps with ``Checkpointer`` and no mode: bitwise the run without it (the default is lossless)."""
    def run(path: Path | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ck = ldformat.Checkpointer(path, model, optimizer) if path is not None else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            x = torch.randn(32, 8, generator=gen)
            y = torch.randn(32, 4, generator=gen)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        if ck is not None:
            assert ck.mode == "xor"
            ck.close()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain = run(None)
    checkpointed = run(tmp_path / "chain")
    for name, t in plain.items():
        assert torch.equal(bits_view(t), bits_view(checkpointed[name])), name
    assert ldformat.ChainReader(tmp_path / "chain").latest_step == 20


def test_step_with_later_steps_needs_truncate(tmp_path: Path) -> None:
    """``Checkpointer(step=)`` on a chain with later steps refuses before writing anything."""
    path = tmp_path / "chain"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ldformat.Checkpointer(path, model, optimizer, batch_steps=1)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
    ck.close()
    ldformat.resume(path, model, optimizer, step=2)
    before = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    with pytest.raises(ldformat.UsageError, match="truncate=True"):
        ldformat.Checkpointer(path, model, optimizer, step=2)
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) == before
    assert ldformat.ChainReader(path).steps == [0, 1, 2, 3, 4]
    ldformat.Checkpointer(path, model, optimizer, step=2, truncate=True).close()
    assert ldformat.ChainReader(path).steps == [0, 1, 2]


def test_wrapped_objects_are_unwrapped(tmp_path: Path) -> None:
    """``torch.compile``-style and accelerate-style wrappers: stored names carry no prefix and
    the hooks fire on the optimizer that steps."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401  (the type unwrap_model knows)

    class AcceleratedOptimizer(torch.optim.Optimizer):  # the shape of accelerate's
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        @property  # type: ignore[override]
        def param_groups(self) -> Any:
            return self.optimizer.param_groups

        @property  # type: ignore[override]
        def state(self) -> Any:
            return self.optimizer.state

        def step(self, closure: Any = None) -> Any:  # bypasses the wrapper's own hooks
            return self.optimizer.step(closure)

    inner = torch.nn.Linear(4, 2)
    compiled = torch.nn.Module()
    compiled._orig_mod = inner  # what torch.compile's OptimizedModule holds
    optimizer = AcceleratedOptimizer(torch.optim.Adam(inner.parameters(), lr=0.1))
    ck = ldformat.Checkpointer(tmp_path / "chain", compiled, optimizer, batch_steps=1)
    for _ in range(3):
        optimizer.optimizer.zero_grad()
        inner(torch.ones(3, 4)).sum().backward()
        optimizer.step()
    ck.close()
    state = ldformat.ChainReader(tmp_path / "chain").materialize()
    assert state["step"] == 3
    assert sorted(state["model"]) == ["bias", "weight"]
    assert torch.equal(bits_view(state["model"]["weight"]), bits_view(inner.weight.detach()))


def test_no_residual_warning_when_resuming_at_step_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The residuals of step 0 are zero: re-opening a lowdiff chain there is exact, without a warning."""
    import logging

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ldformat.Checkpointer(tmp_path / "chain", model, optimizer, mode="lowdiff").close()
    caplog.set_level(logging.WARNING, logger="ldformat.capture")
    step = ldformat.resume(tmp_path / "chain", model, optimizer, exact=True)
    ldformat.Checkpointer(tmp_path / "chain", model, optimizer, mode="lowdiff", step=step).close()
    assert step == 0
    assert not [r for r in caplog.records if "residuals" in r.getMessage()]


@pytest.mark.parametrize("mode", ["lowdiff+", "lowdiff", "xor"])
def test_step_with_a_closure_is_captured_after_it(tmp_path: Path, mode: str) -> None:
    """``optimizer.step(closure)`` (Lightning's way): forward and backward run inside the step,
    so gradients are captured after the closure; every step materializes exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = ldformat.Checkpointer(tmp_path / "chain", model, optimizer, mode=mode, anchor_every=4, batch_steps=2)
    refs = {}
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 8):
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if step % 2:
            optimizer.step(closure)
        else:
            optimizer.step(closure=closure)
        refs[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ck.close()
    reader = ChainReader(tmp_path / "chain")
    for step, ref in refs.items():
        state = reader.materialize(step)
        for name, t in ref.items():
            assert torch.equal(bits_view(t), bits_view(state["model"][name])), (mode, step, name)


def test_torch_compile_model_has_no_prefix(tmp_path: Path) -> None:
    """A real ``torch.compile`` module (eager backend): names without ``_orig_mod.``, and
    ``resume`` loads into the compiled module."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torch.compile(inner, backend="eager")
    optimizer = torch.optim.Adam(compiled.parameters(), lr=0.01)
    ck = ldformat.Checkpointer(tmp_path / "chain", compiled, optimizer, batch_steps=1)
    for _ in range(3):
        optimizer.zero_grad()
        compiled(torch.ones(3, 4)).sum().backward()
        optimizer.step()
    ck.close()
    state = ChainReader(tmp_path / "chain").materialize()
    assert sorted(state["model"]) == sorted(inner.state_dict())
    fresh = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), backend="eager")
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    assert ldformat.resume(tmp_path / "chain", fresh, fresh_opt) == 3
    for name, t in inner.state_dict().items():
        assert torch.equal(bits_view(t), bits_view(fresh.state_dict()[f"_orig_mod.{name}"])), name


def test_per_rank_statistics_note_only_when_buffers_are_not_broadcast() -> None:
    from ldformat.capture.runtime import per_rank_statistics_note

    assert per_rank_statistics_note(None, ["norm"]) is None  # not DDP
    assert per_rank_statistics_note(True, ["norm"]) is None  # rank 0's reach every rank each forward
    assert per_rank_statistics_note(False, []) is None  # no running statistics
    note = per_rank_statistics_note(False, ["norm", "block.bn"])
    assert note is not None and "norm, block.bn" in note and "SyncBatchNorm" in note
