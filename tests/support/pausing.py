"""Deterministic pauses for the fencing tests (spec §7.5, §15.3, §15.4, §17).

A paused writer stands for a process stopped by SIGSTOP, a long GC pause, swapping, a VM
migration or a stuck NFS client. :class:`PausingStore` wraps a store and blocks the thread
that makes one chosen call (a primitive, a path pattern and the n-th matching call) until the
test releases it; from then until the release every other call through the same wrapper
blocks too, so the "process" (every thread of it that uses the store, a lease renewer
included) stands still as a stopped process would. The paused writer *A* runs in a thread of
the test process, so the pause lands exactly where it is asked; the test's main thread acts
as the other processes (*B*, *C*, ...). Being the same process, B takes the lock over with
``break_lock=True`` (what an operator does with a writer that looks dead), or, where A's
store makes A's lock generations look like another host's with a short lease, by waiting
the lease out with ``lock_wait`` (spec §15.6).

The rest is what the checks need:

- a :class:`Ledger` of every step some call reported durable (a commit that returned), with
  the bits of the state committed at that step, and the steps deliberately dropped since
  (compaction with ``keep_last``, truncation);
- :class:`Session`: one writer with its own model and optimizer, reporting to the ledger;
- :func:`run_trial`: one pause of A at one point of one phase (open, commit, renewal,
  snapshot, close, compaction, truncation), one interleaving of the others (commit and close,
  lease renewal, compaction, writer snapshots), then every fencing check.

Run as a script it is the child writer of the subprocess tests (PID namespaces, leases).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

import ldformat
from ldformat import ChainReader, ChainWriter, LockLostError, ReplicaDivergedError
from ldformat.chain.writer import SnapshotPolicy
from ldformat.errors import ChainLockedError
from ldformat.stores import LocalStore, MemoryStore, Store

#: No pause outlives this, and no thread is waited for longer: a failing test never hangs.
PAUSE_LIMIT_S = 120.0
JOIN_LIMIT_S = 120.0
#: The lease of the writers that renew in a trial (short: a renewal happens within a trial).
RENEW_LEASE_S = 0.2
#: A snapshot after every commit (spec §7.8): the records below the previous one are deleted.
EVERY_COMMIT = SnapshotPolicy(ratio=0.0, min_bytes=0, min_records=1, max_tail_records=1)
#: The token of a planted stale lock generation (not a holder of this test).
STALE_TOKEN = "5a1e5a1e5a1e5a1e"
BATCH_STEPS = 2

When = Literal["before", "after"]


# -- the pause -------------------------------------------------------------------------------------
class HarnessError(AssertionError):
    """The test itself went wrong (a pause point never reached, a pause never released)."""


@dataclass(frozen=True)
class PausePoint:
    """Where to pause: the ``nth`` call (from 1) of a primitive in ``op`` on a path matching
    ``path`` (shell patterns, :func:`fnmatch.fnmatchcase`; ``*`` crosses ``/``; for ``sync``
    any of its paths, for ``list`` the prefix), before the call or after it returned."""

    op: str | tuple[str, ...]
    path: str | tuple[str, ...] = "*"
    nth: int = 1
    when: When = "before"
    label: str = ""

    def matches(self, op: str, paths: Sequence[str]) -> bool:
        ops = (self.op,) if isinstance(self.op, str) else self.op
        patterns = (self.path,) if isinstance(self.path, str) else self.path
        return op in ops and any(fnmatch.fnmatchcase(p, pat) for p in (paths or ("",)) for pat in patterns)

    def __str__(self) -> str:
        if self.label:
            return self.label
        return f"{self.when} {self.op} {self.path} #{self.nth}"


@dataclass
class Call:
    """One call through a :class:`PausingStore`."""

    index: int
    op: str
    paths: tuple[str, ...]
    phase: str
    thread: str
    after_release: bool
    outcome: str = "running"  # "ok", or the exception's class name


class Pause:
    """One armed pause: ``reached`` once the paused thread blocks, ``release()`` lets it go."""

    def __init__(self, point: PausePoint) -> None:
        self.point = point
        self.reached = threading.Event()
        self._go = threading.Event()
        self.call: Call | None = None

    @property
    def released(self) -> bool:
        return self._go.is_set()

    def release(self) -> None:
        self._go.set()

    def block(self) -> None:
        if not self._go.wait(PAUSE_LIMIT_S):
            raise HarnessError(f"pause at {self.point} was never released")


class PausingStore(Store):
    """A store that blocks its caller at one chosen call (see the module documentation).

    Args:
        inner: the store that does the work.
        on_create: rewrites the bytes of each ``create_exclusive`` (path, data) -> data; e.g.
            to make a lock generation record a process that looks dead (a misjudged holder).

    Every call is recorded in :attr:`trace`, with the current :attr:`phase` label, whether it
    started after the pause was released, and how it ended.
    """

    def __init__(self, inner: Store, *, on_create: Callable[[str, bytes], bytes] | None = None) -> None:
        self.inner = inner
        self.on_create = on_create
        self.trace: list[Call] = []
        self.phase = ""
        self.pause: Pause | None = None
        self._matched = 0
        self._lock = threading.Lock()

    def arm(self, point: PausePoint) -> Pause:
        with self._lock:
            self.pause = Pause(point)
            self._matched = 0
            return self.pause

    def calls(self, phase: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self.trace if phase is None or c.phase == phase]

    def _call(self, op: str, paths: Sequence[str], run: Callable[[], Any]) -> Any:
        pause = self.pause
        if pause is not None and pause.reached.is_set() and not pause.released:
            pause.block()  # the whole process stands still while it is paused
        fire = False
        with self._lock:
            call = Call(len(self.trace), op, tuple(paths), self.phase, threading.current_thread().name,
                        after_release=pause is not None and pause.released)
            self.trace.append(call)
            if pause is not None and not pause.reached.is_set() and pause.point.matches(op, paths):
                self._matched += 1
                if self._matched == pause.point.nth:
                    fire = True
                    pause.call = call
                    pause.reached.set()
        if fire and pause is not None and pause.point.when == "before":
            pause.block()
            call.after_release = True
        try:
            result = run()
        except BaseException as e:
            call.outcome = type(e).__name__
            if fire and pause is not None and pause.point.when == "after":
                pause.block()
            raise
        call.outcome = "ok"
        if fire and pause is not None and pause.point.when == "after":
            pause.block()
        return result

    # -- the primitives ------------------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._call("write", [path], lambda: self.inner.write(path, data))

    def write_parts(self, path: str, parts: Sequence[Any]) -> None:
        self._call("write_parts", [path], lambda: self.inner.write_parts(path, parts))

    def sync(self, paths: Iterable[str]) -> None:
        wanted = list(paths)
        self._call("sync", wanted, lambda: self.inner.sync(wanted))

    def create_exclusive(self, path: str, data: bytes) -> None:
        if self.on_create is not None:
            data = self.on_create(path, data)
        self._call("create_exclusive", [path], lambda: self.inner.create_exclusive(path, data))

    def read(self, path: str) -> bytes:
        return self._call("read", [path], lambda: self.inner.read(path))  # type: ignore[no-any-return]

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self._call("read_buffer", [path], lambda: self.inner.read_buffer(path, max_size))  # type: ignore[no-any-return]

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        return self._call("read_buffer_crc32c", [path],  # type: ignore[no-any-return]
                          lambda: self.inner.read_buffer_crc32c(path, max_size, seed))

    def size(self, path: str) -> int:
        return self._call("size", [path], lambda: self.inner.size(path))  # type: ignore[no-any-return]

    def list(self, prefix: str) -> list[str]:
        return self._call("list", [prefix], lambda: self.inner.list(prefix))  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        self._call("delete", [path], lambda: self.inner.delete(path))

    def exists(self, path: str) -> bool:
        return self._call("exists", [path], lambda: self.inner.exists(path))  # type: ignore[no-any-return]

    def local_path(self, path: str) -> Path | None:
        return self._call("local_path", [path], lambda: self.inner.local_path(path))  # type: ignore[no-any-return]


class StaleListingStore(Store):
    """A store whose ``list(prefix)`` answers with an answer it gave earlier (:meth:`freeze`),
    as a caching gateway or an eventually consistent S3-compatible store may (spec §7.7).

    ``replays``: how many later ``list(prefix)`` calls get the frozen answer (None: all).
    """

    def __init__(self, inner: Store, prefix: str = "log", replays: int | None = None) -> None:
        self.inner = inner
        self.prefix = prefix
        self.replays = replays
        self.replayed = 0
        self.frozen: list[str] | None = None

    def freeze(self) -> list[str]:
        self.frozen = self.inner.list(self.prefix)
        return self.frozen

    def list(self, prefix: str) -> list[str]:
        if (prefix == self.prefix and self.frozen is not None
                and (self.replays is None or self.replayed < self.replays)):
            self.replayed += 1
            return list(self.frozen)
        return self.inner.list(prefix)

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write(path, data)

    def write_parts(self, path: str, parts: Sequence[Any]) -> None:
        self.inner.write_parts(path, parts)

    def sync(self, paths: Iterable[str]) -> None:
        self.inner.sync(paths)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(path, data)

    def read(self, path: str) -> bytes:
        return self.inner.read(path)

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self.inner.read_buffer(path, max_size)

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        return self.inner.read_buffer_crc32c(path, max_size, seed)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def local_path(self, path: str) -> Path | None:
        return self.inner.local_path(path)


# -- training and exact state ----------------------------------------------------------------------
StateBits = dict[str, bytes]


def tiny_training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A few-parameter model: every trial's tensors are tiny."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_one(model: torch.nn.Module, optimizer: torch.optim.Optimizer, who: str, step: int) -> None:
    """One step on data of the writer ``who``: two writers' step 6 differ in every bit."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{who}/{step}".encode()))
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def tensor_bits(t: torch.Tensor) -> bytes:
    """dtype, shape and the raw bytes (an integer view: -0.0 != 0.0, NaN payloads count)."""
    t = t.detach().cpu().contiguous()
    return f"{t.dtype}{tuple(t.shape)}:".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()


