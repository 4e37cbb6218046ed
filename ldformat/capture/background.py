"""The background writer: one thread appends the captured steps in order (docs/capture-runtime.md "Pipeline").

It takes the queued steps, encodes their extra state (JSON encoding stays off the training
thread), waits for their copies, applies them to the replica (``lowdiff+``,
docs/capture-runtime.md "`lowdiff+`: the CPU replica") and appends them to the
:class:`~ldformat.ChainWriter`, which commits every ``batch_steps`` steps and at anchors.
Its first exception is kept and it writes nothing more; the training thread raises it at its
next call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import NamedTuple

from ..chain.captured import CapturedStep, CapturedTensor
from ..chain.writer import ChainWriter
from ..format.jsonvalue import encode
from .ddp import EXTRAS_TIMEOUT_S, RankStates
from .replica import Replica
from .staging import BufferPool, BufferSet, Stager
from .stats import CaptureStats
from .tuning import Tuning

log = logging.getLogger("ldformat.capture")
#: The exchange fails by itself after EXTRAS_TIMEOUT_S; this only bounds a stuck thread.
RANKS_TIMEOUT_S = EXTRAS_TIMEOUT_S + 30.0


class Queued(NamedTuple):
    """A finalized step on its way to the background writer."""

    captured: CapturedStep  # its extra is encoded by the background writer, from raw_extra
    raw_extra: dict[str, object]
    buffers: BufferSet  # returned to the pool once the step is encoded
    #: Data parallel: the other ranks' RNG states and data positions (spec §19.1 ``ranks``),
    #: from the exchange thread; waited for before the extra is encoded.
    ranks: Future[RankStates | None] | None = None
    #: time.monotonic() when the step ended: once it is committed, what a crash loses is measured from it.
    ended_at: float | None = None
    #: xor's lazy snapshot (snapshot.py): whether the buffers hold the step's state, once fenced.
    valid: Future[bool] | None = None
    #: xor in pieces (docs/capture-runtime.md "Host memory"): reads the step's tensors piece by
    #: piece for :meth:`ChainWriter.append_in_pieces`; ``read`` is set once it is done with them.
    pieces: Callable[[list[str]], Iterator[dict[str, CapturedTensor]]] | None = None
    read: threading.Event | None = None


class BackgroundWriter:
    """The thread that appends queued steps; started on construction, ended by :meth:`stop`."""

    def __init__(self, writer: ChainWriter, pool: BufferPool, stats: CaptureStats, tuning: Tuning,
                 replica: Replica | None, on_commit: Callable[[int | None], None] | None = None) -> None:
        self.writer = writer
        self.on_commit = on_commit  # called with the durable step after each commit (the mirror)
        self.pool = pool
        self.stats = stats
        self.tuning = tuning
        self.replica = replica
        self.error: BaseException | None = None
        self.active = False  # working on a step now (the capture cadence's clean intervals need it idle)
        self.queue: queue.Queue[Queued | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ldformat-writer", daemon=True)
        self.thread.start()

    def put(self, item: Queued) -> None:
        self.queue.put(item)

    def join(self) -> None:
        """Wait until every queued step is appended (or dropped after an error)."""
        self.queue.join()

    def stop(self) -> None:
        """Let the thread finish the queued steps, then end it."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        cpu_start = time.thread_time()
        while True:
            item = self.queue.get()
            if item is None:
                self.queue.task_done()
                break
            captured, raw_extra, buffers, ranks, ended_at, valid, pieces, read = item
            self.active = True
            started = time.perf_counter()
            released = False

            def release() -> None:  # once the step is encoded: training may refill the buffers
                nonlocal released
                if not released:
                    released = True
                    self.pool.release(buffers)  # noqa: B023 (called within this iteration)
                    if read is not None:  # noqa: B023 (the live state may move on: training waits for it)
                        read.set()  # noqa: B023

            try:
                if self.error is None and valid is not None and not valid.result():
                    pass  # a change in place invalidated the lazy snapshot: the step is not recorded
                elif self.error is None:
                    theirs = ranks.result(timeout=RANKS_TIMEOUT_S) if ranks is not None else None
                    if theirs:
                        raw_extra = {**raw_extra, "ranks": theirs}
                    captured = replace(captured, extra=encode(raw_extra, "extra"))
                    Stager.wait(buffers)
                    commits = self.writer.commits
                    if self.replica is not None:
                        captured = self.replica.apply(captured)
                    if pieces is not None:
                        self.writer.append_in_pieces(captured, pieces, encoded=release)
                    else:
                        self.writer.append(captured, encoded=release)
                    if self.writer.commits != commits:
                        self.stats.commits += self.writer.commits - commits
                        self.stats.durable_at = ended_at
                        if self.on_commit is not None:
                            self.on_commit(self.writer.durable_step)
                    if captured.anchor:
                        self.stats.anchors_written += 1
                        self.tuning.anchor_write_s = time.perf_counter() - started
            except BaseException as e:  # surfaced in the training thread at its next call
                self.error = e
                log.error("%s: checkpoint writer failed at step %d: %s", self.writer.path, captured.step, e)
            finally:
                self.stats.background_wall_s += time.perf_counter() - started
                self.stats.background_cpu_s = time.thread_time() - cpu_start
                release()
                if read is not None:  # training waits for it at its next optimizer step, failed or not
                    read.set()
                self.active = False
                self.queue.task_done()
