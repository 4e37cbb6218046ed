"""Resuming training from a chain (spec §19.5)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import StepNotFoundError
from ..manifest import ROOT_FILE
from ..reader import ChainReader
from ..stores import Store
from ..topk import TopK
from .rng import restore_rng


def _exact_step(reader: ChainReader) -> int:
    """The latest anchor; for grad.topk the latest one that holds residuals (compaction anchors do not)."""
    if reader.kind == "grad.topk":
        from ..anchor import tensor_bytes

        for s in reversed(reader.anchors):
            entry = reader.state.anchors[s]
            if tensor_bytes(reader.read_object(entry.object, s), "compressor") > 0:
                return s
    return reader.anchors[-1]


def resume(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    compressor: TopK | None = None,
    exact: bool = False,
    step: int | None = None,
    rank: int = 0,
    store: Store | None = None,
) -> int:
    """Restore the live training objects from a chain; returns the restored step.

    Restores model, optimizer, scheduler, GradScaler, RNG states (CPU, CUDA where present,
    Python, NumPy) and the sampler position captured by a :class:`Checkpointer`. Returns 0
    and changes nothing when ``path`` holds no chain yet, so the same code starts and
    resumes a run.

    Args:
        exact: resume from the latest *anchor* instead of the latest step. In ``lowdiff``
            mode only anchors hold the top-k residuals, so only this continues exactly like
            the uninterrupted run; from a later delta step the residuals restart at zero,
            which changes the following compressed gradients (spec §14.2).
        step: an explicit step to resume from.
        rank: whose top-k residuals ``compressor`` receives (data-parallel ``lowdiff``).

    Pass the returned step to ``Checkpointer(..., step=step)`` so that steps after it are
    truncated and re-recorded by the resumed run.
    """
    exists = store.exists(ROOT_FILE) if store is not None else (Path(path) / ROOT_FILE).exists()
    if not exists:
        return 0
    reader = ChainReader(path, store=store)
    if reader.latest_step is None:
        return 0
    if step is None:
        step = _exact_step(reader) if exact else reader.latest_step
    elif step not in reader.steps:
        raise StepNotFoundError(f"{path}: step {step} is not in the chain")
    state = reader.materialize(step)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    extra = state["extra"]
    if scheduler is not None and "scheduler" in extra:
        scheduler.load_state_dict(extra["scheduler"])
    if scaler is not None and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    if sampler is not None and extra.get("data") is not None:
        sampler.load_state_dict(extra["data"])
    if compressor is not None:
        residuals = state.get("compressor", {}) if rank == 0 else state.get("compressor_ranks", {}).get(rank, {})
        compressor.load_residuals(residuals)
    if "rng" in extra:
        restore_rng(extra["rng"])
    return step
