"""Unwrapping what frameworks wrap training objects in (docs/capture-runtime.md "Wrapped objects").

accelerate's ``AcceleratedOptimizer`` and ``AcceleratedScheduler``, Lightning's
``LightningOptimizer``, DDP/``DataParallel`` and ``torch.compile`` all wrap the object that
holds the state. The checkpointer needs the object underneath: its hooks must fire on the
optimizer that really steps (``AcceleratedOptimizer.step`` bypasses the wrapper's own step
hooks), and the stored names must be those of the unwrapped model, without ``module.`` or
``_orig_mod.`` prefixes, so that the outputs load into a plain model.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")

# The wrappers unwrapped, by class name, and the attribute that holds the wrapped object. Only
# these: an optimizer that merely holds another (Magma wraps AdamW, Lookahead its base) is
# itself the optimizer whose state is the training state.
_OPTIMIZER_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "LightningOptimizer": "_optimizer"}
_SCHEDULER_ATTRS = ("scheduler",)  # accelerate
_MODEL_WRAPPERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.parallel.DistributedDataParallel,
    torch.nn.DataParallel,
)


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer under accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer``."""
    seen = {id(optimizer)}
    while True:
        # By the names in the MRO: Lightning makes a subclass per optimizer class ("LightningAdamW").
        attr = next((_OPTIMIZER_WRAPPERS[c.__name__] for c in type(optimizer).__mro__
                     if c.__name__ in _OPTIMIZER_WRAPPERS), None)
        inner = getattr(optimizer, attr, None) if attr is not None else None
        if not isinstance(inner, torch.optim.Optimizer) or id(inner) in seen:
            return optimizer
        seen.add(id(inner))
        optimizer = inner


def unwrap_scheduler(scheduler: T) -> T:
    """The scheduler under accelerate's ``AcceleratedScheduler`` (any other object as is)."""
    seen = {id(scheduler)}
    while True:
        inner = getattr(scheduler, "scheduler", None) if type(scheduler).__name__ == "AcceleratedScheduler" else None
        if inner is None or id(inner) in seen:
            return scheduler
        seen.add(id(inner))
        scheduler = inner


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP, ``DataParallel`` and ``torch.compile`` wrappers."""
    seen = {id(model)}
    while True:
        inner: object
        if isinstance(model, _MODEL_WRAPPERS):
            inner = model.module
        else:
            inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, torch.nn.Module) or id(inner) in seen:
            return model
        seen.add(id(inner))
        model = inner

