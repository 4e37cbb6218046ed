"""Storage interface (spec §7.4, "Commit protocol").

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

from .errors import CorruptChainError

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


class LocalStore(Store):
    """A chain in a local directory, with explicit fsync of files and directories."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _abs(self, path: str) -> Path:
        target = self.root / check_relative_path(path)
        # Refuse to read, write or delete through a symbolic link inside the chain.
        probe = self.root
        for part in path.split("/"):
            probe = probe / part
            if probe.is_symlink():
                raise CorruptChainError(f"{self.root}/{path}: symbolic links are not allowed inside a chain")
        return target

    # Low-level hooks, overridden by fault-injection tests.
    def _write_fd(self, fd: int, data: memoryview) -> None:
        while data:
            n = os.write(fd, data)
            data = data[n:]

    def _fsync_fd(self, fd: int) -> None:
        os.fsync(fd)

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.write_parts(path, (data,))

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        target = self._abs(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = kicked = 0
            for part in parts:
                view = byte_view(part)
                for start in range(0, max(len(view), 1), WRITEBACK_CHUNK):
                    piece = view[start : start + WRITEBACK_CHUNK]
                    self._write_fd(fd, piece)
                    written += len(piece)
                    if written - kicked >= WRITEBACK_CHUNK:
                        self._start_writeback(fd, kicked, written - kicked)
                        kicked = written
            if kicked and written > kicked:
                self._start_writeback(fd, kicked, written - kicked)
        finally:
            os.close(fd)

    @staticmethod
    def _start_writeback(fd: int, offset: int, length: int) -> None:
        """Hand written bytes to writeback now, without waiting (a hint, not a durability point).

        On Linux ``POSIX_FADV_DONTNEED`` starts writing the range's dirty pages back (and
        drops only pages already clean, so the object normally stays cached). Done every
        :data:`WRITEBACK_CHUNK` bytes of a large object, the disk works while the rest is
        written and checksummed, and the fsync of :meth:`sync` has little left to wait for.
        """
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def _fsync_path(self, target: Path) -> None:
        fd = os.open(target, os.O_RDONLY)
        try:
            self._fsync_fd(fd)
        finally:
            os.close(fd)

    def sync(self, paths: Iterable[str]) -> None:
        targets = [self._abs(p) for p in paths]
        for target in targets:
            self._fsync_path(target)
        self._sync_dirs(targets)

    def _sync_dirs(self, targets: list[Path]) -> None:
        dirs: set[Path] = set()
        for target in targets:
            # Every new directory between the object and the root must be durable too.
            parent = target.parent
            while parent != self.root and self.root in parent.parents:
                dirs.add(parent)
                parent = parent.parent
            dirs.add(self.root)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            self._fsync_path(d)

    def create_exclusive(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{target.name}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                self._write_fd(fd, memoryview(data))
                self._fsync_fd(fd)
            finally:
                os.close(fd)
            # link() fails with EEXIST where rename() would silently replace.
            os.link(tmp, target)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self._sync_dirs([target])

    def read(self, path: str) -> bytes:
        return self._abs(path).read_bytes()

    def read_buffer(self, path: str) -> np.ndarray:
        # One copy, from the page cache into uninitialized memory (a bytearray would be
        # zero-filled first: a second pass over the object).
        with open(self._abs(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, np.uint8)
            got = 0
            with buf.data as view:
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            if got < size:  # the file shrank while being read
                buf = buf[:got]
            else:  # or grew
                rest = f.read()
                if rest:
                    buf = np.concatenate([buf, np.frombuffer(rest, np.uint8)])
        return buf

    def size(self, path: str) -> int:
        return self._abs(path).stat().st_size

    def list(self, prefix: str) -> list[str]:
        base = self._abs(prefix) if prefix else self.root
        if not base.is_dir() or base.is_symlink():
            return []
        out = []
        for dirpath, _dirnames, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    out.append(name if rel == "." else f"{rel}/{name}")
        return sorted(out)

    def delete(self, path: str) -> None:
        target = self._abs(path)
        try:
            target.unlink()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            return
        # Drop directories left empty, up to (not including) the root.
        parent = target.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def exists(self, path: str) -> bool:
        return self._abs(path).is_file()

    def local_path(self, path: str) -> Path | None:
        return self._abs(path)
