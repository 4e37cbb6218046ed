"""The commit path (spec §5 "Root metadata", §7 "Commit log and commit protocol", §15 "Writer lock").

Everything that decides what a chain *is* lives here, and every other module goes through it:

- the root file (:func:`read_root`, :func:`create_root`);
- folding the log from the newest snapshot (:func:`read_log`);
- creating a commit record exclusively (:func:`commit_record`), fenced by the lock generation;
- object names (:func:`anchor_object_path`, :func:`batch_group_path`);
- the writer lock as a sequence of exclusively created generations (:class:`WriterLock`);
- garbage removal (:func:`collect_garbage`), which never deletes what a newer record may use.

The protocol needs only *create exclusively*, *read*, *list* and *delete* from storage: no
rename, no shared clock, and pids only to tell a dead local writer from a live one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import (
    ChainError,
    ChainLockedError,
    CorruptChainError,
    FormatError,
    LdformatError,
    LockLostError,
    MissingObjectError,
    NotAChainError,
    WriterIOError,
)
from .fold import ChainState, SegmentReader, is_fence
from .jsonvalue import MAX_LOCK_BYTES, MAX_RECORD_BYTES, MAX_ROOT_BYTES, canonical, object_checksum_seed, parse_json
from .manifest import AnchorEntry, DeltaEntry, ObjectRef, Record, RootMetadata, Segment, SegmentRef
from .stores import ObjectTooLargeError, Store

ROOT_FILE = "ldformat.json"
LOG_DIR = "log"
LOCK_DIR = "lock"
SEGMENT_DIR = "segments"
LEGACY_LOCK_FILE = "writer.lock"  # format 1.0 writers' lock (spec §15.5)
_LOG_NAME = re.compile(r"^log/(\d{12})\.json$")
_LOCK_NAME = re.compile(r"^lock/(\d{12})\.json$")
_TMP_NAME = re.compile(r"^\.tmp-(.+)-[0-9a-f]+$")
#: Folds attempted before a record that keeps vanishing is reported (spec §7.3).
FOLD_ATTEMPTS = 5

RecordType = Literal["append", "snapshot"]
#: How long a held lock generation stays valid without renewal (spec §15.6).
LEASE_S = 60.0
MAX_LEASE_S = 86400.0


def now() -> str:
    """The current UTC time as spec §5.4 writes it (millisecond precision, ``Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def writer_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- names ---------------------------------------------------------------------------------
def log_path(seq: int) -> str:
    return f"{LOG_DIR}/{seq:012d}.json"


def lock_path(generation: int) -> str:
    return f"{LOCK_DIR}/{generation:012d}.json"


def anchor_object_path(step: int) -> str:
    """A fresh name for the anchor of ``step`` (spec §4.1)."""
    return f"anchors/{step}-{secrets.token_hex(4)}.safetensors"


def batch_group_path(first: int, last: int) -> str:
    """A fresh name for a batch holding steps ``first``..``last`` (spec §4.1)."""
    return f"deltas/{first}-{last}-{secrets.token_hex(4)}"


def numbered(store: Store, prefix: str, pattern: re.Pattern[str]) -> list[int]:
    out = []
    for p in store.list(prefix):
        m = pattern.match(p)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def log_sequence_numbers(store: Store) -> list[int]:
    return numbered(store, LOG_DIR, _LOG_NAME)


def read_bounded(store: Store, path: str, limit: int, where: str) -> bytes:
    """Read a metadata file, refusing one larger than ``limit`` before reading it (spec §6.4)."""
    try:
        return store.read_buffer(path, max_size=limit).tobytes()
    except ObjectTooLargeError as e:
        raise FormatError(f"{where}: {e.size} bytes, more than the {limit} a reader accepts (spec §6.4)") from None


# -- root ----------------------------------------------------------------------------------
def read_root(store: Store, where: str) -> RootMetadata:
    data = read_root_file(store, ROOT_FILE, MAX_ROOT_BYTES, where, "an ldformat chain")
    return RootMetadata.from_bytes(data, f"{where}/{ROOT_FILE}")


def read_root_file(store: Store, name: str, limit: int, where: str, what: str) -> bytes:
    """The bytes of a root file (``ldformat.json``, ``sharded.json``); NotAChainError without one."""
    try:
        return read_bounded(store, name, limit, f"{where}/{name}")
    except FileNotFoundError:
        raise NotAChainError(f"{where}: not {what} (no {name}); check the path") from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise NotAChainError(f"{where}: cannot read {name}: {e.strerror}") from None


def create_root(store: Store, root: RootMetadata, where: str) -> None:
    """Create the root file exclusively: the last act of creating a chain (spec §7.4)."""
    create_root_file(store, ROOT_FILE, root.to_bytes(), where, "chain")


def create_root_file(store: Store, name: str, data: bytes, where: str, what: str) -> None:
    """Create a root file exclusively; another process's means a concurrent creation."""
    try:
        store.create_exclusive(name, data)
    except FileExistsError:
        from .errors import ChainExistsError

        raise ChainExistsError(f"{where}: another process created a {what} here concurrently") from None
    except OSError as e:
        raise io_error(f"{where}/{name}: cannot create the {what}", e) from None


def io_error(what: str, e: OSError) -> WriterIOError:
    err = WriterIOError(f"{what}: {e.strerror or e} (errno {e.errno})")
    err.errno = e.errno
    return err


# -- folding the log -------------------------------------------------------------------------
class MissingLogRecord(CorruptChainError):
    """A listed record vanished before it was read (a compaction removed it); fold again."""


def read_log(store: Store, where: str) -> tuple[list[Record], ChainState]:
    """Read, verify and fold the log from its newest snapshot (spec §7.3).

    A chain without any record is corrupt: its log was lost, or its creation never finished.
    A compaction may delete superseded records between listing and reading: re-list then.
    """
    for attempt in range(FOLD_ATTEMPTS):
        try:
            return _read_log_once(store, where)
        except MissingLogRecord:
            if attempt == FOLD_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _read_log_once(store: Store, where: str) -> tuple[list[Record], ChainState]:
    seqs = log_sequence_numbers(store)
    if not seqs:
        raise CorruptChainError(
            f"{where}/{LOG_DIR}: the chain has no commit record (the log is missing or empty, "
            "or the chain's creation never finished); nothing in it is readable. Restore log/ "
            "from a copy, or delete the chain and start a new one"
        )
    records: dict[int, Record] = {}
    sizes: dict[int, int] = {}
    # Records created after the listing (or that a lagging listing left out) are found by
    # name: the log is contiguous at its end, and a name read is never stale (spec §7.3).
    while True:
        try:
            records[seqs[-1] + 1], sizes[seqs[-1] + 1] = _read_record_sized(store, seqs[-1] + 1, where)
        except MissingLogRecord:
            break
        seqs.append(seqs[-1] + 1)
    # Find the newest snapshot by reading from the end; records before it are superseded.
    start_index = 0
    for i in range(len(seqs) - 1, -1, -1):
        if seqs[i] not in records:
            records[seqs[i]], sizes[seqs[i]] = _read_record_sized(store, seqs[i], where)
        rec = records[seqs[i]]
        if rec.type == "snapshot":
            start_index = i
            break
    used = seqs[start_index:]
    if records[used[0]].type != "snapshot" and used[0] != 1:
        raise CorruptChainError(f"{where}/{log_path(1)}: the log does not start at record 1 and has no snapshot")
    state = ChainState(first_seq=used[0], read_segment=segment_reader(store, where), where=where)
    out = []
    prev: str | None = None
    for expected, seq in enumerate(used, start=used[0]):
        if seq != expected:
            raise CorruptChainError(f"{where}/{log_path(expected)}: commit record missing (log jumps to {seq})")
        rec = records[seq]
        if rec.seq != seq:
            raise CorruptChainError(f"{where}/{log_path(seq)}: record says seq {rec.seq}")
        if seq != used[0] and rec.prev != prev:
            raise CorruptChainError(f"{where}/{log_path(seq)}: prev checksum does not match record {seq - 1}")
        state.apply(rec, sizes[seq])
        prev = rec.checksum
        out.append(rec)
    return out, state


def read_verified(store: Store, path: str, ref: ObjectRef, where: str, what: str = "object",
                  missing: str = "`ldtools truncate` the chain before the step that needs it") -> np.ndarray:
    """Read a referenced object and verify its size and crc32c before anyone parses it (spec
    §7.6); ``where`` names it in errors, ``missing`` says what to do when it is gone."""
    try:
        # An object larger than its reference says is never read into memory; the checksum
        # (object_checksum's) runs while the object is read.
        data, crc = store.read_buffer_crc32c(path, max_size=ref.size, seed=object_checksum_seed(path))
    except ObjectTooLargeError as e:
        raise CorruptChainError(f"{where}: size {e.size} differs from the committed {ref.size}") from None
    except FileNotFoundError:
        raise MissingObjectError(
            f"{where}: {what} is missing (deleted or never synced); restore it from a copy, or {missing}") from None
    except (IsADirectoryError, NotADirectoryError):
        raise CorruptChainError(f"{where}: expected a file, found a directory") from None
    if len(data) != ref.size:
        raise CorruptChainError(f"{where}: size {len(data)} differs from the committed {ref.size} (truncated?)")
    if f"{crc:08x}" != ref.crc32c:
        raise CorruptChainError(f"{where}: crc32c mismatch (the {what} was modified or damaged)")
    return data


def segment_reader(store: Store, where: str) -> SegmentReader:
    """Reads a segment a fold references: verified before it is parsed (spec §7.6, §7.9)."""

    def read(ref: SegmentRef) -> Segment:
        w = f"{where}/{ref.object.path}"
        data = read_verified(store, ref.object.path, ref.object, w, "segment",
                             "truncate the chain before the steps it holds")
        return Segment.from_bytes(data.tobytes(), w)

    return read


def read_record(store: Store, seq: int, where: str) -> Record:
    return _read_record_sized(store, seq, where)[0]


def _read_record_sized(store: Store, seq: int, where: str) -> tuple[Record, int]:
    """Record ``seq`` and its size in bytes."""
    path = log_path(seq)
    try:
        data = read_bounded(store, path, MAX_RECORD_BYTES, f"{where}/{path}")
    except FileNotFoundError:
        raise MissingLogRecord(f"{where}/{path}: commit record vanished while reading") from None
    return Record.from_bytes(data, f"{where}/{path}"), len(data)


# -- the writer lock ------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()  # field 22: start time in clock ticks since boot
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]": the namespace's identity
    except OSError:
        return None


