"""A chain in a local directory (spec §7.4 on a POSIX file system; links: §21.2)."""

from __future__ import annotations

import errno
import os
import queue
import secrets
import stat
import threading
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import CorruptChainError
from .base import WRITEBACK_CHUNK, Part, Store, byte_view, check_relative_path, refuse_larger
from .crc32c import crc32c_extend

#: How often making the parent directories and opening a new file is tried again when a
#: concurrent :meth:`LocalStore.delete` removed a directory it emptied in between.
_RACE_RETRIES = 100

#: The most views one ``writev`` is given (POSIX guarantees at least 16; Linux takes 1024).
def _iov_max() -> int:
    try:
        return max(16, min(1024, os.sysconf("SC_IOV_MAX")))
    except (AttributeError, ValueError, OSError):
        return 16


_IOV_MAX = _iov_max()

#: How many random names :meth:`LocalStore.create_exclusive` tries for its temporary file.
_TMP_NAME_TRIES = 16

#: Objects at least this large leave the page cache once :meth:`LocalStore.sync` made them
#: durable (``drop_cache``); smaller ones (metadata, records) stay cached for the readers.
DROP_CACHE_MIN_BYTES = 1 << 20


def _drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """``POSIX_FADV_DONTNEED`` on a range of ``fd`` (0, 0: the whole file), where the platform
    has it; a hint whose failure changes nothing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


#: Objects from this size on are checksummed by :meth:`LocalStore.read_buffer_crc32c` on a
#: thread of their own while they are read, in pieces of ``READ_PIECE_BYTES``.
CHECKSUM_BEHIND_MIN_BYTES = 16 << 20
READ_PIECE_BYTES = 8 << 20


class _ChecksumBehind:
    """The crc32c of pieces handed over in order, computed on a thread of its own while the
    caller reads the next piece (``readinto`` releases the GIL). The thread lives as long as
    one read: :meth:`finish` ends it, also after a failed read."""

    def __init__(self, seed: int) -> None:
        self._crc = seed
        self._error: BaseException | None = None
        self._pieces: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ldformat-checksum", daemon=True)
        self._thread.start()

    def add(self, piece: np.ndarray) -> None:
        self._pieces.put(piece)

    def _run(self) -> None:
        try:
            while (piece := self._pieces.get()) is not None:
                self._crc = crc32c_extend(self._crc, piece)
        except BaseException as e:  # handed to finish()
            self._error = e

    def finish(self) -> int:
        self._pieces.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._crc


def _no_object(target: Path, why: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)} ({why})", str(target))


class LocalStore(Store):
    """A chain in a local directory, with explicit fsync of files and directories.

    Objects are files below ``root``; the directories between them are created on demand
    and removed by :meth:`delete` when it empties them. Symbolic links below ``root`` are
    refused by every method (spec §21.2); ``root`` itself may be one. See
    :mod:`ldformat.stores.base` for the contract.

    Args:
        root: the chain directory; created by the first write if missing.
        drop_cache: once :meth:`sync` has made an object of at least
            :data:`DROP_CACHE_MIN_BYTES` durable, drop its pages from the page cache
            (``POSIX_FADV_DONTNEED``; a hint, where the platform has it). Anchors and delta
            batches are written once and read rarely: kept cached, a chain's hundreds of MiB per
            step push the training's own cached files (its dataset) out, and the kernel's work
            to find pages for them lands on the writing thread (on a 2-core VM, 100 MiB per step
            as 45 objects cost 229-231 ms of the writer's CPU cached and 40-47 ms dropped;
            docs/implementation-notes.md "Page cache"). ``False`` keeps them cached, for a
            reader or mirror that reads them right after the commit.

    Example:
        >>> store = LocalStore("runs/chain")                       # doctest: +SKIP
        >>> store.write("anchors/0-0123abcd.safetensors", data)     # doctest: +SKIP
        >>> store.sync(["anchors/0-0123abcd.safetensors"])          # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], *, drop_cache: bool = True) -> None:
        self.root = Path(root)
        self.drop_cache = drop_cache

    def describe(self) -> str:
        return str(self.root)

    def _identity(self) -> Hashable:
        return ("file", self.root.resolve())

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
        views = [v for v in (byte_view(p) for p in parts) if len(v)]  # TypeError before anything is written
        fd = self._open_new(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self._write_views(fd, views)
        finally:
            os.close(fd)

    def _write_views(self, fd: int, views: list[memoryview]) -> None:
        """Write ``views`` back to back in large sequential writes, handing them to writeback.

        Consecutive views are gathered into one ``writev`` of :data:`WRITEBACK_CHUNK` bytes
        (small tensors of an anchor cost no syscall of their own, and a large one is cut at
        multiples of the chunk in the file, not of its own start); after each chunk the
        written range is handed to writeback (:meth:`_start_writeback`). Straight from the
        caller's memory: no copy besides the kernel's into the page cache.
        """
        written = kicked = 0
        batch: list[memoryview] = []
        room = WRITEBACK_CHUNK
        for view in views:
            while view:
                piece, view = view[:room], view[room:]
                batch.append(piece)
                room -= len(piece)
                if room == 0 or len(batch) >= _IOV_MAX:
                    written += self._write_batch(fd, batch)
                    batch, room = [], WRITEBACK_CHUNK - written % WRITEBACK_CHUNK
                    if written - kicked >= WRITEBACK_CHUNK:
                        self._start_writeback(fd, kicked, written - kicked)
                        kicked = written
        if batch:
            written += self._write_batch(fd, batch)
        if kicked and written > kicked:
            self._start_writeback(fd, kicked, written - kicked)

    def _write_batch(self, fd: int, batch: list[memoryview]) -> int:
        """Write ``batch`` (non-empty views) in order with ``writev``, resuming after short writes."""
        total = sum(len(v) for v in batch)
        if len(batch) == 1 or not hasattr(os, "writev") or type(self)._write_fd is not LocalStore._write_fd:
            for v in batch:  # one view, no writev, or a subclass hooks _write_fd (fault injection)
                self._write_fd(fd, v)
            return total
        first = 0
        while first < len(batch):
            n = os.writev(fd, batch[first : first + _IOV_MAX])
            while n and n >= len(batch[first]):
                n -= len(batch[first])
                first += 1
            if n:
                batch[first] = batch[first][n:]
        return total

    def _open_new(self, target: Path, flags: int) -> int:
        """``os.open(target, flags)`` after creating the directories above ``target``.

        A concurrent :meth:`delete` removes the directories it empties, possibly between the
        two steps (or in the middle of the first): then both are done again.
        """
        for attempt in range(_RACE_RETRIES):
            try:
                os.makedirs(target.parent, exist_ok=True)
            except FileExistsError:
                # exist_ok only covers directories: an object (a file) may have the name of one.
                # Or a concurrent delete removed the directory between makedirs' mkdir and its
                # isdir check: then there is no such object, and the attempt is repeated.
                blocking = next((p for p in (target.parent, *target.parent.parents)
                                 if os.path.lexists(p) and not os.path.isdir(p)), None)
                if blocking is not None:
                    raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} (an object has this name)",
                                             str(blocking)) from None
                if attempt == _RACE_RETRIES - 1:
                    raise
                continue
            except FileNotFoundError:
                if attempt == _RACE_RETRIES - 1:
                    raise
                continue
            try:
                return os.open(target, flags, 0o644)
            except FileNotFoundError:
                if attempt == _RACE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _start_writeback(fd: int, offset: int, length: int) -> None:
        """Hand written bytes to writeback now, without waiting (a hint, not a durability point).

        On Linux ``POSIX_FADV_DONTNEED`` starts writing the range's dirty pages back (and
        drops only pages already clean; with ``drop_cache`` :meth:`sync` drops the rest). Done every
        :data:`WRITEBACK_CHUNK` bytes of a large object, the disk works while the rest is
        written and checksummed, and the fsync of :meth:`sync` has little left to wait for.
        """
        _drop_cached(fd, offset, length)

    def _fsync_path(self, target: Path) -> None:
        fd = os.open(target, os.O_RDONLY)
        try:
            self._fsync_fd(fd)
        finally:
            os.close(fd)

    def sync(self, paths: Iterable[str]) -> None:
        targets = [self._abs(p) for p in paths]
        for target in targets:
            self._fsync_object(target)
        self._sync_dirs(targets)

    def _fsync_object(self, target: Path) -> None:
        try:
            fd = os.open(target, os.O_RDONLY)
        except NotADirectoryError:
            raise _no_object(target, "an object has the name of a directory above it") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _no_object(target, "it is a directory")
            self._fsync_fd(fd)
            if self.drop_cache and st.st_size >= DROP_CACHE_MIN_BYTES:
                _drop_cached(fd)  # clean now: the kernel can free the pages at once
        finally:
            os.close(fd)

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
        fd, tmp = self._create_temporary(target)
        try:
            try:
                self._write_fd(fd, memoryview(data))
                self._fsync_fd(fd)
            finally:
                os.close(fd)
            # link() fails with EEXIST where rename() would silently replace.
            try:
                os.link(tmp, target)
            except FileExistsError:
                if target.is_dir() and not target.is_symlink():
                    # Not "another writer got there first": no object can ever be created here.
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target)) from None
                raise
            except FileNotFoundError:
                # Our temporary file was removed as garbage: that only happens once the name
                # it was for is settled, i.e. exists. Report what link() would have.
                if target.exists():
                    raise FileExistsError(errno.EEXIST, "File exists", str(target)) from None
                raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self._sync_dirs([target])

    def _create_temporary(self, target: Path) -> tuple[int, Path]:
        """Create ``.tmp-<name>-<8 hex>`` next to ``target`` (spec §7.4); its fd and path.

        A name already taken (a crashed writer's leftover, or a concurrent call that drew
        the same 32 random bits) does not mean that ``target`` exists: draw another name.
        """
        for _ in range(_TMP_NAME_TRIES):
            tmp = target.parent / f".tmp-{target.name}-{secrets.token_hex(4)}"
            try:
                return self._open_new(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), tmp
            except FileExistsError:
                continue
        raise OSError(f"{target.parent}: no free temporary name in {_TMP_NAME_TRIES} tries")

    def read(self, path: str) -> bytes:
        target = self._abs(path)
        try:
            return target.read_bytes()
        except IsADirectoryError:
            raise _no_object(target, "it is a directory") from None
        except NotADirectoryError:
            raise _no_object(target, "an object has the name of a directory above it") from None

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self._read(path, max_size, None)[0]

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        if type(self).read_buffer is not LocalStore.read_buffer:
            # A subclass that reads its own way (instrumented, say): every read still goes through it.
            return super().read_buffer_crc32c(path, max_size, seed)
        return self._read(path, max_size, seed)

    def _read(self, path: str, max_size: int | None, seed: int | None) -> tuple[np.ndarray, int]:
        """The object in one buffer and, with ``seed``, its crc32c continued from ``seed``. An
        object of ``CHECKSUM_BEHIND_MIN_BYTES`` or more is then read in pieces, each checksummed
        on another thread while the next is read: a 451 MiB anchor took 47 ms against 75 read,
        then checksummed."""
        # One copy, from the page cache into uninitialized memory (a bytearray would be
        # zero-filled first: a second pass over the object).
        target = self._abs(path)
        try:
            f = open(target, "rb", buffering=0)  # noqa: SIM115 (closed by the with below)
        except IsADirectoryError:
            raise _no_object(target, "it is a directory") from None
        except NotADirectoryError:
            raise _no_object(target, "an object has the name of a directory above it") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            refuse_larger(size, max_size)
            buf = np.empty(size, np.uint8)
            behind = _ChecksumBehind(seed) if seed is not None and size >= CHECKSUM_BEHIND_MIN_BYTES else None
            try:
                piece = READ_PIECE_BYTES if behind is not None else max(size, 1)
                got = 0
                with buf.data as view:
                    while got < size:
                        n = f.readinto(view[got : got + piece])
                        if not n:
                            break
                        if behind is not None:
                            behind.add(buf[got : got + n])
                        got += n
                if got < size:  # the file shrank while being read
                    buf = buf[:got]
                else:  # or grew
                    rest = f.read()
                    if rest:
                        if behind is not None:
                            behind.add(np.frombuffer(rest, np.uint8))
                        buf = np.concatenate([buf, np.frombuffer(rest, np.uint8)])
            finally:
                crc = behind.finish() if behind is not None else None
        if crc is None and seed is not None:  # read in one piece: checksummed after
            crc = crc32c_extend(seed, buf)
        return buf, crc or 0

    def size(self, path: str) -> int:
        target = self._abs(path)
        try:
            st = target.stat()
        except NotADirectoryError:
            raise _no_object(target, "an object has the name of a directory above it") from None
        if not stat.S_ISREG(st.st_mode):
            raise _no_object(target, "it is a directory")
        return st.st_size

    def list(self, prefix: str) -> list[str]:
        # _abs refuses a prefix passing through a link; the root itself may be one (§21.2).
        base = self._abs(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, _dirnames, filenames in os.walk(base):  # does not descend into links
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    out.append(name if rel == "." else f"{rel}/{name}")
        return sorted(out)

    def delete(self, path: str) -> None:
        target = self._abs(path)
        try:
            target.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return  # no such object (nothing, a directory, or an object above it)
        except PermissionError:
            if target.is_dir():  # what some systems (macOS) say for unlink() of a directory
                return
            raise
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


def make_directory(path: Path) -> None:
    """Create a chain directory (and its parents) so that its own entry is durable too."""
    path.mkdir(parents=True, exist_ok=True)
    fd = None
    try:
        fd = os.open(path.resolve().parent, os.O_RDONLY)
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the chain's files are still synced
    finally:
        if fd is not None:
            os.close(fd)
