"""The storage interface (spec §7.4, "Commit protocol"; paths: §21.2).

The format needs a handful of primitives from a storage backend: write a new object, make a
set of written objects durable, create an object *exclusively* (the commit record), read,
list and delete. :class:`~ldformat.stores.LocalStore` implements them on a POSIX file
system, :class:`~ldformat.stores.MemoryStore` in memory; the interface is shaped so that an
object store (conditional put with ``If-None-Match: *``, no rename) fits it too. Every
backend passes the suite :class:`ldformat.testing.store_contract.StoreContract`, which is
the executable form of the contract written down here.

The contract, for every backend:

* **Objects, not files.** An object is a byte string named by a chain-relative path.
  Directories are not objects: they are implied by the paths of the objects below them,
  never listed, and a path naming only a "directory" (``a`` while ``a/b`` exists) or lying
  below an object (``a/b`` while ``a`` is an object) behaves as a missing object for
  :meth:`~Store.read`, :meth:`~Store.read_buffer`, :meth:`~Store.read_buffer_crc32c`, :meth:`~Store.size`,
  :meth:`~Store.exists` and :meth:`~Store.delete`. A backend need not hold an object and
  another below it (``a`` and ``a/b``) at once; creating one while the other exists MAY
  fail with an :class:`OSError`, never with :class:`FileExistsError`. The format never
  asks for that.
* **Paths.** Every path argument, and every non-empty :meth:`~Store.list` prefix, is
  checked with :func:`check_relative_path` before any I/O: an unsafe path raises
  :class:`~ldformat.errors.CorruptChainError` (a :class:`ValueError`) from every
  primitive, including :meth:`~Store.sync`, :meth:`~Store.delete`, :meth:`~Store.exists`
  and :meth:`~Store.local_path`, and touches nothing. A backend on a file system also
  refuses symbolic links below its root (spec §21.2) with ``CorruptChainError``.
* **Errors.** A missing object is :class:`FileNotFoundError`; an existing one met by
  :meth:`~Store.create_exclusive` is :class:`FileExistsError`, and nothing else is. Every
  other storage failure (disk full, I/O error, permission) is an :class:`OSError` carrying
  its ``errno``.
* **Durable** means: the object, with the bytes it had when it was made durable, survives
  a crash of the process *and* of the machine (power loss), and so does every directory
  entry leading to it. :meth:`~Store.sync` makes written objects durable;
  :meth:`~Store.create_exclusive` is durable when it returns. Nothing else is promised to
  survive a crash: an object written but not synced may be missing, empty or partial
  afterwards, and a deleted object may come back.
* **Consistency.** Once a call returns, every handle on the same storage (another
  :class:`Store` object, another process, another host for a shared backend) sees its
  effect: read-after-write, read-after-delete and list-after-write are consistent.
* **Threads.** One handle may be used from several threads at once. Calls on different
  paths do not interfere with each other, even in the same directory (a :meth:`~Store.delete`
  emptying a directory does not make a concurrent :meth:`~Store.write` below it fail).

Besides the primitives, a store knows where it is: :meth:`~Store.describe` names its location
in messages, :attr:`~Store.is_remote` says whether every call is a round trip to another
machine, and ``==`` (with :func:`hash`) says whether two handles reach the same location (a
sync onto its own source is refused). :class:`WrapperStore` passes all of it, and every
primitive, to the store it wraps.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import TypeAlias

import numpy as np

from ..errors import CorruptChainError
from .crc32c import crc32c_extend

#: Large objects are written in pieces of at most this size, each handed to writeback as
#: soon as it is written (see :meth:`LocalStore._start_writeback`).
WRITEBACK_CHUNK = 8 << 20

#: A piece of an object for :meth:`Store.write_parts`: any C-contiguous bytes-like object
#: (``bytes``, ``bytearray``, a ``memoryview`` or a numpy array of any dtype and shape: its
#: raw bytes in memory order).
Part: TypeAlias = "bytes | bytearray | memoryview | np.ndarray"


def byte_view(part: Part) -> memoryview:
    """A flat byte view of ``part``, without a copy.

    Args:
        part: ``bytes``, ``bytearray``, a ``memoryview`` or a numpy array, C-contiguous, of
            any format or dtype and any shape (zero-size and 0-d included).

    Returns:
        A one-dimensional ``memoryview`` of format ``"B"`` over the same memory.

    Raises:
        TypeError: ``part`` is not C-contiguous (viewing it as bytes would need a copy;
            pass ``np.ascontiguousarray(part)``), or is a numpy array of Python objects.

    Example:
        >>> len(byte_view(np.zeros((2, 3), np.float32)))
        24
    """
    if isinstance(part, np.ndarray):
        if not part.flags.c_contiguous:
            raise TypeError(f"a part of shape {part.shape} is not C-contiguous; pass np.ascontiguousarray(part)")
        # reshape(-1) of a C-contiguous array is a view; view(uint8) copes with every dtype
        # and with zero-size shapes, which memoryview.cast refuses.
        return part.reshape(-1).view(np.uint8).data
    view = memoryview(part)
    if not view.c_contiguous:
        raise TypeError(f"a part of shape {view.shape} is not C-contiguous; copy it (bytes(part)) first")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.nbytes else memoryview(b"")


def check_relative_path(path: str) -> str:
    """Return ``path`` if it is a safe chain-relative path (spec §21.2).

    Safe: non-empty, not starting with ``/``, no ``\\`` and no NUL, and no ``/``-separated
    component that is empty, ``.`` or ``..``.

    Raises:
        CorruptChainError: the path is unsafe. Stores call this before any I/O, so that a
            hostile log record cannot reach outside the chain.

    Example:
        >>> check_relative_path("log/000000000001.json")
        'log/000000000001.json'
    """
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


class ObjectTooLargeError(ValueError):
    """An object is larger than the reader accepts (``read_buffer(path, max_size)``)."""

    def __init__(self, size: int, max_size: int) -> None:
        super().__init__(f"{size} bytes, more than the {max_size} accepted")
        self.size = size
        self.max_size = max_size


def refuse_larger(size: int, max_size: int | None) -> None:
    if max_size is not None and size > max_size:
        raise ObjectTooLargeError(size, max_size)


class Store(abc.ABC):
    """What the format needs from storage; the rules every method follows are in the
    module documentation above (paths, errors, durability, consistency, threads).

    Call order for a commit (spec §7.4): :meth:`write` (or :meth:`write_parts`) every data
    object under a fresh name, :meth:`sync` them, then :meth:`create_exclusive` the commit
    record. Only the last call makes data visible to readers of the chain: objects written
    before it are unreferenced until a record names them.

    Subclasses implement the abstract methods; :meth:`write_parts`, :meth:`read_buffer`,
    :meth:`read_buffer_crc32c` and :meth:`local_path` have defaults that a backend overrides
    when it can do better, and so have the identity methods (:meth:`describe`,
    :attr:`is_remote`, ``==``: by default a handle is a location of its own).
    """

    def describe(self) -> str:
        """How messages name the store's location: a directory, a URL, ``memory://name``
        (the ``repr`` of a store that has no better name)."""
        return repr(self)

    @property
    def is_remote(self) -> bool:
        """Whether each call is a round trip to another machine (an object store): a reader
        then fetches the objects of a batch concurrently rather than one after another."""
        return False

    def _identity(self) -> Hashable:
        """What two handles on the same location have equal (see ``__eq__``); by default the
        handle itself, so that a store is only ever the same location as itself."""
        return (Store, id(self))

    def __eq__(self, other: object) -> bool:
        """Whether ``other`` reaches the same location: the same directory (symbolic links
        resolved), the same named memory store, the same object store URL; a wrapper that
        passes calls through unchanged is its inner store's location."""
        if not isinstance(other, Store):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    @abc.abstractmethod
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Create the object ``path`` holding exactly ``data``, replacing any object there.

        The bytes are taken during the call: the caller may reuse ``data`` once it returns.
        The object is *not* durable until :meth:`sync` names it, and the write is *not*
        atomic: a concurrent reader may see it partly written, and a failed write may leave
        a partial object behind (garbage for the writer to clean up, spec §7.5). The
        format only ever replaces such leftovers, never an object a record references.

        Raises:
            CorruptChainError: ``path`` is unsafe (nothing is written).
            OSError: the storage failed (``ENOSPC``, ``EIO``, ``EFBIG``, ...).
        """

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        """Like :meth:`write`, with the object made of ``parts`` back to back.

        Args:
            path: the object's chain-relative path.
            parts: bytes-like pieces (see :data:`Part`); an empty sequence makes an empty
                object. They are read during the call only. Backends stream them without
                joining (objects can be many GiB); the default joins them in memory.

        Raises:
            CorruptChainError: ``path`` is unsafe.
            TypeError: a part is not C-contiguous (the object may be left partly written).
            OSError: the storage failed; the object may be left partly written.
        """
        self.write(path, b"".join(byte_view(p) for p in parts))

    @abc.abstractmethod
    def sync(self, paths: Iterable[str]) -> None:
        """Make the objects ``paths`` durable, with the content they were last written with.

        When it returns, each object survives a process or machine crash (see "durable"
        in the module documentation), and so do the directory entries naming it. ``paths``
        may be any iterable, empty included. Objects made by :meth:`create_exclusive` are
        already durable; naming them is harmless.

        Raises:
            CorruptChainError: a path is unsafe (checked before anything is synced).
            FileNotFoundError: a path names no object, for backends that can tell (those
                where syncing is a no-op need not check).
            OSError: the storage failed; which objects are durable is then unknown, and the
                caller must not commit a record referencing any of them.
        """

    @abc.abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create the object ``path`` holding ``data``, atomically, exclusively and durably.

        * **Exclusive**: if an object ``path`` exists, whoever made it (any handle, any
          process, any primitive), raise :class:`FileExistsError` and leave it unchanged.
          Of any number of concurrent callers on the same storage (threads, processes,
          hosts), exactly one succeeds; the others get :class:`FileExistsError`.
        * **Atomic**: other readers see either no object or the whole of ``data``, never a
          part of it, not even an empty object.
        * **Durable** when it returns, with no :meth:`sync` needed.
        * **Clean**: on success and on :class:`FileExistsError` no other object is left
          behind. Only a crash may leave a temporary object named
          ``<directory>/.tmp-<name>-<8 hex digits>`` (spec §4.1), which is garbage.

        On a POSIX file system this is ``link()`` of a synced temporary file (spec §7.4);
        on an object store, a put with ``If-None-Match: *``.

        Raises:
            CorruptChainError: ``path`` is unsafe (nothing is created).
            FileExistsError: ``path`` exists: another writer got there first.
            OSError: any other failure. The object then either does not exist or exists
                complete (e.g. it was linked into place but syncing its directory failed):
                the caller cannot tell which and must treat the outcome as unknown.
        """

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole object.

        Raises:
            CorruptChainError: ``path`` is unsafe.
            FileNotFoundError: no object ``path`` (also for a "directory").
            OSError: the storage failed.
        """

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        """The whole object as a one-dimensional, writable ``uint8`` array that the caller owns.

        "Owns": the array is a fresh buffer that nothing else references; changing it
        changes neither the object nor the result of any other read. Anchor loading turns
        it into tensors without another copy. With ``max_size``, an object larger than that
        is refused before its content is read (readers bound every allocation by what the
        log says, spec §6.4, §21.4); an object store learns the size from the same request
        that reads it. The default asks :meth:`size` first, then copies the result of
        :meth:`read` once.

        Raises:
            CorruptChainError: ``path`` is unsafe.
            ObjectTooLargeError: the object is larger than ``max_size`` (its ``size`` says how large).
            FileNotFoundError: no object ``path``.
            OSError: the storage failed.
        """
        if max_size is not None:
            refuse_larger(self.size(path), max_size)
        data = np.frombuffer(bytearray(self.read(path)), np.uint8)
        if max_size is not None:
            refuse_larger(len(data), max_size)  # it grew between the two requests
        return data

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        """:meth:`read_buffer`, and the crc32c of the object's bytes continued from ``seed`` (the
        checksum a reader verifies before it parses anything, spec §7.6). A store that reads an
        object in pieces computes it while the rest is read (``LocalStore``: on a helper thread,
        for large objects); the default computes it after :meth:`read_buffer`."""
        data = self.read_buffer(path, max_size)
        return data, crc32c_extend(seed, data)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Return the object's size in bytes.

        Raises:
            CorruptChainError: ``path`` is unsafe.
            FileNotFoundError: no object ``path`` (also for a "directory").
            OSError: the storage failed.
        """

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every object below ``prefix``, recursively, as full chain-relative paths, sorted.

        ``prefix`` is a path, matched component by component: ``list("log")`` returns
        ``log/1.json`` and ``log/a/b`` but neither ``logs/x`` nor ``log2`` nor an object
        named ``log`` itself. ``list("")`` returns every object in the store. Directories
        are never returned. A prefix with nothing below it (missing, or an object) gives
        ``[]``. Sorted means by code point (the order of ``sorted()`` on ``str``, which is
        the byte order of the UTF-8 names an object store lists in). An object being
        written concurrently, or a temporary object of a crashed :meth:`create_exclusive`,
        may be listed.

        Raises:
            CorruptChainError: ``prefix`` is neither ``""`` nor a safe path (so a trailing
                ``/`` is refused).
            OSError: the storage failed.
        """

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove the object ``path``; a missing object (or a "directory") is not an error.

        No other object is affected. Deletion need not be durable: after a crash the object
        may be back (the format deletes only garbage and its own lock, both harmless to
        find again).

        Raises:
            CorruptChainError: ``path`` is unsafe.
            OSError: the storage failed.
        """

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether an object ``path`` exists (``False`` for a "directory").

        Raises:
            CorruptChainError: ``path`` is unsafe.
            OSError: the storage failed.
        """

    def local_path(self, path: str) -> Path | None:
        """A file system path holding the object's bytes, for zero-copy reads, or ``None``.

        Backends without local files return ``None`` (the default). The path is only
        meaningful while the object exists and is not rewritten.

        Raises:
            CorruptChainError: ``path`` is unsafe.
        """
        check_relative_path(path)
        return None


class WrapperStore(Store):
    """A store that passes every call to the store it wraps, ``inner``: the primitives and the
    identity (:meth:`describe`, :attr:`is_remote`, ``==``). Subclasses override what they
    change (:class:`~ldformat.stores.FaultyStore` the primitives it makes fail,
    :class:`~ldformat.stores.prefixed.PrefixedStore` the paths and the location)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write(path, data)

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
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

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def local_path(self, path: str) -> Path | None:
        return self.inner.local_path(path)

    def describe(self) -> str:
        return self.inner.describe()

    @property
    def is_remote(self) -> bool:
        return self.inner.is_remote

    def _identity(self) -> Hashable:
        return self.inner._identity()
