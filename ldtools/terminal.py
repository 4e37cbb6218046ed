"""What every ``ldtools`` command shares: printing, exit codes, common options and wording.

Exit codes (spec section 18.1): 0 success; 1 a problem with the chain (invalid, corrupt, missing
object, unsupported version, step not committed, I/O error on the chain); 2 a usage error or a
path that is not a chain; 3 an output file or standard output could not be written; 4 the chain
is locked by another writer; 70 an internal error (a bug); 130 interrupted or not confirmed; 141
standard output closed (broken pipe). An error is one line on stderr, without a traceback unless
``LDTOOLS_DEBUG=1`` or ``ldtools --debug`` asks for one.

The commands (:mod:`ldtools.cli`, :mod:`ldtools.history`) import from here, never from each other.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from ldformat import ChainLockedError, LdformatError, NotAChainError, OutputWriteError, UsageError

from .progress import PROGRESS_ENV, ProgressBar, progress_wanted

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_OUTPUT = 3
EXIT_LOCKED = 4
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

DEBUG_ENV = "LDTOOLS_DEBUG"
_STEP_CONTEXT = "_ldtools_step_context"


class Session:
    """Per-invocation settings (reset each time the command line is parsed)."""

    debug = False


def _debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


# -- printing ----------------------------------------------------------------------------------
def printable(text: str, stream: Any = None) -> str:
    """``text`` as the stream can encode it: undecodable path bytes (``\\udcff``) become ``\\xff``.

    A path with bytes that are not UTF-8 comes from the OS as lone surrogates; a strict
    UTF-8 stream cannot encode them. They are shown as backslash escapes of the original bytes.
    """
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
        return text
    except (UnicodeEncodeError, LookupError):
        pass
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates that are not escaped bytes
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _is_broken_pipe(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (
        isinstance(e, OSError) and not isinstance(e, OutputWriteError) and e.errno == errno.EPIPE
    )


def _errno_text(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    cause = e.strerror or str(e) or type(e).__name__
    return f"{cause} [{name}]" if name else cause


def _write_all(stream: Any, text: str) -> None:
    """Write ``text`` and flush, failing on a short write.

    Python's text layer ignores the count a buffered binary write returns, and that write
    returns a short count, without an error, when the disk fills up half-way: the rest of the
    output would be lost silently. The bytes go to the binary buffer in a loop instead.
    """
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text-only stream (an IDE, a test double)
        stream.write(text)
        stream.flush()
        return
    stream.flush()  # anything already written through the text layer goes first
    data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace"))
    while data:
        n = buffer.write(data)
        if not n:
            raise OSError(errno.EIO, "short write")
        data = data[n:]
    buffer.flush()


def echo(message: str = "") -> None:
    """Print one line on stdout; an error writing it (other than a closed pipe) is an output error."""
    try:
        _write_all(sys.stdout, printable(message, sys.stdout) + "\n")
    except OSError as e:
        if _is_broken_pipe(e):
            raise
        raise output_error("standard output", e) from e


def say(message: str) -> None:
    """Print one line on stderr, whatever state stderr is in."""
    with contextlib.suppress(OSError, ValueError):
        click.echo(printable(" ".join(message.splitlines()), sys.stderr), err=True)


def output_error(what: str, e: OSError) -> OutputWriteError:
    err = OutputWriteError(f"{what}: cannot write: {_errno_text(e)}")
    err.errno = e.errno
    return err


def _silence_stdout() -> None:
    """After a broken pipe, send what is still buffered for stdout to /dev/null (no error at exit)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)


# -- errors and exit codes ---------------------------------------------------------------------
@contextlib.contextmanager
def about_step(step: int | None, doing: str) -> Iterator[None]:
    """Make an error raised inside name ``step`` (the step the user asked for) if it does not already."""
    try:
        yield
    except (LdformatError, OSError) as e:
        if step is not None and not isinstance(e, OutputWriteError) and not hasattr(e, _STEP_CONTEXT):
            setattr(e, _STEP_CONTEXT, f"{doing} step {step}")
        raise


def _os_message(e: OSError) -> str:
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    where = " -> ".join(names) if names else "I/O error"
    return f"{where}: {_errno_text(e)}"


