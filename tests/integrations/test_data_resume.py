"""The data position and the RNG across ``kill -9``: a resumed run continues bit for bit.

A helper process (tests/support/data_resume_train.py) trains a small model with dropout, so that the
global CPU generator shapes every step, and records the sample ids of every batch. One run
goes through uninterrupted; another makes some step durable, trains a few more steps and
SIGKILLs itself; a third resumes that chain with ``ldformat.resume`` and finishes. The
batches of the killed run up to the step ``resume`` returned, followed by the resumed run's,
must be the uninterrupted run's, and the final model and optimizer state must be equal in
bits (integer views).

- torchdata's ``StatefulDataLoader(num_workers=2, shuffle=True)`` with a seeded generator
  is the ``data=`` object (any ``state_dict``/``load_state_dict`` object is captured with
  every step), over several epochs, killed mid-epoch and at an epoch's end;
- ``ldformat.ResumableSampler`` in a ``DataLoader(num_workers=0)``;
- the README's training-loop snippet, extracted from README.md and run as written (and with
  its ``xor`` mode), with the ``# loader = ...`` line it shows; and a variant of it that
  is exact in every mode (``PROPOSED_README_LOOP``).

A forked child (a DataLoader worker ending with its epoch) must leave its parent's
Checkpointer alone: ``test_forked_child_leaves_the_checkpointer_alone``.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models import bits
from paths import REPO, SUPPORT
from torch.utils.data import DataLoader

import ldformat

ROOT = REPO
SCRIPT = SUPPORT / "data_resume_train.py"
RUN_TIMEOUT_S = 120.0
README_SECTION = "## Checkpoint from a training loop"

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not sys.platform.startswith("linux"),
                                reason="the helper SIGKILLs itself and DataLoader workers fork")


def child_env() -> dict[str, str]:
    """The helper must import the ldformat under test."""
    env = dict(os.environ)
    root = str(Path(ldformat.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONWARNINGS"] = "ignore"
    return env


class Run:
    """The helper running to its end (or, with ``killed``, to its own SIGKILL)."""

    def __init__(self, config: str, workdir: Path, log: str, *args: str, killed: bool = False) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.what, self.killed = f"{config} {log}", killed
        self.out = workdir / f"{log}.out"
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), config, str(workdir), "--log", log, *args],
                stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=str(SUPPORT), start_new_session=True)

    def stop(self) -> None:
        """Kill it and what it forked (its own session, started here), unless already done."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self) -> None:
        """Wait for the exit and reap what it forked (DataLoader workers of a killed run)."""
        try:
            rc = self.proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        finally:
            try:  # the run's own session, started here
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tail = self.out.read_text(errors="replace")[-4000:]
        assert rc is not None, f"{self.what}: no exit after {RUN_TIMEOUT_S} s\n{tail}"
        if self.killed:
            assert rc == -signal.SIGKILL, f"{self.what}: exit {rc}, not its own SIGKILL\n{tail}"
        else:
            assert rc == 0, f"{self.what}: exit {rc}\n{tail}"


def batches(path: Path) -> list[tuple[int, list[int]]]:
    """The recorded ``(step, sample ids)`` of a run, in order."""
    out = []
    for line in path.read_text(encoding="ascii").splitlines():
        step, *ids = (int(v) for v in line.split())
        out.append((step, ids))
    return out


def resumed_step(workdir: Path, log: str) -> int:
    return int((workdir / f"{log}.resumed").read_text().strip())


