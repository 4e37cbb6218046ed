"""The ``extra`` object the capture runtime writes with every step (spec §19.1 "The `extra` object").

The RNG states (§19.2), the process's and those the optimizer holds of its own, come from
:mod:`.rng`, the sampler position (§19.4) from the sampler; :mod:`.resume` reads them back
(§19.5). The scalars the loop logs (``Checkpointer.log``) are checked here (§19.1 ``scalars``).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Protocol

import torch

from ..errors import LdformatError, UsageError
from ..format.jsonvalue import JSON, decode
from .rng import capture_optimizer_rng

#: At most this many scalars per step (spec §19.1 ``scalars``): the extra of every step entry
#: is read with the log, so it stays small.
MAX_SCALARS = 64
#: A scalar's name: 1 to 64 characters among letters, digits and ``_ . / : -``.
SCALAR_NAME = re.compile(r"[A-Za-z0-9_./:-]{1,64}")


def check_scalars(scalars: dict[str, object], logged: int) -> dict[str, float]:
    """``scalars`` as floats, checked against spec §19.1 (``logged``: names already logged
    for the step and not among these). NaN and infinities are kept: after a spike they are the
    values that matter; the extra encodes them as tagged floats (spec §6.1).

    Raises:
        UsageError: a bad name, a value that is not a real number, or too many scalars.
    """
    out: dict[str, float] = {}
    for name, value in scalars.items():
        if not SCALAR_NAME.fullmatch(name):
            raise UsageError(f"Checkpointer.log: scalar name {name!r} is not 1-64 letters, digits or _ . / : -")
        try:
            # float() takes Python and NumPy numbers and one-element tensors (a GPU one syncs).
            out[name] = float(value.detach() if isinstance(value, torch.Tensor) else value)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            raise UsageError(f"Checkpointer.log: scalar {name}={value!r} is not a real number "
                             "(pass a float, an int or a one-element tensor)") from None
    if logged + len(out) > MAX_SCALARS:
        raise UsageError(f"Checkpointer.log: more than {MAX_SCALARS} scalars for one step (spec §19.1); "
                         "log fewer, or keep the rest in your own logger")
    return out


class Stateful(Protocol):
    """A training object whose state is captured: a scheduler, a GradScaler, a sampler."""

    # Any: a torch-style state dict, whatever the object keeps (torch types them so too).
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


#: Param groups whose learning rate the runtime records with each step (``lr``, ``lr/1``, ...).
MAX_LR_GROUPS = 8


def step_lrs(hyper: JSON, room: int = MAX_SCALARS) -> dict[str, float]:
    """The learning rates a step used, from the hyperparameters captured just before its
    ``optimizer.step()``: ``lr`` for param group 0, ``lr/<g>`` for the next ones (at most
    :data:`MAX_LR_GROUPS`, and ``room`` in all). Recorded as scalars because the step entry's
    ``param_groups`` are those after the step (after a scheduler's ``step()``: the next
    step's), and ``state.xor`` entries keep ``hyper`` only where Adam prediction needs it."""
    try:
        groups = decode(hyper, "hyperparameters")
    except LdformatError:
        return {}
    out: dict[str, float] = {}
    for g, group in enumerate(groups[:min(MAX_LR_GROUPS, room)] if isinstance(groups, list) else []):
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = float(lr)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            out["lr" if g == 0 else f"lr/{g}"] = float(lr)
    return out


def loop_extra(
    *,
    rng: dict[str, object],
    scheduler: Stateful | None,
    scaler: Stateful | None,
    data: dict[str, object] | None,
    policy: dict[str, object],
    user: dict[str, object],
    ranks: dict[str, dict[str, object]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scalars: dict[str, float] | None = None,
) -> dict[str, object]:
    """The extra state of one step as Python values: copies, not live objects.

    Args:
        rng: the RNG states (:func:`~ldformat.capture.rng.capture_rng`).
        scheduler, scaler: captured with their ``state_dict()`` when given.
        data: the sampler's ``state_dict()``, or ``None`` without a sampler.
        policy: the anchor interval and batch size in force (and the policy's inputs).
        user: the user's own dict (left out when empty).
        ranks: the other data-parallel ranks' ``{"rng", "data"}``, by rank (a decimal string).
        optimizer: its own generators, outside its ``state_dict()``, are recorded as
            ``optimizer_rng`` (:func:`~ldformat.capture.rng.capture_optimizer_rng`). Taken here,
            when the step is queued: only the optimizer's next step draws from them.
        scalars: what the loop logged for the step (:func:`check_scalars`), as ``scalars``.

    Returns:
        A dict for :func:`ldformat.format.jsonvalue.encode` (which the background writer runs).
    """
    extra: dict[str, object] = {"rng": rng}
    if scheduler is not None:
        extra["scheduler"] = copy.deepcopy(scheduler.state_dict())
    if scaler is not None:
        extra["scaler"] = scaler.state_dict()
    if data is not None:
        extra["data"] = data
    extra["policy"] = policy
    if user:
        extra["user"] = copy.deepcopy(user)
    if ranks:
        extra["ranks"] = ranks
    generators = capture_optimizer_rng(optimizer) if optimizer is not None else {}
    if generators:
        extra["optimizer_rng"] = generators
    if scalars:
        extra["scalars"] = dict(scalars)
    return extra
