"""``validate`` overlapping a maintainer never reports a valid chain as invalid (spec §18).

A background thread keeps changing a chain the way a training job and its maintenance do:
an appending :class:`ChainWriter`, ``compact`` (which commits a snapshot and then deletes
the objects and records it superseded) and ``truncate``. Every state it leaves is valid, so
every concurrent ``validate`` must report no problem: a problem can only come from the
validator reading the log at one point and objects at another. Before validators re-read
the log and restarted when it moved, about 1-3 % of overlapping runs reported a missing
object or record.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from models import TinyNet, train_step

import ldformat
from ldformat import ChainReader, ChainWriter

RUNS = 120  # validate runs overlapping the maintainer
TIME_LIMIT_S = 45.0


class Maintainer(threading.Thread):
    """Append, compact and truncate in a loop until stopped; every commit leaves a valid chain."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(daemon=True)
        self.path, self.kind = path, kind
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.cycles = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.cycle()
                self.cycles += 1
        except BaseException as e:  # reported by the test
            self.error = e

    def cycle(self) -> None:
        torch.manual_seed(self.cycles)
        model = TinyNet()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        reader = ChainReader(self.path)
        latest = reader.latest_step
        assert latest is not None
        reader.load_into(model, optimizer)
        writer = ChainWriter.open(self.path, model, optimizer, batch_steps=2, anchor_every=4)
        try:
            for step in range(latest + 1, latest + 5):
                train_step(model, optimizer, step)
                writer.record_step(step)
        finally:
            writer.close()
        # Compaction drops old steps, folds long replays into new anchors and deletes what
        # it superseded; truncation drops the newest step and deletes its objects.
        ldformat.compact(self.path, keep_last=5, max_replay=2)
        latest = ChainReader(self.path).latest_step
        assert latest is not None
        ldformat.truncate(self.path, after=latest - 1)


def _run(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    writer = ChainWriter.create(path, model, optimizer, kind=kind, batch_steps=2, anchor_every=4)
    for step in range(1, 9):
        train_step(model, optimizer, step)
        writer.record_step(step)
    writer.close()
    assert ldformat.validate(path).ok

    maintainer = Maintainer(path, kind)
    false_reports: list[str] = []
    runs = 0
    started = time.monotonic()
    maintainer.start()
    try:
        while runs < RUNS and time.monotonic() - started < TIME_LIMIT_S and maintainer.is_alive():
            report = ldformat.validate(path)
            runs += 1
            if not report.ok:
                false_reports.append("; ".join(str(p) for p in report.problems))
    finally:
        maintainer.stop.set()
        maintainer.join(timeout=60)
    assert maintainer.error is None, f"the maintainer failed: {maintainer.error!r}"
    assert runs >= 100 and maintainer.cycles >= 3, (runs, maintainer.cycles)
    assert not false_reports, f"{len(false_reports)} of {runs} validate runs reported a valid chain invalid:\n" + \
        "\n".join(false_reports[:5])
    assert ldformat.validate(path).ok


def test_validate_overlapping_append_compact_truncate_xor(tmp_path: Path) -> None:
    _run(tmp_path, "state.xor")


def test_validate_overlapping_append_compact_truncate_grad(tmp_path: Path) -> None:
    _run(tmp_path, "grad.dense")