def state_bits(model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> StateBits:
    out: StateBits = {f"model/{k}": tensor_bits(v) for k, v in model_state.items()}
    for i, s in optimizer_state["state"].items():
        for k, v in s.items():
            out[f"optimizer/{i}/{k}"] = tensor_bits(v) if isinstance(v, torch.Tensor) else repr(v).encode()
    out["param_groups"] = repr([sorted(g.items()) for g in optimizer_state["param_groups"]]).encode()
    return out


def live_bits(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateBits:
    return state_bits(model.state_dict(), optimizer.state_dict())


def differing(got: StateBits, want: StateBits) -> list[str]:
    return sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))


# -- the ledger ------------------------------------------------------------------------------------
@dataclass
class Report:
    who: str
    step: int
    bits: StateBits
    after_takeover: bool


@dataclass
class Drop:
    steps: frozenset[int]
    why: str


class Ledger:
    """Every step some call reported durable, in order, and the steps dropped on purpose."""

    def __init__(self) -> None:
        self.events: list[Report | Drop] = []
        self.takeover = False  # set once the others start acting while A is paused
        self._lock = threading.Lock()

    def report(self, who: str, step: int, bits: StateBits) -> None:
        with self._lock:
            self.events.append(Report(who, step, bits, self.takeover))

    def drop(self, steps: Iterable[int], why: str) -> None:
        with self._lock:
            self.events.append(Drop(frozenset(steps), why))

    def reports(self, who: str | None = None) -> list[Report]:
        with self._lock:
            return [e for e in self.events if isinstance(e, Report) and (who is None or e.who == who)]

    def standing(self) -> list[Report]:
        """The reports that must still hold: those not dropped on purpose after they were made."""
        with self._lock:
            out = []
            for i, e in enumerate(self.events):
                if isinstance(e, Report) and not any(
                        isinstance(d, Drop) and e.step in d.steps for d in self.events[i + 1:]):
                    out.append(e)
            return out


