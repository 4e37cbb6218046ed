"""Local-first checkpointing with background replication: ``Checkpointer(mirror=...)``.

- After ``close()`` the mirror (``memory://`` and a local directory) holds the local chain:
  the same steps, each materializing bit-exactly, and it validates; syncs ran off the
  training thread.
- A mirror that is down for a while, then back: no error reaches the training loop, steps
  do not slow down, the lag grows and returns to 0, each change of state is logged once.
- A divergent mirror is reported once and mirroring stops; training goes on.
- ``resume(..., mirror=)``: the local chain gone, the run resumes from the mirror with the
  same state as from the local chain; a divergent local chain defers to a newer mirror
  and wins over an older one.
- The same with ``mirror="s3://..."`` (a ``moto_server`` on 127.0.0.1 behind a fault
  proxy, ``s3server.py``): the store answers 503 or resets every connection for a while,
  starting just after a sync took the mirror's lock (so that its release fails too), then
  comes back; training is not held up, the lag grows and returns to 0, the mirror equals
  the local chain bit for bit, and a run resumes from it when the local chain is gone.
"""

from __future__ import annotations

import errno
import logging
import secrets
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
import ldformat.capture.mirror as mirror_mod
from ldformat import ChainReader
from ldformat.stores import OPS, FaultyStore, LocalStore, MemoryStore

if TYPE_CHECKING:  # s3server is loaded as a plugin (below), not imported before it
    from s3server import FaultProxy

pytest_plugins = ["s3server"]  # the fixtures moto, s3_env, s3_url and fault_proxy

LOGGER = "ldformat.capture"


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch, close_leftover_checkpointers: None) -> None:
    monkeypatch.setattr(LocalStore, "_fsync_fd", lambda self, fd: None)
    monkeypatch.setattr(mirror_mod, "FIRST_RETRY_S", 0.05)
    monkeypatch.setattr(mirror_mod, "MAX_RETRY_S", 0.2)


