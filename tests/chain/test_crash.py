"""Crash consistency: ``kill -9`` of the writer at any point.

A writer process (tests/support/crash_writer.py, forked from a warm server so that a trial costs
its training and not a torch import) trains TinyNet with Adam and records every step. The
test kills it with SIGKILL at random points, or the writer kills itself inside a chosen
fsync of the commit protocol, then checks that:

- the chain validates;
- every step the writer reported durable is in the chain and materializes bit for bit as
  the same training re-run here without a writer; so do the steps committed after the last
  report (and, in two trials per kind, every step of the chain);
- the writer lock names the dead writer, and ``ChainWriter.open`` takes it over, removes
  the uncommitted leftovers (objects under ``anchors/`` and ``deltas/`` no record
  references, ``log/.tmp-*``) and appends steps that again materialize exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import crash_writer as cw
import pytest
from models import assert_state_bits_equal, snapshot
from paths import SUPPORT

import ldformat
from ldformat import ChainLockedError, ChainReader, ChainWriter
from ldformat.chain.lock import current_lock
from ldformat.stores import LocalStore

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc"),
                       reason="the fork server and the lock's liveness check need Linux"),
    pytest.mark.procs,
]

TRIAL_TIMEOUT_S = 60.0
EXTRA_STEPS = 4  # steps appended by the writer that takes over
RANDOM_TRIALS_PER_KIND = 7

# -- the fork server ---------------------------------------------------------------------
class ForkServer:
    """Talks to ``crash_writer.py serve``: start a writer job, learn how it died."""

    def __init__(self, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT / "crash_writer.py"), "serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0,
            cwd=str(SUPPORT), env=cw.child_env(),
        )
        self._buf = b""
        line = self._readline(120.0)
        assert line == "ready", f"crash_writer server did not start: {line!r}\n{self.stderr_tail()}"

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _readline(self, timeout: float) -> str | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"crash_writer server died\n{self.stderr_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def start(self, job: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        line = self._readline(30.0)
        assert line is not None, f"no pid from the server\n{self.stderr_tail()}"
        return int(json.loads(line)["pid"])

    def poll_exit(self, timeout: float) -> dict[str, Any] | None:
        line = self._readline(timeout)
        return None if line is None else json.loads(line)

    def kill(self, pid: int) -> dict[str, Any]:
        """SIGKILL a writer that is known to be alive (it never exits by itself) and reap it."""
        os.kill(pid, signal.SIGKILL)
        status = self.poll_exit(30.0)
        assert status is not None and status["exited"] == pid, f"{status}\n{self.stderr_tail()}"
        return status

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = ForkServer(tmp_path_factory.mktemp("crash_server") / "stderr.txt")
    yield srv
    srv.close()


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    # The writers train on one thread (see crash_writer.training_threads); so does this
    # process while it checks them: switching torch between 1 and 2 threads here made each
    # TinyNet step ~100x slower (OpenMP pool churn on 2 cores).
    with cw.training_threads():
        yield


_REFS: dict[str, dict[int, dict[str, Any]]] = {}


def refs_for(kind: str) -> dict[int, dict[str, Any]]:
    if kind not in _REFS:
        _REFS[kind] = cw.reference_states(kind, cw.STEPS)
    return _REFS[kind]


# -- helpers -----------------------------------------------------------------------------
class Events:
    def __init__(self, path: Path) -> None:
        self.recorded = 0
        self.durable: list[int] = []
        self.done = self.error = False
        try:
            text = path.read_text()
        except FileNotFoundError:
            return
        for line in text.splitlines():
            parts = line.split()
            if parts == ["done"]:
                self.done = True
            elif parts == ["error"]:
                self.error = True
            elif len(parts) == 2 and parts[0] in ("R", "D") and parts[1].isdigit():
                if parts[0] == "R":
                    self.recorded = int(parts[1])
                else:
                    self.durable.append(int(parts[1]))


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def tree_digest(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in files_under(root)}


def leftovers(root: Path, reader: ChainReader) -> list[str]:
    """Objects no commit record references, and temporary commit records."""
    referenced = {a.object.path for a in reader.state.anchors.values()}
    for entry in reader.state.delta_entries():
        referenced.update(f"{entry.path}/{o.path}" for o in entry.objects)
    out = [p for p in files_under(root) if p.split("/")[0] in ("anchors", "deltas") and p not in referenced]
    out += [p for p in files_under(root) if p.startswith("log/") and p.split("/")[-1].startswith(".tmp-")]
    return out


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_writer(server: ForkServer, tmp_path: Path, kind: str, *, kill_at: tuple[str, int] | None = None,
               rng: random.Random | None = None, steps: int = cw.STEPS) -> tuple[Path, int, Events]:
    """Run one writer and SIGKILL it; returns (chain, dead pid, what it reported)."""
    path, events_path = tmp_path / "chain", tmp_path / "events.txt"
    job = {"kind": kind, "path": str(path), "events": str(events_path), "steps": steps, "kill_at": kill_at}
    pid = server.start(job)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    status = None
    if kill_at is None:
        assert rng is not None
        target, delay = rng.randint(1, steps), rng.uniform(0.0, 0.02)
        while True:
            ev = Events(events_path)
            if ev.recorded >= target or ev.done or ev.error:
                break
            assert time.monotonic() < deadline, f"writer made no progress\n{server.stderr_tail()}"
            time.sleep(0.002)
        time.sleep(delay)
        status = server.kill(pid)
    else:
        # The writer kills itself inside the chosen fsync; if it finishes first, kill it.
        while status is None:
            status = server.poll_exit(0.01)
            if status is None and (Events(events_path).done or Events(events_path).error):
                status = server.kill(pid)
            assert time.monotonic() < deadline, f"writer neither died nor finished\n{server.stderr_tail()}"
    ev = Events(events_path)
    assert not ev.error, f"the writer failed before it was killed:\n{server.stderr_tail()}"
    assert status["exited"] == pid and status["signal"] == signal.SIGKILL, status
    assert ev.durable and ev.durable[0] == 0, "the writer reported no durable step after create"
    return path, pid, ev


def check_and_take_over(path: Path, kind: str, dead_pid: int, reported: list[int], *,
                        every_step: bool = False) -> dict[str, Any]:
    """All the post-crash checks; returns facts the caller may assert on."""
    refs = refs_for(kind)
    lock = current_lock(LocalStore(path))
    assert lock is not None and lock.pid == dead_pid and pid_is_gone(dead_pid), lock

    # The chain validates (and validating changes nothing).
    before = tree_digest(path)
    report = ldformat.validate(path)
    assert report.ok, [str(p) for p in report.problems]
    assert tree_digest(path) == before, "validate changed the chain"

    # Nothing reported durable is lost, and it is exact; so is what was committed after the
    # last report (a kill between the commit and its report). With ``every_step`` (a few
    # trials: it costs ~0.5 s each) the steps in between are materialized too.
    reader = ChainReader(path)
    latest = reader.latest_step
    assert latest is not None
    assert reader.steps == list(range(latest + 1)), reader.steps
    assert set(reported) <= set(reader.steps), (reported, reader.steps)
    assert max(reported) <= latest <= cw.STEPS
    check = reader.steps if every_step else sorted(set(reported) | set(range(max(reported) + 1, latest + 1)))
    for s in check:
        assert_state_bits_equal(reader.materialize(s), refs[s], f"{kind} step {s} after the crash")
    assert tree_digest(path) == before, "reading changed the chain"
    found = leftovers(path, reader)

    # A new writer takes over the dead writer's lock and removes the leftovers.
    model, optimizer, topk = cw.make_training(kind)
    assert reader.load_into(model, optimizer, compressor=topk)["step"] == latest
    writer = ChainWriter.open(path, model, optimizer, compressor=topk,
                              batch_steps=cw.BATCH_STEPS, anchor_every=cw.ANCHOR_EVERY)
    lock = current_lock(LocalStore(path))
    assert lock is not None and lock.pid == os.getpid()
    assert writer.durable_step == latest
    after_open = ChainReader(path)
    assert after_open.steps == reader.steps
    assert leftovers(path, after_open) == [], "leftovers survived the take-over"
    for rel in found:
        assert not (path / rel).exists(), rel
    assert not [p for p in files_under(path) if ".tmp-" in p]

    # ... and appends steps that materialize exactly.
    live: dict[int, dict[str, Any]] = {}
    for s in range(latest + 1, latest + 1 + EXTRA_STEPS):
        cw.train(model, optimizer, topk, s)
        writer.record_step(s)
        live[s] = snapshot(model, optimizer)
    assert writer.close() == latest + EXTRA_STEPS
    assert current_lock(LocalStore(path)) is None
    report = ldformat.validate(path)
    assert report.ok, [str(p) for p in report.problems]
    final = ChainReader(path)
    assert final.steps == list(range(latest + EXTRA_STEPS + 1))
    for s, want in live.items():
        assert_state_bits_equal(final.materialize(s), want, f"{kind} step {s} appended after the crash")
    for s in sorted({0, max(reported), latest}):
        assert_state_bits_equal(final.materialize(s), refs[s], f"{kind} step {s} after the take-over")
    return {"latest": latest, "leftovers": found}


# -- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("trial", range(RANDOM_TRIALS_PER_KIND))
@pytest.mark.parametrize("kind", cw.KINDS)
def test_sigkill_at_a_random_point(server: ForkServer, tmp_path: Path, kind: str, trial: int) -> None:
    rng = random.Random(f"ldformat-crash-{kind}-{trial}")
    path, pid, ev = run_writer(server, tmp_path, kind, rng=rng)
    facts = check_and_take_over(path, kind, pid, ev.durable, every_step=trial < 2)
    # The writer reports after commit returns: a kill may land in between, never the other way.
    assert facts["latest"] >= max(ev.durable)


@pytest.mark.parametrize(
    "kill_at",
    [("sync", 1), ("sync", 37), ("tmp", 4), ("link", 6)],
    ids=["first-data-fsync", "data-fsync-37", "record-tmp-fsync", "log-dir-fsync-after-link"],
)
@pytest.mark.parametrize("kind", cw.KINDS)
def test_sigkill_inside_the_commit_protocol(server: ForkServer, tmp_path: Path, kind: str,
                                            kill_at: tuple[str, int]) -> None:
    path, pid, ev = run_writer(server, tmp_path, kind, kill_at=kill_at)
    assert not ev.done, "the writer finished before reaching the kill point"
    facts = check_and_take_over(path, kind, pid, ev.durable)
    phase = kill_at[0]
    if phase == "sync":
        # Data objects were written, no record references them: garbage for the next writer.
        assert facts["leftovers"], "expected uncommitted data objects"
        assert facts["latest"] == max(ev.durable)
    elif phase == "tmp":
        assert any(p.startswith("log/.tmp-") for p in facts["leftovers"]), facts["leftovers"]
        assert facts["latest"] == max(ev.durable)
    else:
        # The record was linked into place: committed, though commit() never returned.
        assert facts["latest"] > max(ev.durable)


def test_live_writer_lock_is_refused_by_another_process(server: ForkServer, tmp_path: Path) -> None:
    kind = "grad.dense"
    path, events_path = tmp_path / "chain", tmp_path / "events.txt"
    pid = server.start({"kind": kind, "path": str(path), "events": str(events_path), "steps": 5, "kill_at": None})
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while not (Events(events_path).done or Events(events_path).error):
        assert server.poll_exit(0.005) is None, f"writer died\n{server.stderr_tail()}"
        assert time.monotonic() < deadline
    assert not Events(events_path).error, server.stderr_tail()
    try:
        # Readers are welcome while the writer lives.
        reader = ChainReader(path)
        assert reader.latest_step == 3  # batch of 3 committed; steps 4-5 are still pending
        assert ldformat.validate(path).ok
        model, optimizer, _ = cw.make_training(kind)
        reader.load_into(model, optimizer)
        lock_before = sorted((path / "lock").iterdir())
        held = current_lock(LocalStore(path))
        assert held is not None and held.pid == pid
        with pytest.raises(ChainLockedError, match=rf"pid {pid}\b"):
            ChainWriter.open(path, model, optimizer, batch_steps=cw.BATCH_STEPS)
        assert sorted((path / "lock").iterdir()) == lock_before, "a refused open touched the lock"
    finally:
        status = server.kill(pid)
    assert status["signal"] == signal.SIGKILL
    check_and_take_over(path, kind, pid, Events(events_path).durable)