def check_ledger(ledger: Ledger, path: str, store: Store) -> list[str]:
    """Every standing report materializes bit-exactly (0 lost, 0 false durable)."""
    problems: list[str] = []
    reader = ChainReader(path, store=store)
    for r in ledger.standing():
        what = f"step {r.step} reported durable by {r.who}" + (" after the takeover" if r.after_takeover else "")
        try:
            got = reader.materialize(r.step)
        except ldformat.StepNotFoundError:
            problems.append(f"{UNSAFE} {what} is not in the chain (false durable)" if r.after_takeover else
                            f"{UNSAFE} {what} is lost (not in the chain)")
            continue
        except Exception as e:  # any failure to read a durable step is a finding
            problems.append(f"{UNSAFE} {what} is lost: {type(e).__name__}: {first_line(e)}")
            continue
        diff = differing(state_bits(got["model"], got["optimizer"]), r.bits)
        if diff:
            kind = "false durable: the chain holds another writer's step" if r.after_takeover else "lost"
            problems.append(f"{UNSAFE} {what} materializes to other bits ({kind}; differs in {diff[:3]})")
    return problems


#: The classes of violations, the first word of each: "unsafe" (a step lost or falsely durable,
#: a newer holder's object deleted, a superseded writer not stopped, validate or sync failing,
#: the chain left locked), "error" (a superseded writer stopped cleanly, but not with
#: LockLostError), "harness" (the test itself went wrong).
UNSAFE, ERROR, HARNESS = "unsafe:", "error:", "harness:"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]


# -- writers ---------------------------------------------------------------------------------------
def open_writer(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, store: Store,
                lease_s: float | None = None, **kw: Any) -> ChainWriter:
    """``ChainWriter.open``, with a lease of ``lease_s`` seconds: through its ``lease_s``
    parameter where it has one, else through a lock taken with that lease (``lock=``)."""
    if lease_s is None:
        return ChainWriter.open(path, model, optimizer, store=store, **kw)
    if "lease_s" in inspect.signature(ChainWriter.open).parameters:
        return ChainWriter.open(path, model, optimizer, store=store, **{**kw, "lease_s": lease_s})
    from ldformat.chain.lock import WriterLock

    lock = WriterLock.acquire(store, path, break_lock=kw.pop("break_lock", False),
                              wait_s=kw.pop("lock_wait", 0.0), lease_s=lease_s)
    return ChainWriter.open(path, model, optimizer, store=store, lock=lock, **kw)


class Session:
    """One writer: its own model and optimizer, trained on its own data; every step a call of
    it reports durable goes to the ledger with the bits of the state at that step."""

    def __init__(self, who: str, ledger: Ledger, store: Store, path: str, *, kind: str = "grad.dense") -> None:
        self.who, self.ledger, self.store, self.path, self.kind = who, ledger, store, path, kind
        self.model, self.optimizer = tiny_training()
        self.states: dict[int, StateBits] = {}
        self.reported: set[int] = set()
        self.writer: ChainWriter | None = None
        self.next_step = 0

    def create(self, **kw: Any) -> None:
        self.states[0] = live_bits(self.model, self.optimizer)
        self.writer = ChainWriter.create(self.path, self.model, self.optimizer, kind=self.kind,
                                         batch_steps=BATCH_STEPS, store=self.store, **kw)
        self.next_step = 1
        self._report()

    def open(self, *, load: bool = True, **kw: Any) -> None:
        self.writer = open_writer(self.path, self.model, self.optimizer, store=self.store,
                                  batch_steps=BATCH_STEPS, **kw)
        if load:
            self.load()

    def load(self) -> None:
        """Load the state of the writer's durable step into the live objects (ChainWriter.open's
        precondition)."""
        assert self.writer is not None
        d = self.writer.durable_step
        if d is not None:
            ChainReader(self.path, store=self.store).load_into(self.model, self.optimizer, d)
        self.next_step = (d or 0) + 1

    def train(self, n: int) -> None:
        assert self.writer is not None
        for _ in range(n):
            step = self.next_step
            train_one(self.model, self.optimizer, self.who, step)
            self.states[step] = live_bits(self.model, self.optimizer)
            self.next_step += 1
            self.writer.record_step(step)  # commits a full batch
            self._report()

    def commit(self) -> None:
        assert self.writer is not None
        self.writer.commit()
        self._report()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._report()

    def abort(self) -> None:
        if self.writer is not None:
            try:
                self.writer.abort()
            except Exception:  # only tidying up after a failure
                pass

    def _report(self) -> None:
        assert self.writer is not None
        d = self.writer.durable_step
        for s in sorted(self.states):
            if d is not None and s <= d and s not in self.reported:
                self.reported.add(s)
                self.ledger.report(self.who, s, self.states[s])