#: What makes a pid meaningful here (spec §15.2): the kernel's boot and this process's PID
#: namespace. A holder recorded with other values runs elsewhere, or before a reboot.
BOOT_ID = _read_text("/proc/sys/kernel/random/boot_id")
PID_NAMESPACE = _pid_namespace()


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    current = _start_time(pid)
    return start is None or current is None or current == start


@dataclass(frozen=True)
class LockOwner:
    """What a lock generation says (spec §15.1). ``state`` is ``held`` or ``released``."""

    generation: int
    state: Literal["held", "released"]
    host: str | None
    pid: int | None
    start_time: str | None
    token: str
    lease_s: float | None = None  # held only: the holder renews within this many seconds (§15.6)
    #: Held only: whether the generation before it was held by another holder (a takeover,
    #: spec §15.3). Such a generation is never deleted; None where the file does not say.
    takeover: bool | None = None
    boot_id: str | None = None  # held only: the holder's kernel boot (spec §15.2)
    pid_namespace: str | None = None  # held only: the holder's PID namespace (spec §15.2)

    @classmethod
    def parse(cls, data: bytes, generation: int, where: str) -> LockOwner | None:
        """The owner, or None if the file is not a well-formed lock (such a lock is stale)."""
        try:
            d = parse_json(data, where, max_bytes=MAX_LOCK_BYTES)
        except FormatError:
            return None
        if not isinstance(d, dict) or d.get("generation") != generation or not isinstance(d.get("token"), str):
            return None
        state = d.get("state")
        if state == "released":
            return cls(generation, "released", None, None, None, d["token"])
        host, pid, start, lease = d.get("host"), d.get("pid"), d.get("start_time"), d.get("lease_s")
        if not (isinstance(lease, (int, float)) and not isinstance(lease, bool) and 0 < lease <= MAX_LEASE_S):
            lease = None  # no usable lease: the holder can only be proven dead by its pid
        if (
            state != "held"
            or not isinstance(host, str)
            or not isinstance(pid, int)
            or isinstance(pid, bool)
            or not 0 < pid < 2**31
            or not (start is None or isinstance(start, str))
        ):
            return None
        takeover, boot, ns = d.get("takeover"), d.get("boot_id"), d.get("pid_namespace")
        return cls(generation, "held", host, pid, start, d["token"], None if lease is None else float(lease),
                   takeover if isinstance(takeover, bool) else None,
                   boot if isinstance(boot, str) else None, ns if isinstance(ns, str) else None)

    def describe(self) -> str:
        lease = "" if self.lease_s is None else f", lease {self.lease_s:g} s"
        return f"host {self.host}, pid {self.pid}, lock generation {self.generation}{lease}"


