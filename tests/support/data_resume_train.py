"""Helper process for tests/integrations/test_data_resume.py: train with dropout, checkpoint, die, resume.

Run with ``sys.executable`` and the ldformat under test on ``PYTHONPATH``::

    data_resume_train.py CONFIG WORKDIR --log NAME [--steps N] [--flush-at F] [--kill-at K]
                         [--snippet FILE] [--mode MODE]

Every run trains the same small model (with dropout, so the global CPU generator matters)
from the same seed. ``CONFIG`` picks the data pipeline and the loop:

``stateful``
    torchdata's ``StatefulDataLoader(num_workers=2, shuffle=True)`` with a seeded
    generator, passed as ``data=`` to ``ldformat.resume`` and ``ldformat.Checkpointer``
    (``batch_steps=1``); ``--steps`` steps over several epochs.
``sampler``
    ``ldformat.ResumableSampler`` in a ``DataLoader(num_workers=0)`` that owns a generator.
``snippet``
    Executes the training-loop snippet in ``--snippet`` (the README's, extracted by the test)
    with the working directory ``WORKDIR``, after defining what it uses: ``dataset``,
    ``sampler``, ``loader`` (from the snippet's own ``# loader = ...`` comment when it has
    one), ``model``, ``optimizer``, ``scheduler`` and ``loss_fn``. One epoch.

Each step appends ``<step> <sample id> ...`` to ``WORKDIR/NAME`` (flushed). ``--flush-at F``
makes step ``F`` durable (``ck.flush()``) once it is done; ``--kill-at K`` SIGKILLs the
process once step ``K`` is done (before step ``K + 1`` draws anything), so steps after ``F``
may or may not be durable. The step ``ldformat.resume`` returned is written to
``WORKDIR/NAME.resumed``; a run that finishes writes the final model and optimizer state to
``WORKDIR/NAME.final.pt``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ldformat

FEATURES = 8
SNIPPET_DATASET = 96  # 12 batches of 8: the README loop's one epoch
LOOP_DATASET = 48  # 12 batches of 4


class Samples(Dataset[tuple[torch.Tensor, int]]):
    """``n`` fixed feature rows; a sample is ``(features, its index)`` so batches name their samples."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def make_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    return model, optimizer, scheduler


class Recorder:
    """Appends each step's sample ids; flushes and kills at the chosen steps."""

    def __init__(self, path: Path, flush_at: int, kill_at: int) -> None:
        self.file = open(path, "a", encoding="ascii")  # open for the whole run
        self.flush_at, self.kill_at = flush_at, kill_at

    def record(self, step: int, ids: torch.Tensor) -> None:
        self.file.write(f"{step} {' '.join(str(int(i)) for i in ids)}\n")
        self.file.flush()

    def after_step(self, step: int, ck: ldformat.Checkpointer) -> None:
        if step == self.flush_at:
            ck.flush()
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def save_final(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def run_loop(config: str, workdir: Path, args: argparse.Namespace, rec: Recorder) -> None:
    dataset = Samples(LOOP_DATASET)
    model, optimizer, scheduler = make_model()
    loader: Any
    if config == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                                    generator=torch.Generator().manual_seed(7))
        data: Any = loader
    else:
        data = ldformat.ResumableSampler(len(dataset), seed=3)
        loader = DataLoader(dataset, batch_size=4, sampler=data, generator=torch.Generator())
    chain = workdir / "chain"
    step = ldformat.resume(chain, model, optimizer, scheduler=scheduler, data=data)
    (workdir / f"{args.log}.resumed").write_text(f"{step}\n")
    ck = ldformat.Checkpointer(chain, model, optimizer, mode=args.mode, scheduler=scheduler, data=data,
                               step=step, anchor_every=5, batch_steps=1)
    while step < args.steps:
        for x, ids in loader:
            step += 1
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x).squeeze(-1), dataset.y[ids])
            loss.backward()
            optimizer.step()
            scheduler.step()
            rec.record(step, ids)
            rec.after_step(step, ck)
            if step == args.steps:
                break
    ck.close()
    save_final(workdir / f"{args.log}.final.pt", model, optimizer)


DEFAULT_LOADER = "loader = DataLoader(dataset, batch_size=8, sampler=sampler)"


def loader_source(snippet: str) -> str:
    """The snippet's own DataLoader line: code if it has one, else its ``# loader = ...`` comment."""
    if re.search(r"^\s*loader\s*=", snippet, re.MULTILINE):
        return ""
    m = re.search(r"#\s*(loader\s*=\s*DataLoader\(.*\))\s*$", snippet, re.MULTILINE)
    return m.group(1) if m else DEFAULT_LOADER


def run_snippet(workdir: Path, args: argparse.Namespace, rec: Recorder) -> None:
    snippet = Path(args.snippet).read_text(encoding="utf-8")
    dataset = Samples(SNIPPET_DATASET)
    model, optimizer, scheduler = make_model()
    ns: dict[str, Any] = {"__name__": "__snippet__", "torch": torch, "DataLoader": DataLoader,
                          "dataset": dataset, "model": model, "optimizer": optimizer, "scheduler": scheduler,
                          "sampler": ldformat.ResumableSampler(len(dataset), seed=3)}

    def loss_fn(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rec.record(ns["ck"].step + 1, ids)  # the snippet's Checkpointer has finalized the step before this
        return nn.functional.mse_loss(out.squeeze(-1), dataset.y[ids])

    ns["loss_fn"] = loss_fn
    exec(loader_source(snippet), ns)  # the snippet's own definition
    seen: set[int] = set()

    def pre_forward(module: nn.Module, inputs: object) -> None:
        """Before a step draws anything: note the resumed step, flush or die after the step before."""
        done = ns["ck"].step
        if not seen:
            (workdir / f"{args.log}.resumed").write_text(f"{done}\n")
        if done in seen:
            return
        seen.add(done)
        if done == rec.flush_at:
            ns["ck"].flush()
        if done == rec.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(pre_forward)
    os.chdir(workdir)
    exec(compile(snippet, "README.md snippet", "exec"), ns)  # the snippet under test
    save_final(workdir / f"{args.log}.final.pt", model, optimizer)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", choices=("stateful", "sampler", "snippet"))
    p.add_argument("workdir", type=Path)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--flush-at", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--snippet")
    p.add_argument("--mode", default="xor")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    workdir = args.workdir.resolve()
    rec = Recorder(workdir / args.log, args.flush_at, args.kill_at)
    if args.config == "snippet":
        run_snippet(workdir, args, rec)
    else:
        run_loop(args.config, workdir, args, rec)


if __name__ == "__main__":
    main(sys.argv[1:])
