"""``validate`` overlapping a maintainer never reports a valid chain as invalid (spec §18).

A second process keeps changing a chain the way a training job and its maintenance do: an
appending :class:`ChainWriter`, ``truncate`` and ``compact``, both of which commit a snapshot
and then delete the objects and records it superseded. Every state it leaves is valid, so no
concurrent ``validate`` may report a problem: one could only come from reading the log at
one moment and objects at another. Before validation re-read the log and started again
when it had moved, a few in a hundred overlapping runs reported a missing object or record.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from collections.abc import Iterator
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import TinyNet, train_step

import ldformat
from ldformat import ChainReader, ChainWriter, LocalStore

pytestmark = pytest.mark.procs

RUNS = 60  # validate runs overlapping the maintainer, per kind (120 in all)
TIME_LIMIT_S = 60.0  # a bound on a loaded machine; it normally takes a few seconds
READ_DELAY_S = 0.001


class SlowStore(LocalStore):
    """Reads objects a little slowly, as a network store would: the longer a validation takes
    between folding the log and reading the objects, the more often a commit falls in between."""

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        time.sleep(READ_DELAY_S)
        return super().read_buffer(path, max_size)


def _cycle(path: Path, n: int) -> None:
    """Truncate the newest steps, append them again, and now and then compact."""
    torch.manual_seed(n)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    latest = ChainReader(path).latest_step
    assert latest is not None
    ldformat.truncate(path, after=latest - 2)  # deletes the newest batch (and anchor)
    reader = ChainReader(path)
    reader.load_into(model, optimizer)
    start = reader.latest_step
    assert start is not None
    with ChainWriter.open(path, model, optimizer, batch_steps=2, anchor_every=4) as writer:
        for step in range(start + 1, start + 4):
            train_step(model, optimizer, step)
            writer.record_step(step)
    if n % 2 == 0:  # folds long replays into new anchors and drops old steps, then deletes them
        ldformat.compact(path, keep_last=6, max_replay=2)


def maintain(path: str, stop: Event, cycles: Synchronized, errors: Any) -> None:
    """The maintainer process: cycles until ``stop`` is set."""
    torch.set_num_threads(1)
    try:
        while not stop.is_set():
            _cycle(Path(path), cycles.value)
            with cycles.get_lock():
                cycles.value += 1
    except BaseException:
        errors.put(traceback.format_exc())


@contextlib.contextmanager
def maintained_chain(tmp_path: Path, kind: str) -> Iterator[tuple[Path, Synchronized]]:
    """A valid chain of ``kind`` and the maintainer process working on it: yields the path and
    the maintainer's cycle count once it has started; stops it on exit and checks it never failed."""
    path = tmp_path / "chain"
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with ChainWriter.create(path, model, optimizer, kind=kind, batch_steps=2, anchor_every=4) as writer:
        for step in range(1, 9):
            train_step(model, optimizer, step)
            writer.record_step(step)
    assert ldformat.validate(path).ok

    ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch's thread pools
    stop, cycles, errors = ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    process = ctx.Process(target=maintain, args=(str(path), stop, cycles, errors), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 60
        while cycles.value == 0 and process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # the maintainer is importing torch
        yield path, cycles
    finally:
        stop.set()
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    assert errors.empty(), f"the maintainer failed:\n{errors.get()}"


def _run(tmp_path: Path, kind: str) -> None:
    false_reports: list[str] = []
    runs = 0
    with maintained_chain(tmp_path, kind) as (path, cycles):
        store = SlowStore(path)
        started = time.monotonic()
        # Until both sides did enough: on a loaded machine the maintainer's cycles come slower.
        while (runs < RUNS or cycles.value < 3) and time.monotonic() - started < TIME_LIMIT_S:
            report = ldformat.validate(path, store=store)
            runs += 1
            if not report.ok:
                false_reports.append("; ".join(str(p) for p in report.problems))
    assert runs >= RUNS and cycles.value >= 3, f"too little overlap: {runs} validate runs, {cycles.value} cycles"
    assert not false_reports, (f"{len(false_reports)} of {runs} validate runs reported a valid chain invalid:\n"
                               + "\n".join(false_reports[:5]))
    assert ldformat.validate(path).ok


def test_validate_overlapping_writer_truncate_compact_xor(tmp_path: Path) -> None:
    _run(tmp_path, "state.xor")


def test_validate_overlapping_writer_truncate_compact_grad(tmp_path: Path) -> None:
    _run(tmp_path, "grad.dense")