class WriterLock:
    """The right to commit, compact, truncate and delete (spec §15).

    The lock is a sequence of generations ``lock/<generation>.json``, each created
    exclusively. The newest generation is the lock's state: *held* by a writer, or
    *released*. Taking the lock creates the next generation, so of any number of processes
    taking over the same stale lock exactly one succeeds. A takeover also commits a fence
    record (:func:`fence`), so a writer that lost its lock can never commit again: its next
    record number exists, and fence records are never deleted. Before deleting anything a
    writer checks that generation ``own + 1`` does not exist: the generation a takeover
    creates is never deleted either, so a superseded holder always finds it, however long it
    was paused (spec §15.4).

    With a lease, a thread renews it every quarter lease while the lock is held (spec §15.6),
    so a training step or a compaction longer than the lease does not let a taker in.
    """

    def __init__(self, store: Store, where: str, owner: LockOwner, previous: LockOwner | None,
                 took_over: bool) -> None:
        self.store = store
        self.where = where
        self.owner = owner
        self.previous = previous
        #: True if the previous generation was held (a dead or broken writer), so the log
        #: must be fenced before anything is deleted.
        self.took_over = took_over
        #: Whether this holder committed the fence record (one is enough, however many
        #: operations it runs under the lock).
        self.fenced = False
        self.released = False
        #: Set when a renewal found the lock taken over; every later check raises it.
        self.lost: LockLostError | None = None
        self._renewed = time.monotonic()
        # Renewal (a thread) and the holder's checks and release never interleave: a check
        # between a renewal's create and its update of ``owner`` would see "a newer generation".
        self._mutex = threading.RLock()
        #: True while the check that this generation was the newest after its create is owed
        #: (the listing failed in acquire): the first check() makes it, before any action.
        self._unconfirmed = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def generation(self) -> int:
        return self.owner.generation

    @classmethod
    def acquire(cls, store: Store, where: str, *, break_lock: bool = False, wait_s: float = 0.0,
                lease_s: float | None = None, renew: bool = True) -> WriterLock:
        """Take the lock, or raise :class:`ChainLockedError` naming the live holder.

        A holder on this host is live while its process runs. A holder on another host is
        live while it renews its lease: with ``wait_s`` > 0 this call watches the newest
        generation for up to ``wait_s`` seconds and takes the lock over once it went a whole
        lease unrenewed by this process's own clock (spec §15.6). ``renew``: renew the lease
        from a thread until :meth:`release` (or until the lock is lost).
        """
        _refuse_live_legacy_lock(store, where, break_lock)
        lease = LEASE_S if lease_s is None else lease_s
        started = time.monotonic()
        first_seen: dict[int, float] = {}
        attempts = 0
        while True:
            try:
                generations = numbered(store, LOCK_DIR, _LOCK_NAME)
            except OSError as e:
                raise io_error(f"{where}/{LOCK_DIR}: cannot list the writer lock", e) from None
            current: LockOwner | None = None
            if generations:
                g = generations[-1]
                try:
                    current = _read_lock(store, g, where)
                except FileNotFoundError:
                    attempts += 1
                    if attempts > 8:
                        raise ChainLockedError(f"{where}: the writer lock keeps changing; retry") from None
                    continue  # a stale listing; look again
                seen = first_seen.setdefault(g, time.monotonic())
                if current.state == "held" and _live(current) and not break_lock:
                    expired = not _this_host(current) and current.lease_s is not None and (
                        time.monotonic() - seen >= current.lease_s)
                    if not expired:
                        waited = time.monotonic() - started
                        # A holder of this host's name from another boot is most likely this
                        # machine before a reboot: wait out one lease (it renews if it runs).
                        patience = max(wait_s, _reboot_wait(current) * 1.05)
                        if waited < patience:
                            _log_reboot_wait(current, where, patience)
                            time.sleep(min(1.0, max(0.01, patience - waited), (current.lease_s or 1.0) / 10))
                            continue
                        raise ChainLockedError(
                            f"{where}: the chain is locked by a running writer ({current.describe()}"
                            f"{_elsewhere_note(current)}); close it first, wait for its lease to run out "
                            "(lock_wait), or break the lock if that writer is known to be gone"
                        )
            generation = (generations[-1] if generations else 0) + 1
            took_over = current is not None and current.state == "held"
            owner = LockOwner(generation, "held", socket.gethostname(), os.getpid(), _start_time(os.getpid()),
                              secrets.token_hex(8), lease, took_over, BOOT_ID, PID_NAMESPACE)
            try:
                store.create_exclusive(lock_path(generation), _lock_bytes(owner))
            except FileExistsError:
                attempts += 1
                if attempts > 8:
                    raise ChainLockedError(
                        f"{where}: could not take the writer lock (other processes keep taking it); retry"
                    ) from None
                continue  # another process took this generation: look at who holds it now
            except OSError as e:
                raise io_error(f"{where}/{lock_path(generation)}: cannot take the writer lock", e) from None
            # A name this process listed as free may have been taken and freed again meanwhile
            # (a renewal or a garbage collection deletes generations): only a generation that is
            # the newest after its create holds the lock (spec §15.1).
            try:
                newest: list[int] | None = numbered(store, LOCK_DIR, _LOCK_NAME)
            except OSError:
                newest = None  # the store failed just now: the first check() confirms it (before any action)
            if newest and newest[-1] > generation:
                attempts += 1
                if attempts > 8:
                    raise ChainLockedError(
                        f"{where}: could not take the writer lock (other processes keep taking it); retry"
                    ) from None
                continue
            lock = cls(store, where, owner, current, took_over)
            lock._unconfirmed = newest is None
            if renew:
                lock.start_renewal()
            return lock

    def start_renewal(self) -> None:
        """Renew the lease from a daemon thread every quarter lease until released or lost.

        The thread holds the lock only weakly: a lock nobody references any more (an
        abandoned writer) stops being renewed, and its lease runs out.
        """
        if self.owner.lease_s is None or self._renewer is not None:
            return
        ref = weakref.ref(self)
        stop, period = self._stop, self.owner.lease_s / 4

        def run() -> None:
            while not stop.wait(period):
                lock = ref()
                if lock is None:
                    return
                try:
                    lock.renew_if_due()
                except (LockLostError, WriterIOError):
                    return  # the holder meets it at its next check or commit
                except Exception:  # noqa: BLE001 - a renewal thread must never die noisily
                    return
                finally:
                    del lock

        self._renewer = threading.Thread(target=run, name=f"ldformat-lease {self.where}", daemon=True)
        self._renewer.start()

    def stop_renewal(self) -> None:
        self._stop.set()

    def renew_if_due(self) -> None:
        """Renew the lease by creating the next generation with the same token (spec §15.6),
        once half a lease has passed since the last renewal."""
        with self._mutex:
            if (self.released or self.owner.lease_s is None
                    or time.monotonic() - self._renewed < self.owner.lease_s / 2):
                return
            self.check()
            nxt = dataclasses.replace(self.owner, generation=self.owner.generation + 1, takeover=False)
            try:
                create_or_lose(self.store, lock_path(nxt.generation), _lock_bytes(nxt), self.where,
                               "another process took over this writer's lock while renewing its lease",
                               "cannot renew the writer lock")
            except LockLostError as e:
                self.lost = e
                self._stop.set()
                raise
            previous, self.owner, self._renewed = self.owner, nxt, time.monotonic()
        if previous.takeover is False:
            # Our own superseded generation, which no other holder checks (the one before it was
            # ours or released). A takeover's generation stays: its predecessor's holder checks it.
            try:
                self.store.delete(lock_path(previous.generation))
            except OSError:
                pass

    def check(self) -> None:
        """Raise :class:`LockLostError` if another process took the lock over since."""
        with self._mutex:
            if self.released:
                raise LockLostError(f"{self.where}: this writer released its lock")
            if self.lost is not None:
                raise self.lost
            nxt = lock_path(self.generation + 1)
            try:
                newer = self.store.exists(nxt)
            except OSError as e:
                raise io_error(f"{self.where}/{nxt}: cannot check the writer lock", e) from None
            if not newer and self._unconfirmed:
                try:
                    newest = numbered(self.store, LOCK_DIR, _LOCK_NAME)
                except OSError as e:
                    raise io_error(f"{self.where}/{LOCK_DIR}: cannot list the writer lock", e) from None
                newer = bool(newest) and newest[-1] > self.generation
                self._unconfirmed = newer
            if newer:
                self.lost = LockLostError(
                    f"{self.where}: another process took over this writer's lock (generation "
                    f"{self.generation} is superseded); this writer stops and deletes nothing. "
                    "Re-open the chain to continue"
                )
                self._stop.set()
                raise self.lost

    def raise_if_lost(self) -> None:
        """After a failed operation: raise :class:`LockLostError` if the lock was taken over
        meanwhile (the taker may have removed what the operation wrote or read); otherwise, or
        when the store cannot even be asked, return and let the original error stand."""
        try:
            self.check()
        except LockLostError:
            raise
        except (LdformatError, OSError):
            pass

    def release(self) -> bool:
        """Release by creating the next generation as ``released`` (if still the holder).

        Returns False when that write failed (the store is unreachable): the lock then stays
        held by this process, which a later taker sees as live while it runs. Never raises:
        a release runs on every way out, errors included.
        """
        self._stop.set()
        with self._mutex:
            if self.released:
                return True
            self.released = True
            marker = LockOwner(self.generation + 1, "released", None, None, None, self.owner.token)
            try:
                self.store.create_exclusive(lock_path(marker.generation), _lock_bytes(marker))
            except FileExistsError:
                pass  # taken over meanwhile: nothing of ours to release
            except OSError:
                return False
            return True