# -- lock inspection (spec §15.1; read only) -------------------------------------------------------
_GENERATION = re.compile(r"^lock/(\d{12})\.json$")


def generations(store: Store) -> list[int]:
    return sorted(int(m.group(1)) for p in store.list("lock") if (m := _GENERATION.match(p)))


def newest_lock(store: Store) -> dict[str, Any] | None:
    """The newest lock generation's content, or None without one."""
    for _ in range(8):
        gens = generations(store)
        if not gens:
            return None
        try:
            d = json.loads(store.read(f"lock/{gens[-1]:012d}.json"))
        except FileNotFoundError:
            continue
        return d if isinstance(d, dict) else {}
    return None


def holder_token(store: Store) -> str | None:
    """The token of the lock's holder, None if it is released or free."""
    d = newest_lock(store)
    return d.get("token") if d is not None and d.get("state") == "held" else None


def plant_stale_lock(store: Store) -> None:
    """A held generation of a writer of this host that no longer runs (a wrong start time)."""
    g = max(generations(store), default=0) + 1
    owner = {"generation": g, "state": "held", "host": socket.gethostname(), "pid": os.getpid(),
             "start_time": "0", "since": 0, "token": STALE_TOKEN}
    store.create_exclusive(f"lock/{g:012d}.json", json.dumps(owner).encode())


# -- environments ----------------------------------------------------------------------------------
class Env(Protocol):
    kind: str
    path: str

    def handle(self) -> Store:
        """A fresh handle on the chain's storage, as another process would open it."""


class MemoryEnv:
    kind = "memory"

    def __init__(self) -> None:
        self._store = MemoryStore()
        self.path = "memory-chain"

    def handle(self) -> Store:
        return self._store.reopen()


class LocalEnv:
    kind = "local"

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True)
        self.root = root
        self.path = str(root)

    def handle(self) -> Store:
        return LocalStore(self.root)


class S3Env:
    kind = "s3"
    FAST_RETRY = {"retry_init_backoff": 0.01, "retry_max_backoff": 0.05}

    def __init__(self, url: str) -> None:
        self.path = url

    def handle(self) -> Store:
        from ldformat.stores import ObjectStore

        return ObjectStore(self.path, storage_options=self.FAST_RETRY)


# -- one trial -------------------------------------------------------------------------------------
#: What A does when it is paused.
PHASES = ("open", "open-takeover", "commit", "renew", "snapshot", "close", "compact", "compact-keep", "truncate")
#: What the others do meanwhile.
INTERLEAVINGS = ("commit", "renew", "compact", "snapshot", "compact-takeover", "commit-compact")

#: The named points of each phase (spec terms); the sweep adds every call A makes.
NAMED_POINTS: dict[str, dict[str, PausePoint]] = {
    "open": {
        "take-lock": PausePoint("create_exclusive", "lock/*", label="before A creates its lock generation"),
        "fold": PausePoint(("read", "read_buffer", "read_buffer_crc32c"), "log/*",
                           label="before A reads its first record"),
        "gc-list": PausePoint("list", ("anchors", "deltas", "segments"),
                              label="after A folded, before it lists garbage"),
        "gc-delete": PausePoint("delete", label="before A's first garbage deletion"),
    },
    "open-takeover": {
        "fence": PausePoint("create_exclusive", "log/*", label="before A creates its fence record"),
        "gc-list": PausePoint("list", ("anchors", "deltas", "segments"),
                              label="after A fenced and folded, before it lists garbage"),
        "gc-delete": PausePoint("delete", label="before A's first garbage deletion"),
    },
    "commit": {
        "objects": PausePoint(("write", "write_parts"), "deltas/*", label="before A writes its batch"),
        "sync": PausePoint("sync", label="before A syncs its batch"),
        "record": PausePoint("create_exclusive", "log/*", label="after A's lock check, before it creates its record"),
    },
    "renew": {
        "renew": PausePoint("create_exclusive", "lock/*", label="before A creates its renewed generation"),
        "renew-delete": PausePoint("delete", "lock/*", label="before A deletes its superseded generation"),
        "record": PausePoint("create_exclusive", "log/*", label="before A creates its record (after renewing)"),
    },
    "snapshot": {
        "snapshot-record": PausePoint("create_exclusive", "log/*", nth=2,
                                      label="before A creates its snapshot record"),
        "superseded-delete": PausePoint("delete", "log/*", label="before A deletes a superseded record"),
    },
    "close": {
        "record": PausePoint("create_exclusive", "log/*", label="before A creates its last record"),
        "release": PausePoint("create_exclusive", "lock/*", label="before A creates its released generation"),
    },
    "compact": {
        "anchor": PausePoint(("write", "write_parts"), "anchors/*", label="before A writes a new anchor"),
        "snapshot-record": PausePoint("create_exclusive", "log/*", label="before A creates its snapshot record"),
        "gc-list": PausePoint("list", ("anchors", "deltas", "segments"),
                              label="after A's snapshot, before it lists garbage"),
        "gc-delete": PausePoint("delete", label="before A's first garbage deletion"),
    },
    "compact-keep": {
        "snapshot-record": PausePoint("create_exclusive", "log/*", label="before A creates its snapshot record"),
        "gc-delete": PausePoint("delete", label="before A's first garbage deletion"),
    },
    "truncate": {
        "snapshot-record": PausePoint("create_exclusive", "log/*", label="before A creates its truncation record"),
        "gc-delete": PausePoint("delete", label="before A's first garbage deletion"),
    },
}

