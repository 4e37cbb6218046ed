"""Consent for the commands that delete (spec §18.1 "Exit codes").

A command that removes committed steps (``truncate``; ``compact`` with ``--keep-last`` or
``--keep-every``) or breaks another writer's lock (``--break-lock``) asks first when standard
input is a terminal, and goes ahead without asking when ``--yes`` is given. With neither, it
cannot ask, so it refuses: it changes nothing, prints one line and exits 2 (a usage error), as
``git clean`` does without ``-f``. A declined question exits 130.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import click

from ldformat import ChainLockedError, LockLostError, UsageError

T = TypeVar("T")

YES_HELP = ("Do not ask for confirmation. Without it the command asks on a terminal, and refuses "
            "(exit 2, nothing changed) when standard input is not a terminal.")
BREAK_LOCK_HELP = ("Take the writer lock over even from a writer that looks alive: only when that writer is known "
                   "to be gone (a killed job on another host). Asks first, as --yes describes.")


def stdin_is_terminal() -> bool:
    """Whether a question can be asked: standard input is a terminal."""
    stream = sys.stdin
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):  # closed or detached
        return False


def refuse_without_terminal(refusal: str) -> None:
    """Raise :class:`UsageError` (exit 2) saying ``refusal`` and what to pass, unless a
    question can be asked."""
    if not stdin_is_terminal():
        raise UsageError(f"{refusal}; standard input is not a terminal, so ldtools cannot ask: pass --yes to go "
                         "ahead; nothing was changed")


def confirm(question: str, *, yes: bool, refusal: str) -> None:
    """Go on if ``yes``; else ask ``question`` on the terminal (declined: exit 130, via
    :class:`click.Abort`), or, without a terminal, refuse (:func:`refuse_without_terminal`)."""
    if yes:
        return
    refuse_without_terminal(refusal)
    click.confirm(question, abort=True)


def refuse_break_lock_without_consent(chain: str, break_lock: bool, yes: bool) -> None:
    """``--break-lock`` without ``--yes`` and without a terminal: refused before anything is read."""
    if break_lock and not yes and not stdin_is_terminal():
        raise UsageError(f"{chain}: --break-lock takes the writer lock from another process; standard input is "
                         "not a terminal, so ldtools cannot ask: pass --yes with --break-lock to go ahead; "
                         "nothing was changed")


_API_ADVICE = re.compile(r"break the lock if that writer is known to be gone")


def lock_advice(e: ChainLockedError) -> ChainLockedError:
    """The lock error as a command-line user can act on it: ``--break-lock`` rather than the
    API's ``break_lock``/``lock_wait``."""
    text = str(e).replace(" (lock_wait)", "")
    text, n = _API_ADVICE.subn("rerun with --break-lock if that writer is known to be gone", text)
    if not n:
        text += "; rerun with --break-lock if that writer is known to be gone"
    return ChainLockedError(text)


@contextmanager
def cli_lock_advice() -> Iterator[None]:
    """Reword a :class:`ChainLockedError` raised inside for the command line (a lost lock,
    :class:`LockLostError`, is left as it is: breaking the lock again would not help)."""
    try:
        yield
    except LockLostError:
        raise
    except ChainLockedError as e:
        raise lock_advice(e) from None


def with_lock(chain: str, run: Callable[[bool], T], *, break_lock: bool, yes: bool) -> T:
    """``run(break_lock)``, the command's work under the writer lock.

    With ``--break-lock`` and ``--yes``, the lock is broken at once. With ``--break-lock`` on a
    terminal, the command first tries without breaking it; if a live writer holds it, the
    user is shown who and asked. Without ``--break-lock``, a held lock is exit 4 with advice.
    """
    with cli_lock_advice():
        if not break_lock or yes:
            return run(break_lock)
        try:
            return run(False)
        except LockLostError:
            raise
        except ChainLockedError as e:
            holder = str(e).split("; ", 1)[0]
            confirm(f"{holder}. Break the lock? That writer, if it still runs, fails at its next commit",
                    yes=False, refusal=f"{chain}: --break-lock")
        return run(True)
