"""I/O faults injected through the store: disk full, permission, I/O errors.

Tests run as root, where permissions do not bite, so faults come from
:class:`~ldformat.stores.FaultyStore` wrapping a :class:`~ldformat.stores.LocalStore`: one
rule makes one primitive of the commit protocol raise ``OSError`` once it has succeeded
``after`` times on matching paths (and keep failing: a full disk stays full). Failures inside
``LocalStore``'s own exclusive create (its temporary file half-written, or its fsync) are in
``test_stores.py``. A real ``EFBIG`` comes from ``RLIMIT_FSIZE`` in a subprocess.

After a fault the writer must raise :class:`ldformat.WriterIOError` naming the path and
errno, keep raising, and leave a chain that a plain reader validates and materializes
exactly at its last commit; a writer re-opened on a healthy store continues it. A failed
creation leaves nothing behind, and creating the chain again works.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import crash_writer as cw
import pytest
from models import assert_state_bits_equal, snapshot
from paths import SUPPORT

import ldformat
from ldformat import ChainReader, ChainWriter, WriterIOError
from ldformat.chain.lock import current_lock
from ldformat.stores import WRITES, Fault, FaultyStore, LocalStore

BATCH_STEPS = 3
ANCHOR_EVERY = 5
MAX_STEPS = 30

@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    # One thread throughout: the EFBIG references come from crash_writer (one thread), and
    # switching torch between thread counts makes TinyNet steps very slow on 2 cores.
    with cw.training_threads():
        yield


# -- helpers -----------------------------------------------------------------------------
def fault(name: str, err: int, *, after: int = 0) -> Fault:
    """A fresh rule for the fault ``name`` (``op:what``) raising ``err`` after ``after`` calls.

    ``write:anchor`` / ``write:delta``: writing a data object fails half-way (half its bytes
    are written first, like a disk filling up mid-file); ``fsync:data``: syncing the data
    objects of a commit; ``create:record``: creating a commit record is refused outright
    (e.g. EACCES on ``log/``); ``write:record`` / ``fsync:record``: creating it fails inside
    (the temporary file cannot be written or synced; nothing becomes visible);
    ``fsync:log-dir``: the record was linked into place, then syncing ``log/`` fails (the
    record is visible); ``create:root`` and ``create:lock``: creating ``ldformat.json`` or a
    lock generation fails.
    """
    rules: dict[str, Fault] = {
        "write:anchor": Fault(ops=WRITES, path="anchors/*", error=err, after=after, torn=0.5),
        "write:delta": Fault(ops=WRITES, path="deltas/*", error=err, after=after, torn=0.5),
        "fsync:data": Fault(ops=("sync",), error=err, after=after),
        "create:record": Fault(ops=("create_exclusive",), path="log/*", error=err, after=after),
        "write:record": Fault(ops=("create_exclusive",), path="log/*", error=err, after=after),
        "fsync:record": Fault(ops=("create_exclusive",), path="log/*", error=err, after=after),
        "fsync:log-dir": Fault(ops=("create_exclusive",), path="log/*", error=err, after=after, when="after"),
        "create:root": Fault(ops=("create_exclusive",), path="ldformat.json", error=err, after=after),
        "create:lock": Fault(ops=("create_exclusive",), path="lock/*", error=err, after=after),
    }
    return rules[name]


def faulty(path: Path, rule: Fault, *, armed: bool = True) -> FaultyStore:
    """The chain directory ``path`` behind a store that injects ``rule`` (once armed)."""
    return FaultyStore(LocalStore(path), [rule], armed=armed)


def lock_released(path: Path) -> bool:
    return current_lock(LocalStore(path)) is None


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def tree_digest(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in files_under(root)}


def leftovers(root: Path) -> list[str]:
    reader = ChainReader(root)
    referenced = {a.object.path for a in reader.state.anchors.values()}
    for entry in reader.state.delta_entries():
        referenced.update(f"{entry.path}/{o.path}" for o in entry.objects)
    return [p for p in files_under(root)
            if (p.split("/")[0] in ("anchors", "deltas") and p not in referenced) or "/.tmp-" in p]


def assert_clear_io_error(e: BaseException, path: Path, err: int, names: str | None = None) -> None:
    """A WriterIOError (still an OSError) whose one-line message names the path and errno."""
    assert isinstance(e, WriterIOError), f"{type(e).__name__}: {e}"
    assert isinstance(e, OSError)
    assert e.errno == err, f"errno {e.errno!r}, expected {err}: {e}"
    msg = str(e)
    assert "\n" not in msg
    assert str(path) in msg, msg
    assert os.strerror(err) in msg, msg
    assert f"errno {err}" in msg or errno.errorcode[err] in msg, msg
    if names is not None:
        assert names in msg, msg


def check_chain_at(path: Path, latest: int, live: dict[int, dict[str, Any]]) -> None:
    """A plain reader sees a valid chain ending at ``latest``, every step bit-exact."""
    before = tree_digest(path)
    report = ldformat.validate(path)
    assert report.ok, [str(p) for p in report.problems]
    reader = ChainReader(path)
    assert reader.steps == list(range(latest + 1)), reader.steps
    for s in reader.steps:
        assert_state_bits_equal(reader.materialize(s), live[s], f"step {s}")
    assert tree_digest(path) == before, "reading changed the chain"


def resume_and_continue(path: Path, kind: str, latest: int, live: dict[int, dict[str, Any]],
                        extra_steps: int = 4) -> None:
    """Re-open on a healthy store: leftovers go, new steps append and materialize exactly."""
    model, optimizer, topk = cw.make_training(kind)
    reader = ChainReader(path)
    if reader.latest_step is not None:
        assert reader.load_into(model, optimizer, compressor=topk)["step"] == latest
    writer = ChainWriter.open(path, model, optimizer, compressor=topk,
                              batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY)
    assert writer.durable_step == latest
    assert leftovers(path) == []
    appended = {}
    for s in range(latest + 1, latest + 1 + extra_steps):
        cw.train(model, optimizer, topk, s)
        writer.record_step(s)
        appended[s] = snapshot(model, optimizer)
    assert writer.close() == latest + extra_steps
    assert lock_released(path)
    report = ldformat.validate(path)
    assert report.ok, [str(p) for p in report.problems]
    final = ChainReader(path)
    assert final.steps == list(range(latest + extra_steps + 1))
    for s, want in appended.items():
        assert_state_bits_equal(final.materialize(s), want, f"step {s} after re-opening")
    assert_state_bits_equal(final.materialize(latest), live[latest], f"step {latest} after re-opening")


def train_until_fault(path: Path, kind: str, store: FaultyStore) -> tuple[ChainWriter, WriterIOError, int, int,
                                                                           dict[int, dict[str, Any]]]:
    """Create a chain on ``store``, arm it and record steps until the writer fails."""
    model, optimizer, topk = cw.make_training(kind)
    writer = ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk,
                                batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY, store=store)
    live = {0: snapshot(model, optimizer)}
    store.arm()
    durable = 0
    assert writer.durable_step == durable
    for s in range(1, MAX_STEPS + 1):
        cw.train(model, optimizer, topk, s)
        live[s] = snapshot(model, optimizer)
        try:
            writer.record_step(s)
        except WriterIOError as e:
            return writer, e, s, durable, live
        now_durable = writer.durable_step
        assert now_durable is not None
        durable = now_durable
    rule = store.faults[0]
    raise AssertionError(f"{rule.ops} on {rule.path} never failed in {MAX_STEPS} steps ({rule.calls} calls)")


# -- faults while recording --------------------------------------------------------------
MID_RUN = {
    # fault: (errno, successful calls before the fault, what the message must name)
    "write:delta": (errno.ENOSPC, 9, "/deltas/"),
    "write:anchor": (errno.ENOSPC, 1, "/anchors/"),
    "fsync:data": (errno.EIO, 3, None),
    "create:record": (errno.EACCES, 3, "/log/"),
    "write:record": (errno.ENOSPC, 4, "/log/"),
    "fsync:record": (errno.EIO, 2, "/log/"),
}


@pytest.mark.parametrize("op", list(MID_RUN))
@pytest.mark.parametrize("kind", cw.KINDS)
def test_fault_while_recording_keeps_the_last_commit(tmp_path: Path, kind: str, op: str) -> None:
    err, after, names = MID_RUN[op]
    path = tmp_path / "chain"
    path.mkdir()
    store = faulty(path, fault(op, err, after=after), armed=False)
    writer, e, failed_at, durable, live = train_until_fault(path, kind, store)
    assert_clear_io_error(e, path, err, names)
    assert store.failures == 1
    assert writer.durable_step == durable < failed_at
    assert f"step {durable}" in str(e)

    # The writer stays failed: every call raises again and touches nothing.
    before = tree_digest(path)
    model, optimizer = writer.model, writer.optimizer
    cw.train(model, optimizer, writer.compressor, failed_at + 1)
    for call in (lambda: writer.record_step(failed_at + 1), writer.commit, lambda: writer.write_anchor(failed_at)):
        with pytest.raises(WriterIOError) as again:
            call()
        assert again.value.errno == err
    assert store.failures == 1, "a failed writer attempted more I/O"
    assert tree_digest(path) == before
    assert writer.close() == durable
    assert lock_released(path), "close() of a failed writer kept the lock"

    # Nothing committed is lost; a plain reader sees the chain at its last commit.
    check_chain_at(path, durable, live)
    resume_and_continue(path, kind, durable, live)


@pytest.mark.parametrize("kind", cw.KINDS)
def test_fault_in_a_reopened_writer(tmp_path: Path, kind: str) -> None:
    # The faulty store is handed to ChainWriter.open this time; the fault hits an append.
    path = tmp_path / "chain"
    model, optimizer, topk = cw.make_training(kind)
    writer = ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk,
                                batch_steps=BATCH_STEPS, anchor_every=ANCHOR_EVERY)
    live = {0: snapshot(model, optimizer)}
    for s in range(1, 4):
        cw.train(model, optimizer, topk, s)
        writer.record_step(s)
        live[s] = snapshot(model, optimizer)
    assert writer.close() == 3
    model, optimizer, topk = cw.make_training(kind)
    ChainReader(path).load_into(model, optimizer, compressor=topk)
    store = faulty(path, fault("fsync:data", errno.EIO))
    writer = ChainWriter.open(path, model, optimizer, compressor=topk, batch_steps=BATCH_STEPS,
                              anchor_every=ANCHOR_EVERY, store=store)
    with pytest.raises(WriterIOError) as info:
        for s in range(4, 7):
            cw.train(model, optimizer, topk, s)
            writer.record_step(s)
    assert_clear_io_error(info.value, path, errno.EIO)
    with pytest.raises(WriterIOError):
        writer.commit()
    assert writer.close() == 3
    check_chain_at(path, 3, live)
    resume_and_continue(path, kind, 3, live)


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_fault_after_the_record_is_linked(tmp_path: Path, kind: str) -> None:
    # The record is in place when fsync of log/ fails: the commit may or may not survive
    # a power cut, but as files stand it is visible and must be complete and exact.
    path = tmp_path / "chain"
    path.mkdir()
    store = faulty(path, fault("fsync:log-dir", errno.EIO, after=2), armed=False)
    writer, e, failed_at, durable, live = train_until_fault(path, kind, store)
    assert_clear_io_error(e, path, errno.EIO, "/log/")
    with pytest.raises(WriterIOError):
        writer.record_step(failed_at + 1)
    writer.close()
    assert lock_released(path)
    check_chain_at(path, failed_at, live)
    resume_and_continue(path, kind, failed_at, live)


def test_close_surfaces_a_failed_final_commit(tmp_path: Path) -> None:
    kind = "grad.dense"
    path = tmp_path / "chain"
    path.mkdir()
    store = faulty(path, fault("write:delta", errno.ENOSPC), armed=False)
    model, optimizer, _ = cw.make_training(kind)
    writer = ChainWriter.create(path, model, optimizer, kind=kind, batch_steps=100, store=store)
    live = {0: snapshot(model, optimizer)}
    for s in (1, 2):
        cw.train(model, optimizer, None, s)
        writer.record_step(s)
        live[s] = snapshot(model, optimizer)
    store.arm()
    with pytest.raises(WriterIOError) as info:
        writer.close()
    assert_clear_io_error(info.value, path, errno.ENOSPC, "/deltas/")
    assert lock_released(path), "close() kept the lock after a failed commit"
    check_chain_at(path, 0, live)
    resume_and_continue(path, kind, 0, live)


# -- faults while creating or opening ------------------------------------------------------
def create_again_and_continue(path: Path, kind: str, steps: int = 3) -> None:
    """After a failed creation: no chain and no lock are left, and creating it again works."""
    assert not (path / "ldformat.json").exists(), "a failed create() left a chain behind"
    assert lock_released(path), "a failed create() kept the writer lock"
    model, optimizer, topk = cw.make_training(kind)
    writer = ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk, batch_steps=BATCH_STEPS)
    live = {0: snapshot(model, optimizer)}
    for s in range(1, steps + 1):
        cw.train(model, optimizer, topk, s)
        writer.record_step(s)
        live[s] = snapshot(model, optimizer)
    assert writer.close() == steps
    check_chain_at(path, steps, live)


def test_create_fails_on_the_root_file(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    path.mkdir()
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(WriterIOError) as info:
        ChainWriter.create(path, model, optimizer, kind="grad.dense",
                           store=faulty(path, fault("create:root", errno.ENOSPC)))
    # Record 1 stays: its name is one another creator could reuse by the time it was deleted
    # (spec §15.4). The next create() reclaims it as an unfinished creation (spec §7.4).
    assert files_under(path) == ["log/000000000001.json"]
    assert_clear_io_error(info.value, path, errno.ENOSPC, "ldformat.json")
    create_again_and_continue(path, "grad.dense")


def test_create_fails_on_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    path.mkdir()
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(OSError) as info:
        ChainWriter.create(path, model, optimizer, kind="grad.dense",
                           store=faulty(path, fault("create:lock", errno.ENOSPC)))
    assert_clear_io_error(info.value, path, errno.ENOSPC, "/lock/")
    assert files_under(path) == []
    create_again_and_continue(path, "grad.dense")


@pytest.mark.parametrize("op", ["write:anchor", "create:record"])
def test_create_fails_on_the_first_anchor(tmp_path: Path, op: str) -> None:
    path = tmp_path / "chain"
    path.mkdir()
    model, optimizer, _ = cw.make_training("grad.dense")
    with pytest.raises(WriterIOError) as info:
        ChainWriter.create(path, model, optimizer, kind="grad.dense",
                           store=faulty(path, fault(op, errno.ENOSPC)))
    assert_clear_io_error(info.value, path, errno.ENOSPC)
    # The failed create must not leave this (live) process holding the lock, nor a chain
    # without its first record: creating again must work without breaking a lock.
    create_again_and_continue(path, "grad.dense")


def test_open_fails_on_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    model, optimizer, _ = cw.make_training("grad.dense")
    live = {0: snapshot(model, optimizer)}
    ChainWriter.create(path, model, optimizer, kind="grad.dense").close()
    before = tree_digest(path)
    with pytest.raises(OSError) as info:
        ChainWriter.open(path, model, optimizer, store=faulty(path, fault("create:lock", errno.EIO)))
    assert_clear_io_error(info.value, path, errno.EIO, "/lock/")
    assert tree_digest(path) == before
    resume_and_continue(path, "grad.dense", 0, live)


# -- a real EFBIG ----------------------------------------------------------------------------
@pytest.mark.procs
def test_real_efbig_from_rlimit_fsize(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    proc = subprocess.run([sys.executable, str(SUPPORT / "crash_writer.py"), "efbig", str(path), "1024"],
                          capture_output=True, text=True, timeout=180, cwd=str(SUPPORT), env=cw.child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["durable_before"] == 9
    error = out["error"]
    assert error is not None, "the write past RLIMIT_FSIZE did not fail"
    assert error["type"] == "WriterIOError" and error["errno"] == errno.EFBIG, error
    msg = error["message"]
    # Step 10 is an anchor step: its anchor is written first, then the batch ending at 10.
    assert str(path) in msg and ("/anchors/" in msg or "/deltas/" in msg), msg
    assert os.strerror(errno.EFBIG) in msg, msg
    assert f"errno {errno.EFBIG}" in msg, msg
    assert out["second"] is not None and out["second"]["errno"] == errno.EFBIG, out["second"]
    assert out["durable_after"] == 9
    assert out["lock_released"]
    assert leftovers(path), "expected the partial object the EFBIG left behind"
    refs = cw.reference_states("grad.dense", 10)
    check_chain_at(path, 9, refs)
    resume_and_continue(path, "grad.dense", 9, refs)