TRUNCATE_AFTER = 2
#: How a taker gets A's lock: ``break_lock=True``, or waiting out the lease of a lock that A's
#: store makes look like another host's (the lease expiry of spec §15.6).
Takeover = Literal["break", "lease"]
OTHER_HOST = "another-host.invalid"
TAKEOVER_LEASE_S = 0.3


@dataclass(frozen=True)
class Shape:
    """How many steps each writer of a trial commits, and how the others take A's lock."""

    w0_steps: int = 4  # the chain before A: steps 0..w0_steps, in records of BATCH_STEPS steps
    b_steps: int = 4
    c_steps: int = 2
    post_steps: int = 2  # what A trains and commits after its release, if it still can
    takeover: Takeover = "break"


@dataclass
class TrialResult:
    env: str
    phase: str
    interleaving: str
    point: str
    violations: list[str] = field(default_factory=list)
    reached: bool = False
    superseded: bool = False
    a_error: str = ""
    a_error_type: type[BaseException] | None = None
    a_steps_after: list[int] = field(default_factory=list)
    a_deleted_after: list[str] = field(default_factory=list)
    seconds: float = 0.0
    trace: list[Call] = field(default_factory=list)

    def describe(self) -> str:
        return f"[{self.env} {self.phase} @ {self.point} | others: {self.interleaving}]"

    def explain(self) -> str:
        lines = [f"{self.describe()} A held the lock when paused: {self.superseded}; "
                 f"A ended with: {self.a_error or 'no error'}"]
        return "\n".join(lines + [f"  - {x}" for x in self.violations])


def other_host_lock(path: str, data: bytes) -> bytes:
    """A's lock generations as another host's with a short lease: a taker may wait it out."""
    if not path.startswith("lock/"):
        return data
    d = json.loads(data)
    if d.get("state") == "held":
        d.update(host=OTHER_HOST, lease_s=TAKEOVER_LEASE_S)
    return json.dumps(d).encode()


