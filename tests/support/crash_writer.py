"""Helper process for the crash and fault tests (tests/chain/test_crash.py, tests/chain/test_faults.py).

Run with ``sys.executable``. Two modes:

``serve``
    A fork server: imports torch and ldformat once, prints ``ready``, then reads one JSON
    job per line on stdin. For each job it forks a writer process, prints
    ``{"pid": ...}``, waits for that process to die and prints
    ``{"exited": pid, "signal": ..., "code": ...}``. Forking from a warm process keeps a
    trial at the cost of its training instead of a torch import (~4 s here).

    The writer trains TinyNet with Adam, records every step into a chain and appends to the
    job's ``events`` file: ``R <step>`` after each ``record_step`` and ``D <step>`` (fsynced)
    whenever the durable step changes. It never exits by itself: when it has recorded every
    step (``done``) or hit an error (``error``) it waits to be killed, so the pid the test
    kills is never reused. With ``kill_at`` it SIGKILLs itself inside a chosen fsync of the
    commit protocol.

``efbig <chain> <limit>``
    Records a grad.dense chain, then lowers RLIMIT_FSIZE to ``limit`` bytes (SIGXFSZ
    ignored) so that the next commit fails with a real EFBIG; prints a JSON summary.

The training itself (:func:`make_training`, :func:`train`) is imported by the tests, which
re-run it in-process to get bit-exact reference states.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch

import ldformat
from ldformat.chain.lock import current_lock
from ldformat.stores import LocalStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyNet, snapshot, train_step  # noqa: E402

STEPS = 40
BATCH_STEPS = 3
ANCHOR_EVERY = 10
KINDS = ("grad.dense", "grad.topk", "state.xor")


def child_env() -> dict[str, str]:
    """Environment for running this script: it must import the ldformat under test."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ldformat.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def make_training(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, ldformat.TopK | None]:
    """The initial model, optimizer and compressor of every crash trial (deterministic)."""
    torch.manual_seed(1234)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    topk = ldformat.TopK(0.1) if kind == "grad.topk" else None
    return model, optimizer, topk


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, topk: ldformat.TopK | None, step: int) -> None:
    train_step(model, optimizer, step, compress=None if topk is None else topk.compress_)


@contextlib.contextmanager
def training_threads() -> Iterator[None]:
    """Train on one thread, as the forked writers do.

    The thread count changes the bits of training (the embedding backward reduces in
    per-thread chunks), so references must use the writers' count; and the fork server
    must not fork with an OpenMP pool alive (the child hangs), so that count is 1.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def reference_states(kind: str, steps: int = STEPS) -> dict[int, dict[str, Any]]:
    """Live state after every step 0..steps of an uninterrupted run without a writer."""
    with training_threads():
        model, optimizer, topk = make_training(kind)
        refs = {0: snapshot(model, optimizer)}
        for s in range(1, steps + 1):
            train(model, optimizer, topk, s)
            refs[s] = snapshot(model, optimizer)
    return refs


class CrashStore(LocalStore):
    """A LocalStore that SIGKILLs its own process at a chosen fsync of the commit protocol.

    ``kill_at`` is ``(phase, n)``: the n-th fsync (1-based, counted after :meth:`arm`) in
    ``phase``: ``"sync"`` (data objects and their directories), ``"tmp"`` (the temporary
    file of a commit record, before it is linked into place) or ``"link"`` (the log
    directory, after the record was linked but before ``commit`` returned).
    """

    def __init__(self, root: str, kill_at: tuple[str, int] | None) -> None:
        super().__init__(root)
        self.kill_at = kill_at
        self.armed = False
        self.phase: str | None = None
        self.counts = {"sync": 0, "tmp": 0, "link": 0}

    def arm(self) -> None:
        self.armed = True

    def sync(self, paths: Any) -> None:
        self.phase = "sync"
        try:
            super().sync(paths)
        finally:
            self.phase = None

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.phase = "tmp" if path.startswith("log/") else None
        try:
            super().create_exclusive(path, data)
        finally:
            self.phase = None

    def _fsync_fd(self, fd: int) -> None:
        phase = self.phase
        if self.armed and phase is not None and self.kill_at is not None:
            self.counts[phase] += 1
            if (phase, self.counts[phase]) == tuple(self.kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
        if phase == "tmp":
            self.phase = "link"  # the next fsync in create_exclusive is the directory's
        super()._fsync_fd(fd)


def _event(fd: int, line: str, durable: bool = False) -> None:
    os.write(fd, (line + "\n").encode())
    if durable:
        os.fsync(fd)


def run_job(job: dict[str, Any]) -> None:
    """The writer process of one trial; returns only if the job asks to stop."""
    events = os.open(job["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        kind = job["kind"]
        model, optimizer, topk = make_training(kind)
        os.makedirs(job["path"], exist_ok=True)
        kill_at = job.get("kill_at")
        store = CrashStore(job["path"], None if kill_at is None else (kill_at[0], int(kill_at[1])))
        writer = ldformat.ChainWriter.create(
            job["path"], model, optimizer, kind=kind, compressor=topk,
            batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY, store=store,
        )
        durable = writer.durable_step
        _event(events, f"D {durable}", durable=True)
        store.arm()
        for s in range(1, int(job.get("steps", STEPS)) + 1):
            train(model, optimizer, topk, s)
            writer.record_step(s)
            _event(events, f"R {s}")
            if writer.durable_step != durable:
                durable = writer.durable_step
                _event(events, f"D {durable}", durable=True)
        _event(events, "done")
    except BaseException:
        traceback.print_exc()
        _event(events, "error")
    while True:  # wait for SIGKILL: the test owns this pid until it kills it
        signal.pause()


def serve() -> None:
    # Pay torch's first-call initialisation (~1 s) once, before forking, not in every
    # writer. One thread: no OpenMP pool exists when we fork (the model is tiny anyway).
    # Nothing touches zarr here, so no zarr event-loop thread is inherited half-dead.
    torch.set_num_threads(1)  # for good: see training_threads
    for kind in KINDS:
        reference_states(kind, 2)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the forked writer
            code = 1
            try:
                os.dup2(2, 1)  # keep the protocol on stdout clean
                run_job(job)
                code = 0
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        print(json.dumps({"exited": pid, "signal": sig, "code": exit_code}), flush=True)


def efbig(path: str, limit: int) -> None:
    """Record steps 1-9, then fail the next commit with a real EFBIG (RLIMIT_FSIZE)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
    torch.set_num_threads(1)  # the references use one thread (see training_threads)
    model, optimizer, _ = make_training("grad.dense")
    writer = ldformat.ChainWriter.create(path, model, optimizer, kind="grad.dense",
                                         batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY)
    out: dict[str, Any] = {}
    for s in range(1, 10):
        train(model, optimizer, None, s)
        writer.record_step(s)
    out["durable_before"] = writer.durable_step
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    train(model, optimizer, None, 10)
    try:
        writer.record_step(10)  # step 10 is an anchor step: commits the delta and the anchor
        out["error"] = None
    except ldformat.WriterIOError as e:
        out["error"] = {"type": type(e).__name__, "errno": e.errno, "message": str(e)}
    train(model, optimizer, None, 11)
    try:
        writer.record_step(11)
        out["second"] = None
    except ldformat.LdformatError as e:
        out["second"] = {"type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}
    out["durable_after"] = writer.durable_step
    writer.close()
    out["lock_released"] = current_lock(LocalStore(path)) is None
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    elif sys.argv[1:2] == ["efbig"]:
        efbig(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: crash_writer.py serve | efbig CHAIN LIMIT")
