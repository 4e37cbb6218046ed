"""A part of a store as a store of its own: the objects below a prefix (one rank chain of a
sharded chain, spec §20.1)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from .base import Store, WrapperStore, check_relative_path


class PrefixedStore(WrapperStore):
    """The objects of ``inner`` below ``prefix``, as a store of their own: one rank chain of
    a sharded chain given as a :class:`~ldformat.stores.Store` or a local directory (syncing
    an object makes every directory up to the sharded chain's own durable, spec §20.3.3
    rule D). Messages name it ``<inner>/<prefix>``; it is remote if ``inner`` is, and the
    same location only as itself."""

    def __init__(self, inner: Store, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = check_relative_path(prefix)

    def __repr__(self) -> str:
        return f"PrefixedStore({self.inner!r}, {self.prefix!r})"

    def describe(self) -> str:
        return f"{self.inner.describe()}/{self.prefix}"

    def _identity(self) -> Hashable:
        # as before stores knew their location: a view is the same location only as itself
        return Store._identity(self)

    def _path(self, path: str) -> str:
        return f"{self.prefix}/{check_relative_path(path)}"

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write(self._path(path), data)

    def write_parts(self, path: str, parts: Any) -> None:
        self.inner.write_parts(self._path(path), parts)

    def sync(self, paths: Any) -> None:
        self.inner.sync([self._path(p) for p in paths])

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.inner.create_exclusive(self._path(path), data)

    def read(self, path: str) -> bytes:
        return self.inner.read(self._path(path))

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self.inner.read_buffer(self._path(path), max_size)

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        return self.inner.read_buffer_crc32c(self._path(path), max_size, seed)

    def size(self, path: str) -> int:
        return self.inner.size(self._path(path))

    def list(self, prefix: str) -> list[str]:
        n = len(self.prefix) + 1
        return [p[n:] for p in self.inner.list(self._path(prefix) if prefix else self.prefix)]

    def delete(self, path: str) -> None:
        self.inner.delete(self._path(path))

    def exists(self, path: str) -> bool:
        return self.inner.exists(self._path(path))

    def local_path(self, path: str) -> Path | None:
        return self.inner.local_path(self._path(path))