class _Trial:
    def __init__(self, env: Env, phase: str, interleaving: str, point: PausePoint | None, shape: Shape,
                 result: TrialResult) -> None:
        self.env, self.phase, self.interleaving, self.point, self.shape = env, phase, interleaving, point, shape
        self.result = result
        self.ledger = Ledger()
        self.store = env.handle()  # what the others (B, C, E) and the checks use
        self.replicas: list[MemoryStore] = []  # one per sync during the pause: each saw another log
        self.planned_drop: list[int] = []  # what A's compaction or truncation drops, known before it runs
        self.a_dropped: list[int] | None = None  # what it dropped, once it returned
        self.a_store = PausingStore(env.handle(), on_create=other_host_lock if shape.takeover == "lease" else None)
        self.a = Session("A", self.ledger, self.a_store, env.path)
        self.a_error: BaseException | None = None
        self.lock_max_at_release = 0
        self.a_retook = False

    # -- set-up: W0 commits steps 0..w0_steps and closes; a leftover object is garbage --------------------
    def setup(self) -> None:
        w0 = Session("W0", self.ledger, self.store, self.env.path)
        w0.create()
        w0.train(self.shape.w0_steps)
        w0.close()
        self.store.write("anchors/99-0badc0de.safetensors", b"an uncommitted leftover")
        self.store.sync(["anchors/99-0badc0de.safetensors"])
        if self.phase == "open-takeover":
            plant_stale_lock(self.store)

    # -- A, in its own thread --------------------------------------------------------------------------
    def run_a(self) -> None:
        a, path = self.a, self.env.path
        try:
            self.a_store.phase = "pre"
            op: Callable[[], None]
            if self.phase in ("open", "open-takeover"):
                def op() -> None:
                    a.open(load=False, break_lock=self.phase == "open-takeover")
            elif self.phase == "renew":
                a.open(lease_s=RENEW_LEASE_S)
                a.train(1)

                def op() -> None:  # one step longer than half the lease, then its commit
                    time.sleep(RENEW_LEASE_S * 0.7)
                    a.train(1)
            elif self.phase in ("commit", "snapshot", "close"):
                a.open()
                if self.phase == "snapshot":
                    assert a.writer is not None
                    a.writer.snapshot_policy = EVERY_COMMIT
                    a.train(2)  # a first snapshot: the next one deletes the records below it
                a.train(1)

                def op() -> None:
                    if self.phase == "close":
                        a.close()
                    else:
                        a.train(1)  # a full batch: commit (and snapshot)
            elif self.phase in ("compact", "compact-keep"):
                keep = 2 if self.phase == "compact-keep" else None
                self.planned_drop = ldformat.compact(path, store=self.a_store, keep_last=keep, max_replay=1,
                                                     dry_run=True).dropped_steps

                def op() -> None:
                    plan = ldformat.compact(path, store=self.a_store, keep_last=keep, max_replay=1)
                    self.a_dropped = plan.dropped_steps
            elif self.phase == "truncate":
                self.planned_drop = list(range(TRUNCATE_AFTER + 1, self.shape.w0_steps + 1))

                def op() -> None:
                    self.a_dropped = ldformat.truncate(path, TRUNCATE_AFTER, store=self.a_store)
            else:
                raise HarnessError(f"unknown phase {self.phase}")
            if self.point is not None:
                self.a_store.arm(self.point)
            self.a_store.phase = "op"
            op()
            self.a_store.phase = "post"
            if a.writer is not None and self.phase != "close":
                if self.phase in ("open", "open-takeover"):
                    a.load()
                a.train(self.shape.post_steps)
                a.commit()
                a.close()
        except BaseException as e:  # recorded, judged by the checks
            self.a_error = e
        finally:
            a.abort()

    # -- the others, in the main thread while A is paused ----------------------------------------------------
    def sync_mid(self) -> None:
        """A replica that saw the chain as it was now (a mirror stops where it was synced last)."""
        replica = MemoryStore()
        ldformat.sync(self.store, replica)
        self.replicas.append(replica)

    def take_over(self, b: Session, **kw: Any) -> None:
        if self.shape.takeover == "lease":
            b.open(lock_wait=PAUSE_LIMIT_S / 4, **kw)  # A's lease runs out while it is paused
        else:
            b.open(break_lock=True, **kw)

    def others(self) -> Callable[[], None] | None:
        """What the others do while A is paused; returns what they do after A went on."""
        led, st, path, shape = self.ledger, self.store, self.env.path, self.shape
        b = Session("B", led, st, path)
        il = self.interleaving
        if il in ("commit", "commit-compact"):
            self.take_over(b)
            b.train(shape.b_steps)
            b.close()
            c = Session("C", led, st, path)
            c.open()
            c.train(shape.c_steps)
            c.close()
            self.sync_mid()
            if il == "commit-compact":
                led.drop(ldformat.compact(path, store=st, max_replay=1).dropped_steps, "compact")
                self.sync_mid()
        elif il == "renew":
            self.take_over(b, lease_s=RENEW_LEASE_S)
            first = generations(st)[-1]
            b.train(BATCH_STEPS)
            for _ in range(2):  # two renewals: B's first generations are deleted, their names free again
                time.sleep(RENEW_LEASE_S * 0.7)
                b.train(BATCH_STEPS)  # renews at this commit (or its renewer thread did meanwhile)
            if generations(st)[-1] < first + 2:
                raise HarnessError(f"{HARNESS} B did not renew its lease twice")
            self.sync_mid()

            def after() -> None:  # B still holds the lock while A goes on
                try:
                    b.train(BATCH_STEPS)
                    b.close()
                finally:
                    b.abort()  # a failed B must not keep its lock (and its renewer) alive
            return after
        elif il == "compact":
            self.take_over(b)
            b.train(shape.b_steps)
            b.close()
            self.sync_mid()
            led.drop(ldformat.compact(path, store=st, max_replay=1).dropped_steps, "compact")
            self.sync_mid()
        elif il == "snapshot":
            self.take_over(b)
            assert b.writer is not None
            b.writer.snapshot_policy = EVERY_COMMIT
            b.train(max(shape.b_steps, 3 * BATCH_STEPS))  # three snapshots: the fence and older records go
            b.close()
            self.sync_mid()
        elif il == "compact-takeover":
            if shape.takeover == "lease":
                raise HarnessError("compact-takeover breaks the lock")
            plan = ldformat.compact(path, store=st, keep_last=2, max_replay=1, break_lock=True)
            led.drop(plan.dropped_steps, "compact keep_last=2")
            c = Session("C", led, st, path)
            c.open()
            c.train(shape.c_steps)
            c.close()
            self.sync_mid()
        else:
            raise HarnessError(f"unknown interleaving {il}")
        return None

    # -- the whole trial ---------------------------------------------------------------------------------------
    def run(self) -> None:
        res, v = self.result, self.result.violations
        self.setup()
        thread = threading.Thread(target=self.run_a, name="paused-A", daemon=True)
        thread.start()
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while time.monotonic() < deadline and thread.is_alive():
            pause = self.a_store.pause
            if pause is not None and pause.reached.wait(0.005):
                break
        pause = self.a_store.pause
        res.reached = pause is not None and pause.reached.is_set()
        if self.point is None or not res.reached or pause is None:
            thread.join(JOIN_LIMIT_S)
            res.trace = self.a_store.calls()
            why = "" if self.a_error is None else f" (A: {type(self.a_error).__name__}: {first_line(self.a_error)})"
            if self.point is None and self.a_error is not None:
                v.append(f"{HARNESS} the reference run failed{why}")
            elif self.point is not None:
                v.append(f"{HARNESS} the pause point was never reached{why}")
            return
        # At the pause: who holds the lock, and what exists (A may delete only that).
        token = holder_token(self.store)
        res.superseded = token is not None and token != STALE_TOKEN
        existing = set(self.store.list(""))
        if self.planned_drop and any(c.op == "create_exclusive" and c.paths[0].startswith("log/")
                                     and c.outcome == "ok" for c in self.a_store.calls("op")):
            self.ledger.drop(self.planned_drop, f"A's {self.phase} committed before the pause")
        self.ledger.takeover = True
        after: Callable[[], None] | None = None
        try:
            after = self.others()
        except BaseException as e:  # a finding (or a harness failure), reported
            v.append(f"{UNSAFE} the others failed while A was paused: {type(e).__name__}: {first_line(e)}")
        finally:
            # The newest lock generation when A goes on: one A creates above it is a later take
            # of the lock (after the others released it), not the generation A held when paused.
            self.lock_max_at_release = max(generations(self.store), default=0)
            pause.release()
        thread.join(JOIN_LIMIT_S)
        res.trace = self.a_store.calls()
        if thread.is_alive():
            v.append(f"{UNSAFE} A did not finish after its release")
            return
        self.judge_a(existing)
        if (not res.superseded or self.a_retook) and self.a_dropped:
            # A took the lock after the others, legitimately, and compacted or truncated: on purpose.
            self.ledger.drop(self.a_dropped, f"A's {self.phase} after the others")
        self.sync_all([(f"replica {i + 1} (synced while A was paused)", r) for i, r in enumerate(self.replicas)])
        try:
            if after is not None:
                after()
        except LockLostError as e:
            # A breaking the lock is what open-takeover asks of it: when it held nothing at its
            # pause, or took the lock again after it.
            if not (self.phase == "open-takeover" and (not res.superseded or self.a_retook)):
                v.append(f"{UNSAFE} the holder lost its lock to A: {first_line(e)}")
        except BaseException as e:
            v.append(f"{UNSAFE} the holder failed after A went on: {type(e).__name__}: {first_line(e)}")
        self.check_chain()

    def judge_a(self, existing: set[str]) -> None:
        res, v = self.result, self.result.violations
        err = self.a_error
        res.a_error = "" if err is None else f"{type(err).__name__}: {first_line(err)}"
        res.a_error_type = None if err is None else type(err)
        post = [c for c in self.a_store.calls() if c.after_release]
        res.a_steps_after = [r.step for r in self.ledger.reports("A") if r.after_takeover]
        res.a_deleted_after = [c.paths[0] for c in post if c.op == "delete"]
        if not res.superseded:
            if err is not None and not isinstance(err, ChainLockedError):
                v.append(f"{ERROR} A (not holding the lock when paused) failed: {res.a_error}")
            return
        # A paused inside its own take of the lock (after creating its generation, before
        # confirming it is the newest) holds nothing: it either takes the lock again after the
        # others released it (a later holder, judged by the chain checks like any other) or is
        # refused with ChainLockedError, having acted on nothing.
        retook = any(c.op == "create_exclusive" and c.outcome == "ok" and c.paths[0].startswith("lock/")
                     and (m := _GENERATION.match(c.paths[0])) is not None
                     and int(m.group(1)) > self.lock_max_at_release for c in post)
        acted = any(c.op == "delete" or (c.op == "create_exclusive" and c.outcome == "ok"
                                         and c.paths[0].startswith("log/")) for c in post)
        self.a_retook = retook
        if retook or (isinstance(err, ChainLockedError) and not acted):
            return
        # A held the lock when it paused. Whatever it reports after the takeover is checked against
        # the chain (check_ledger); here: it deletes nothing newer, and it stops with LockLostError.
        for p in res.a_deleted_after:
            if p not in existing:
                v.append(f"{UNSAFE} A deleted {p}, which a newer holder created after A's pause")
        created = [c.paths[0] for c in post if c.op == "create_exclusive" and c.outcome == "ok"
                   and c.paths[0].startswith("log/")]
        if err is None:
            if created:
                v.append(f"{UNSAFE} A was never stopped (no LockLostError): it created {created} after the takeover "
                         f"and returned (reporting steps {res.a_steps_after} durable)")
        elif not isinstance(err, LockLostError):
            v.append(f"{ERROR} A stopped with {res.a_error} instead of LockLostError"
                     + (f" (after creating {created})" if created else ""))

    def check_chain(self) -> None:
        v, st, path = self.result.violations, self.store, self.env.path
        # A later writer opens without breaking any lock and appends.
        e = Session("E", self.ledger, st, path)
        try:
            e.open()
            e.train(2)
            e.close()
        except BaseException as exc:
            e.abort()
            v.append(f"{UNSAFE} a later writer could not append: {type(exc).__name__}: {first_line(exc)}")
        v.extend(check_ledger(self.ledger, path, self.env.handle()))
        report = ldformat.validate(path, store=self.env.handle())
        if not report.ok:
            v.append(f"{UNSAFE} validate: " + "; ".join(str(p) for p in report.problems[:3]))
        self.sync_all([("a fresh replica", MemoryStore())])

    def sync_all(self, replicas: list[tuple[str, MemoryStore]]) -> None:
        """The next sync of each replica (a mirror's, right after A went on) reports no divergence."""
        for name, replica in replicas:
            try:
                ldformat.sync(self.env.handle(), replica)
            except ReplicaDivergedError as exc:
                self.result.violations.append(f"{UNSAFE} sync to {name}: false ReplicaDivergedError: {first_line(exc)}")
            except BaseException as exc:
                self.result.violations.append(f"{UNSAFE} sync to {name} failed: {type(exc).__name__}: "
                                              f"{first_line(exc)}")