def training(seed: int = 0) -> tuple[TinyNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def run(path: Path, mirror: Any, steps: int, **kw: Any) -> ldformat.Checkpointer:
    model, opt = training()
    ck = ldformat.Checkpointer(path, model, opt, mode="lowdiff+", anchor_every=4, batch_steps=2,
                               mirror=mirror, **kw)
    for s in range(1, steps + 1):
        train_step(model, opt, s)
    return ck


def assert_same_chain(local: ChainReader, replica: ChainReader) -> None:
    assert replica.root.chain_id == local.root.chain_id
    assert replica.steps == local.steps and local.latest_step is not None
    for s in local.steps:
        assert_state_bits_equal(replica.materialize(s), local.materialize(s), f"step {s}")


@pytest.mark.parametrize("where", ["memory", "local"])
def test_mirror_equals_local_after_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    threads: list[str] = []
    real_sync = mirror_mod.sync

    def spy(*args: Any, **kw: Any) -> ldformat.SyncReport:
        threads.append(threading.current_thread().name)
        return real_sync(*args, **kw)

    monkeypatch.setattr(mirror_mod, "sync", spy)
    target = f"memory://mirror-{uuid.uuid4().hex}" if where == "memory" else str(tmp_path / "mirror")
    ck = run(tmp_path / "chain", target, 11)
    assert ck.close() == 11
    assert threads and set(threads) == {"ldformat-mirror"}, threads
    assert ck.stats.mirror_syncs >= 1 and ck.stats.mirror_last_error is None
    assert ck.stats.mirror_lag_steps == 0 and ck.stats.mirror_lag_seconds == 0.0
    assert ck.stats.to_dict()["mirror_lag_steps"] == 0
    local, replica = ChainReader(tmp_path / "chain"), ChainReader(target)
    assert replica.latest_step == 11
    assert_same_chain(local, replica)
    assert ldformat.validate(target).ok


def test_mirror_down_then_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    remote = FaultyStore(MemoryStore())
    remote.fail(OPS, errno.EIO)  # down: every call fails
    model, opt = training()
    ck = ldformat.Checkpointer(tmp_path / "chain", model, opt, mode="lowdiff+", anchor_every=4, batch_steps=2,
                               mirror=remote)
    step_times: list[float] = []
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            started = time.perf_counter()
            train_step(model, opt, step)  # raises if anything reached the training thread
            step_times.append(time.perf_counter() - started)
            time.sleep(0.01)

    train(20)
    deadline = time.monotonic() + 5
    while remote.failures < 3 and time.monotonic() < deadline:
        train(1)
    assert remote.failures >= 3  # retried, with backoff
    assert ck.stats.mirror_lag_steps >= 15, ck.stats.to_dict()
    assert ck.stats.mirror_lag_seconds > 0.1
    assert ck.stats.mirror_last_error is not None and "OSError" in ck.stats.mirror_last_error
    assert ck.stats.mirror_syncs == 0
    lag_down = ck.stats.mirror_lag_steps
    train(5)
    assert ck.stats.mirror_lag_steps > lag_down  # grows while down

    remote.clear()  # back
    deadline = time.monotonic() + 10
    while ck.stats.mirror_syncs == 0 and time.monotonic() < deadline:
        train(1)
    ck.flush()
    deadline = time.monotonic() + 10
    while ck.stats.mirror_lag_steps and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ck.stats.mirror_syncs >= 1 and ck.stats.mirror_lag_steps == 0, ck.stats.to_dict()
    assert ck.stats.mirror_lag_seconds == 0.0
    assert ck.close() == step
    assert sorted(step_times)[len(step_times) // 2] < 0.2 and max(step_times) < 5.0, step_times

    failed = [r for r in caplog.records if r.levelno >= logging.WARNING and "mirroring failed" in r.message]
    back = [r for r in caplog.records if "mirroring works again" in r.message]
    assert len(failed) == 1 and len(back) == 1, [r.message for r in caplog.records]
    assert_same_chain(ChainReader(tmp_path / "chain"), ChainReader("replica", store=remote.inner))


def test_close_warns_when_mirror_stays_behind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    remote = FaultyStore(MemoryStore())
    remote.fail(OPS, errno.EIO)
    ck = run(tmp_path / "chain", remote, 5, mirror_timeout=2.0)
    started = time.monotonic()
    assert ck.close() == 5  # the local chain is complete whatever the mirror does
    assert time.monotonic() - started < 2.0
    assert any("behind the local chain at close" in r.message for r in caplog.records)
    assert ck.stats.mirror_lag_steps > 0
    assert ChainReader(tmp_path / "chain").latest_step == 5


def test_divergent_mirror_stops_mirroring(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    other = tmp_path / "other"
    run(tmp_path / "first", other, 3).close()  # the mirror now holds another chain
    assert ChainReader(other).latest_step == 3
    ck = run(tmp_path / "chain", other, 9)
    assert ck.close() == 9
    diverged = [r for r in caplog.records if "diverged" in r.message]
    assert len(diverged) == 1, [r.message for r in caplog.records]
    assert ck.stats.mirror_last_error is not None and "ReplicaDivergedError" in ck.stats.mirror_last_error
    assert ck.stats.mirror_syncs == 0
    assert ChainReader(other).latest_step == 3  # untouched
    assert ChainReader(tmp_path / "chain").latest_step == 9


def test_resume_from_mirror_when_local_is_gone(tmp_path: Path) -> None:
    mirror = str(tmp_path / "mirror")
    run(tmp_path / "chain", mirror, 10).close()

    model_a, opt_a = training(seed=1)
    step_a = ldformat.resume(tmp_path / "chain", model_a, opt_a)
    model_b, opt_b = training(seed=2)
    fresh = tmp_path / "fresh"
    step_b = ldformat.resume(fresh, model_b, opt_b, mirror=mirror)
    assert step_a == step_b == 10
    assert_state_bits_equal(snapshot(model_b, opt_b), snapshot(model_a, opt_a), "resumed from the mirror")
    assert ChainReader(fresh).latest_step == 10  # the mirror was synced into the fresh location
    # Training continues there and mirrors again.
    ck = ldformat.Checkpointer(fresh, model_b, opt_b, mode="lowdiff+", anchor_every=4, batch_steps=2,
                               step=step_b, mirror=mirror)
    train_step(model_b, opt_b, 11)
    assert ck.close() == 11
    assert ChainReader(mirror).latest_step == 11


def test_resume_rule_with_a_divergent_local_chain(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    mirror = str(tmp_path / "mirror")
    run(tmp_path / "chain", mirror, 8).close()
    run(tmp_path / "older", None, 3).close()  # another chain, older than the mirror
    run(tmp_path / "newer", None, 12).close()  # another chain, newer than the mirror

    model, opt = training(seed=3)
    assert ldformat.resume(tmp_path / "older", model, opt, mirror=mirror) == 8
    assert any("resuming from the mirror" in r.message for r in caplog.records)
    assert ChainReader(tmp_path / "older").latest_step == 3  # left untouched
    want_model, want_opt = training(seed=4)
    ldformat.resume(mirror, want_model, want_opt)
    assert_state_bits_equal(snapshot(model, opt), snapshot(want_model, want_opt), "from the mirror")

    assert ldformat.resume(tmp_path / "newer", model, opt, mirror=mirror) == 12
    assert ChainReader(mirror).latest_step == 8


#: Retries fast enough for tests (the defaults allow 30 s).
S3_FAST_RETRY = {"retry_init_backoff": 0.01, "retry_max_backoff": 0.05, "max_retries": 1, "retry_timeout": 1}


def _wait_for(condition: Any, timeout: float, train: Any) -> bool:
    """Train a step at a time until ``condition()`` holds (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        train(1)
    return bool(condition())


@pytest.mark.parametrize("action", ["503", "reset"])
def test_s3_mirror_down_then_back(tmp_path: Path, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture,
                                  action: str) -> None:
    from s3server import BUCKET

    caplog.set_level(logging.WARNING, LOGGER)
    url = f"s3://{BUCKET}/mirror-{secrets.token_hex(6)}"
    local = tmp_path / "chain"
    model, opt = training()
    ck = ldformat.Checkpointer(local, model, opt, mode="lowdiff+", anchor_every=4, batch_steps=2, mirror=url,
                               mirror_options=S3_FAST_RETRY)
    step_times: list[float] = []
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            started = time.perf_counter()
            train_step(model, opt, step)  # raises if anything reached the training thread
            step_times.append(time.perf_counter() - started)
            time.sleep(0.01)

    train(4)
    assert _wait_for(lambda: ck.stats.mirror_syncs >= 1, 20, train), ck.stats.to_dict()  # mirroring works

    # Down: from just after the next sync took the mirror's lock, every request fails (the
    # sync's records, objects and its release of the lock included).
    lock_taken = threading.Event()

    def down(method: str, target: str, _: int) -> str:
        if lock_taken.is_set():
            return action
        if method == "PUT" and "/lock/" in target:
            lock_taken.set()
        return "forward"

    fault_proxy.set_plan(down)
    syncs_before = ck.stats.mirror_syncs
    assert _wait_for(lambda: lock_taken.is_set() and ck.stats.mirror_last_error is not None, 20, train)
    train(8)
    lag_down = ck.stats.mirror_lag_steps
    assert lag_down >= 6, ck.stats.to_dict()
    assert ck.stats.mirror_lag_seconds > 0.05
    assert ck.stats.mirror_last_error is not None and url in ck.stats.mirror_last_error
    train(6)
    assert ck.stats.mirror_lag_steps > lag_down  # grows while down
    assert fault_proxy.faults() >= 2  # retried (with backoff) while down
    syncs_down = ck.stats.mirror_syncs
    assert syncs_down <= syncs_before + 1  # at most the sync that ended just before the outage

    fault_proxy.forward_all()  # back
    assert _wait_for(lambda: ck.stats.mirror_syncs > syncs_down, 30, train), ck.stats.to_dict()
    assert ck.close() == step
    assert ck.stats.mirror_lag_steps == 0 and ck.stats.mirror_lag_seconds == 0.0, ck.stats.to_dict()
    # Not held up by the outage: loose bounds (a step takes milliseconds; a retry cycle of the
    # mirror takes a second or more).
    assert sorted(step_times)[len(step_times) // 2] < 0.5 and max(step_times) < 5.0, step_times
    failed = [r for r in caplog.records if "mirroring failed" in r.message]
    back = [r for r in caplog.records if "mirroring works again" in r.message]
    assert len(failed) == 1 and len(back) == 1, [r.message for r in caplog.records]

    assert_same_chain(ChainReader(local), ChainReader(url))
    assert ldformat.validate(url).ok
    truth = snapshot(model, opt)

    shutil.rmtree(local)  # the machine is gone: resume from the mirror
    model_b, opt_b = training(seed=7)
    fresh = tmp_path / "fresh"
    assert ldformat.resume(fresh, model_b, opt_b, mirror=url, mirror_options=S3_FAST_RETRY) == step
    assert_state_bits_equal(snapshot(model_b, opt_b), truth, "resumed from the s3 mirror")
    assert ChainReader(fresh).latest_step == step


def test_resume_keeps_a_deliberate_rewind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A truncation of the local chain below the mirror's latest step is the user's decision:
    resume honours it (the truncation is the newer record), and the next sync carries it."""
    caplog.set_level(logging.WARNING, LOGGER)
    mirror = str(tmp_path / "mirror")
    run(tmp_path / "chain", mirror, 10).close()
    assert ChainReader(mirror).latest_step == 10
    ldformat.truncate(tmp_path / "chain", 6)

    model, opt = training(seed=5)
    assert ldformat.resume(tmp_path / "chain", model, opt, mirror=mirror) == 6
    assert not any("mirror is ahead" in r.message for r in caplog.records)
    want_model, want_opt = training(seed=6)
    ldformat.resume(tmp_path / "chain", want_model, want_opt)
    assert_state_bits_equal(snapshot(model, opt), snapshot(want_model, want_opt), "the rewound step")
    ldformat.sync(tmp_path / "chain", mirror)
    assert ChainReader(mirror).latest_step == 6  # the rewind reached the mirror