def load_final(workdir: Path, log: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(workdir / f"{log}.final.pt", weights_only=True)
    return state


def assert_bits_equal(got: object, want: object, where: str) -> None:
    """Equal structure; every tensor equal in its integer view; other leaves equal."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert bool((bits(got) == bits(want)).all()), f"{where} differs in bits"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for k in want:
            assert_bits_equal(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bits_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


Reference = tuple[list[tuple[int, list[int]]], dict[str, Any]]
_references: dict[tuple[str, ...], Reference] = {}


def crash_and_resume(config: str, tmp_path: Path, flush_at: int, kill_at: int, *args: str,
                     earliest: int | None = None) -> None:
    """Kill after ``kill_at`` (``flush_at`` durable), resume, compare with the uninterrupted run.

    ``resume`` must return a step from ``earliest`` (default ``flush_at``) to ``kill_at``:
    the steps after it are redone. The uninterrupted run (once per configuration) runs
    alongside the killed one.
    """
    key = (config, *args)
    ref_dir = tmp_path / "uninterrupted"
    ref_run = Run(config, ref_dir, "ref", *args) if key not in _references else None
    workdir = tmp_path / "run"
    try:
        Run(config, workdir, "killed", "--flush-at", str(flush_at), "--kill-at", str(kill_at), *args,
            killed=True).wait()
        Run(config, workdir, "resumed", *args).wait()
        if ref_run is not None:
            ref_run.wait()
            _references[key] = batches(ref_dir / "ref"), load_final(ref_dir, "ref")
    finally:
        if ref_run is not None:
            ref_run.stop()
    ref_batches, ref_final = _references[key]

    killed = batches(workdir / "killed")
    assert [s for s, _ in killed] == list(range(1, kill_at + 1))
    assert killed == ref_batches[:kill_at], "the killed run already differs from the uninterrupted one"
    start = resumed_step(workdir, "resumed")
    assert (flush_at if earliest is None else earliest) <= start <= kill_at, f"resumed from step {start}"
    resumed = batches(workdir / "resumed")
    assert [s for s, _ in resumed] == list(range(start + 1, len(ref_batches) + 1)), "resumed steps"
    assert killed[:start] + resumed == ref_batches, f"the batch sequence differs after resuming from step {start}"
    assert_bits_equal(load_final(workdir, "resumed"), ref_final, f"final state, resumed from step {start}")


# -- 1. any state_dict-able data= object: torchdata's StatefulDataLoader with workers --------------

@pytest.mark.procs
@pytest.mark.parametrize(("flush_at", "kill_at"), [(16, 19), (12, 12)], ids=["mid-epoch", "epoch-end"])
def test_stateful_dataloader_with_workers_resumes_exactly(tmp_path: Path, flush_at: int, kill_at: int) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    crash_and_resume("stateful", tmp_path, flush_at, kill_at)


@pytest.mark.procs
def test_forked_child_leaves_the_checkpointer_alone(tmp_path: Path) -> None:
    """A forked process that exits (a DataLoader worker at the end of an epoch) must not close,
    commit to or unlock its parent's Checkpointer: that is the parent's chain."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ldformat.Checkpointer(tmp_path / "chain", model, optimizer, batch_steps=1, anchor_every=100)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    with ck:
        step()
        step()
        ck.flush()
        child = multiprocessing.get_context("fork").Process(target=int)  # exits at once, as a worker does
        child.start()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
        step()
        step()
        assert ck.flush() == 4
    assert ldformat.ChainReader(tmp_path / "chain").steps == [0, 1, 2, 3, 4]


# -- 2. ResumableSampler -------------------------------------------------------------------------

@pytest.mark.procs
def test_resumable_sampler_resumes_exactly(tmp_path: Path) -> None:
    crash_and_resume("sampler", tmp_path, 10, 14)


# -- 3. the README's training loop ------------------------------------------------------------------

def readme_loop() -> str:
    """The first Python block of the README's training-loop section, as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert README_SECTION in text, "the README lost its training-loop section"
    section = text[text.index(README_SECTION):]
    m = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert m is not None, "no python block in the README's training-loop section"
    return m.group(1)


def with_mode(snippet: str, mode: str | None) -> str:
    """``snippet`` with its Checkpointer's mode set to ``mode`` (given or added)."""
    if mode is None:
        return snippet
    changed, n = re.subn(r'mode="[^"]*"', f'mode="{mode}"', snippet, count=1)
    if n == 0:
        changed, n = re.subn(r"Checkpointer\(([^,]+), model, optimizer, ",
                             f'Checkpointer(\\1, model, optimizer, mode="{mode}", ', snippet, count=1)
    assert n == 1, "the README loop has no Checkpointer(path, model, optimizer, ...) call"
    return changed


def run_snippet_trial(snippet: str, tmp_path: Path, earliest: int | None = None) -> None:
    path = tmp_path / "loop.py"
    path.write_text(snippet, encoding="utf-8")
    # One epoch of 12 steps: step 6 durable, killed once step 8 is done.
    crash_and_resume("snippet", tmp_path, 6, 8, "--snippet", str(path), earliest=earliest)


@pytest.mark.procs
@pytest.mark.parametrize("mode", [None, pytest.param("lowdiff+", marks=pytest.mark.slow)],
                         ids=["as-written", "lowdiff+"])
def test_readme_loop_is_exact_with_dropout(tmp_path: Path, mode: str | None) -> None:
    """The README loop, killed and resumed, trains exactly like the uninterrupted run.

    Two things break it: ``for x, y in loader`` creates the loader's iterator after
    ``resume`` restored the global generator, and without a ``generator=`` of its own that
    draws a base seed from the global one, which the uninterrupted run drew before step 1
    (so every later dropout mask differs); and in ``lowdiff`` mode ``resume`` without
    ``exact=True`` continues from a delta step, where the top-k residuals restart at zero.
    """
    run_snippet_trial(with_mode(readme_loop(), mode), tmp_path)


PROPOSED_README_LOOP = """\
import torch, ldformat

sampler = ldformat.ResumableSampler(len(dataset), seed=0)
loader = DataLoader(dataset, batch_size=8, sampler=sampler,
                    generator=torch.Generator())  # its own generator: iter(loader) leaves the global RNG alone
step = ldformat.resume("runs/chain", model, optimizer, scheduler=scheduler, data=sampler,
                       exact=True)       # 0 on a fresh run; lowdiff: the latest anchor (it holds the residuals)
ck = ldformat.Checkpointer("runs/chain", model, optimizer, mode="lowdiff",   # or "lowdiff+" / "xor"
                           scheduler=scheduler, data=sampler, step=step, truncate=True)  # redo the steps after it
for x, y in loader:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()                     # capture happens in the optimizer's step hooks
    scheduler.step()
ck.close()                               # flushes and commits everything
"""
"""A README loop that is exact with dropout in every mode (the README's, with the three changes
that make it so: the loader owns a generator, ``exact=True``, ``truncate=True``)."""


@pytest.mark.procs
@pytest.mark.parametrize("mode", [None, pytest.param("xor", marks=pytest.mark.slow)], ids=["lowdiff", "xor"])
def test_proposed_readme_loop_is_exact_with_dropout(tmp_path: Path, mode: str | None) -> None:
    run_snippet_trial(with_mode(PROPOSED_README_LOOP, mode), tmp_path, earliest=0)


def test_iterating_a_loader_without_generator_draws_from_the_global_rng() -> None:
    """Why a DataLoader must own a generator for a resumed loop to be exact: creating its
    iterator draws a base seed, from the loader's generator or else the global one. The
    uninterrupted run draws it before step 1; a resumed run after ``resume`` restored the
    global generator, which then no longer matches the next step's dropout."""
    sampler = ldformat.ResumableSampler(8, seed=0)

    def draws(loader: DataLoader[int]) -> bool:
        torch.manual_seed(5)
        before = bits(torch.get_rng_state())
        iter(loader)
        return not bool((bits(torch.get_rng_state()) == before).all())

    assert draws(DataLoader(range(8), batch_size=2, sampler=sampler))
    assert not draws(DataLoader(range(8), batch_size=2, sampler=sampler, generator=torch.Generator()))
