"""Helper process for tests/capture/test_capture.py: training loops driven by ``ldformat.Checkpointer``.

Run as ``python capture_trainer.py WORKDIR KILLS`` with ``KILLS`` a JSON object
``{mode: kill_at}``. The process imports torch once, warms it up, and forks every run from
there (a torch import costs seconds here; a fork, milliseconds). The runs execute
concurrently, each in its own process, and write under ``WORKDIR``:

For each mode (``WORKDIR/<mode>/``), :data:`STEPS` steps trained three times, each run
dumping its live state after every step (``<run>/<step>.pt``: loss, model and optimizer
state, scheduler and sampler state):

* ``ref``: an uninterrupted run with a Checkpointer (chain ``chain-ref``);
* ``crash``: the same run (chain ``chain``), which SIGKILLs itself after step ``kill_at``
  once at least :data:`MIN_DURABLE_BEFORE_KILL` steps are durable; it appends
  ``D <step>`` (fsynced) to ``crash.events`` whenever the durable step changes;
* ``resumed``: a process forked after the crashed one was reaped, so it never trained
  before: it builds new objects, scrambles the RNGs, calls ``ldformat.resume``
  (``exact=True`` for ``lowdiff``) and ``Checkpointer(step=...)`` on the crashed chain and
  trains on to :data:`STEPS`. For ``lowdiff`` it then also resumes a copy of the crashed
  chain from a *delta* step (``exact=False``) into ``inexact/`` (chain ``chain-inexact``).
  It writes ``result.json``.

``WORKDIR/atexit/``: two runs train :data:`ATEXIT_STEPS` steps with a Checkpointer and
never call ``close()``; ``normal`` returns and exits through the interpreter, ``exception``
dies of an uncaught exception. Both must still commit every step (the Checkpointer's
``atexit`` handler).

``WORKDIR/exits.json`` gives how every process ended. Nothing is fsynced: a killed process
loses nothing the kernel already has (power loss is tests/chain/test_crash.py's subject).

Every run uses one torch thread (the bits of a step depend on the thread count), a
:class:`~ldformat.ResumableSampler` under ``DataLoader(num_workers=0)``, a cosine LR
schedule, dropout (torch RNG), Python ``random`` and NumPy's global RNG, so that an
inexact restore of any of them shows up in the compared bits.

The DataLoader gets its own ``generator``: without one, every ``iter(loader)`` draws its
base seed from the global torch RNG, and a resumed run creates its first iterator at a
point where the uninterrupted run did not, shifting every later dropout mask.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ldformat
from ldformat.stores import LocalStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import TinyNet, snapshot  # noqa: E402

MODES = ("lowdiff", "lowdiff+", "xor")
STEPS = 30
ANCHOR_EVERY = 5
BATCH_STEPS = 3
TOPK_RATIO = 0.2
DATA_N = 44  # 5 full batches of 8 and one of 4 per epoch: an epoch ends every 6 steps
BATCH_SIZE = 8
MIN_DURABLE_BEFORE_KILL = 10  # at least anchors 0, 5 and 10 are committed when the crash run dies
ATEXIT_STEPS = 7  # not a multiple of BATCH_STEPS: the last batch is partial
WAIT_S = 60.0


class DropNet(TinyNet):
    """TinyNet with dropout: every forward draws from the global torch RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.drop(torch.relu(self.hidden(h)))
        h = self.norm(h)
        return self.head(h)


