"""The stale-lock takeover race (spec §15.3) that the local and the S3 lock tests run: send one
job to 2 or 3 racing worker processes at once, then check that exactly one of them won."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import ldformat
from ldformat import ChainReader
from ldformat.chain.lock import current_lock


def run_race_trial(workers: list[tuple[Any, Connection]], barrier: Any, job: dict[str, Any],
                   n: int) -> list[dict[str, Any]]:
    """Send ``job`` to ``n`` of the 3 race workers at once; their results."""
    for _, conn in workers[:n]:
        conn.send(job)
    if n < 3:  # the third party of the barrier
        barrier.wait(timeout=60)
    first = [conn.recv() for _, conn in workers[:n]]
    # Every racer has now either been locked out or holds the lock; more than one holder is
    # the defect under test. Holders then commit one step and release.
    for (_, conn), result in zip(workers[:n], first, strict=True):
        if result["result"] == "holding":
            conn.send("finish")
    return [conn.recv() if result["result"] == "holding" else result
            for (_, conn), result in zip(workers[:n], first, strict=True)]


def check_race_outcome(results: list[dict[str, Any]], location: str, before: list[int], store: Any,
                       trial: int) -> dict[str, Any]:
    """Exactly one winner, the rest locked out; the winner's step is durable, the chain valid."""
    kinds = sorted(r["result"] for r in results)
    assert kinds == ["locked"] * (len(results) - 1) + ["won"], f"trial {trial}: {kinds}"
    won = next(r for r in results if r["result"] == "won")
    reader = ChainReader(location)
    assert reader.steps == before + [won["durable"]], f"trial {trial}: a durable step was lost"
    report = ldformat.validate(location)
    assert report.ok, (trial, [str(p) for p in report.problems])
    reader.materialize(won["durable"])
    assert current_lock(store) is None, "the winner did not release the lock"
    return won
