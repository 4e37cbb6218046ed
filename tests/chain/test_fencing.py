"""Fencing that holds under pauses (spec §7.5, §7.7, §15.2-§15.6, §17).

A writer paused at any store call (SIGSTOP, a GC pause, swapping, a VM migration), then
superseded by another holder, must never delete what a newer holder wrote, never report a
step durable that is not in the chain, and must stop with ``LockLostError``; every step any
call reported durable stays materializable bit for bit, ``validate`` passes, and ``sync``
reports no divergence. The pause harness is tests/support/pausing.py; the exhaustive sweep over every
call is tests/chain/test_fencing_slow.py (``-m slow``).

Here:

- a sweep of named pause points (open, commit, lease renewal, writer snapshots, close,
  compaction, truncation) against every interleaving of the others, on memory, local
  directories and s3 (moto on loopback);
- D1, D2 and D3 of the issue, as it describes them;
- a live writer in another PID namespace keeps its lock (``unshare``; skipped elsewhere);
- a training step three leases long does not let a waiting taker of another host in;
- a failed chain creation deletes nothing of a process that took the creation over;
- a record create whose every answer was lost says the record may or may not exist, and
  ``ChainWriter.create`` reports a failed first LIST as ``WriterIOError``.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from paths import SUPPORT
from pausing import (
    JOIN_LIMIT_S,
    NAMED_POINTS,
    PAUSE_LIMIT_S,
    Env,
    Ledger,
    LocalEnv,
    MemoryEnv,
    PausePoint,
    PausingStore,
    S3Env,
    Session,
    Shape,
    StaleListingStore,
    check_ledger,
    digest,
    live_bits,
    newest_lock,
    run_trial,
    state_bits,
    tiny_training,
)

import ldformat
from ldformat import ChainLockedError, ChainReader, ChainWriter, LdformatError, LockLostError, WriterIOError
from ldformat.stores import WRITES, FaultyStore, LocalStore, MemoryStore

if TYPE_CHECKING:  # s3server is loaded as a plugin (below), not imported before it
    from s3server import FaultProxy

pytest_plugins = ["s3server"]  # the fixtures moto, s3_env, s3_url and fault_proxy

PAUSING = SUPPORT / "pausing.py"
CHILD_LIMIT_S = 90.0  # no child process is waited for longer


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Torch on one thread (tests/conftest.py): the trials' tensors are tiny."""


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing here crashes the machine: fsync would only slow the local trials down.
    monkeypatch.setattr(LocalStore, "_fsync_fd", lambda self, fd: None)


