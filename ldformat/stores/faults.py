"""Fault injection for any store (spec §7.4: what a commit must survive).

:class:`FaultyStore` wraps a :class:`~ldformat.stores.Store` and, following a list of
:class:`Fault` rules, makes chosen calls of chosen primitives fail with an :class:`OSError`
(``ENOSPC``, ``EIO``, ``EACCES``, ... or ``EEXIST`` to fake a lost race), write only a
prefix of an object before failing (a *torn* write, as when a disk fills up mid-file), or
sleep to widen the window of a race. With no rule it is a transparent wrapper, and passes
the store contract suite like the store it wraps.

Example:
    >>> import errno
    >>> from ldformat.stores import MemoryStore
    >>> store = FaultyStore(MemoryStore(), stall={"create_exclusive": 0.002})  # widen lock races
    >>> disk_full = store.fail(WRITES, errno.ENOSPC, path="deltas/*", after=2, torn=0.5)
    >>> for i in range(3):
    ...     try:
    ...         store.write(f"deltas/1-1-0123abcd/c/{i}", b"0123456789")
    ...     except OSError as e:
    ...         print(e, store.inner.read(f"deltas/1-1-0123abcd/c/{i}"))
    [Errno 28] No space left on device: 'deltas/1-1-0123abcd/c/2' b'01234'
"""

from __future__ import annotations

import errno as errno_
import fnmatch
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, get_args

import numpy as np

from ..errors import UsageError
from .base import Part, Store, WrapperStore, byte_view, check_relative_path

__all__ = ["OPS", "WRITES", "Fault", "FaultyStore", "Op", "When"]

#: The primitives of :class:`~ldformat.stores.Store`, by method name.
Op = Literal["write", "write_parts", "sync", "create_exclusive", "read", "read_buffer", "size", "list",
             "delete", "exists", "local_path"]
OPS: tuple[Op, ...] = get_args(Op)

#: Both ways of writing an object: a fault on a data object usually wants both.
WRITES: tuple[Op, ...] = ("write", "write_parts")

#: Whether a fault acts before the wrapped call (which then does not happen) or after it
#: returned (its effect stays: an object created, then an error, as when syncing the
#: directory of a linked record fails).
When = Literal["before", "after"]

T = TypeVar("T")


@dataclass(kw_only=True, eq=False)
class Fault:
    """One rule of a :class:`FaultyStore`: which calls it matches and what it does to them.

    A call *matches* when its primitive is in ``ops`` and its path matches the shell
    pattern ``path`` (:func:`fnmatch.fnmatchcase`; ``*`` also crosses ``/``). For
    :meth:`~Store.sync` any of the paths may match; for :meth:`~Store.list` the prefix is
    the path. The rule lets its first ``after`` matching calls through, then *fires* on the
    next ``times`` (``None``: on every one from then on; a full disk stays full).

    When it fires it sleeps ``stall`` seconds, then raises ``OSError(error)`` if ``error``
    is set: before the wrapped call, or after it returned (``when``). A ``torn`` write
    (``write``/``write_parts`` only) first writes a prefix of the object, ``torn`` bytes
    (an ``int``) or that fraction of them (a ``float``), then raises.

    Attributes:
        calls: matching calls seen so far (counted only while the store is armed).
        fired: calls the rule acted on (slept on or failed).
    """

    ops: tuple[Op, ...]
    path: str = "*"
    after: int = 0
    times: int | None = None
    error: int | None = errno_.EIO
    torn: int | float | None = None
    when: When = "before"
    stall: float = 0.0
    calls: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise UsageError(f"Fault: unknown store primitive(s) {unknown or self.ops!r}; choose from {OPS}")
        if self.after < 0 or (self.times is not None and self.times < 0) or self.stall < 0:
            raise UsageError(f"Fault: after, times and stall must not be negative ({self.after}, {self.times}, "
                             f"{self.stall})")
        if self.when not in get_args(When):
            raise UsageError(f"Fault: when={self.when!r}; choose 'before' or 'after'")
        if self.error is None and not self.stall:
            raise UsageError("Fault: neither an error nor a stall: the rule would do nothing")
        if self.torn is not None:
            if self.error is None or self.when != "before" or not set(self.ops) <= set(WRITES):
                raise UsageError("Fault: torn applies to write/write_parts with an error, acting 'before'")
            if isinstance(self.torn, bool) or self.torn < 0 or (isinstance(self.torn, float) and self.torn > 1):
                raise UsageError(f"Fault: torn={self.torn!r}; give a byte count or a fraction in [0, 1]")

    def matches(self, op: Op, paths: Sequence[str]) -> bool:
        return op in self.ops and any(fnmatch.fnmatchcase(p, self.path) for p in paths)

    def torn_length(self, size: int) -> int:
        """How many of an object's ``size`` bytes a torn write keeps."""
        if self.torn is None:
            return size
        if isinstance(self.torn, float):
            return int(size * self.torn)
        return min(self.torn, size)


