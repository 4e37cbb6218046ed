"""What the roles of a chain writer share: where the chain is, the lock the writer holds, the
committed state, and the error that stopped the writer (spec §7.4 "Commit protocol", §15.3
"Takeover and fencing").

Every storage call of a role (an anchor, a batch's objects, a commit record, a snapshot)
runs through :meth:`WriterGuard.io`. A failure becomes one :class:`~ldformat.WriterIOError`
that names the object and says what is durable, and it *poisons* the writer: every later
call raises that error, since the pending batch or base may hold part of a step, until the
chain is re-opened. A failure after another process took the lock over is reported as the
lost lock instead: the taker may have removed this writer's uncommitted objects as garbage
(spec §7.5 "Leftovers and garbage"). A commit record's creation may have happened although
the call failed (spec §7.4 step 5); its error says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from ..errors import ChainError, LdformatError, LockLostError, UsageError, WriterIOError
from ..format.fold import ChainState
from ..stores import Store
from .lock import WriterLock

E = TypeVar("E", bound=LdformatError)


class WriterGuard:
    """The chain, lock, committed state and failure one writer's roles share."""

    def __init__(self, path: str, store: Store, lock: WriterLock, state: ChainState) -> None:
        self.path = path
        self.store = store
        #: None once the writer is closed or aborted.
        self.lock: WriterLock | None = lock
        #: The chain as committed; live retention replaces it (it rewrites the log).
        self.state = state
        #: The error that stopped the writer: raised again by every later call.
        self.failed: LdformatError | None = None

    @property
    def durable_step(self) -> int | None:
        return self.state.latest_step

    def fail(self, err: E) -> E:
        """Poison the writer with ``err`` and return it, to be raised."""
        self.failed = err
        return err

    def broken(self, what: str, e: Exception) -> ChainError:
        """Poison the writer after coding part of a step failed: the pending batch (or the base)
        holds part of a row, so nothing pending can be committed."""
        return self.fail(ChainError(
            f"{self.path}: {what} failed ({type(e).__name__}: {e}); nothing after step {self.durable_step} is "
            "durable. Re-open the chain with ChainWriter.open to continue"))

    def check_usable(self) -> WriterLock:
        """Raise the error that stopped the writer, or refuse a closed one; returns the lock."""
        if self.failed is not None:
            raise self.failed
        if self.lock is None:
            raise UsageError(f"{self.path}: the writer is closed")
        return self.lock

    def release(self) -> None:
        """Release the lock, once."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def io(self, what: str, fn: Callable[..., object], *args: Any, outcome_unknown: bool = False) -> None:
        """Run a storage call; a failure poisons the writer with a clear error. ``outcome_unknown``:
        the call creates a commit record, which may exist although the call failed (spec §7.4 step 5)."""
        if outcome_unknown:
            durable = ("the chain is valid either without or with this commit's steps (the next open decides); "
                       f"nothing after {'its creation' if self.durable_step is None else f'step {self.durable_step}'}"
                       " is known to be durable")
        else:
            durable = "no step is durable yet" if self.durable_step is None else (
                f"nothing after step {self.durable_step} is durable and the chain is valid there")
        try:
            fn(*args)
        except WriterIOError as e:
            self._raise_if_superseded()
            self._raise_io(what, e, durable)
        except ChainError as e:
            self.failed = e
            raise
        except OSError as e:
            self._raise_if_superseded()
            self._raise_io(what, e, durable)

    def _raise_if_superseded(self) -> None:
        """After a failed storage call: if another process took the lock over meanwhile (and,
        say, removed this writer's uncommitted objects as garbage), that is the error to report."""
        if self.lock is None:
            return
        try:
            self.lock.raise_if_lost()
        except LockLostError as lost:
            self.failed = lost
            raise lost from None

    def _raise_io(self, what: str, e: OSError, durable: str) -> NoReturn:
        if isinstance(e, WriterIOError):  # already names the object (the commit path's I/O errors)
            err = WriterIOError(f"{e}; {durable}. Fix the cause and re-open the chain with ChainWriter.open "
                                "to continue")
        else:
            err = WriterIOError(f"{self.path}/{what}: {e.strerror or e} (errno {e.errno}); {durable}. Fix the cause "
                                "and re-open the chain with ChainWriter.open to continue")
        err.errno = e.errno
        self.failed = err
        raise err from None