def _read_lock(store: Store, generation: int, where: str) -> LockOwner:
    """Generation ``generation`` of the lock; an unparseable one is held by nobody alive (§15.2)."""
    path = lock_path(generation)
    try:
        data = read_bounded(store, path, MAX_LOCK_BYTES, f"{where}/{path}")
    except FormatError:
        data = b""
    except FileNotFoundError:
        raise
    except OSError as e:
        raise io_error(f"{where}/{path}: cannot read the writer lock", e) from None
    owner = LockOwner.parse(data, generation, f"{where}/{path}")
    return owner if owner is not None else LockOwner(generation, "held", None, None, None, "")


def _lock_bytes(owner: LockOwner) -> bytes:
    import json

    d: dict[str, object] = {"generation": owner.generation, "state": owner.state, "token": owner.token}
    if owner.state == "held":
        d.update(host=owner.host, pid=owner.pid, start_time=owner.start_time, since=time.time())
        if owner.lease_s is not None:
            d["lease_s"] = owner.lease_s
        if owner.takeover is not None:
            d["takeover"] = owner.takeover
        if owner.boot_id is not None:
            d["boot_id"] = owner.boot_id
        if owner.pid_namespace is not None:
            d["pid_namespace"] = owner.pid_namespace
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _this_host(owner: LockOwner) -> bool:
    """Whether ``owner``'s pid names a process this one can see (spec §15.2): the same host
    name, and, where the generation records them, the same boot and PID namespace. A holder
    in another container with the same host name, or on another machine of that name, is
    another host's."""
    return (owner.host == socket.gethostname()
            and (owner.boot_id is None or owner.boot_id == BOOT_ID)
            and (owner.pid_namespace is None or owner.pid_namespace == PID_NAMESPACE))


