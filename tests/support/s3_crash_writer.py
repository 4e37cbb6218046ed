"""Helper process for the object store crash tests (tests/stores/test_object_store_crash.py).

obstore's runtime does not survive ``fork()``, so every writer is a fresh process started
with ``subprocess`` (fork + exec). To keep a trial at the cost of its training rather than a
torch import, the test keeps a few of these processes warm: each imports torch and
ldformat, trains two throw-away steps, prints ``ready`` and waits for one JSON job on
stdin. It never touches obstore before the job arrives.

The job trains TinyNet (or :class:`BigNet`, whose anchors are multipart uploads) with Adam,
records every step into a chain at ``job["url"]`` and appends to the job's ``events`` file:
``R <step>`` after each ``record_step``, ``D <step>`` (fsynced) whenever the durable step
changes, and ``U <path>`` / ``u <path>`` around each write of an object larger than the
multipart threshold; with ``commit_stall``, ``C <record>`` before it sleeps that long ahead of
creating each commit record. It never exits by itself: when it has recorded every step (``done``)
or hit an error (``error``) it waits to be killed, so the pid the test kills is never reused.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import ldformat
from ldformat.stores import ObjectStore, Part
from ldformat.stores.base import byte_view

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_writer as cw  # noqa: E402
from models import TinyNet, snapshot  # noqa: E402

#: Elements of BigNet's extra parameter: 18 MiB of float32, over the 16 MiB multipart threshold.
BIG_NUMEL = 18 * (1 << 20) // 4


class BigNet(TinyNet):
    """TinyNet plus a large parameter that never gets a gradient (Adam keeps no state for
    it), so every anchor holds one object that goes up as a multipart upload."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.big = nn.Parameter(torch.randn(BIG_NUMEL, generator=g))  # random: incompressible


def make_training(kind: str, big: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The initial model and optimizer of every trial (deterministic)."""
    torch.manual_seed(1234)
    model = BigNet() if big else TinyNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def reference_states(kind: str, big: bool, steps: int) -> dict[int, dict[str, Any]]:
    """Live state after every step 0..steps of an uninterrupted run without a writer."""
    with cw.training_threads():
        model, optimizer = make_training(kind, big)
        refs = {0: snapshot(model, optimizer)}
        for s in range(1, steps + 1):
            cw.train(model, optimizer, None, s)
            refs[s] = snapshot(model, optimizer)
    return refs


class ReportingStore(ObjectStore):
    """An ObjectStore that reports each large write (a multipart upload) to the events file."""

    def __init__(self, url: str, events: int, commit_stall: float = 0.0) -> None:
        super().__init__(url)
        self.events = events
        self.commit_stall = commit_stall

    def create_exclusive(self, path: str, data: bytes) -> None:
        if self.commit_stall and path.startswith("log/"):
            # The batch's objects are written, its record not yet: a kill now leaves garbage.
            _event(self.events, f"C {path}", durable=True)
            time.sleep(self.commit_stall)
        super().create_exclusive(path, data)

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        total = sum(byte_view(p).nbytes for p in parts)
        large = total > self.multipart_threshold
        if large:
            _event(self.events, f"U {path}", durable=True)
        super().write_parts(path, parts)
        if large:
            _event(self.events, f"u {path}", durable=True)

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.write_parts(path, [data])


def _event(fd: int, line: str, durable: bool = False) -> None:
    os.write(fd, (line + "\n").encode())
    if durable:
        os.fsync(fd)


def run_job(job: dict[str, Any]) -> None:
    events = os.open(job["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        kind, big = job["kind"], bool(job.get("big"))
        model, optimizer = make_training(kind, big)
        store = ReportingStore(job["url"], events, float(job.get("commit_stall", 0.0)))
        writer = ldformat.ChainWriter.create(
            job["url"], model, optimizer, kind=kind, batch_steps=job["batch_steps"],
            anchor_every=job["anchor_every"], store=store,
        )
        durable = writer.durable_step
        _event(events, f"D {durable}", durable=True)
        for s in range(1, int(job["steps"]) + 1):
            cw.train(model, optimizer, None, s)
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


def race_worker(conn: Any, barrier: Any) -> None:
    """One of the processes racing to take over a stale lock (a spawned process: it serves
    many trials, each on a fresh chain; its obstore client never crosses a fork)."""
    from ldformat.stores import FaultyStore

    torch.set_num_threads(1)
    while True:
        job = conn.recv()
        if job is None:
            return
        url, stall = job["url"], job["stall"]
        model, optimizer = make_training("grad.dense", False)
        reader = ldformat.ChainReader(url)
        reader.load_into(model, optimizer)
        store = FaultyStore(ObjectStore(url))
        if stall:  # widen every window of the take-over
            store.stall("read", stall, path="lock/*")
            store.stall("create_exclusive", stall)
        barrier.wait(timeout=60)
        try:
            writer = ldformat.ChainWriter.open(url, model, optimizer, batch_steps=8, store=store)
        except ldformat.ChainLockedError:
            conn.send({"result": "locked"})
            continue
        except Exception as e:  # reported to the test, which fails on it
            conn.send({"result": f"error {type(e).__name__}: {e}"})
            continue
        conn.send({"result": "holding"})
        conn.recv()  # hold the lock until every racer has tried: a slow starter must be locked out
        try:
            generation = writer._lock.generation if writer._lock is not None else -1
            step = (writer.durable_step or 0) + 1
            cw.train(model, optimizer, None, step)
            writer.record_step(step)
            durable = writer.close()
            conn.send({"result": "won", "durable": durable, "generation": generation})
        except Exception as e:
            conn.send({"result": f"error after winning {type(e).__name__}: {e}"})


def serve() -> None:
    torch.set_num_threads(1)  # the bits of training depend on it: see crash_writer.training_threads
    reference_states("grad.dense", False, 2)  # pay torch's first-call costs before the job
    print("ready", flush=True)
    line = sys.stdin.readline()
    if line.strip():
        run_job(json.loads(line))


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit(f"usage: {sys.argv[0]} serve")