class Run:
    """The live objects of one training run."""

    def __init__(self) -> None:
        torch.manual_seed(1234)
        random.seed(1234)
        np.random.seed(1234)
        self.model = DropNet()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=STEPS, eta_min=1e-3)
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, 32, (DATA_N,), generator=g)
        y = torch.randint(0, 32, (DATA_N,), generator=g)
        self.sampler = ldformat.ResumableSampler(DATA_N, seed=3)
        self.loader = DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, sampler=self.sampler, num_workers=0,
                                 generator=torch.Generator())

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self.loader

    def checkpointer(self, path: str | Path, mode: str, step: int | None = None) -> ldformat.Checkpointer:
        return ldformat.Checkpointer(path, self.model, self.optimizer, mode=mode, scheduler=self.scheduler,
                                     sampler=self.sampler, anchor_every=ANCHOR_EVERY, batch_steps=BATCH_STEPS,
                                     topk_ratio=TOPK_RATIO, step=step, truncate=step is not None,
                                     options=ldformat.CaptureOptions(capture_every=1))  # every step is compared

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        self.model.train()
        if random.random() < 0.5:  # Python's RNG decides the order (BatchNorm sums in it)
            x, y = x.flip(0), y.flip(0)
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(x), y) * (1.0 + 0.01 * float(np.random.rand()))
        loss.backward()
        self.optimizer.step()  # the Checkpointer captures the step in its hooks
        self.scheduler.step()
        return loss.detach().clone()

    def dump(self, out: Path, step: int, loss: torch.Tensor | None) -> None:
        state = {"loss": loss, "state": snapshot(self.model, self.optimizer),
                 "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict()}
        tmp = out / f".{step}.pt"
        torch.save(state, tmp)
        os.replace(tmp, out / f"{step}.pt")


def train(run: Run, out: Path, first: int, last: int, ck: ldformat.Checkpointer | None = None,
          events: int | None = None, kill_at: int | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if first == 1:
        run.dump(out, 0, None)
    durable = None
    batches = run.batches()
    for step in range(first, last + 1):
        loss = run.step(next(batches))
        run.dump(out, step, loss)
        if events is not None and ck is not None and ck.durable_step != durable:
            durable = ck.durable_step
            _event(events, f"D {durable}")
        if step == kill_at:
            assert ck is not None and events is not None
            deadline = time.monotonic() + WAIT_S
            while (ck.durable_step or 0) < MIN_DURABLE_BEFORE_KILL and time.monotonic() < deadline:
                time.sleep(0.005)
            _event(events, f"D {ck.durable_step}")
            _event(events, f"K {step}")
            os.kill(os.getpid(), signal.SIGKILL)


def _event(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())
    os.fsync(fd)


def reference_run(mode: str, work: Path) -> None:
    run = Run()
    ck = run.checkpointer(work / "chain-ref", mode)
    train(run, work / "ref", 1, STEPS, ck)
    ck.close()


def crash_run(mode: str, work: Path, kill_at: int) -> None:
    events = os.open(work / "crash.events", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    run = Run()
    ck = run.checkpointer(work / "chain", mode)
    train(run, work / "crash", 1, STEPS, ck, events=events, kill_at=kill_at)
    raise AssertionError(f"the crash run was not killed at step {kill_at}")


def resume_one(mode: str, chain: Path, out: Path, *, exact: bool, step: int | None = None) -> int:
    """Fresh objects resume from the chain and train on to STEPS; returns the resumed step."""
    run = Run()
    torch.manual_seed(999)  # whatever the process did before: resume() restores the RNGs
    random.seed(999)
    np.random.seed(999)
    resumed = ldformat.resume(chain, run.model, run.optimizer, scheduler=run.scheduler, sampler=run.sampler,
                              exact=exact, step=step)
    ck = run.checkpointer(chain, mode, step=resumed)
    out.mkdir(parents=True, exist_ok=True)
    run.dump(out, resumed, None)
    train(run, out, resumed + 1, STEPS, ck)
    ck.close()
    return resumed


def resume_run(mode: str, work: Path) -> None:
    reader = ldformat.ChainReader(work / "chain")
    latest = reader.latest_step
    assert latest is not None
    result: dict[str, Any] = {"after_crash": {"steps": reader.steps, "anchors": reader.anchors, "latest": latest}}
    if mode == "lowdiff":
        shutil.copytree(work / "chain", work / "chain-inexact")
    result["resumed"] = resume_one(mode, work / "chain", work / "resumed", exact=(mode == "lowdiff"))
    if mode == "lowdiff":
        delta_step = latest if latest not in reader.anchors else latest - 1
        result["inexact_resumed"] = resume_one(mode, work / "chain-inexact", work / "inexact", exact=False,
                                               step=delta_step)
    (work / "result.json").write_text(json.dumps(result))


def atexit_run(work: Path, fail: bool) -> None:
    """Train without ever calling close(); then exit through the interpreter (atexit runs)."""
    name = "exception" if fail else "normal"
    run = Run()
    ck = run.checkpointer(work / f"chain-{name}", "lowdiff+")
    train(run, work / name, 1, ATEXIT_STEPS, ck)
    durable = ck.durable_step
    (work / f"{name}.durable").write_text(str(durable))
    if fail:
        raise RuntimeError("training died of an ordinary exception")


def warm_up() -> None:
    """Pay torch's first-use costs (the first optimizer imports torch._dynamo) before forking.

    One thread, set before any parallel region, so that no OpenMP pool exists when we fork.
    Nothing touches zarr here, so no zarr event-loop thread is inherited half-dead.
    """
    torch.set_num_threads(1)
    run = Run()
    batches = run.batches()
    for _ in range(2):
        run.step(next(batches))


def _fork(fn: Any, *args: Any) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _fork_exiting(work: Path, fail: bool) -> int:
    """A child that leaves through the interpreter's own exit path (atexit handlers included)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child
        atexit_run(work, fail)
        sys.exit(0)  # SystemExit unwinds main() (which has no handlers) and ends the interpreter
    return pid


def main(work: Path, kills: dict[str, int]) -> None:
    # A killed process loses nothing the kernel already has: fsync only matters for power
    # loss (tests/chain/test_crash.py), and here it would only serialize a dozen runs on the disk.
    LocalStore._fsync_fd = lambda self, fd: None  # type: ignore[method-assign]
    warm_up()
    children: dict[int, tuple[str, str]] = {}
    for mode, kill_at in kills.items():
        (work / mode).mkdir(parents=True)
        children[_fork(reference_run, mode, work / mode)] = (mode, "ref")
        children[_fork(crash_run, mode, work / mode, kill_at)] = (mode, "crash")
    (work / "atexit").mkdir(parents=True)
    for fail in (False, True):
        children[_fork_exiting(work / "atexit", fail)] = ("atexit", "exception" if fail else "normal")
    exits: dict[str, dict[str, Any]] = {}
    while children:
        pid, status = os.wait()
        mode, role = children.pop(pid)
        exits.setdefault(mode, {})[role] = {
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        }
        if role == "crash":  # reaped: its lock is now stale and the chain can be resumed
            children[_fork(resume_run, mode, work / mode)] = (mode, "resume")
    (work / "exits.json").write_text(json.dumps(exits))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
