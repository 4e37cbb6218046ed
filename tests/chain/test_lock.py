"""The writer lock and the commit path (spec §7.4, §7.5, §15).

- Takeover of a stale lock is exclusive: of two or three processes racing for it, with a
  stall injected into the store to widen every window, exactly one proceeds and the others
  get ``ChainLockedError``; no step reported durable is ever lost.
- A writer whose lock was broken is fenced: its next commit fails, it deletes nothing.
- Garbage lock files are stale locks, never a crash.
- A chain without records is an error, and nothing deletes a chain's objects because of it.
- An unfinished creation is reclaimed by the next ``create``; a refused one leaves nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from clirun import invoke
from lock_race import check_race_outcome, run_race_trial
from models import TinyNet, batch

import ldformat
from ldformat import ChainLockedError, ChainReader, ChainWriter, CorruptChainError
from ldformat.chain.lock import current_lock
from ldformat.chain.records import lock_path
from ldformat.errors import LockLostError, UsageError
from ldformat.stores import LocalStore

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the lock's liveness check needs /proc")

RACE_TRIALS = 200


def make_training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = TinyNet()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def make_chain(path: Path, steps: int = 3) -> None:
    model, optimizer = make_training()
    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=2)
    for s in range(1, steps + 1):
        train(model, optimizer, s)
        writer.record_step(s)
    writer.close()


def plant_stale_lock(path: Path) -> int:
    """Make the newest lock generation a held lock of a writer that no longer runs."""
    store = LocalStore(path)
    gens = [int(p[5:17]) for p in store.list("lock") if p.endswith(".json") and "/." not in p]
    g = max(gens, default=0) + 1
    owner = {"generation": g, "state": "held", "host": socket.gethostname(), "pid": os.getpid(),
             "start_time": "0", "since": 0, "token": "0123456789abcdef"}  # wrong start time: not us
    store.create_exclusive(lock_path(g), json.dumps(owner).encode())
    return g


class StallingStore(LocalStore):
    """Sleeps before every lock read and exclusive create: every race window gets wide."""

    def __init__(self, root: Path, stall: float) -> None:
        super().__init__(root)
        self.stall = stall

    def read(self, path: str) -> bytes:
        if path.startswith("lock/"):
            time.sleep(self.stall)
        return super().read(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        time.sleep(self.stall)
        super().create_exclusive(path, data)


def _race_worker(conn: Connection, barrier: Any) -> None:
    torch.set_num_threads(1)
    while True:
        job = conn.recv()
        if job is None:
            return
        path, stall = Path(job["path"]), job["stall"]
        model, optimizer = make_training()
        barrier.wait(timeout=60)
        try:
            writer = ChainWriter.open(path, model, optimizer, batch_steps=8, store=StallingStore(path, stall))
        except ChainLockedError:
            conn.send({"result": "locked"})
            continue
        except Exception as e:  # reported to the test, which fails on it
            conn.send({"result": f"error {type(e).__name__}: {e}"})
            continue
        conn.send({"result": "holding"})
        conn.recv()  # hold the lock until every racer has tried: a slow starter must be locked out
        try:
            step = (writer.durable_step or 0) + 1
            train(model, optimizer, step)
            writer.record_step(step)
            durable = writer.close()
            conn.send({"result": "won", "durable": durable})
        except Exception as e:
            conn.send({"result": f"error after winning {type(e).__name__}: {e}"})


@pytest.fixture(scope="module")
def race_pool() -> Any:
    ctx = mp.get_context("spawn")
    workers = []
    barrier = ctx.Barrier(3)
    for _ in range(3):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_race_worker, args=(child, barrier), daemon=True)
        proc.start()
        workers.append((proc, parent))
    yield workers, barrier
    for proc, conn in workers:
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.procs
def test_stale_lock_takeover_is_exclusive(race_pool: Any, tmp_path: Path) -> None:
    """200 trials of 2 or 3 processes taking over one stale lock at once (spec §15.3)."""
    race_trials(race_pool, tmp_path, RACE_TRIALS)


@pytest.mark.procs
@pytest.mark.slow
def test_stale_lock_takeover_soak(race_pool: Any, tmp_path: Path) -> None:
    race_trials(race_pool, tmp_path, 1200)


def race_trials(race_pool: Any, tmp_path: Path, trials: int) -> None:
    workers, barrier = race_pool
    template = tmp_path / "template"
    make_chain(template)
    template_steps = ChainReader(template).steps
    outcomes: dict[str, int] = {}
    for trial in range(trials):
        path = tmp_path / f"t{trial}"
        shutil.copytree(template, path)
        plant_stale_lock(path)
        n = 2 + trial % 2
        stall = [0.0, 0.0005, 0.002][trial % 3]
        results = run_race_trial(workers, barrier, {"path": str(path), "stall": stall}, n)
        check_race_outcome(results, str(path), template_steps, LocalStore(path), trial)
        outcomes[f"{n} processes"] = outcomes.get(f"{n} processes", 0) + 1
        shutil.rmtree(path)
    assert sum(outcomes.values()) == trials


@pytest.mark.procs
def test_cli_takeover_race_exit_codes(tmp_path: Path) -> None:
    """Two ``ldtools compact`` processes on one stale lock: one succeeds, one exits 4."""
    path = tmp_path / "chain"
    make_chain(path, steps=6)
    for _trial in range(2):
        plant_stale_lock(path)
        procs = [subprocess.Popen([sys.executable, "-m", "ldtools", "compact", str(path), "--max-replay", "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        codes = sorted(p.returncode for p in procs)
        # A loser that looks after the winner released the lock runs after it: both succeed then.
        assert codes in ([0, 4], [0, 0]), (codes, [o[1].decode() for o in outs])
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode == 4:
                assert b"locked" in err and b"Traceback" not in err
        assert ldformat.validate(path).ok


@pytest.mark.procs
@pytest.mark.parametrize("command", [["compact", "--max-replay", "2"], ["truncate", "--after", "3", "--yes"],
                                     ["sync", "SRC"]])
def test_cli_exits_4_while_a_live_writer_holds_the_lock(tmp_path: Path, command: list[str]) -> None:
    """The race above cannot force the overlap; a live holder (this process) does: every
    command that needs the lock exits 4 with one line naming the holder, and changes nothing."""
    path = tmp_path / "chain"
    make_chain(path, steps=6)
    model, optimizer = make_training()
    ChainReader(path).load_into(model, optimizer)
    if command[0] == "sync":  # sync takes the destination's lock
        src = tmp_path / "src"
        make_chain(src, steps=2)
        ldformat.sync(src, path / ".." / "replica")
        path = tmp_path / "replica"
        ChainReader(path).load_into(model, optimizer)
        args = ["sync", str(src), str(path)]
    else:
        args = [command[0], str(path), *command[1:]]
    before = ChainReader(path).steps
    with ChainWriter.open(path, model, optimizer):
        proc = subprocess.run([sys.executable, "-m", "ldtools", *args], capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 4, (proc.returncode, err)
    assert "locked" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert ChainReader(path).steps == before
    assert ldformat.validate(path).ok


def test_broken_lock_fences_the_old_writer(tmp_path: Path) -> None:
    """A writer whose lock is broken can never commit again, and deletes nothing (spec §15.3)."""
    path = tmp_path / "chain"
    model, optimizer = make_training()
    old = ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=100)
    for s in (1, 2):
        train(model, optimizer, s)
        old.record_step(s)
    assert old.commit() == 2  # durable
    train(model, optimizer, 3)
    old.record_step(3)  # pending

    m2, o2 = make_training()
    ChainReader(path).load_into(m2, o2)
    with pytest.raises(ChainLockedError):  # the old writer runs (it is this very process)
        ChainWriter.open(path, m2, o2)
    new = ChainWriter.open(path, m2, o2, break_lock=True)
    with pytest.raises(LockLostError, match="another process took over"):
        old.commit()
    with pytest.raises(LockLostError):
        old.record_step(4)
    old.close()  # must not raise, must not release the new writer's lock
    assert current_lock(LocalStore(path)) is not None
    train(m2, o2, 3)
    new.record_step(3)
    assert new.close() == 3
    assert ChainReader(path).steps == [0, 1, 2, 3]
    assert ldformat.validate(path).ok


def test_stale_writer_commit_after_fence_fails_even_without_lock_check(tmp_path: Path) -> None:
    """The record number is the final fence: a writer that missed the takeover still cannot commit."""
    path = tmp_path / "chain"
    model, optimizer = make_training()
    old = ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=100)
    train(model, optimizer, 1)
    old.record_step(1)
    m2, o2 = make_training()
    new = ChainWriter.open(path, m2, o2, break_lock=True)  # commits the fence record
    assert old._lock is not None
    old._lock.check = lambda: None  # type: ignore[method-assign]  # as if the check raced the takeover
    with pytest.raises(LockLostError, match="another writer committed this record"):
        old.commit()
    new.close()
    assert ChainReader(path).steps == [0]
    assert ldformat.validate(path).ok


@pytest.mark.parametrize("content", [
    b'{"pid": "abc"}', b'{"generation": 2, "state": "held", "pid": "abc"', b"", b"\xff\xfe", b"[1]",
    b'{"generation": 2, "state": "held", "host": "HOST", "pid": null, "start_time": null, "token": "t"}',
    b'{"generation": 2, "state": "held", "host": "HOST", "pid": [1], "start_time": null, "token": "t"}',
    b'{"generation": 2, "state": "held", "host": "HOST", "pid": 123456789012345678901234567890, '
    b'"start_time": null, "token": "t"}',
    b'{"generation": 2, "state": "held", "host": "HOST", "pid": 1.5, "start_time": null, "token": "t"}',
    b'{"generation": 2, "state": "held", "host": "HOST", "pid": NaN, "start_time": null, "token": "t"}',
    b"[" * 100000,
])
def test_garbage_lock_file_is_a_stale_lock(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    store = LocalStore(path)
    g = max(int(p[5:17]) for p in store.list("lock") if "/." not in p) + 1
    store.create_exclusive(lock_path(g), content.replace(b"HOST", socket.gethostname().encode()))
    model, optimizer = make_training()
    ChainReader(path).load_into(model, optimizer)
    writer = ChainWriter.open(path, model, optimizer)
    train(model, optimizer, 4)
    writer.record_step(4)
    assert writer.close() == 4
    assert ldformat.validate(path).ok
    assert not store.exists(lock_path(g)), "the garbage lock generation was not collected"


def test_lock_of_another_host_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    store = LocalStore(path)
    g = max(int(p[5:17]) for p in store.list("lock") if "/." not in p) + 1
    store.create_exclusive(lock_path(g), json.dumps({"generation": g, "state": "held", "host": "elsewhere",
                                                      "pid": 1, "start_time": None, "token": "x"}).encode())
    model, optimizer = make_training()
    with pytest.raises(ChainLockedError, match="host elsewhere"):
        ChainWriter.open(path, model, optimizer)
    with pytest.raises(ChainLockedError):
        ldformat.compact(path)
    with pytest.raises(ChainLockedError):
        ldformat.truncate(path, 1)
    assert ChainReader(path).steps == [0, 1, 2, 3]


def test_live_format_1_0_lock_is_refused(tmp_path: Path) -> None:
    """A format 1.0 writer locks with ``writer.lock``: a live one keeps 1.1 writers out."""
    path = tmp_path / "chain"
    make_chain(path)
    from ldformat.chain.lock import _start_time

    (path / "writer.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "start_time": _start_time(os.getpid()), "token": "x"}))
    model, optimizer = make_training()
    with pytest.raises(ChainLockedError, match="format 1.0 writer"):
        ChainWriter.open(path, model, optimizer)
    (path / "writer.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "start_time": "0", "token": "x"}))  # a dead one
    ChainReader(path).load_into(model, optimizer)
    ChainWriter.open(path, model, optimizer).close()
    assert not (path / "writer.lock").exists(), "the dead 1.0 lock was not collected"


# -- a chain must have records --------------------------------------------------------------
@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_chain_without_log_is_an_error_and_nothing_deletes_it(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    shutil.rmtree(path / "log")
    if damage == "empty":
        (path / "log").mkdir()
    before = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    report = ldformat.validate(path)
    assert not report.ok and "no commit record" in str(report.problems[0])
    with pytest.raises(CorruptChainError, match="no commit record"):
        ldformat.compact(path)
    with pytest.raises(CorruptChainError, match="no commit record"):
        ldformat.compact(path, dry_run=True)
    with pytest.raises(CorruptChainError, match="no commit record"):
        ldformat.truncate(path, 0)
    model, optimizer = make_training()
    with pytest.raises(CorruptChainError, match="no commit record"):
        ChainWriter.open(path, model, optimizer)
    after = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    gone = set(before) - set(after)
    assert not [p for p in gone if p.startswith(("anchors", "deltas"))], gone
    result = invoke("validate", path, code=1)  # in this process: no traceback, exit 1
    assert "no commit record" in result.output, result.output


def test_root_is_created_after_record_1(tmp_path: Path) -> None:
    """A root always has a log: creation writes the anchor, record 1, then the root (spec §7.4)."""
    path = tmp_path / "chain"
    model, optimizer = make_training()
    order: list[str] = []

    class Recording(LocalStore):
        def create_exclusive(self, p: str, data: bytes) -> None:
            order.append(p)
            super().create_exclusive(p, data)

    ChainWriter.create(path, model, optimizer, kind="state.xor", store=Recording(path)).close()
    assert [p for p in order if not p.startswith("lock/")] == ["log/000000000001.json", "ldformat.json"]
    assert json.loads((path / "ldformat.json").read_text())["format_version"] == ldformat.FORMAT_VERSION


def test_unfinished_creation_is_reclaimed(tmp_path: Path) -> None:
    """A creator killed before the root leaves record 1, an anchor and its held lock."""
    path = tmp_path / "chain"
    (path / "log").mkdir(parents=True)
    (path / "anchors").mkdir()
    (path / "log" / "000000000001.json").write_text("{}")
    (path / "log" / ".tmp-000000000001.json-0badf00d").write_text("")
    (path / "anchors" / "0-deadbeef.safetensors").write_bytes(b"x")
    plant_stale_lock(path)
    with pytest.raises(ldformat.NotAChainError):
        ChainReader(path)
    model, optimizer = make_training()
    ChainWriter.create(path, model, optimizer, kind="grad.dense").close()
    assert ChainReader(path).steps == [0]
    assert not (path / "anchors" / "0-deadbeef.safetensors").exists()
    assert not (path / "log" / ".tmp-000000000001.json-0badf00d").exists()
    assert ldformat.validate(path).ok


def test_creation_in_progress_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    path.mkdir()
    from ldformat.chain.lock import WriterLock

    lock = WriterLock.acquire(LocalStore(path), str(path))  # a live creator (this process)
    model, optimizer = make_training()
    with pytest.raises(ChainLockedError, match="creating a chain here"):
        ChainWriter.create(path, model, optimizer, kind="grad.dense")
    lock.release()


def test_create_refuses_a_directory_with_someone_elses_data(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    path.mkdir()
    (path / "log").mkdir()
    for seq in (1, 2):
        (path / "log" / f"{seq:012d}.json").write_text("{}")
    model, optimizer = make_training()
    with pytest.raises(UsageError, match="not empty"):
        ChainWriter.create(path, model, optimizer, kind="grad.dense")
    assert sorted(p.name for p in (path / "log").iterdir()) == ["000000000001.json", "000000000002.json"]


def test_refused_creation_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "new"
    model, _ = make_training()
    optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ldformat.UnsupportedStateError):
        ChainWriter.create(path, model, optimizer, kind="grad.dense")
    assert not path.exists()

    class Failing(LocalStore):
        def write_parts(self, p: str, parts: Any) -> None:
            raise OSError(28, "No space left on device")

    model, optimizer = make_training()
    path.mkdir()
    with pytest.raises(ldformat.WriterIOError):
        ChainWriter.create(path, model, optimizer, kind="grad.dense", store=Failing(path))
    assert list(path.iterdir()) == [], "a failed creation left files behind"


# -- leases (spec §15.6) --------------------------------------------------------------------
def _plant_remote_lock(path: Path, lease_s: float, generation: int | None = None) -> int:
    store = LocalStore(path)
    g = generation or max(int(p[5:17]) for p in store.list("lock") if "/." not in p) + 1
    store.create_exclusive(lock_path(g), json.dumps({
        "generation": g, "state": "held", "host": "elsewhere", "pid": 1, "start_time": None, "token": "remote",
        "lease_s": lease_s}).encode())
    return g


def test_lease_of_a_silent_remote_holder_runs_out(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    _plant_remote_lock(path, lease_s=0.5)
    model, optimizer = make_training()
    ChainReader(path).load_into(model, optimizer)
    with pytest.raises(ChainLockedError, match="host elsewhere.*lease 0.5 s"):
        ChainWriter.open(path, model, optimizer)  # no waiting: a remote holder counts as live
    started = time.monotonic()
    writer = ChainWriter.open(path, model, optimizer, lock_wait=5.0)
    assert 0.5 <= time.monotonic() - started < 4.0, "the lease was not waited for, or not taken over"
    assert ChainReader(path).records[-1].reason == "takeover"  # the old holder is fenced
    train(model, optimizer, 4)
    writer.record_step(4)
    assert writer.close() == 4
    assert ldformat.validate(path).ok


def test_lease_renewed_by_a_remote_holder_keeps_the_lock(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "chain"
    make_chain(path)
    g = _plant_remote_lock(path, lease_s=0.6)
    stop = threading.Event()

    def renew() -> None:  # a live holder on another host: a new generation every 0.2 s
        nonlocal g
        while not stop.wait(0.2):
            g = _plant_remote_lock(path, lease_s=0.6, generation=g + 1)

    t = threading.Thread(target=renew)
    t.start()
    try:
        model, optimizer = make_training()
        with pytest.raises(ChainLockedError, match="lease"):
            ChainWriter.open(path, model, optimizer, lock_wait=1.5)
    finally:
        stop.set()
        t.join()
    assert ChainReader(path).steps == [0, 1, 2, 3]


def test_writer_renews_its_lease_at_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ldformat.chain.lock.LEASE_S", 0.2)
    path = tmp_path / "chain"
    model, optimizer = make_training()
    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=1)
    assert writer._lock is not None
    first = writer._lock.generation
    for s in (1, 2, 3):
        time.sleep(0.15)
        train(model, optimizer, s)
        writer.record_step(s)
    assert writer._lock.generation > first, "the lease was never renewed"
    held = current_lock(LocalStore(path))
    assert held is not None and held.generation == writer._lock.generation and held.lease_s == 0.2
    gens = sorted(LocalStore(path).list("lock"))
    assert len(gens) == 1, f"superseded generations of our own were kept: {gens}"
    assert writer.close() == 3
    assert ldformat.validate(path).ok
