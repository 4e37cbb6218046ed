"""Error hierarchy (exit codes: spec §18.1 "Exit codes").

Every error names the file and/or step involved and says what to do. Each class also
inherits the closest builtin so that callers catching ``OSError`` or ``ValueError`` keep
working. The CLI maps :class:`ChainLockedError` (and :class:`LockLostError`) to exit code 4,
other :class:`ChainError` subclasses to 1, :class:`UsageError` and :class:`NotAChainError`
to 2, and :class:`OutputWriteError` to 3.
"""

from __future__ import annotations


class LdformatError(Exception):
    """Base class of every error raised by ldformat."""


class ChainError(LdformatError):
    """A problem with the chain on disk (corrupt, missing, unsupported)."""


class NotAChainError(ChainError, FileNotFoundError):
    """The path holds no ldformat chain (no ``ldformat.json``)."""


class ChainExistsError(ChainError, FileExistsError):
    """``ChainWriter.create`` was pointed at a path that already holds a chain."""


class UnsupportedVersionError(ChainError):
    """The chain's format MAJOR version (or a must-understand field) is unknown to this reader."""


class CorruptChainError(ChainError, ValueError):
    """Checksum mismatch, truncated object, malformed record or broken log sequence."""


class FormatError(CorruptChainError):
    """A record, root or lock file is not well-formed JSON within the limits of spec §6.4."""


class MissingObjectError(CorruptChainError, FileNotFoundError):
    """An object referenced by the log does not exist."""


class StepNotFoundError(ChainError, KeyError):
    """The requested step is not committed in the chain (or was removed by retention)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class EmptyChainError(StepNotFoundError):
    """The chain has no committed step yet."""


class ChainLockedError(ChainError):
    """Another live writer holds the chain's writer lock."""


class LockLostError(ChainLockedError):
    """This writer's lock generation was superseded by a takeover; it must stop (spec §15)."""


class OutputWriteError(LdformatError, OSError):
    """Writing an output file (not the chain) failed: disk full, permission, I/O error."""


class WriterIOError(ChainError, OSError):
    """Writing or syncing an object failed (disk full, permission, I/O error).

    The chain stays valid at its last commit; nothing recorded after it is durable.
    """


class UnsupportedStateError(LdformatError, TypeError):
    """The model or optimizer uses something the format refuses (spec §12)."""


class UsageError(LdformatError, ValueError):
    """The API or CLI was called incorrectly (wrong step order, bad argument)."""


class ReplayEnvironmentWarning(UserWarning):
    """Replay runs in an environment that differs from the one that recorded the chain."""