def _reboot_wait(owner: LockOwner) -> float:
    """How long to watch a held generation with this host's name but another boot before taking
    it over: its lease (spec §15.6), or 0 when it is not such a generation or has none."""
    if owner.host == socket.gethostname() and owner.boot_id is not None and owner.boot_id != BOOT_ID:
        return owner.lease_s or 0.0
    return 0.0


_reboot_logged: set[tuple[str, int]] = set()


def _log_reboot_wait(owner: LockOwner, where: str, patience: float) -> None:
    if _reboot_wait(owner) and (where, owner.generation) not in _reboot_logged:
        _reboot_logged.add((where, owner.generation))
        logging.getLogger("ldformat").warning(
            "%s: the lock is held by %s, recorded before this machine's last reboot (or on another machine of "
            "the same name); waiting up to %.0f s for its lease to run out", where, owner.describe(), patience)


def _elsewhere_note(owner: LockOwner) -> str:
    """Why a holder with this host's name counts as another host's (spec §15.2)."""
    if owner.host != socket.gethostname():
        return ""
    if owner.boot_id is not None and owner.boot_id != BOOT_ID:
        return ("; it ran before this machine's last reboot, or on another machine of the same name, "
                "so its pid cannot be checked here")
    if owner.pid_namespace is not None and owner.pid_namespace != PID_NAMESPACE:
        return "; it runs in another PID namespace (another container), so its pid cannot be checked here"
    return ""


