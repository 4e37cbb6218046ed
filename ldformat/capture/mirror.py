"""Background replication of a capture chain to a mirror (local-first checkpointing).

A :class:`~ldformat.Checkpointer` opened with ``mirror=`` commits to its own chain as usual;
a :class:`Mirror` thread then copies that chain to the mirror location with
:func:`ldformat.sync` after commits. Syncs are coalesced: at most one runs, and commits made
while it runs schedule exactly one more. Nothing here runs on the training thread, and no
failure of the mirror reaches it:

* a storage error or a :class:`~ldformat.errors.ChainLockedError` is retried with bounded
  exponential backoff (:data:`FIRST_RETRY_S` doubling up to :data:`MAX_RETRY_S`);
* a :class:`~ldformat.ReplicaDivergedError` (the mirror holds another chain, or a log that is
  not a copy of this one) stops mirroring for good; training goes on.

Each change of state (working, failing, diverged) is logged once on the
``ldformat.capture`` logger, and the lag is kept in :class:`~ldformat.CaptureStats`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..api import sync
from ..chain.replicate import ReplicaDivergedError, SyncReport
from ..stores import Store, StoreOrPath
from .stats import CaptureStats

log = logging.getLogger("ldformat.capture")

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0
DEFAULT_MIRROR_TIMEOUT_S = 60.0



def describe(location: StoreOrPath) -> str:
    """The location as messages name it."""
    if isinstance(location, Store):
        return location.describe()
    return os.fspath(location)


class Mirror:
    """The thread that syncs ``src`` to ``dst`` after commits; see the module docstring.

    Args:
        src: the local chain (a location or a Store), ``src_options`` its storage options.
        dst: the mirror, ``dst_options`` its storage options.
        stats: where the mirror's lag, last error and sync count are kept.
        first_retry_s, max_retry_s: the backoff after a failed sync (default
            :data:`FIRST_RETRY_S`, :data:`MAX_RETRY_S`).
        sync_fn: the sync function (default :func:`ldformat.sync`).
    """

    def __init__(self, src: StoreOrPath, dst: StoreOrPath, *, stats: CaptureStats,
                 src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None,
                 first_retry_s: float | None = None, max_retry_s: float | None = None,
                 sync_fn: Callable[..., SyncReport] | None = None) -> None:
        self.src, self.dst = src, dst
        self.name = describe(dst)
        self.src_options, self.dst_options = src_options, dst_options
        self.stats = stats
        self.first_retry_s = FIRST_RETRY_S if first_retry_s is None else first_retry_s
        self.max_retry_s = MAX_RETRY_S if max_retry_s is None else max_retry_s
        self._sync = sync if sync_fn is None else sync_fn
        self._cond = threading.Condition()
        self._wanted = False  # a sync is due (a commit since the last attempt began, or a retry)
        self._stopping = False
        self._running = False
        self._next_try = 0.0  # monotonic time before which no retry starts (backoff)
        self._failures = 0  # consecutive failed attempts
        self._attempts = 0  # attempts finished (for close's final attempt)
        self._state = "new"  # new | ok | failing | diverged
        self._local_step: int | None = None
        self._unmirrored: list[tuple[int, float]] = []  # (step, monotonic time) of commits the mirror lacks
        self.thread = threading.Thread(target=self._run, name="ldformat-mirror", daemon=True)
        self.thread.start()

    # -- the writer's side --------------------------------------------------------------------
    def committed(self, step: int | None) -> None:
        """A commit made ``step`` durable locally: schedule a sync (coalesced)."""
        with self._cond:
            if step is not None and (self._local_step is None or step > self._local_step):
                self._local_step = step
                self._unmirrored.append((step, time.monotonic()))
            self._update_stats()
            if self._state == "diverged":
                return
            self._wanted = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """Mirroring stopped for good (the mirror diverged)."""
        return self._state == "diverged"

    def close(self, timeout: float) -> bool:
        """Make one final sync attempt (no backoff), waiting at most ``timeout`` seconds.

        Returns True when the mirror then holds every local commit. The thread is ended; a
        sync still running at the timeout is left to finish in its (daemon) thread.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._state != "diverged":
                target = self._attempts + (2 if self._running else 1)  # the running one saw older commits
                self._wanted = True
                self._next_try = 0.0
                self._cond.notify_all()
                while self._attempts < target and self._state != "diverged":
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            self._stopping = True
            self._cond.notify_all()
            caught_up = not self._unmirrored
            self._update_stats()
        if not caught_up:
            log.warning("%s: the mirror is %s steps (%.1f s) behind the local chain at close%s",
                        self.name, self.stats.mirror_lag_steps, self.stats.mirror_lag_seconds,
                        f"; last error: {self.stats.mirror_last_error}" if self.stats.mirror_last_error else "")
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return caught_up

    # -- the mirror thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._state == "diverged" or (self._stopping and not self._wanted):
                        return
                    if self._stopping and self._next_try > time.monotonic():
                        return  # stopping: no retry after close's final attempt
                    wait = self._next_try - time.monotonic()
                    if self._wanted and wait <= 0:
                        break
                    self._cond.wait(wait if self._wanted else None)
                self._wanted = False
                self._running = True
            self._attempt()

    def _attempt(self) -> None:
        error: BaseException | None = None
        report: SyncReport | None = None
        try:
            report = self._sync(self.src, self.dst, src_options=self.src_options, dst_options=self.dst_options)
        except BaseException as e:  # noqa: BLE001 - no mirror failure may reach training
            error = e
        with self._cond:
            self._running = False
            self._attempts += 1
            if report is not None:
                self.stats.mirror_syncs += 1
                self._failures = 0
                self._next_try = 0.0
                mirrored = report.dst_latest_step
                if mirrored is not None:
                    self.stats.mirror_step = mirrored
                    self._unmirrored = [(s, t) for s, t in self._unmirrored if s > mirrored]
                if self._state != "ok":
                    if self._state == "failing":
                        log.warning("%s: mirroring works again (at step %s)", self.name, mirrored)
                    self._state = "ok"
                if not report.up_to_date:
                    self._wanted = True  # committed while copying
            elif isinstance(error, ReplicaDivergedError):
                self._state = "diverged"
                self.stats.mirror_last_error = f"{type(error).__name__}: {error}"
                log.error("%s: the mirror diverged from the local chain; mirroring stops (training goes on): %s",
                          self.name, error)
            else:
                self._failures += 1
                delay = min(self.max_retry_s, self.first_retry_s * 2 ** (self._failures - 1))
                self._next_try = time.monotonic() + delay
                self._wanted = True
                message = f"{type(error).__name__}: {error}"
                self.stats.mirror_last_error = message
                if self._state != "failing":
                    self._state = "failing"
                    log.warning("%s: mirroring failed, retrying with backoff (training goes on): %s",
                                self.name, message)
                else:
                    log.debug("%s: mirror retry %d failed (next in %.1f s): %s", self.name, self._failures, delay,
                              message)
            self._update_stats()
            self._cond.notify_all()

    def _update_stats(self) -> None:
        """Lag in steps and the time of the oldest local commit the mirror lacks (lock held)."""
        s = self.stats
        s.mirror_behind_since = self._unmirrored[0][1] if self._unmirrored else None
        if not self._unmirrored or self._local_step is None:
            s.mirror_lag_steps = 0
        elif s.mirror_step is None:
            s.mirror_lag_steps = self._local_step - self._unmirrored[0][0] + 1
        else:
            s.mirror_lag_steps = self._local_step - s.mirror_step
