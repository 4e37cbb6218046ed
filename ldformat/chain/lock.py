"""The writer lock (spec §15 "Writer lock and crash takeover"): a sequence of exclusively created generations.

A writer holds generation G while ``lock/<G>`` says so and ``lock/<G+1>`` does not exist;
renewing creates G+1. Takeover lock generations are never deleted (spec §7.5). Process ids
only tell a dead local writer from a live one (spec §15.6).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Literal

from ..errors import (
    ChainLockedError,
    FormatError,
    LdformatError,
    LockLostError,
    WriterIOError,
)
from ..format.jsonvalue import MAX_LOCK_BYTES, parse_json
from ..stores import Store
from .records import (
    LEGACY_LOCK_FILE,
    LOCK_DIR,
    LOCK_NAME,
    create_or_lose,
    io_error,
    lock_path,
    numbered,
    read_bounded,
)

#: How long a held lock generation stays valid without renewal (spec §15.6).
LEASE_S = 60.0
MAX_LEASE_S = 86400.0


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
                generations = numbered(store, LOCK_DIR, LOCK_NAME)
            except OSError as e:
                raise io_error(f"{where}/{LOCK_DIR}: cannot list the writer lock", e) from None
            current: LockOwner | None = None
            if generations:
                g = generations[-1]
                try:
                    current = read_lock(store, g, where)
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
                newest: list[int] | None = numbered(store, LOCK_DIR, LOCK_NAME)
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
                    newest = numbered(self.store, LOCK_DIR, LOCK_NAME)
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


def read_lock(store: Store, generation: int, where: str) -> LockOwner:
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
    generations = numbered(store, LOCK_DIR, LOCK_NAME)
    if not generations:
        return None
    try:
        owner = read_lock(store, generations[-1], where)
    except FileNotFoundError:
        return None
    return owner if owner.state == "held" else None