def run_trial(env: Env, phase: str, interleaving: str, point: PausePoint | None,
              shape: Shape = Shape()) -> TrialResult:
    """Pause A (in a thread) at ``point`` of ``phase``, let the others do ``interleaving``,
    release A, then check every fencing invariant; ``point`` None: a reference run that
    only records A's calls."""
    result = TrialResult(env.kind, phase, interleaving, str(point) if point is not None else "reference")
    started = time.monotonic()
    trial = _Trial(env, phase, interleaving, point, shape, result)
    try:
        trial.run()
    except BaseException as e:  # the set-up or a check itself failed
        result.violations.append(f"{HARNESS} {type(e).__name__}: {first_line(e)}\n{traceback.format_exc()}")
    result.seconds = time.monotonic() - started
    return result


# -- the sweep's points ----------------------------------------------------------------------------
_TOKEN = re.compile(r"-[0-9a-f]{8}(?=[./]|$)")
_LOCK_FILE = re.compile(r"^lock/\d{12}\.json$")


def normalized(path: str) -> str:
    """A path with its random name part as ``*`` (anchors/3-1a2b3c4d.safetensors ->
    anchors/3-*.safetensors), and a lock generation's number too (a renewer thread makes it
    depend on timing), so that a point found in one run names the same call in the next."""
    return "lock/*.json" if _LOCK_FILE.match(path) else _TOKEN.sub("-*", path)