def classify(e: BaseException) -> tuple[int, str | None]:
    """The exit code of an exception and its one-line message (None: exit quietly)."""
    if isinstance(e, OutputWriteError):
        code, message = EXIT_OUTPUT, str(e)
    elif _is_broken_pipe(e):
        return EXIT_BROKEN_PIPE, None
    elif isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    elif isinstance(e, click.Abort):
        return EXIT_INTERRUPTED, "aborted; nothing was changed"
    elif isinstance(e, ChainLockedError):  # LockLostError too
        code, message = EXIT_LOCKED, str(e)
    elif isinstance(e, (NotAChainError, UsageError)):
        code, message = EXIT_USAGE, str(e)
    elif isinstance(e, LdformatError):
        code, message = EXIT_PROBLEM, str(e)
    elif isinstance(e, OSError):
        code, message = EXIT_PROBLEM, _os_message(e)
    else:
        detail = " ".join(str(e).splitlines()) or "(no message)"
        return EXIT_INTERNAL, (
            f"internal error: {type(e).__name__}: {detail} (this is a bug in ldtools: please report it "
            f"with the command line; {DEBUG_ENV}=1 shows the traceback)"
        )
    context = getattr(e, _STEP_CONTEXT, None)
    if context is not None:
        step = context.rsplit(" ", 1)[-1]
        if not re.search(rf"\bstep {re.escape(step)}\b", message):
            message += f"; while {context}"
    return code, f"error: {message}"


def exit_for(e: BaseException) -> NoReturn:
    """Report ``e`` as documented (spec section 18.1) and exit with its code."""
    code, message = classify(e)
    if message is None:
        _silence_stdout()
        sys.exit(code)
    if Session.debug or _debug_from_env():
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    say(f"ldtools: {message}")
    sys.exit(code)


_CLICK_FLOW = (click.exceptions.Exit, click.ClickException)


@contextlib.contextmanager
def _exit_codes() -> Iterator[None]:
    try:
        yield
    except _CLICK_FLOW:
        raise  # --help, --version, bad options: click reports them (exit 0 or 2)
    except (Exception, KeyboardInterrupt) as e:
        exit_for(e)


def errors_to_exit_codes(fn: F) -> F:
    """Turn every error of a command into one line on stderr and its documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _exit_codes():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class LdtoolsGroup(click.Group):
    """A click group that applies the exit codes to everything it runs, help and version included."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        if parent is None:
            Session.debug = _debug_from_env()
        with _exit_codes():
            return super().make_context(info_name, args, parent, **extra)
        raise AssertionError("unreachable")  # pragma: no cover

    def invoke(self, ctx: click.Context) -> Any:
        with _exit_codes():
            return super().invoke(ctx)
        raise AssertionError("unreachable")  # pragma: no cover


CHAIN = click.argument("chain", type=click.Path(path_type=str))

PROGRESS = click.option(
    "--progress/--no-progress", "show_progress", default=None,
    help=f"Draw a progress bar on stderr (default: only when stderr is a terminal; {PROGRESS_ENV}=1 "
         "or 0 changes the default). Standard output never gets one.")


def progress_bar(show_progress: bool | None, labels: dict[str, str], byte_stages: tuple[str, ...] = ()) -> ProgressBar:
    return ProgressBar(labels, enabled=progress_wanted(show_progress, sys.stderr), byte_stages=byte_stages)


# -- wording -----------------------------------------------------------------------------------
def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 step``, ``2 steps`` (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def step_span(steps: list[int]) -> str:
    """``6..12`` (``6`` for one step)."""
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}..{steps[-1]}"


def refuse_existing_output(out: Path, force: bool, *, directory: bool) -> None:
    """Refuse (exit 2) to replace an existing output without ``--force``, before any replay.

    A file is in the way of a file output if it exists at all; a dcp output (a directory) is
    in the way unless it is an empty directory (which is written into).
    """
    if force or not os.path.lexists(out):
        return
    if directory and out.is_dir() and not any(out.iterdir()):
        return
    what = "exists and is not an empty directory" if directory and out.is_dir() else "exists"
    raise UsageError(f"{out}: {what}; pass --force to replace it, or choose another -o; nothing was written")
