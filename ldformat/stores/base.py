"""The storage interface (spec §7.4, "Commit protocol").

The format needs five primitives from a storage backend: write a new object, make a set of
written objects durable, create an object *exclusively* (the commit record), read, list and
delete. :class:`LocalStore` implements them on a POSIX file system; the interface is shaped
so that an object store (conditional put with ``If-None-Match: *``, no rename) fits it too.

All paths are ``/``-separated and relative to the chain root. Paths are checked so that a
hostile log record cannot reach outside the chain (spec §21.2).
"""

from __future__ import annotations

import abc
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeAlias

import numpy as np

from ..errors import CorruptChainError

#: Large objects are written in pieces of at most this size, each handed to writeback as
#: soon as it is written (see :meth:`LocalStore._start_writeback`).
WRITEBACK_CHUNK = 8 << 20

#: A piece of an object for :meth:`Store.write_parts`: any C-contiguous bytes-like object.
Part: TypeAlias = "bytes | bytearray | memoryview | np.ndarray"


def byte_view(part: Part) -> memoryview:
    """A flat byte view of ``part`` (no copy)."""
    view = part.data if isinstance(part, np.ndarray) else memoryview(part)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_relative_path(path: str) -> str:
    """Return ``path`` if it is a safe chain-relative path, else raise CorruptChainError."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise CorruptChainError(f"unsafe object path {path!r} in chain metadata")
    return path


class Store(abc.ABC):
    """What the format needs from storage.

    Call order for a commit: :meth:`write` (or :meth:`write_parts`) every data object,
    :meth:`sync` them, then :meth:`create_exclusive` the commit record. Only the last call
    may make data visible to readers; objects written before it are invisible until a record
    references them.
    """

    @abc.abstractmethod
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a new object (replacing a leftover of the same name). Not yet durable."""

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        """Write a new object made of ``parts`` back to back, like :meth:`write`.

        Backends that can stream should override this; the default joins the parts in memory.
        """
        self.write(path, b"".join(byte_view(p) for p in parts))

    @abc.abstractmethod
    def sync(self, paths: Iterable[str]) -> None:
        """Make previously written objects, and the directories naming them, durable."""

    @abc.abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> None:
        """Durably create ``path`` with ``data``; raise FileExistsError if it exists."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole object; FileNotFoundError if it does not exist."""

    def read_buffer(self, path: str) -> np.ndarray:
        """The whole object as a writable ``uint8`` array that the caller owns.

        Anchor loading turns it into tensors without another copy. The default copies the
        result of :meth:`read` once.
        """
        return np.frombuffer(bytearray(self.read(path)), np.uint8)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Return the size in bytes; FileNotFoundError if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Return every object path under ``prefix`` (recursive), sorted."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove an object; a missing object is not an error."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether the object exists."""

    def local_path(self, path: str) -> Path | None:
        """A file system path for zero-copy reads, when the backend has one."""
        return None
