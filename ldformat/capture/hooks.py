"""Hooks into the live training objects, installed and removed together (spec §20.1 "Modes and life cycle").

The capture runtime registers optimizer step hooks and per-parameter gradient hooks, and
runs code after ``scheduler.step()`` and ``scaler.update()`` return. Those methods are
wrapped by a per-instance subclass, so that nothing lands in the object's ``__dict__``
(schedulers return theirs from ``state_dict()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


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
