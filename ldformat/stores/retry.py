"""What an object store request's failure means, and how it is retried (spec §7.4 "Commit protocol").

:func:`classify_failure` turns an exception from obstore into an errno, a summary for the message,
and whether the failure is transient; :class:`RetryPolicy` says how often and how long a
transient one is retried; :class:`ObjectStoreError` is what the caller sees when the retries
did not help. Which requests ldformat retries itself, and why, is in :mod:`.object`.
"""

from __future__ import annotations

import errno
import random
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import UsageError

__all__ = ["RETRY_OPTION_KEYS", "ObjectStoreError", "RetryPolicy"]

#: ``storage_options`` keys of the retry policy (see :class:`RetryPolicy`).
RETRY_OPTION_KEYS = {
    "max_retries": "tries - 1",
    "retry_timeout": "total, in seconds",
    "retry_init_backoff": "initial_backoff, in seconds",
    "retry_max_backoff": "max_backoff, in seconds",
}

_STATUS = re.compile(r"status code: (\d{3})")
_RETRIED = re.compile(r"after (\d+) retries")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONNECTION_WORDS = ("error sending request", "connection", "connect error", "reset", "broken pipe",
                     "error decoding response body", "incomplete", "unexpected eof", "body error")
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline has elapsed")


class ObjectStoreError(OSError):
    """A failure of an object store request that is neither a missing nor an existing object.

    ``errno`` says what kind (``EIO``, ``EAGAIN`` for throttling, ``ECONNRESET``,
    ``ETIMEDOUT``, ``EACCES``, ``ENOENT`` for a missing bucket, ...), ``filename`` is the URL
    of the object and ``strerror`` what failed and what to do. Being a subclass, it is never a
    :class:`FileNotFoundError` or :class:`FileExistsError`, which keep their contract meaning
    (no such object; lost an exclusive create) even when ``errno`` is ``ENOENT``.
    """


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried (see the module documentation for which).

    Attributes:
        tries: attempts of one request in all (the first included), at least 1.
        initial_backoff: seconds before the first retry; doubled for each next one (with
            jitter), up to ``max_backoff``.
        max_backoff: the longest wait between two attempts, in seconds.
        total: no retry starts later than this many seconds after the first attempt.
    """

    tries: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    total: float = 30.0

    def __post_init__(self) -> None:
        if self.tries < 1 or self.initial_backoff < 0 or self.max_backoff < 0 or self.total < 0:
            raise UsageError(f"RetryPolicy: tries must be >= 1 and times >= 0 (got {self})")

    def obstore_config(self) -> dict[str, Any]:
        """The same policy as obstore's ``RetryConfig``."""
        return {
            "max_retries": self.tries - 1,
            "retry_timeout": timedelta(seconds=self.total),
            "backoff": {"init_backoff": timedelta(seconds=self.initial_backoff),
                        "max_backoff": timedelta(seconds=max(self.max_backoff, self.initial_backoff)), "base": 2},
        }

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...): exponential, half jittered."""
        full = min(self.max_backoff, self.initial_backoff * 2.0 ** (retry - 1))
        return full / 2 + random.uniform(0, full / 2)


@dataclass
class Failure:
    """What went wrong in one attempt, in the terms the retry loop and the caller need."""

    errno: int
    summary: str
    transient: bool
    retried_inside: int  # how many times obstore already retried it
    error: BaseException
    builder: bool = False  # obstore could not set up its HTTP client (a plain http:// endpoint not allowed)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:500]


def classify_failure(e: BaseException) -> Failure | None:
    """What an exception from obstore (or from a ranged read) means; None: not a storage error."""
    try:
        from obstore.exceptions import (
            BaseError,
            NotSupportedError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )
    except ImportError:  # pragma: no cover - ObjectStore cannot exist without obstore
        return None
    if isinstance(e, (FileExistsError, UsageError)):
        return None  # already what the contract wants
    text = str(e)
    first = first_line(e)
    # What failed, without obstore's preamble (request, URL, retry counts).
    detail = first.rsplit(" - ", 1)[-1].strip() if " - " in first else first
    lower = re.sub(r"retry_timeout: \S+", "", text).lower()
    retried = _RETRIED.search(text)
    retried_inside = int(retried.group(1)) if retried is not None else 0
    status_match = _STATUS.search(text)
    status = int(status_match.group(1)) if status_match else None
    code_match = _CODE.search(text)
    code = code_match.group(1) if code_match else None
    if "NoSuchBucket" in text:
        return Failure(errno.ENOENT, "the bucket does not exist (NoSuchBucket)", False, retried_inside, e)
    if isinstance(e, FileNotFoundError):
        return Failure(errno.ENOENT, "no such object", False, retried_inside, e)
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return Failure(errno.EACCES, f"HTTP {status or ''} {code or ''}".strip() + f" ({detail})", False,
                        retried_inside, e)
    if isinstance(e, PreconditionError):  # a ranged read found the object replaced meanwhile
        return Failure(errno.EAGAIN, "the object changed while it was read", True, 0, e)
    if isinstance(e, NotSupportedError):
        return Failure(errno.EOPNOTSUPP, f"not supported by this store ({detail})", False, retried_inside, e)
    described = f"HTTP {status}" + (f" {code}" if code else "") if status is not None else None
    if status in _TRANSIENT_STATUS:
        code_errno = errno.EAGAIN if status in (429, 503) else errno.EIO
        return Failure(code_errno, described or "", True, retried_inside, e)
    if isinstance(e, (TimeoutError,)) or (status is None and any(w in lower for w in _TIMEOUT_WORDS)):
        return Failure(errno.ETIMEDOUT, f"timed out ({detail})", True, retried_inside, e)
    if isinstance(e, ConnectionError) or (status is None and any(w in lower for w in _CONNECTION_WORDS)):
        return Failure(errno.ECONNRESET, f"connection failed ({detail})", True, retried_inside, e)
    if isinstance(e, (BaseError, OSError)):
        return Failure(errno.EIO, described or detail, False, retried_inside, e, "builder error" in lower)
    return None


def retry_policy(policy: RetryPolicy, options: dict[str, Any], url: str) -> RetryPolicy:
    """``policy`` with the retry keys of ``options`` applied (and removed from ``options``)."""
    fields: dict[str, Any] = {}
    names = {"max_retries": "tries", "retry_timeout": "total", "retry_init_backoff": "initial_backoff",
             "retry_max_backoff": "max_backoff"}
    for key, name in names.items():
        if key not in options:
            continue
        value = options.pop(key)
        try:
            fields[name] = int(value) + 1 if key == "max_retries" else float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{url}: retry setting {key}={value!r} is not a number") from None
    if not fields:
        return policy
    return RetryPolicy(**{**{f: getattr(policy, f) for f in ("tries", "initial_backoff", "max_backoff", "total")},
                          **fields})