def make_env(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Env:
    if kind == "memory":
        return MemoryEnv()
    if kind == "local":
        return LocalEnv(tmp_path / "chain")
    return S3Env(request.getfixturevalue("s3_url"))


# -- the sweep of named points ---------------------------------------------------------------------
#: (store, phase, named point, interleaving): D1's and D2's points against every interleaving,
#: every other named point against one; the whole cross product is tests/chain/test_fencing_slow.py.
MAIN_SWEEP = [
    *[("memory", "open", "gc-list", il) for il in ("commit", "renew", "compact", "snapshot")],
    ("memory", "open", "take-lock", "commit"),
    ("memory", "open", "fold", "compact"),
    ("memory", "open", "gc-delete", "snapshot"),
    ("memory", "open-takeover", "fence", "commit"),
    ("memory", "open-takeover", "gc-list", "renew"),
    *[("memory", "commit", "record", il) for il in ("commit", "renew", "compact", "snapshot")],
    ("memory", "commit", "sync", "compact"),
    ("memory", "renew", "renew", "commit"),
    ("memory", "renew", "renew-delete", "snapshot"),
    ("memory", "snapshot", "snapshot-record", "compact"),
    ("memory", "snapshot", "superseded-delete", "renew"),
    ("memory", "close", "record", "snapshot"),
    ("memory", "close", "release", "commit"),
    ("memory", "compact", "anchor", "commit"),
    ("memory", "compact", "snapshot-record", "snapshot"),
    ("memory", "compact", "gc-list", "compact"),
    ("memory", "compact", "gc-list", "renew"),
    ("memory", "compact-keep", "gc-delete", "commit"),
    ("memory", "truncate", "snapshot-record", "compact"),
    ("memory", "truncate", "gc-delete", "renew"),
    ("local", "open", "gc-list", "commit"),
    ("local", "commit", "record", "compact"),
    ("local", "snapshot", "superseded-delete", "snapshot"),
    ("local", "compact", "gc-list", "renew"),
    ("local", "truncate", "snapshot-record", "commit"),
    ("s3", "snapshot", "snapshot-record", "snapshot"),
    ("s3", "compact", "gc-list", "commit"),
]
SLOW = pytest.mark.slow  # s3 trials cost seconds each: D1 and D2 run on s3 in the main suite


@pytest.mark.parametrize("kind, phase, point, interleaving",
                         [pytest.param(*x, id="-".join(x), marks=SLOW if x[0] == "s3" else ()) for x in MAIN_SWEEP])
def test_a_writer_paused_at_a_named_point_is_fenced(kind: str, phase: str, point: str, interleaving: str,
                                                    tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A pauses at the point; B (and C) take over and act; A goes on. Then: 0 lost, 0 false
    durable, A stopped with LockLostError and deleted nothing newer, validate and sync pass."""
    result = run_trial(make_env(kind, tmp_path, request), phase, interleaving, NAMED_POINTS[phase][point])
    assert result.reached, result.explain()
    assert not result.violations, result.explain()


# -- D1, D2, D3 ------------------------------------------------------------------------------------
STORES = ["memory", "local", "s3"]


@pytest.mark.parametrize("kind, variant", [
    pytest.param(kind, variant, id=f"{kind}-{variant}", marks=SLOW if kind == "s3" and variant != "break_lock" else ())
    for kind in STORES for variant in ("break_lock", "lease-expiry", "compaction-in-between")])
def test_d1_a_superseded_open_never_deletes_a_newer_holders_objects(kind: str, variant: str, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    """D1: A pauses in ``ChainWriter.open`` after folding the log (steps 0-6) and before listing
    garbage; B takes over (``break_lock``, or waiting out A's lease) and commits steps 7-12; C
    opens and commits 13-14 (its garbage collection removes B's lock generations; with
    ``compaction-in-between`` a compaction follows). A resumes: today its garbage collection
    deletes B's and C's anchors and deltas (only ``lock/<own + 1>`` was checked, and it is gone)."""
    shape = Shape(w0_steps=6, b_steps=6, c_steps=2, takeover="lease" if variant == "lease-expiry" else "break")
    interleaving = "commit-compact" if variant == "compaction-in-between" else "commit"
    result = run_trial(make_env(kind, tmp_path, request), "open", interleaving, NAMED_POINTS["open"]["gc-list"],
                       shape)
    assert result.reached and result.superseded, result.explain()  # A held the lock: the trial tests fencing
    assert not result.violations, result.explain()
    assert result.a_error_type is not None and issubclass(result.a_error_type, LockLostError), result.explain()


@pytest.mark.parametrize("kind", STORES)
def test_d2_a_fenced_writer_never_commits_after_a_compaction_removed_its_fence(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """D2: A pauses right before creating ``log/4`` (after its lock check). B takes over, fences
    (record 4), commits steps 5-10 (records 5-7) and closes; ``compact(max_replay=1)`` writes
    a snapshot (record 8) and deletes records 4-7, the fence among them. A resumes: today it
    creates records 4-7 and reports steps 6, 8, 10 and 12 durable, none of which is in the
    chain, and the next sync of a replica reports a false ``ReplicaDivergedError``."""
    shape = Shape(w0_steps=4, b_steps=6, post_steps=6)
    result = run_trial(make_env(kind, tmp_path, request), "commit", "compact",
                       PausePoint("create_exclusive", "log/000000000004.json", label="before A creates log/4"), shape)
    assert result.reached and result.superseded, result.explain()
    assert result.a_steps_after == [], f"A reported steps {result.a_steps_after} durable after the takeover\n" + \
        result.explain()
    assert not result.violations, result.explain()
    assert result.a_error_type is not None and issubclass(result.a_error_type, LockLostError), result.explain()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_taker_paused_before_creating_its_generation_never_takes_a_live_holders_lock(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Found by the sweep (not in the issue): A lists lock/ (the newest generation, g, is
    released) and pauses before creating g + 1. B takes the lock (g + 1), renews its lease
    (g + 2) and deletes g + 1, its own superseded generation: the name is free again. A goes
    on, and today its create of g + 1 succeeds: A believes it holds the lock B holds, folds,
    commits, and B's next commit fails. A must get ChainLockedError; B keeps its lock."""
    result = run_trial(make_env(kind, tmp_path, request), "open", "renew", NAMED_POINTS["open"]["take-lock"])
    assert result.reached and not result.superseded, result.explain()
    assert not result.violations, result.explain()
    assert result.a_error_type is not None and issubclass(result.a_error_type, ChainLockedError), result.explain()


@pytest.mark.parametrize("replays", [1, None], ids=["first-list", "every-list"])
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_d3_a_stale_listing_of_the_log_deletes_nothing_committed(kind: str, replays: int | None, tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    """D3: a gateway answers LIST log/ with an answer from when the chain ended at step 6 (its
    first LIST, or every one) while a writer opens; steps 7-12 were committed meanwhile. The
    writer must not fold at step 6 and delete their objects (spec §7.7: nothing relies on
    listings being consistent). Whatever it does, steps 0-12 stay bit-exact."""
    env = make_env(kind, tmp_path, request)
    ledger = Ledger()
    w0 = Session("W0", ledger, env.handle(), env.path)
    w0.create()
    w0.train(6)
    w0.close()
    stale = StaleListingStore(env.handle(), "log", replays)
    assert len(stale.freeze()) == 4  # records 1-4: steps 0-6
    w1 = Session("W1", ledger, env.handle(), env.path)
    w1.open()
    w1.train(6)  # steps 7-12, records 5-7
    w1.close()
    a = Session("A", ledger, stale, env.path)
    outcome = "opened"
    try:
        a.open()
        a.train(2)
        a.commit()
        a.close()
    except LockLostError as e:  # a clean stop is fine: it found out it was behind
        outcome = f"LockLostError: {e}"
    finally:
        a.abort()
    stale.frozen = None
    later = Session("E", ledger, env.handle(), env.path)
    later.open()
    later.train(2)
    later.close()
    problems = check_ledger(ledger, env.path, env.handle())
    report = ldformat.validate(env.path, store=env.handle())
    assert not problems and report.ok, (f"A ({outcome}) after a stale LIST of log/:\n" + "\n".join(problems)
                                        + "\n" + "\n".join(str(p) for p in report.problems[:5]))


# -- PID namespaces --------------------------------------------------------------------------------
def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.isdir("/proc"):
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _free_host_pid(limit: int) -> int:
    """A pid no process of this PID namespace has (dead here), below ``limit``."""
    for pid in range(limit - 1, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    pytest.skip("no free pid in this namespace")


class Child:
    """A child process whose stdout JSON lines are read on a thread (so every read has a timeout)."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue
        self.lines.put({"exited": self.proc.wait()})

    def next(self, timeout: float = CHILD_LIMIT_S) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the child said nothing for {timeout:.0f} s") from None

    def say(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stop(self) -> str:
        self.say()
        try:
            _, err = self.proc.communicate(timeout=CHILD_LIMIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
        return err or ""


@pytest.fixture
def child_processes() -> Iterator[list[Child]]:
    children: list[Child] = []
    yield children
    for c in children:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait(timeout=10)


def _chain_with_steps(path: Path, steps: int) -> Ledger:
    ledger = Ledger()
    w0 = Session("W0", ledger, LocalStore(path), str(path))
    w0.create()
    w0.train(steps)
    w0.close()
    return ledger


def _namespaced_writer(path: Path, case: str) -> tuple[int, list[str]]:
    """The pid the writer gets in its namespace, and the command that starts it there."""
    python = [sys.executable, str(PAUSING), "writer", str(path), "0"]
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    if case == "1":
        return 1, [*unshare, *python]
    want = os.getpid() if case == "this-process" else _free_host_pid(32768)
    # The shell is pid 1 of the namespace; it makes the python it starts get pid `want`.
    script = f'echo {want - 1} > /proc/sys/kernel/ns_last_pid && "$@"; exit $?'
    return want, [*unshare, "sh", "-c", script, "sh", *python]


@pytest.mark.procs
def test_a_live_writer_in_another_pid_namespace_keeps_its_lock(tmp_path: Path,
                                                               child_processes: list[Child]) -> None:
    """A writer in another PID namespace on the same host name (a container) records a pid that
    means nothing here: pid 1 (alive here: another process), a pid dead here, or this very
    process's pid. A writer here must not take its lock without ``break_lock``
    (ChainLockedError), whatever that pid is here. The three cases run at once, each writer in
    its own namespace on its own chain."""
    if not _unshare_works():
        pytest.skip("needs root and `unshare --pid --fork --mount-proc`")
    cases: dict[str, tuple[Path, int, Child]] = {}
    for case in ("1", "dead-here", "this-process"):
        path = tmp_path / case
        path.mkdir()
        _chain_with_steps(path, 2)
        want, command = _namespaced_writer(path, case)
        child = Child(command)
        child_processes.append(child)
        cases[case] = (path, want, child)
    failures: list[str] = []
    ran: list[str] = []
    for case, (path, want, child) in cases.items():
        ready = child.next()
        if "ready" not in ready:
            failures.append(f"{case}: the namespaced writer did not start: {ready}")
            continue
        if ready["pid"] != want:
            continue  # this kernel would not give it that pid: nothing to test in this case
        held = newest_lock(LocalStore(path))  # spec §15.1: the newest generation is the lock's state
        assert held is not None and held.get("state") == "held" and held.get("pid") == want, held
        assert held.get("host") == socket.gethostname(), held
        ran.append(case)
        outside = Session("OUT", Ledger(), LocalStore(path), str(path))
        try:
            outside.open()  # no break_lock, no lease wait
            failures.append(f"pid {want} ({case}): a writer here took the lock of a live writer in another "
                            "PID namespace without break_lock")
        except ChainLockedError:
            pass
        finally:
            outside.abort()
    for _, _, child in cases.values():
        child.say()
    for case in ran:
        path, want, child = cases[case]
        done = child.next()
        if "done" not in done:
            failures.append(f"pid {want} ({case}): the namespaced writer lost its lock: {done}")
            continue
        assert child.proc.wait(timeout=CHILD_LIMIT_S) == 0
        # Once it closed, the lock is free, and its steps are in the chain as it trained them.
        after = Session("AFTER", Ledger(), LocalStore(path), str(path))
        after.open()
        after.close()
        reader = ChainReader(str(path), store=LocalStore(path))
        for step, want_digest in done["states"].items():
            got = reader.materialize(int(step))
            assert digest(state_bits(got["model"], got["optimizer"])) == want_digest, f"{case}: step {step}"
    if not ran:
        pytest.skip("could not give a namespaced writer a colliding pid")
    assert not failures, "\n".join(failures)


# -- leases ----------------------------------------------------------------------------------------
@pytest.mark.procs
def test_a_step_longer_than_the_lease_does_not_let_a_waiting_taker_in(tmp_path: Path,
                                                                      child_processes: list[Child]) -> None:
    """A writer with a 1 s lease trains one step of 3 s (no commit meanwhile) while a writer of
    another host (a subprocess whose ``socket.gethostname`` says so) waits with ``lock_wait``.
    The waiter must not get the lock while the writer runs (the lease is renewed without a
    commit, spec §15.6); it gets it once the writer closed, and the writer's commit after the
    long step succeeds."""
    lease = 1.0
    path = tmp_path / "chain"
    path.mkdir()
    ledger = _chain_with_steps(path, 2)
    w = Session("W", ledger, LocalStore(path), str(path))
    w.open(lease_s=lease)
    w.train(2)
    waiter = Child([sys.executable, str(PAUSING), "waiter", str(path), "another-host.invalid", "60"])
    child_processes.append(waiter)
    assert "waiting" in waiter.next()
    time.sleep(3 * lease)  # one training step three leases long
    try:
        w.train(2)  # its commit: the lock must still be this writer's
    finally:
        closed = time.time()
        w.close()
    got = waiter.next()
    assert "acquired" in got, f"the waiter did not get the lock after the writer closed: {got}"
    assert got["acquired"] >= closed - 0.05, (
        f"the waiter took the lock {closed - got['acquired']:.2f} s before the writer released it")
    assert not check_ledger(ledger, str(path), LocalStore(path))


# -- a failed creation -----------------------------------------------------------------------------
def _looks_dead(path: str, data: bytes) -> bytes:
    """A's lock generations name a start time that is not its own: its liveness is misjudged
    (as for a creator in another PID namespace), so a second creator takes its lock over."""
    if not path.startswith("lock/"):
        return data
    d = json.loads(data)
    if d.get("state") == "held":
        d["start_time"] = "0"
    return json.dumps(d).encode()


def _run(target: Any, errors: list[BaseException]) -> threading.Thread:
    def body() -> None:
        try:
            target()
        except BaseException as e:  # judged by the test
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def _wait(pause: Any, thread: threading.Thread, who: str) -> None:
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not pause.reached.wait(0.01):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"{who} never reached its pause point")


@pytest.mark.parametrize("failure", ["lock-lost", "io-error"])
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_failed_creation_deletes_nothing_of_a_creator_that_took_over(kind: str, failure: str, tmp_path: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    """A creates a chain and pauses before writing its anchor; B, creating the same chain, finds
    A's lock stale (misjudged), takes it over and pauses before creating the root. A goes on and
    fails (its lock was taken over, or its anchor write fails). Its cleanup must not delete B's
    lock generation, anchor or record 1: B's creation then completes, and its chain is whole."""
    env = make_env(kind, tmp_path, request)
    inner = env.handle()
    a_inner: Any = env.handle()
    if failure == "io-error":
        a_inner = FaultyStore(a_inner)
        a_inner.fail(WRITES, errno.EIO, path="anchors/*")
    a_store = PausingStore(a_inner, on_create=_looks_dead)
    a_pause = a_store.arm(PausePoint(("write", "write_parts"), "anchors/*", label="before A writes its anchor"))
    if isinstance(a_inner, FaultyStore):
        a_inner.disarm()  # the fault fires only once A goes on
    ledger = Ledger()
    a = Session("A", ledger, a_store, env.path)
    a_errors: list[BaseException] = []
    a_thread = _run(a.create, a_errors)
    _wait(a_pause, a_thread, "A")
    b_store = PausingStore(env.handle())
    b_pause = b_store.arm(PausePoint("create_exclusive", "ldformat.json", label="before B creates its root"))
    b = Session("B", ledger, b_store, env.path)
    b_errors: list[BaseException] = []
    b_thread = _run(b.create, b_errors)
    try:
        _wait(b_pause, b_thread, "B")
        b_objects = [p for p in inner.list("") if p.startswith(("lock/", "anchors/", "log/"))]
        if isinstance(a_inner, FaultyStore):
            a_inner.arm()
    finally:
        a_pause.release()
    a_thread.join(JOIN_LIMIT_S)
    assert not a_thread.is_alive(), "A did not finish"
    try:
        assert a_errors and isinstance(a_errors[0], LdformatError), f"A's creation did not fail cleanly: {a_errors}"
        gone = [p for p in b_objects if not inner.exists(p)]
        assert not gone, f"A's failed creation ({type(a_errors[0]).__name__}) deleted B's {gone}"
    finally:
        b_pause.release()
        b_thread.join(JOIN_LIMIT_S)
    assert not b_errors, f"B's creation failed: {b_errors}"
    b.train(2)
    b.close()
    problems = check_ledger(ledger, env.path, env.handle())
    report = ldformat.validate(env.path, store=env.handle())
    assert not problems and report.ok, "\n".join(problems + [str(p) for p in report.problems[:5]])


# -- messages --------------------------------------------------------------------------------------
def _assert_unknown_outcome_message(e: WriterIOError, durable: int) -> None:
    text = str(e)
    assert "unchanged" not in text, f"says the chain is unchanged while the record may exist: {text}"
    assert f"nothing after step {durable} is durable" not in text, f"says nothing is durable: {text}"
    assert "may or may not" in text, f"does not say the record may or may not exist: {text}"


def test_a_record_create_whose_answer_was_lost_says_the_record_may_or_may_not_exist() -> None:
    """Every attempt at creating a record took effect but answered an error (the contract's
    unknown outcome): the writer must not say the chain is unchanged, since the record exists."""
    env = MemoryEnv()
    ledger = Ledger()
    w0 = Session("W0", ledger, env.handle(), env.path)
    w0.create()
    w0.train(2)
    w0.close()
    faulty = FaultyStore(env.handle())
    a = Session("A", ledger, faulty, env.path)
    a.open()
    durable = a.writer.durable_step if a.writer is not None else None
    assert durable == 2
    records = [p for p in env.handle().list("log") if p.endswith(".json")]
    faulty.fail("create_exclusive", errno.EIO, path="log/*", when="after")
    a.train(1)
    with pytest.raises(WriterIOError) as caught:
        a.train(1)
    a.abort()
    assert env.handle().exists(f"log/{len(records) + 1:012d}.json")  # the record was created
    _assert_unknown_outcome_message(caught.value, durable)
    # A later writer appends after it: the record was there all along.
    later = Session("E", ledger, env.handle(), env.path)
    later.open()
    assert later.next_step == 5
    later.train(2)
    later.close()
    assert not check_ledger(ledger, env.path, env.handle())


def test_every_lost_answer_to_a_record_create_on_s3_says_may_or_may_not_exist(fault_proxy: FaultProxy) -> None:
    """The same over HTTP: every PUT of a record reaches S3, and every answer is lost."""
    env = S3Env(f"s3://ldformat-test/fencing-{os.urandom(6).hex()}")
    ledger = Ledger()
    store = ldformat.stores.ObjectStore(env.path, storage_options={**S3Env.FAST_RETRY, "max_retries": 2,
                                                                   "retry_timeout": 5})
    w = Session("W", ledger, store, env.path)
    w.create()
    w.train(2)
    fault_proxy.set_plan(lambda method, target, n: "reset-after" if method == "PUT" and "/log/" in target
                         else "forward")
    w.train(1)
    started = time.monotonic()
    with pytest.raises(WriterIOError) as caught:
        w.train(1)
    fault_proxy.forward_all()
    w.abort()
    assert time.monotonic() - started < 60
    assert env.handle().exists("log/000000000003.json")
    _assert_unknown_outcome_message(caught.value, 2)


def test_create_reports_a_failed_first_list_as_writer_io_error() -> None:
    store = FaultyStore(MemoryStore())
    store.fail("list", errno.EIO, times=1)
    model, optimizer = tiny_training()
    with pytest.raises(WriterIOError):
        ChainWriter.create("chain", model, optimizer, kind="grad.dense", store=store)


def test_create_on_s3_reports_a_failed_first_list_as_writer_io_error(fault_proxy: FaultProxy) -> None:
    url = f"s3://ldformat-test/fencing-{os.urandom(6).hex()}"
    fault_proxy.set_plan(lambda method, target, n: "503" if method == "GET" and "list-type" in target
                         else "forward")
    model, optimizer = tiny_training()
    with pytest.raises(WriterIOError):
        ChainWriter.create(url, model, optimizer, kind="grad.dense",
                           storage_options={**S3Env.FAST_RETRY, "max_retries": 1, "retry_timeout": 2})
    fault_proxy.forward_all()


# -- the harness itself ----------------------------------------------------------------------------
def test_the_harness_pauses_at_the_chosen_call_and_holds_the_whole_process() -> None:
    """The pause lands before the n-th matching call, every other call of the paused store
    waits until the release, and the trace says what came after it."""
    store = PausingStore(MemoryStore())
    pause = store.arm(PausePoint("create_exclusive", "log/*", nth=2))
    done: list[str] = []

    def paused() -> None:
        for i in range(1, 4):
            store.create_exclusive(f"log/{i:012d}.json", b"{}")
            done.append(f"log/{i}")

    t = threading.Thread(target=paused, daemon=True)
    t.start()
    assert pause.reached.wait(10)
    assert done == ["log/1"] and store.inner.list("log") == ["log/000000000001.json"]
    other = threading.Thread(target=lambda: store.exists("lock/000000000001.json"), daemon=True)
    other.start()
    other.join(0.2)
    assert other.is_alive(), "another thread's call went through the paused store"
    pause.release()
    t.join(10)
    other.join(10)
    assert done == ["log/1", "log/2", "log/3"]
    assert [c.after_release for c in store.calls() if c.op == "create_exclusive"] == [False, True, True]


def test_the_ledger_catches_a_lost_and_a_falsely_durable_step() -> None:
    """The checks can fail: a step whose bits differ, and one the chain does not hold."""
    env = MemoryEnv()
    ledger = Ledger()
    w = Session("W", ledger, env.handle(), env.path)
    w.create()
    w.train(2)
    w.close()
    model, optimizer = tiny_training()
    ledger.takeover = True
    ledger.report("X", 2, live_bits(model, optimizer))  # another state at step 2
    ledger.report("X", 9, live_bits(model, optimizer))  # a step the chain does not hold
    problems = check_ledger(ledger, env.path, env.handle())
    assert len(problems) == 2 and "false durable" in problems[0] and "not in the chain" in problems[1], problems
