"""Storage backends (spec §7.4). Every backend passes :mod:`ldformat.testing.store_contract`.

:class:`Store` is the interface and its contract; :class:`LocalStore` keeps a chain in a
directory, :class:`MemoryStore` in memory (with simulated crashes), :class:`ObjectStore` in
an object store (S3, GCS, Azure, HTTP; the ``s3`` extra), and :class:`FaultyStore` wraps any
store to inject I/O errors, torn writes and stalls.

:func:`open_store` turns a chain location into a store, and :func:`open_existing_store` that
of a chain that must already be there (a local directory must exist). A location is a local directory
(a path, or ``file:///abs/path``), ``memory://<name>`` (a process-wide
:meth:`MemoryStore.named` store), or an object store URL: ``s3://bucket/prefix`` (also
``s3a://``), ``gs://bucket/prefix``, ``az://container/prefix`` (the storage account from
``AZURE_STORAGE_ACCOUNT_NAME`` or ``storage_options``; also ``azure://``, ``adl://``, and
``abfs(s)://container@account.dfs.core.windows.net/prefix``) or ``http(s)://host/prefix``. Any other
``scheme://`` is refused rather than taken for a directory name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import unquote

from ..errors import NotAChainError, UsageError
from .base import ObjectTooLargeError, Part, Store, WrapperStore, byte_view, check_relative_path
from .faults import OPS, WRITES, Fault, FaultyStore, Op
from .local import LocalStore
from .memory import MemoryStore
from .object import ObjectStore, ObjectStoreError, RetryPolicy

#: URL schemes opened as an :class:`ObjectStore`.
OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


#: Where a chain is, as the operations that open it take it: a path or URL, or an open store.
StoreOrPath: TypeAlias = "str | os.PathLike[str] | Store"


@dataclass(frozen=True)
class Location:
    """Where a chain is, as :func:`parse_location` understood it.

    Attributes:
        name: how messages name the chain (the path as given; a URL without trailing ``/``).
        scheme: ``"file"`` for a local directory, ``"memory"``, or one of :data:`OBJECT_SCHEMES`.
        path: the local directory (``scheme == "file"`` only).
        target: what follows ``scheme://`` (bucket and prefix, or the memory store's name).
    """

    name: str
    scheme: str
    path: Path | None = None
    target: str = ""

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"


def parse_location(location: str | os.PathLike[str]) -> Location:
    """Understand a chain location (see the module documentation for the forms).

    Raises:
        UsageError: an unsupported ``scheme://``, or a malformed URL (no bucket, a query or
            fragment, an empty, ``.`` or ``..`` component in the prefix).
    """
    if not isinstance(location, str):
        return Location(os.fspath(location), "file", Path(location))
    found = _SCHEME.match(location)
    if found is None:
        return Location(location, "file", Path(location))
    scheme, rest = found.group(1).lower(), location[found.end():]
    if scheme == "file":
        host, _, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise UsageError(f"{location}: a file:// URL names a local directory (file:///abs/path), not host {host!r}")
        return Location(location, "file", Path("/" + unquote(path)))
    if "?" in rest or "#" in rest:
        raise UsageError(f"{location}: a chain URL takes no query or fragment; pass settings as storage_options "
                         "or environment variables")
    rest = rest.rstrip("/")
    if scheme == "memory":
        if not rest:
            raise UsageError(f"{location}: memory:// needs a name, e.g. memory://run1")
        return Location(f"memory://{rest}", "memory", None, rest)
    if scheme in OBJECT_SCHEMES:
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UsageError(f"{location}: the URL names no bucket (write {scheme}://bucket/prefix)")
        if prefix and any(c in ("", ".", "..") for c in prefix.split("/")):
            raise UsageError(f"{location}: the prefix has an empty, '.' or '..' component")
        return Location(f"{scheme}://{rest}", scheme, None, rest)
    raise UsageError(
        f"{location}: unsupported URL scheme {scheme}://; a chain is a local directory (a path or file:///...), "
        f"memory://<name>, or an object store URL ({', '.join(s + '://' for s in OBJECT_SCHEMES)})"
    )


def location_name(location: str | os.PathLike[str]) -> str:
    """How messages name the chain at ``location`` (a URL without its trailing ``/``)."""
    return parse_location(location).name


def open_store(location: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Store:
    """The store holding the chain at ``location``; no request is made.

    Args:
        location: a local directory, ``file://``, ``memory://<name>`` or an object store URL
            (see the module documentation).
        storage_options: settings of an object store that override its environment
            variables (see :class:`ObjectStore`); refused for other locations.

    Raises:
        UsageError: an unsupported scheme or malformed URL; ``storage_options`` for a
            location that is not an object store; obstore missing for an object store URL
            (``pip install 'ldformat[s3]'``).

    Example:
        >>> open_store("memory://doc-example")
        MemoryStore(name='doc-example')
    """
    loc = parse_location(location)
    if storage_options and loc.scheme in ("file", "memory"):
        raise UsageError(f"{loc.name}: storage_options apply to object store URLs, not to a "
                         f"{'local directory' if loc.is_local else 'memory store'}")
    if loc.path is not None:
        return LocalStore(loc.path)
    if loc.scheme == "memory":
        return MemoryStore.named(loc.target)
    return ObjectStore(loc.name, storage_options=storage_options)


def open_existing_store(location: str | os.PathLike[str], store: Store | None,
                        storage_options: dict[str, Any] | None = None) -> Store:
    """``store`` if given, else the store of the chain at ``location`` (a directory or a URL),
    which must already be there: unlike :func:`open_store`, a missing local directory is refused.

    A local directory must exist; an object store or ``memory://`` URL is opened without a
    request (see :func:`open_store`).

    Raises:
        NotAChainError: ``location`` is a local path that is missing or not a directory.
        UsageError: an unsupported URL scheme, or ``storage_options`` for a local path.
    """
    if store is not None:
        return store
    loc = parse_location(location)
    if loc.path is None or storage_options:  # a URL (storage_options are refused for a directory)
        return open_store(location, storage_options=storage_options)
    p = loc.path
    if not p.exists():
        raise NotAChainError(f"{loc.name}: no such directory")
    if not p.is_dir():
        raise NotAChainError(f"{loc.name}: not a directory, so not an ldformat chain")
    return LocalStore(p)


__all__ = [
    "OPS",
    "WRITES",
    "Fault",
    "FaultyStore",
    "LocalStore",
    "Location",
    "StoreOrPath",
    "MemoryStore",
    "ObjectTooLargeError",
    "OBJECT_SCHEMES",
    "ObjectStore",
    "ObjectStoreError",
    "Op",
    "Part",
    "RetryPolicy",
    "Store",
    "WrapperStore",
    "byte_view",
    "check_relative_path",
    "location_name",
    "open_existing_store",
    "open_store",
    "parse_location",
]