_READS = ("read", "read_buffer", "read_buffer_crc32c", "size", "local_path", "exists")
_DATA = ("anchors/", "deltas/", "segments/")


def _run_key(c: Call) -> tuple[str, str] | None:
    """Consecutive calls with the same key are one point of the sweep: the reads of data objects
    (a replay), the writes of one batch's objects."""
    p = c.paths[0] if c.paths else ""
    if c.op in _READS and p.startswith(_DATA):
        return ("read data", "")
    if c.op in ("write", "write_parts") and p.startswith("deltas/"):
        return ("write batch", "/".join(p.split("/")[:2]))
    return None


def points_of(calls: Sequence[Call], *, collapse: bool = True) -> list[PausePoint]:
    """A point before each call of a reference run's ``op`` phase (by primitive, path and count);
    with ``collapse``, one for each run of data reads and one for each batch's writes."""
    out: list[PausePoint] = []
    seen: list[Call] = []
    previous: tuple[str, str] | None = None
    for c in calls:
        if c.phase != "op":
            continue
        seen.append(c)
        key = _run_key(c)
        if collapse and key is not None and key == previous:
            continue
        previous = key
        pattern = normalized(c.paths[0]) if c.paths else "*"
        probe = PausePoint(c.op, pattern)
        nth = sum(1 for d in seen if probe.matches(d.op, d.paths))
        shown = c.paths[0] if c.paths else ""
        out.append(PausePoint(c.op, pattern, nth, label=f"before {c.op}({shown}) #{nth}"))
    return out


def summarize(results: Sequence[TrialResult]) -> str:
    """The violating trials, worst first, with counts by class (unsafe, error, harness)."""
    bad = [r for r in results if r.violations]
    counts = {c: sum(1 for r in bad if any(x.startswith(c) for x in r.violations)) for c in (UNSAFE, ERROR, HARNESS)}
    lines = [f"{len(bad)} of {len(results)} trials violate the fencing invariants ("
             + ", ".join(f"{n} {c[:-1]}" for c, n in counts.items()) + ")"]
    bad.sort(key=lambda r: not any(x.startswith(UNSAFE) for x in r.violations))
    for r in bad[:25]:
        lines.append(f"{r.describe()} superseded={r.superseded} A: {r.a_error or 'no error'}")
        lines += [f"    - {x}" for x in r.violations[:4]]
    if len(bad) > 25:
        lines.append(f"... and {len(bad) - 25} more")
    return "\n".join(lines)


# -- child processes (the subprocess tests) --------------------------------------------------------
def _child_writer(path: str, lease_s: float) -> None:
    """Open the chain, commit a step, say so, wait for a line on stdin, commit another, close.

    Prints JSON lines: ``{"ready": ..., "pid": ...}``, then ``{"done": ...}`` or ``{"error": ...}``."""
    model, optimizer = tiny_training()
    store = LocalStore(Path(path))
    try:
        writer = open_writer(path, model, optimizer, store=store, lease_s=lease_s if lease_s > 0 else None,
                             batch_steps=1)
        d = writer.durable_step or 0
        ChainReader(path, store=store).load_into(model, optimizer, d)
        states: dict[int, str] = {}
        train_one(model, optimizer, "child", d + 1)
        writer.record_step(d + 1)
        states[d + 1] = _digest(live_bits(model, optimizer))
        print(json.dumps({"ready": writer.durable_step, "pid": os.getpid()}), flush=True)
        sys.stdin.readline()
        train_one(model, optimizer, "child", d + 2)
        writer.record_step(d + 2)
        states[d + 2] = _digest(live_bits(model, optimizer))
        writer.close()
        print(json.dumps({"done": writer.durable_step, "states": states}), flush=True)
    except Exception as e:  # reported to the test
        print(json.dumps({"error": f"{type(e).__name__}: {first_line(e)}"}), flush=True)


def _child_waiter(path: str, host: str, lock_wait: float) -> None:
    """As a writer of another host (``socket.gethostname`` says ``host``), wait for the lock
    with ``lock_wait``; print when it was taken (wall clock) and whether the chain was fenced."""
    socket.gethostname = lambda: host  # type: ignore[assignment]
    model, optimizer = tiny_training()
    store = LocalStore(Path(path))
    print(json.dumps({"waiting": time.time()}), flush=True)
    try:
        writer = ChainWriter.open(path, model, optimizer, store=store, lock_wait=lock_wait)
        got = time.time()
        writer.close()
        print(json.dumps({"acquired": got}), flush=True)
    except ChainLockedError as e:
        print(json.dumps({"locked": time.time(), "error": first_line(e)}), flush=True)
    except Exception as e:  # reported to the test
        print(json.dumps({"error": f"{type(e).__name__}: {first_line(e)}"}), flush=True)


def _digest(bits: StateBits) -> str:
    h = 0
    for k in sorted(bits):
        h = zlib.crc32(k.encode() + bits[k], h)
    return f"{h:08x}:{len(bits)}"


def digest(bits: StateBits) -> str:
    return _digest(bits)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "writer":
        _child_writer(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1] == "waiter":
        _child_waiter(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        raise SystemExit(f"unknown child {sys.argv[1]!r}")
