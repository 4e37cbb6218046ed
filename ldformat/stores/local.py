"""A chain in a local directory (spec §7.4 on a POSIX file system)."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import CorruptChainError
from .base import WRITEBACK_CHUNK, Part, Store, byte_view, check_relative_path


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
            try:
                os.link(tmp, target)
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