class FaultyStore(WrapperStore):
    """A store that injects faults into the calls it passes to ``inner``.

    Args:
        inner: the store that does the work.
        faults: the rules (see :class:`Fault`), checked in order; more are added with
            :meth:`fail`, :meth:`stall` and :meth:`add`.
        stall: shorthand for stall-only rules: seconds to sleep before each call of a
            primitive, e.g. ``{"create_exclusive": 0.002}`` to widen lock races.
        armed: rules count calls and fire only while the store is armed (see :meth:`arm`),
            e.g. to let a chain be created before faults start.

    Paths are checked (spec §21.2) before any rule is consulted, so an unsafe path raises
    :class:`~ldformat.errors.CorruptChainError` as from any store. Every matching rule
    counts the call; the stalls of all firing rules add up, and the first firing rule with
    an error decides how the call fails. The store is ``inner``'s location: same name in
    messages, equal to ``inner``.

    Example:
        >>> import errno
        >>> from ldformat.stores import MemoryStore
        >>> store = FaultyStore(MemoryStore())
        >>> fault = store.fail("create_exclusive", errno.EACCES, path="log/*", after=1)
        >>> store.create_exclusive("log/000000000001.json", b"{}")
        >>> store.create_exclusive("log/000000000002.json", b"{}")
        Traceback (most recent call last):
        PermissionError: [Errno 13] Permission denied: 'log/000000000002.json'
        >>> fault.calls, fault.fired, store.failures
        (2, 1, 1)
    """

    def __init__(self, inner: Store, faults: Iterable[Fault] = (), *, stall: Mapping[Op, float] | None = None,
                 armed: bool = True) -> None:
        super().__init__(inner)
        self.faults: list[Fault] = []
        self.armed = armed
        self.failures = 0  #: calls failed with an injected error, over all rules
        self._lock = threading.Lock()
        for fault in faults:
            self.add(fault)
        for op, seconds in (stall or {}).items():
            self.stall(op, seconds)

    # -- configuring ---------------------------------------------------------------------------
    def add(self, fault: Fault) -> Fault:
        """Append a rule; returns it (its counters show what it did)."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def fail(self, op: Op | Iterable[Op], error: int = errno_.EIO, *, path: str = "*", after: int = 0,
             times: int | None = None, torn: int | float | None = None, when: When = "before") -> Fault:
        """Add a rule raising ``OSError(error)`` from ``op`` (see :class:`Fault`)."""
        return self.add(Fault(ops=_ops(op), path=path, after=after, times=times, error=error, torn=torn, when=when))

    def stall(self, op: Op | Iterable[Op], seconds: float, *, path: str = "*", after: int = 0,
              times: int | None = None, when: When = "before") -> Fault:
        """Add a rule sleeping ``seconds`` in ``op`` (see :class:`Fault`)."""
        return self.add(Fault(ops=_ops(op), path=path, after=after, times=times, error=None, stall=seconds,
                              when=when))

    def clear(self) -> None:
        """Remove every rule (the store becomes transparent)."""
        with self._lock:
            self.faults.clear()

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    # -- firing ------------------------------------------------------------------------------------
    def _firing(self, op: Op, paths: Sequence[str]) -> tuple[float, float, Fault | None]:
        """Count the call; the stalls before and after it, and the rule whose error it gets."""
        before = after = 0.0
        failing: Fault | None = None
        with self._lock:
            if not self.armed:
                return 0.0, 0.0, None
            for fault in self.faults:
                if not fault.matches(op, paths):
                    continue
                fault.calls += 1
                if fault.calls <= fault.after or (fault.times is not None and fault.fired >= fault.times):
                    continue
                fault.fired += 1
                if fault.when == "before":
                    before += fault.stall
                else:
                    after += fault.stall
                if fault.error is not None and failing is None:
                    failing = fault
            if failing is not None:
                self.failures += 1
        return before, after, failing

    def _call(self, op: Op, paths: Sequence[str], run: Callable[[], T]) -> T:
        stall_before, stall_after, fault = self._firing(op, paths)
        if stall_before:
            time.sleep(stall_before)
        if fault is not None and fault.when == "before":
            raise _error(fault, op, paths)
        result = run()
        if stall_after:
            time.sleep(stall_after)
        if fault is not None:
            raise _error(fault, op, paths)
        return result

    def _write(self, op: Op, path: str, parts: Sequence[Part]) -> None:
        check_relative_path(path)
        stall_before, stall_after, fault = self._firing(op, [path])
        if stall_before:
            time.sleep(stall_before)
        if fault is not None and fault.torn is not None:
            views = [byte_view(p) for p in parts]
            keep = fault.torn_length(sum(len(v) for v in views))
            prefix = []
            for view in views:
                prefix.append(view[:keep])
                keep -= len(prefix[-1])
            if op == "write":
                self.inner.write(path, b"".join(prefix))
            else:
                self.inner.write_parts(path, prefix)
            raise _error(fault, op, [path])
        if fault is not None and fault.when == "before":
            raise _error(fault, op, [path])
        if op == "write":
            self.inner.write(path, byte_view(parts[0]))
        else:
            self.inner.write_parts(path, parts)
        if stall_after:
            time.sleep(stall_after)
        if fault is not None:
            raise _error(fault, op, [path])

    # -- the Store primitives ----------------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._write("write", path, (data,))

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        self._write("write_parts", path, parts)

    def sync(self, paths: Iterable[str]) -> None:
        wanted = [check_relative_path(p) for p in paths]
        self._call("sync", wanted, lambda: self.inner.sync(wanted))

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._call("create_exclusive", [check_relative_path(path)], lambda: self.inner.create_exclusive(path, data))

    def read(self, path: str) -> bytes:
        return self._call("read", [check_relative_path(path)], lambda: self.inner.read(path))

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        return self._call("read_buffer", [check_relative_path(path)], lambda: self.inner.read_buffer(path, max_size))

    def read_buffer_crc32c(self, path: str, max_size: int | None = None, seed: int = 0) -> tuple[np.ndarray, int]:
        return self._call("read_buffer", [check_relative_path(path)],
                          lambda: self.inner.read_buffer_crc32c(path, max_size, seed))

    def size(self, path: str) -> int:
        return self._call("size", [check_relative_path(path)], lambda: self.inner.size(path))

    def list(self, prefix: str) -> list[str]:
        if prefix:
            check_relative_path(prefix)
        return self._call("list", [prefix], lambda: self.inner.list(prefix))

    def delete(self, path: str) -> None:
        self._call("delete", [check_relative_path(path)], lambda: self.inner.delete(path))

    def exists(self, path: str) -> bool:
        return self._call("exists", [check_relative_path(path)], lambda: self.inner.exists(path))

    def local_path(self, path: str) -> Path | None:
        return self._call("local_path", [check_relative_path(path)], lambda: self.inner.local_path(path))


def _ops(op: Op | Iterable[Op]) -> tuple[Op, ...]:
    return (op,) if isinstance(op, str) else tuple(op)


def _error(fault: Fault, op: Op, paths: Sequence[str]) -> OSError:
    """``OSError(errno, strerror, path)``: the builtin subclass for the errno (ENOENT gives
    FileNotFoundError, EEXIST FileExistsError), naming the first matching path."""
    code = fault.error if fault.error is not None else errno_.EIO
    path = next((p for p in paths if fnmatch.fnmatchcase(p, fault.path)), paths[0] if paths else "")
    return OSError(code, os.strerror(code), path)