def _live(owner: LockOwner) -> bool:
    """Whether a held lock's writer may still run: on another host we cannot tell, so yes."""
    if owner.host is None or owner.pid is None:
        return False  # unparseable: stale by definition (spec §15.2)
    if not _this_host(owner):
        return True
    return _alive(owner.pid, owner.start_time)


def _refuse_live_legacy_lock(store: Store, where: str, break_lock: bool) -> None:
    """A format 1.0 writer locks with ``writer.lock``; refuse while one of those runs."""
    try:
        data = read_bounded(store, LEGACY_LOCK_FILE, MAX_LOCK_BYTES, f"{where}/{LEGACY_LOCK_FILE}")
    except FormatError:
        return
    except (FileNotFoundError, IsADirectoryError):
        return
    except OSError as e:
        raise io_error(f"{where}/{LEGACY_LOCK_FILE}: cannot read the writer lock", e) from None
    try:
        d = parse_json(data, f"{where}/{LEGACY_LOCK_FILE}", max_bytes=MAX_LOCK_BYTES)
    except FormatError:
        return  # unparseable: stale (spec §15.2)
    if not isinstance(d, dict):
        return
    pid, host, start = d.get("pid"), d.get("host"), d.get("start_time")
    if (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31 and isinstance(host, str)
            and (start is None or isinstance(start, str)) and not break_lock):
        owner = LockOwner(0, "held", host, pid, start, "")
        if _live(owner):
            raise ChainLockedError(
                f"{where}: the chain is locked by a running format 1.0 writer (host {host}, pid {pid}); "
                "close it first, or break the lock if that writer is known to be gone"
            )


