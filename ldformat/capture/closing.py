"""Flushing and closing a recording Checkpointer (docs/capture-runtime.md "Modes and life cycle",
"Pipeline", "Bounded cost").

:meth:`Closing.flush` and :meth:`Closing.close` capture the live state when steps ran since the
last capture (the chain ends where training did), wait for the background writer and commit.
``close`` then stops every thread and hook; with a sharded model, rank 0 commits every rank's
last step for all (spec §20.3), and the mirror gets one last bounded sync. A failure of the
writer, or of the last step's capture, is raised only once what was queued before it is
committed and the lock released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .ddp import EXTRAS_TIMEOUT_S
from .lifecycle import Phase, StepLifecycle
from .parts import Parts

log = logging.getLogger("ldformat.capture")


class Closing:
    """The end of a recording Checkpointer: :meth:`flush` (it goes on) and :meth:`close` (it stops)."""

    def __init__(self, parts: Parts, life: StepLifecycle) -> None:
        self.parts = parts
        self.life = life

    def flush(self) -> int | None:
        parts, life = self.parts, self.life
        life.finalize_ended()
        life.capture_live()
        life.fence()  # the writer waits for the verdict on a step read in pieces
        parts.background.join()
        parts.raise_if_failed()
        step = parts.writer.commit()
        life.committed_all()
        if parts.mirror is not None:
            parts.mirror.committed(step)
        return step

    def close(self, forget: Callable[[], None]) -> int | None:
        """``forget``: removes the Checkpointer from those that interpreter exit closes."""
        parts, life = self.parts, self.life
        if life.closed:
            return parts.writer.durable_step
        failed = self._stop(forget)
        if parts.background.error is not None:
            parts.writer.abort()
            if parts.mirror is not None:
                parts.mirror.close(0.0)
            if parts.committer is not None:
                parts.committer.finish(None, 0.0)
            parts.raise_if_failed()
        step = self._commit_last()
        if parts.mirror is not None:
            parts.mirror.committed(step)
            parts.mirror.close(parts.mirror_timeout)
        if failed is not None:
            raise failed
        return step

    def _stop(self, forget: Callable[[], None]) -> Exception | None:
        """Queue the last step, then stop the hooks and threads; returns the last step's failure."""
        parts, life = self.parts, self.life
        failed: Exception | None = None
        try:
            try:
                if parts.background.error is None and life.open is not None and (
                        life.phase is Phase.ENDED or life.open.hyper is not None):
                    life.finalize()
                if parts.background.error is None:
                    life.capture_live()
            except Exception as e:
                # The last step could not be captured (its staging set outgrew max_host_bytes, say):
                # the steps queued before it are still committed and the lock released, then it is raised.
                failed = e
        finally:
            life.closed = True
            parts.pieces.hold(raise_failed=False)  # the writer waits for it; a failure is raised below
            parts.lazy.close()
            parts.background.stop()
            parts.hooks.remove()
            forget()
            if parts.exchanges is not None:  # every queued step's exchange ran for the writer
                parts.exchanges.close(0.0 if parts.background.error is not None else EXTRAS_TIMEOUT_S)
        return failed

    def _commit_last(self) -> int | None:
        """The final commit (for every rank, with a sharded model) and the writer's close."""
        parts, life = self.parts, self.life
        try:
            step = parts.writer.commit()
            life.committed_all()
            if parts.committer is not None:  # every rank's last step, committed for all (spec §20.3)
                step = parts.committer.finish(step, parts.commit_timeout)
            if parts.sharded and parts.writer.max_bytes is not None:
                self._retain_once_committed()
            written = parts.writer.close()
        except BaseException:
            if parts.mirror is not None:
                parts.mirror.close(0.0)
            if parts.committer is not None:
                parts.committer.finish(None, 0.0)
            parts.writer.abort()
            raise
        return written if parts.committer is None else step

    def _retain_once_committed(self) -> None:
        """The last retention pass of a rank chain (spec §20.8), once the global commit holds
        this rank's last step: the passes after this rank's own commits had to keep the history
        that the then newest commit still needed, so without this one a rank that finished ahead
        of rank 0's last commit would stay over its share."""
        writer, timeout = self.parts.writer, self.parts.commit_timeout
        newest, last = writer.retain_at_most, writer.durable_step
        if newest is None or last is None:
            return
        deadline = time.monotonic() + timeout
        while (committed := newest()) is None or committed < last:
            if time.monotonic() >= deadline:
                log.warning("%s: step %d was not committed for every rank within %g s, so this rank chain keeps "
                            "the history the older commit needs, over its max_bytes share until the next run",
                            writer.path, last, timeout)
                return
            time.sleep(0.1)
        writer.keep_budget()
