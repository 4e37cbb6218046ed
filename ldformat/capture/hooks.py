"""Hooks into the training objects and the interpreter's exit (docs/capture-runtime.md "Modes and life cycle").

The capture runtime registers optimizer step hooks and per-parameter gradient hooks, and
runs code after ``scheduler.step()`` and ``scaler.update()`` return. Those methods are
wrapped by a per-instance subclass, so that nothing lands in the object's ``__dict__``
(schedulers return theirs from ``state_dict()``). Whatever is still open at interpreter
exit is closed then, so that a partial batch is committed rather than dropped.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("ldformat.capture")


class Handle(Protocol):
    """What torch's ``register_*_hook`` methods return."""

    def remove(self) -> None: ...


def call_after(obj: object, name: str, after: Callable[[], None]) -> Callable[[], None]:
    """Run ``after`` whenever ``obj.<name>()`` returns; returns the function that undoes it.

    Example:
        >>> undo = call_after(scheduler, "step", lambda: print("stepped"))   # doctest: +SKIP
    """
    cls = type(obj)

    def wrapped(this: object, *args: object, **kwargs: object) -> object:
        result = getattr(cls, name)(this, *args, **kwargs)
        after()
        return result

    obj.__class__ = type(cls.__name__, (cls,), {name: wrapped, "__module__": cls.__module__})

    def restore() -> None:
        obj.__class__ = cls

    return restore


class Hooks:
    """Every hook and wrapper installed on the training objects; :meth:`remove` undoes them all."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def add(self, handle: Handle) -> None:
        self._undo.append(handle.remove)

    def call_after(self, obj: object, name: str, after: Callable[[], None]) -> None:
        self._undo.append(call_after(obj, name, after))

    def remove(self) -> None:
        """Undo in reverse order: a wrapper restores the class that the one before it replaced."""
        while self._undo:
            self._undo.pop()()


class Closable(Protocol):
    path: str

    def close(self) -> object: ...


open_at_exit: weakref.WeakSet[Closable] = weakref.WeakSet()
"""What interpreter exit closes (add on opening, discard on closing)."""


def _close_at_exit() -> None:
    for obj in list(open_at_exit):
        try:
            obj.close()
        except Exception as e:  # nothing to raise to at exit
            log.error("ldformat: closing %s at exit failed: %s", obj.path, e)


# Interpreter exit first runs threading's exit hooks, among them the one that makes every
# ThreadPoolExecutor refuse new work (zarr encodes through one), then the atexit handlers.
# Flush among the former, before that hook: those run in reverse order of registration.
import concurrent.futures.thread  # noqa: E402,F401  (registers its hook before ours)

if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_at_exit)
else:  # pragma: no cover
    atexit.register(_close_at_exit)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, a ``fork`` multiprocessing process) inherits the
    parent's open Checkpointers: they are the parent's to close. Without this, a worker that
    exits would commit or release the lock of the parent's chain from its copy."""
    open_at_exit.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