def current_lock(store: Store, where: str = "") -> LockOwner | None:
    """The holder of the lock, or None if it is free (released, or never taken)."""
    generations = numbered(store, LOCK_DIR, _LOCK_NAME)
    if not generations:
        return None
    try:
        owner = _read_lock(store, generations[-1], where)
    except FileNotFoundError:
        return None
    return owner if owner.state == "held" else None


# -- committing ------------------------------------------------------------------------------
def commit_record(
    store: Store,
    where: str,
    state: ChainState,
    lock: WriterLock | None,
    *,
    type: RecordType,
    reason: str,
    anchors: Sequence[AnchorEntry] = (),
    deltas: Sequence[DeltaEntry] = (),
    segments: Sequence[SegmentRef] = (),
) -> Record:
    """Create the next record exclusively and fold it into ``state`` (spec §7.4 steps 3-5).

    The data objects it references must already be durable. ``lock`` is None only while a
    chain is being created (the creator holds generation 1 and nobody can see the chain yet).
    """
    if lock is not None:
        lock.renew_if_due()
        lock.check()
    record = Record(
        seq=state.last_seq + 1,
        type=type,
        prev=state.last_checksum,
        time=now(),
        writer=writer_name(),
        reason=reason,
        anchors=tuple(sorted(anchors, key=lambda a: a.step)) if type == "snapshot" else tuple(anchors),
        deltas=tuple(deltas),
        segments=tuple(segments),
    )
    doc = record.to_dict()
    data = canonical(doc) + b"\n"
    path = log_path(record.seq)
    if len(data) > MAX_RECORD_BYTES:
        raise ChainError(
            f"{where}/{path}: the record would be {len(data)} bytes, more than the {MAX_RECORD_BYTES} readers "
            "accept (spec §6.4); commit fewer steps per record, or compact with keep_last to shorten the chain"
        )
    create_or_lose(store, path, data, where, "another writer committed this record",
                   "cannot create the commit record, which may or may not exist now (the next open "
                   f"of the chain decides); nothing after record {record.seq - 1} is known to be durable")
    # The bytes are this call's own canonical serialization: the record as built, with the
    # checksum computed over them; it is not parsed back (a snapshot can be large).
    record = dataclasses.replace(record, checksum=str(doc["checksum"]))
    state.apply(record, len(data))
    return record


def delete_superseded(store: Store, where: str, lock: WriterLock, seqs: range, state: ChainState) -> None:
    """Delete the records ``seqs``, which a snapshot committed by the holder of ``lock``
    supersedes (garbage, spec §7.5), except fence records; a record already gone is skipped.

    The names are known without listing, so the lock is checked once, before the first
    deletion: a newer holder may have written records since, but never under these numbers.
    """
    doomed = [seq for seq in seqs if not _keeps_fence(store, seq, state)]
    if not doomed:
        return
    lock.check()
    for seq in doomed:
        try:
            store.delete(log_path(seq))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise io_error(f"{where}/{log_path(seq)}: cannot remove a superseded record", e) from None


def create_or_lose(store: Store, path: str, data: bytes, where: str, lost: str, failed: str) -> None:
    """Create ``path`` exclusively; an existing one means this writer lost the chain (spec §7.4 step 5)."""
    try:
        store.create_exclusive(path, data)
    except FileExistsError:
        raise LockLostError(
            f"{where}/{path}: {lost}; this writer stops and deletes nothing (re-open the chain to continue)"
        ) from None
    except OSError as e:
        raise io_error(f"{where}/{path}: {failed}", e) from None


#: Fence attempts before a taker gives up: each failed one means the old holder committed
#: once more, into the chain, and the taker folds again.
FENCE_ATTEMPTS = 8


def fence(store: Store, where: str, state: ChainState, lock: WriterLock) -> None:
    """After taking over a held lock, commit an empty record so that the old holder, should it
    still run, can never commit again: its next record number now exists, and fence records
    are never deleted (spec §15.3). If the old holder created that number first, its record
    is part of the chain: fold again and fence after it."""
    if not lock.took_over or lock.fenced:
        return
    for attempt in range(FENCE_ATTEMPTS):
        try:
            commit_record(store, where, state, lock, type="append", reason="takeover")
        except LockLostError:
            lock.check()  # superseded ourselves: stop; else the old holder committed meanwhile
            if attempt == FENCE_ATTEMPTS - 1:
                raise
            _, state = read_log(store, where)
            continue
        lock.fenced = True
        return


def open_log_for_write(store: Store, where: str, lock: WriterLock) -> tuple[list[Record], ChainState]:
    """Fold the log as the new lock holder, fencing it if the lock was taken over."""
    records, state = read_log(store, where)
    if lock.took_over and not lock.fenced:
        fence(store, where, state, lock)
        records, state = read_log(store, where)
    return records, state


