"""A chain in memory (spec §7.4 without a disk), for tests and for simulated crashes.

:class:`MemoryStore` keeps objects in a dictionary and follows the whole store contract of
:mod:`ldformat.stores.base`, including what survives a crash: :meth:`MemoryStore.crash`
drops every object that was written but not made durable (by :meth:`~MemoryStore.sync` or
:meth:`~MemoryStore.create_exclusive`), so that crash tests run without a disk and without
killing a process.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from ..errors import UsageError
from .base import Part, Store, byte_view, check_relative_path, refuse_larger


class _Volume:
    """The objects that every handle opened on the same memory store shares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.unsynced: set[str] = set()


#: The stores of ``memory://<name>`` URLs, by name (see :meth:`MemoryStore.named`).
_NAMED: dict[str, _Volume] = {}
_NAMED_LOCK = threading.Lock()


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


class MemoryStore(Store):
    """A thread-safe in-memory store that can simulate a crash.

    Durability is tracked, not just promised: an object written with :meth:`write` or
    :meth:`write_parts` stays *unsynced* until :meth:`sync` names it, and :meth:`crash`
    drops every unsynced object, as a power cut may on a disk (an object rewritten after
    it was synced is unsynced again, and dropped too: a file rewritten in place may be
    empty after a crash). :meth:`create_exclusive` is durable at once; deletions are
    durable at once too (a disk may bring a deleted file back, which the format tolerates).

    Several handles share one set of objects through :meth:`reopen`, like several
    processes opening the same directory.

    Example:
        >>> store = MemoryStore()
        >>> store.write("deltas/1-1-0123abcd/zarr.json", b"{}")
        >>> store.create_exclusive("log/000000000001.json", b"{}")
        >>> store.unsynced()
        ['deltas/1-1-0123abcd/zarr.json']
        >>> store.crash()
        >>> store.list("")
        ['log/000000000001.json']
    """

    def __init__(self) -> None:
        self._volume = _Volume()
        self.name: str | None = None  #: the registry name of a ``memory://name`` store

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """A handle on the process-wide store ``memory://<name>``, made empty on first use.

        Every call with the same ``name`` shares the same objects, so that two opens of the
        URL ``memory://run`` (a writer and a reader, say) see the same chain. The objects
        live until :meth:`forget` or the end of the process.
        """
        if not name:
            raise UsageError("memory:// needs a name, e.g. memory://run1")
        with _NAMED_LOCK:
            volume = _NAMED.setdefault(name, _Volume())
        store = cls.__new__(cls)
        store._volume = volume
        store.name = name
        return store

    @staticmethod
    def forget(name: str) -> None:
        """Drop the objects of ``memory://<name>`` (handles already open keep them)."""
        with _NAMED_LOCK:
            _NAMED.pop(name, None)

    def __repr__(self) -> str:
        return f"MemoryStore(name={self.name!r})" if self.name is not None else "MemoryStore()"

    def describe(self) -> str:
        return f"memory://{self.name}" if self.name is not None else repr(self)

    def _identity(self) -> Hashable:
        # every handle on memory://<name> is that store; an unnamed one is only itself
        return ("memory", self.name) if self.name is not None else super()._identity()

    def reopen(self) -> MemoryStore:
        """Another handle on the same objects (what another process would open)."""
        other = MemoryStore.__new__(MemoryStore)
        other._volume = self._volume
        other.name = self.name
        return other

    def crash(self) -> None:
        """Simulate a crash of the machine: drop every object written but not synced."""
        v = self._volume
        with v.lock:
            for path in v.unsynced:
                del v.objects[path]
            v.unsynced.clear()

    def unsynced(self) -> list[str]:
        """The objects a crash would drop now (written, not yet synced), sorted."""
        v = self._volume
        with v.lock:
            return sorted(v.unsynced)

    # -- the Store primitives ----------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._put(check_relative_path(path), bytes(byte_view(data)))

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        check_relative_path(path)
        self._put(path, b"".join([byte_view(p) for p in parts]))

    def _put(self, path: str, data: bytes) -> None:
        v = self._volume
        with v.lock:
            v.objects[path] = data
            v.unsynced.add(path)

    def sync(self, paths: Iterable[str]) -> None:
        wanted = [check_relative_path(p) for p in paths]
        v = self._volume
        with v.lock:
            for path in wanted:
                if path not in v.objects:
                    raise _missing(path)
            v.unsynced.difference_update(wanted)

    def create_exclusive(self, path: str, data: bytes) -> None:
        check_relative_path(path)
        content = bytes(data)
        v = self._volume
        with v.lock:
            if path in v.objects:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            v.objects[path] = content

    def read(self, path: str) -> bytes:
        check_relative_path(path)
        with self._volume.lock:
            data = self._volume.objects.get(path)
        if data is None:
            raise _missing(path)
        return data

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        data = self.read(path)
        refuse_larger(len(data), max_size)
        return np.frombuffer(data, np.uint8).copy()

    def size(self, path: str) -> int:
        return len(self.read(path))

    def list(self, prefix: str) -> list[str]:
        if prefix:
            check_relative_path(prefix)
        below = prefix + "/" if prefix else ""
        with self._volume.lock:
            return sorted(p for p in self._volume.objects if p.startswith(below))

    def delete(self, path: str) -> None:
        check_relative_path(path)
        v = self._volume
        with v.lock:
            v.objects.pop(path, None)
            v.unsynced.discard(path)

    def exists(self, path: str) -> bool:
        check_relative_path(path)
        with self._volume.lock:
            return path in self._volume.objects
