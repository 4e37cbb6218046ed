"""The single-writer lock (spec §15).

``writer.lock`` is created exclusively and names its owner (host, pid, process start time).
A lock whose owner is on this host and no longer runs is stale: the next writer takes it
over and removes the dead writer's leftovers. A lock held by a live process, or by another
host, is refused unless the caller explicitly breaks it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass

from .errors import ChainLockedError, WriterIOError
from .manifest import LOCK_FILE
from .stores import Store


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()  # field 22: start time in clock ticks since boot
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_time(pid)
    return start is None or now is None or now == start


@dataclass
class WriterLock:
    store: Store
    owner: dict[str, object]

    @classmethod
    def acquire(
        cls, store: Store, where: str, *, break_lock: bool = False
    ) -> tuple[WriterLock, dict[str, object] | None]:
        """Take the lock. Returns the lock and the previous owner if a stale lock was taken over."""
        pid = os.getpid()
        owner: dict[str, object] = {
            "host": socket.gethostname(),
            "pid": pid,
            "start_time": _start_time(pid),
            "since": time.time(),
            "token": secrets.token_hex(8),
        }
        data = json.dumps(owner, sort_keys=True).encode()
        previous = None
        for _ in range(2):
            try:
                store.create_exclusive(LOCK_FILE, data)
                return cls(store, owner), previous
            except FileExistsError:
                pass
            except OSError as e:
                err = WriterIOError(f"{where}/{LOCK_FILE}: cannot take the writer lock: {e.strerror or e} "
                                    f"(errno {e.errno})")
                err.errno = e.errno
                raise err from None
            try:
                previous = json.loads(store.read(LOCK_FILE))
                if not isinstance(previous, dict):
                    raise ValueError
            except FileNotFoundError:
                continue
            except ValueError:
                previous = {"host": "?", "pid": -1}
            stale = previous.get("host") == owner["host"] and not _alive(
                int(previous.get("pid", -1)), previous.get("start_time")  # type: ignore[arg-type]
            )
            if not (stale or break_lock or previous.get("pid") == -1):
                raise ChainLockedError(
                    f"{where}: the chain is locked by a running writer (host {previous.get('host')}, "
                    f"pid {previous.get('pid')}); close it first, or break the lock if that "
                    "writer is known to be gone"
                )
            store.delete(LOCK_FILE)
        raise ChainLockedError(f"{where}: could not take the writer lock (another writer raced us)")

    def release(self) -> None:
        try:
            current = json.loads(self.store.read(LOCK_FILE))
        except (FileNotFoundError, ValueError):
            return
        if isinstance(current, dict) and current.get("token") == self.owner["token"]:
            self.store.delete(LOCK_FILE)