#: A fence record is a few hundred bytes: a larger record below a fold's start is no fence and
#: is not read whole to tell.
MAX_FENCE_BYTES = 4096


def _keeps_fence(store: Store, seq: int, state: ChainState) -> bool:
    """Whether record ``seq``, below the fold's start, is a fence record and must stay (spec §7.5).

    Records this process folded are known; others are read, at most :data:`MAX_FENCE_BYTES`
    of them. One that is gone, too large or unparseable is no fence.
    """
    known = state.fences.get(seq)
    if known is not None:
        return known
    path = log_path(seq)
    try:
        data = store.read_buffer(path, max_size=MAX_FENCE_BYTES).tobytes()
        record = Record.from_bytes(data, path)
    except (ObjectTooLargeError, FileNotFoundError, LdformatError):
        return False
    except OSError as e:
        raise io_error(f"{state.where or path}: cannot read superseded record {path}", e) from None
    state.fences[seq] = keep = record.seq == seq and is_fence(record)
    return keep


# -- garbage ----------------------------------------------------------------------------------
def garbage(store: Store, state: ChainState, lock: WriterLock | None = None) -> list[str]:
    """Paths that no record at or before ``state.last_seq`` references and no live writer uses.

    Temporary files are garbage only when their exclusive create is settled: a record's below
    the next sequence number, a lock generation's below ours, the root's once the root exists.
    """
    referenced = state.referenced_objects()
    out = [p for prefix in ("anchors", "deltas", SEGMENT_DIR) for p in store.list(prefix) if p not in referenced]
    for p in store.list(LOG_DIR):
        name = p.split("/", 1)[1]
        m = _TMP_NAME.match(name)
        if m and (seq := _seq_of(m.group(1))) is not None and seq <= state.last_seq:
            out.append(p)
    if lock is not None:
        for p in store.list(LOCK_DIR):
            name = p.split("/", 1)[1]
            m = _TMP_NAME.match(name)
            if m:
                g = _seq_of(m.group(1))
                if g is not None and g < lock.generation:
                    out.append(p)
            elif (g := _seq_of(name)) is not None and g < lock.generation and not _keeps_generation(store, g):
                out.append(p)
        if store.exists(LEGACY_LOCK_FILE):
            out.append(LEGACY_LOCK_FILE)
    if store.exists(ROOT_FILE):
        out += [p for p in store.list("") if "/" not in p and p.startswith(f".tmp-{ROOT_FILE}-")]
    out += [log_path(s) for s in log_sequence_numbers(store) if s < state.first_seq
            and not _keeps_fence(store, s, state)]
    return out


def _keeps_generation(store: Store, generation: int) -> bool:
    """Whether lock generation ``generation`` must stay (spec §7.5): one that took the lock over
    from another holder, whose holder checks for it; or a held one that does not say (an older
    writer's). Released generations, renewals and unparseable files (which no holder wrote)
    go."""
    try:
        owner = _read_lock(store, generation, "")
    except FileNotFoundError:
        return False
    return owner.state == "held" and owner.host is not None and owner.takeover is not False


def _check_log_ends(store: Store, state: ChainState, where: str) -> None:
    """Refuse to delete on a fold that is not the newest: record ``last + 1`` exists (spec §7.5).

    Read by name, which no stale listing can hide: the fold may have come from a listing that
    lagged behind the log, and what such a fold does not reference is not garbage.
    """
    nxt = log_path(state.last_seq + 1)
    try:
        newer = store.exists(nxt)
    except OSError as e:
        raise io_error(f"{where}/{nxt}: cannot check the end of the log", e) from None
    if newer:
        raise LockLostError(
            f"{where}/{nxt}: the log has a record after this writer's fold (record {state.last_seq}); "
            "the listing it folded was stale, or another process committed. This process stops and "
            "deletes nothing; re-open the chain to continue")


def _seq_of(name: str) -> int | None:
    m = re.fullmatch(r"(\d{12})\.json", name)
    return int(m.group(1)) if m else None


def collect_garbage(store: Store, state: ChainState, lock: WriterLock, where: str) -> list[str]:
    """Delete :func:`garbage`, as the lock holder. Spec §7.5.

    The generation is checked after listing: an object a newer writer wrote before that
    listing implies a newer generation, which the check sees; one written after it is not in
    the list. So nothing a newer record may reference is deleted.
    """
    paths = garbage(store, state, lock)
    lock.check()
    _check_log_ends(store, state, where)
    for p in paths:
        try:
            store.delete(p)
        except OSError as e:
            raise io_error(f"{where}/{p}: cannot remove garbage", e) from None
    return paths
