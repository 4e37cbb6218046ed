"""Launching multi-process workers for the sharded tests: one launch of ``world`` workers on
gloo at 127.0.0.1, bounded in time, every worker killed on every way out; a sequence of runs
(a JSON job file) retried after a failed run or a lost race for the port.

A worker is a script run as ``python WORKER --rank R --world W --out DIR --job JOB.json [ARGS]``
that saves what rank ``R`` saw of run ``<name>`` to ``DIR/<name>.rank<R>.pt``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from ports import gloo_env


def spawn(worker: Path, world: int, outdir: Path, job: Path, timeout: float, tag: str,
          args: Sequence[str] = ()) -> tuple[list[int | None], str]:
    """One launch of ``world`` workers; as soon as one fails (or the time is up) kill the others.
    Returns the exit codes (None for each, when the time ran out) and the tail of every log."""
    env = gloo_env()
    logs = [outdir / f"{tag}.rank{rank}.log" for rank in range(world)]
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as out:  # a file, not a pipe: a chatty worker can never block on it
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), "--rank", str(rank), "--world", str(world),
                     "--out", str(outdir), "--job", str(job), *args],
                    cwd=outdir, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # never leave a worker behind, whatever happened
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    text = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{log.read_text(errors='replace')[-6000:]}"
                     for r, (p, log) in enumerate(zip(procs, logs, strict=True)) if log.exists())
    if timed_out:
        text = f"(killed after {timeout:.0f} s)\n{text}"
    return [None if timed_out else p.returncode for p in procs], text


@dataclass
class Launch:
    """The outputs of one launch's runs: ``outdir/<run>.rank<R>.pt`` per run and rank."""

    outdir: Path
    world: int
    failed: dict[str, str] = field(default_factory=dict, repr=False)  # run -> the workers' output
    seconds: float = 0.0
    _cache: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict, repr=False)

    def record(self, name: str, rank: int = 0) -> dict[str, Any]:
        """What rank ``rank`` of run ``name`` saved."""
        if name in self.failed:
            pytest.fail(f"run {name!r} failed in the workers (world {self.world}):\n{self.failed[name]}")
        key = (name, rank)
        if key not in self._cache:
            self._cache[key] = torch.load(self.outdir / f"{name}.rank{rank}.pt", weights_only=True)
        return self._cache[key]

    def chain(self, name: str) -> Path:
        self.record(name)
        return self.outdir / name


def done(outdir: Path, world: int, name: str) -> bool:
    return all((outdir / f"{name}.rank{r}.pt").exists() for r in range(world))


def launch(worker: Path, outdir: Path, world: int, runs: list[dict[str, Any]], timeout: float, *,
           attempts: int, stop_on_timeout: bool, args: Sequence[str] = (),
           make: Callable[[Path, int], Launch] = Launch) -> Launch:
    """Run ``runs`` in order on ``world`` workers, in at most ``attempts`` launches. A run that
    fails is recorded and skipped, and the workers are started again for the runs after it (a
    lost race for the port is retried); with ``stop_on_timeout``, a launch that ran out of time
    ends it."""
    started = time.monotonic()
    result = make(outdir, world)
    for attempt in range(attempts):
        pending = [r for r in runs if r["name"] not in result.failed and not done(outdir, world, r["name"])]
        if not pending:
            break
        job = outdir / f"job{attempt}.json"
        job.write_text(json.dumps(pending))
        codes, text = spawn(worker, world, outdir, job, timeout, f"attempt{attempt}", args)
        if codes == [0] * world:
            continue
        if os.strerror(errno.EADDRINUSE).lower() in text.lower() or "EADDRINUSE" in text:
            continue
        first = next((r["name"] for r in pending if not done(outdir, world, r["name"])), None)
        if first is None:
            break
        result.failed[first] = text
        if stop_on_timeout and None in codes:  # timed out: do not spend the time again
            break
    for r in runs:
        if r["name"] not in result.failed and not done(outdir, world, r["name"]):
            result.failed[r["name"]] = "the run never completed (launch attempts used up or timed out)"
    result.seconds = time.monotonic() - started
    return result
