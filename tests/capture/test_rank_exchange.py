"""The exchange thread that carries every data-parallel rank's per-step state to rank 0
(docs/capture-runtime.md, "Replicated (DDP)"): order, errors, back-pressure, close.

The gathers themselves run over gloo in tests/capture/test_ddp.py and tests/sharded/test_sharded_copies.py;
here a stand-in for :class:`~ldformat.capture.ddp.RankExtras` records what it is handed."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ldformat.capture.ddp import ExchangeThread, RankExtras
from ldformat.errors import LdformatError


class Recorder:
    """Answers each exchange with what it was handed; waits for ``gate`` first if given;
    fails on the data value ``fail_on``."""

    def __init__(self, gate: threading.Event | None = None, fail_on: object = None) -> None:
        self.gate = gate
        self.fail_on = fail_on
        self.seen: list[object] = []
        self.threads: set[str] = set()

    def exchange(self, rng: Any, data: object, digest: str | None = None) -> dict[str, dict[str, object]]:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(10)
        if data == self.fail_on:
            raise LdformatError(f"data-parallel rank 0: the exchange failed at {data}")
        self.seen.append(data)
        return {"1": {"rng": rng, "data": data, "digest": digest}}


def make(recorder: Recorder, max_pending: int = 8) -> ExchangeThread:
    extras: RankExtras = recorder  # type: ignore[assignment]  # only exchange() is called
    return ExchangeThread(extras, max_pending=max_pending)


def test_exchanges_run_in_step_order_off_the_calling_thread() -> None:
    recorder = Recorder()
    exchanges = make(recorder)
    futures = [exchanges.submit({"torch": i}, i, f"crc{i}") for i in range(20)]
    exchanges.settle()
    assert recorder.seen == list(range(20))
    assert recorder.threads == {"ldformat-rank-extras"}
    got = [f.result(0) for f in futures]
    assert [g["1"]["data"] for g in got if g is not None] == list(range(20))
    assert got[3] == {"1": {"rng": {"torch": 3}, "data": 3, "digest": "crc3"}}
    assert exchanges.close(5.0)


def test_a_failed_exchange_fails_every_later_one_and_the_next_calls() -> None:
    recorder = Recorder(fail_on=2)
    exchanges = make(recorder)
    futures = [exchanges.submit(None, i) for i in range(5)]
    with pytest.raises(LdformatError, match="failed at 2"):
        exchanges.settle()
    assert recorder.seen == [0, 1]  # nothing runs after the failure
    assert futures[1].result(0) is not None
    for f in futures[2:]:
        with pytest.raises(LdformatError, match="failed at 2"):
            f.result(0)
    with pytest.raises(LdformatError, match="failed at 2"):
        exchanges.submit(None, 5)
    assert exchanges.close(5.0)


def test_the_caller_waits_once_max_pending_exchanges_are_queued() -> None:
    gate = threading.Event()
    exchanges = make(Recorder(gate=gate), max_pending=2)
    for i in range(3):  # one runs (held at the gate), two wait in the queue
        exchanges.submit(None, i)
    deadline = time.monotonic() + 5
    while exchanges._queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    returned = threading.Event()

    def fourth() -> None:
        exchanges.submit(None, 3)
        returned.set()

    caller = threading.Thread(target=fourth, daemon=True)
    caller.start()
    assert not returned.wait(0.3), "submit returned with max_pending exchanges queued"
    gate.set()
    assert returned.wait(10)
    exchanges.settle()
    assert exchanges.close(5.0)


def test_close_reports_exchanges_that_do_not_end_within_its_timeout() -> None:
    gate = threading.Event()
    exchanges = make(Recorder(gate=gate))
    exchanges.submit(None, 0)
    assert not exchanges.close(0.2)
    gate.set()
    exchanges._thread.join(10)
    assert not exchanges._thread.is_alive()
