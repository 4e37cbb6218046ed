"""Crashes and lock races of writers on ``s3://`` (spec §7.4, §7.6, §15.3-§15.6).

S3 is a ``moto_server`` on 127.0.0.1 (``s3server.py``); every test here is skipped when
the ``s3`` extra or moto is missing.

- A writer process SIGKILLed at a random point (after a random recorded step, or in the
  middle of a multipart upload of an 18 MiB anchor object: at least one kill of the default
  run lands inside one) leaves a chain that validates;
  every step it reported durable materializes bit for bit; a new writer takes over its lock
  (same host, dead pid: stale), removes the uncommitted objects, appends, and the chain
  validates again. An incomplete multipart upload is no object: the chain never lists it.
  Only kills before the writer finished count toward the trials.
- Two or three processes opening one chain with a stale lock at once: exactly one proceeds,
  the others get ``ChainLockedError``, and no durable step is lost.
- ``examples/s3_checkpoint.py`` runs against the moto server.

Writers run in processes started with ``subprocess`` (fork + exec), never bare ``fork``:
obstore's runtime does not survive a fork after use. A few of them are kept warm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crash_writer as cw
import pytest
import s3_crash_writer as scw
from lock_race import check_race_outcome, run_race_trial
from models import assert_state_bits_equal, snapshot
from paths import REPO, SUPPORT

import ldformat
from ldformat import ChainReader, ChainWriter
from ldformat.chain.lock import current_lock
from ldformat.chain.records import lock_path

if TYPE_CHECKING:
    from s3server import MotoServer

pytest_plugins = ["s3server"]  # the fixtures moto, s3_env, s3_url

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="the lock's liveness check needs /proc"),
    pytest.mark.procs,
]

SMALL_TRIALS = 16  # alternately grad.dense and state.xor
BIG_TRIALS = 4  # grad.dense with an 18 MiB parameter: killed around multipart uploads
RACE_TRIALS = 20
SMALL = {"steps": 16, "batch_steps": 3, "anchor_every": 6}
BIG = {"steps": 8, "batch_steps": 2, "anchor_every": 3}
EXTRA_STEPS = 2
TRIAL_TIMEOUT_S = 60.0
POOL_SIZE = 3
COMMIT_STALL_S = 0.5


def _object_store(url: str) -> Any:
    from ldformat.stores import ObjectStore

    return ObjectStore(url)


def _s3_client(moto: MotoServer) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


# -- a pool of warm writer processes -----------------------------------------------------------
class WarmPool:
    """Writer processes (``s3_crash_writer.py serve``) started ahead of need; each runs one job."""

    def __init__(self, tmp: Path, size: int) -> None:
        self.tmp, self.size, self.n = tmp, size, 0
        self.idle: list[tuple[subprocess.Popen[str], Path]] = []
        self.used: list[subprocess.Popen[str]] = []
        self.fill()

    def fill(self) -> None:
        env = cw.child_env()  # os.environ (with the AWS variables of s3_env) + PYTHONPATH
        while len(self.idle) < self.size:
            self.n += 1
            err = self.tmp / f"worker-{self.n}.err"
            with open(err, "wb") as f:
                proc = subprocess.Popen([sys.executable, str(SUPPORT / "s3_crash_writer.py"), "serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True,
                                        env=env)
            self.idle.append((proc, err))

    def start(self, job: dict[str, Any]) -> tuple[subprocess.Popen[str], Path]:
        proc, err = self.idle.pop(0)
        self.fill()  # the replacement warms up while this one works
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], TRIAL_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        assert line.strip() == "ready", f"worker did not start: {line!r}\n{err.read_text()[-3000:]}"
        proc.stdin.write(cw_json(job) + "\n")
        proc.stdin.flush()
        self.used.append(proc)
        return proc, err

    def close(self) -> None:
        for proc in [p for p, _ in self.idle] + self.used:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def cw_json(job: dict[str, Any]) -> str:
    import json

    return json.dumps(job)


@pytest.fixture(scope="module")
def pool(s3_env: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmPool]:
    p = WarmPool(tmp_path_factory.mktemp("s3-writers"), POOL_SIZE)
    try:
        yield p
    finally:
        p.close()


class Events:
    def __init__(self, path: Path) -> None:
        self.recorded = 0
        self.durable: list[int] = []
        self.uploads: list[str] = []  # large writes started
        self.uploaded: list[str] = []  # ... and finished
        self.commits: list[str] = []  # commit records about to be created (with commit_stall)
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
            elif len(parts) == 2 and parts[0] == "U":
                self.uploads.append(parts[1])
            elif len(parts) == 2 and parts[0] == "u":
                self.uploaded.append(parts[1])
            elif len(parts) == 2 and parts[0] == "C":
                self.commits.append(parts[1])
            elif len(parts) == 2 and parts[0] in ("R", "D") and parts[1].isdigit():
                if parts[0] == "R":
                    self.recorded = int(parts[1])
                else:
                    self.durable.append(int(parts[1]))


_REFS: dict[tuple[str, bool], dict[int, dict[str, Any]]] = {}


def refs_for(kind: str, big: bool) -> dict[int, dict[str, Any]]:
    if (kind, big) not in _REFS:
        _REFS[(kind, big)] = scw.reference_states(kind, big, (BIG if big else SMALL)["steps"] + EXTRA_STEPS)
    return _REFS[(kind, big)]


# -- one crash trial ----------------------------------------------------------------------------
def run_writer(pool: WarmPool, tmp_path: Path, url: str, kind: str, big: bool, rng: random.Random,
               before_commit: bool = False, at_once: bool = False) -> tuple[int, Events, str]:
    """Run one writer and SIGKILL it; returns (dead pid, what it reported, where it was killed:
    ``mid-upload``, ``between``, ``before-commit``, or ``done``: it had recorded every step).

    With ``before_commit`` the writer stalls before creating each commit record, and is
    killed in the stall of a random one: its batch's objects are written, unreferenced.
    A ``big`` writer is killed at a random moment after a large upload started, or with
    ``at_once`` as soon as it is seen to start (inside it: an upload takes far longer).
    """
    conf = BIG if big else SMALL
    events_path = tmp_path / "events.txt"
    job = {"kind": kind, "big": big, "url": url, "events": str(events_path), **conf,
           "commit_stall": COMMIT_STALL_S if before_commit else 0.0}
    proc, err = pool.start(job)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S

    def progress(ev: Events) -> None:
        assert not ev.error and proc.poll() is None, f"the writer failed:\n{err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"writer made no progress\n{err.read_text()[-3000:]}"
        time.sleep(0.002)

    if before_commit:
        # The first record is the creation's; kill in the stall before a later one.
        target = rng.randint(2, 1 + conf["steps"] // conf["batch_steps"])
        while len((ev := Events(events_path)).commits) < target and not ev.done:
            progress(ev)
    elif big:
        # Kill after the n-th large upload started, at a random moment: mostly inside it.
        # Upload 1 is the creation's anchor: a kill there leaves no chain yet (an unfinished
        # creation, tests/chain/test_lock.py), so the first target is upload 2.
        target = rng.randint(2, 1 + conf["steps"] // conf["anchor_every"])
        while len((ev := Events(events_path)).uploads) < target and not ev.done:
            progress(ev)
        if not at_once:
            time.sleep(rng.uniform(0.0, 0.15))
    else:
        # Below the last step: a writer killed after it recorded every step crashed in nothing.
        target = rng.randint(1, conf["steps"] - 1)
        while (ev := Events(events_path)).recorded < target and not ev.done:
            progress(ev)
        time.sleep(rng.uniform(0.0, 0.01))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err.read_text()[-3000:])
    ev = Events(events_path)
    assert not ev.error, f"the writer failed before it was killed:\n{err.read_text()[-3000:]}"
    assert ev.durable and ev.durable[0] == 0, "the writer reported no durable step after create"
    if before_commit:
        assert not ev.done and len(ev.commits) == target, "the writer was not killed before a commit"
        return proc.pid, ev, "before-commit"
    where = "mid-upload" if len(ev.uploads) > len(ev.uploaded) else ("done" if ev.done else "between")
    return proc.pid, ev, where


def leftovers(store: Any, reader: ChainReader) -> list[str]:
    """Data objects no commit record references."""
    referenced = {a.object.path for a in reader.state.anchors.values()}
    for entry in reader.state.delta_entries():
        referenced.update(f"{entry.path}/{o.path}" for o in entry.objects)
    return sorted(p for p in store.list("") if p.split("/")[0] in ("anchors", "deltas") and p not in referenced)


def incomplete_uploads(moto: MotoServer, url: str) -> list[str]:
    bucket, prefix = _split(url)
    answer = _s3_client(moto).list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return [u["Key"] for u in answer.get("Uploads", [])]


def object_sizes(moto: MotoServer, url: str) -> dict[str, int]:
    bucket, prefix = _split(url)
    out: dict[str, int] = {}
    for page in _s3_client(moto).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def check_and_take_over(moto: MotoServer, url: str, kind: str, big: bool, dead_pid: int,
                        reported: list[int]) -> dict[str, Any]:
    refs = refs_for(kind, big)
    steps = (BIG if big else SMALL)["steps"]
    store = _object_store(url)
    lock = current_lock(store)
    assert lock is not None and lock.pid == dead_pid and lock.host == socket.gethostname(), lock

    # A request the killed writer had already sent (e.g. completing a multipart upload) may
    # still be finishing on the server: wait until the listing is stable.
    before = object_sizes(moto, url)
    for _ in range(50):
        time.sleep(0.2)
        again = object_sizes(moto, url)
        if again == before:
            break
        before = again
    report = ldformat.validate(url)
    assert report.ok, [str(p) for p in report.problems]
    assert object_sizes(moto, url) == before, "validate changed the chain"

    reader = ChainReader(url)
    latest = reader.latest_step
    assert latest is not None and reader.steps == list(range(latest + 1)), reader.steps
    assert set(reported) <= set(reader.steps), (reported, reader.steps)
    assert max(reported) <= latest <= steps
    # Every step reported durable, and what was committed after the last report (a kill
    # between commit() returning and the report), is exact.
    for s in sorted(set(reported) | set(range(max(reported) + 1, latest + 1))):
        assert_state_bits_equal(reader.materialize(s), refs[s], f"{kind} step {s} after the crash")
    found = leftovers(store, reader)
    pending = incomplete_uploads(moto, url)
    listed = set(store.list(""))
    for key in pending:  # an incomplete multipart upload is not an object (spec §7.4)
        assert key.removeprefix(_split(url)[1] + "/") not in listed, key

    model, optimizer = scw.make_training(kind, big)
    assert reader.load_into(model, optimizer)["step"] == latest
    conf = BIG if big else SMALL
    writer = ChainWriter.open(url, model, optimizer, batch_steps=conf["batch_steps"],
                              anchor_every=conf["anchor_every"])
    lock = current_lock(_object_store(url))
    assert lock is not None and lock.pid == os.getpid() and lock.generation > 1, lock
    assert writer.durable_step == latest
    after_open = ChainReader(url)
    assert after_open.steps == reader.steps
    assert leftovers(_object_store(url), after_open) == [], "leftovers survived the take-over"
    live: dict[int, dict[str, Any]] = {}
    for s in range(latest + 1, latest + 1 + EXTRA_STEPS):
        with cw.training_threads():
            cw.train(model, optimizer, None, s)
        writer.record_step(s)
        live[s] = snapshot(model, optimizer)
    assert writer.close() == latest + EXTRA_STEPS
    assert current_lock(_object_store(url)) is None
    report = ldformat.validate(url)
    assert report.ok, [str(p) for p in report.problems]
    final = ChainReader(url)
    assert final.steps == list(range(latest + EXTRA_STEPS + 1))
    for s, want in live.items():
        got = final.materialize(s)
        assert_state_bits_equal(got, want, f"{kind} step {s} appended after the crash")
        assert_state_bits_equal(got, refs[s], f"{kind} step {s} vs the uninterrupted run")
    return {"latest": latest, "leftovers": found, "incomplete_uploads": pending}


#: Trials run again, at most, in place of kills that came after the writer had finished.
MAX_REPLACED = 6


def crash_trials(pool: WarmPool, moto: MotoServer, tmp_path: Path, small: int, big: int) -> dict[str, int]:
    """``small + big`` trials in which the kill came before the writer finished (a kill after it
    did is checked too, but is not counted, and the trial is run again with another seed)."""
    from s3server import BUCKET

    outcomes: dict[str, int] = {}
    # Two of every eight small trials (one of each kind) are killed in a stall just before a
    # commit record. The first big trial is killed as soon as a large upload starts: at least
    # one kill lands inside a multipart upload.
    plan = [("state.xor" if i % 2 else "grad.dense", False, i % 8 >= 6, False) for i in range(small)]
    plan += [("grad.dense", True, False, i == 0) for i in range(big)]
    trial = replaced = 0
    while plan:
        kind, is_big, before_commit, at_once = plan.pop(0)
        rng = random.Random(f"ldformat-s3-crash-{trial}")
        trial += 1
        url = f"s3://{BUCKET}/crash-{trial}-{os.urandom(4).hex()}"
        trial_dir = tmp_path / f"t{trial}"
        trial_dir.mkdir()
        pid, ev, where = run_writer(pool, trial_dir, url, kind, is_big, rng, before_commit, at_once)
        facts = check_and_take_over(moto, url, kind, is_big, pid, ev.durable)
        if where == "done":
            outcomes["after done (not counted)"] = outcomes.get("after done (not counted)", 0) + 1
            replaced += 1
            assert replaced <= max(MAX_REPLACED, (small + big) // 5), f"too many kills after the end: {outcomes}"
            plan.append((kind, is_big, before_commit, at_once))
            continue
        assert facts["latest"] >= max(ev.durable)
        if before_commit:
            assert facts["leftovers"], "the objects of the uncommitted batch are missing"
            assert facts["latest"] == max(ev.durable), "a batch killed before its record was committed"
        for key, n in ((f"{kind}{' big' if is_big else ''} {where}", 1),
                       ("with leftovers", bool(facts["leftovers"])),
                       ("incomplete multipart uploads", len(facts["incomplete_uploads"]))):
            outcomes[key] = outcomes.get(key, 0) + int(n)
    print("crash outcomes:", outcomes)
    return outcomes


def test_sigkill_of_a_writer_at_random_points(pool: WarmPool, s3_env: MotoServer, tmp_path: Path) -> None:
    """20 writers on s3:// SIGKILLed at random points before they finished, 4 of them around
    multipart uploads, at least one inside one."""
    outcomes = crash_trials(pool, s3_env, tmp_path, SMALL_TRIALS, BIG_TRIALS)
    counted = {k: v for k, v in outcomes.items() if k.startswith(("grad", "state"))}
    assert sum(counted.values()) == SMALL_TRIALS + BIG_TRIALS, outcomes
    assert not any(k.endswith(" done") for k in counted), outcomes
    assert outcomes.get("grad.dense big mid-upload", 0) >= 1, outcomes
    assert outcomes.get("with leftovers", 0) >= SMALL_TRIALS // 4, outcomes


@pytest.mark.slow
def test_sigkill_of_a_writer_soak(pool: WarmPool, s3_env: MotoServer, tmp_path: Path) -> None:
    outcomes = crash_trials(pool, s3_env, tmp_path, 48, 12)
    assert sum(v for k, v in outcomes.items() if k.startswith(("grad", "state"))) == 60, outcomes
    assert outcomes.get("grad.dense big mid-upload", 0) > 0, outcomes


# -- two or three writers at once --------------------------------------------------------------
def make_chain(url: str, steps: int = 3) -> list[int]:
    model, optimizer = scw.make_training("grad.dense", False)
    writer = ChainWriter.create(url, model, optimizer, kind="grad.dense", batch_steps=2)
    with cw.training_threads():
        for s in range(1, steps + 1):
            cw.train(model, optimizer, None, s)
            writer.record_step(s)
    writer.close()
    return ChainReader(url).steps


def plant_stale_lock(url: str) -> int:
    """Make the newest lock generation a held lock of a writer that no longer runs (written
    through the store, as a writer would)."""
    import json

    store = _object_store(url)
    gens = [int(p[5:17]) for p in store.list("lock") if p.endswith(".json") and "/." not in p]
    g = max(gens, default=0) + 1
    owner = {"generation": g, "state": "held", "host": socket.gethostname(), "pid": os.getpid(),
             "start_time": "0", "since": 0, "token": "0123456789abcdef"}  # wrong start time: not us
    store.create_exclusive(lock_path(g), json.dumps(owner).encode())
    return g


@pytest.fixture(scope="module")
def race_pool(s3_env: MotoServer) -> Iterator[Any]:
    ctx = mp.get_context("spawn")  # a fresh interpreter: no obstore runtime inherited
    barrier = ctx.Barrier(3)
    workers = []
    for _ in range(3):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=scw.race_worker, args=(child, barrier), daemon=True)
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


def race_trials(race_pool: Any, trials: int) -> dict[str, int]:
    from s3server import BUCKET

    workers, barrier = race_pool
    outcomes: dict[str, int] = {}
    for trial in range(trials):
        url = f"s3://{BUCKET}/race-{trial}-{os.urandom(4).hex()}"
        before = make_chain(url)
        planted = plant_stale_lock(url)
        n = 2 + trial % 2
        stall = [0.0, 0.001, 0.003][trial % 3]
        results = run_race_trial(workers, barrier, {"url": url, "stall": stall}, n)
        won = check_race_outcome(results, url, before, _object_store(url), trial)
        assert won["generation"] > planted, "the winner did not take a new generation"
        outcomes[f"{n} processes"] = outcomes.get(f"{n} processes", 0) + 1
    return outcomes


def test_stale_lock_takeover_on_s3_is_exclusive(race_pool: Any) -> None:
    """20 trials of 2 or 3 processes taking over one stale lock on s3:// at once (spec §15.3)."""
    outcomes = race_trials(race_pool, RACE_TRIALS)
    assert outcomes == {"2 processes": RACE_TRIALS // 2, "3 processes": RACE_TRIALS // 2}


@pytest.mark.slow
def test_stale_lock_takeover_on_s3_soak(race_pool: Any) -> None:
    race_trials(race_pool, 100)


# -- the example ------------------------------------------------------------------------------
def test_s3_checkpoint_example_runs_against_moto(s3_env: MotoServer) -> None:
    from s3server import BUCKET

    url = f"s3://{BUCKET}/example-{os.urandom(4).hex()}"
    script = REPO / "examples" / "s3_checkpoint.py"
    for run, steps in enumerate((12, 7)):  # the second run resumes and appends
        out = subprocess.run([sys.executable, str(script), url, "--steps", str(steps)], env=cw.child_env(),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "bit-exact" in out.stdout and "validate: ok" in out.stdout, out.stdout
        assert f"step {12 + (7 if run else 0)} materialized" in out.stdout, out.stdout
    reader = ChainReader(url)
    assert reader.steps == list(range(20))
    assert ldformat.validate(url, deep=True).ok
