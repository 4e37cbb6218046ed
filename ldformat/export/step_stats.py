"""What the flight recorder says of a step, and how it judges it (spec §19.1 ``scalars``).

:class:`StepStats` (with a :class:`GroupStats` per module prefix) is one step of a chain's
history as :func:`~ldformat.export.history.step_history` measures it by replay;
:class:`SpikeDetector` flags a loss or relative update that jumps, and :func:`rollback_step`
names the state to roll back to. Kept apart from the replay that computes them: the numbers
are judged, printed and plotted (``ldtools history``) without it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SPIKE_MIN_HISTORY", "SPIKE_THRESHOLD", "SPIKE_WINDOW", "GroupStats", "SpikeDetector", "StepStats",
           "group_of", "rollback_step"]

#: The trailing window of the spike detector, in present steps.
SPIKE_WINDOW = 20
#: Steps of history needed before the detector flags anything.
SPIKE_MIN_HISTORY = 5
#: Robust z-score ``0.6745 (x − median) / MAD`` above which a value is a spike (Iglewicz and
#: Hoaglin's outlier rule).
SPIKE_THRESHOLD = 3.5


@dataclass(frozen=True, kw_only=True)
class GroupStats:
    """The parameters of one module prefix at one step.

    ``update_norm`` and ``relative_update`` are ``None`` when the previous step's state is not
    known (the range's first step is the chain's first). ``v_mean``/``v_max``: of Adam's
    ``exp_avg_sq`` over the group's parameters, ``None`` where the optimizer has none.
    """

    name: str
    numel: int
    weight_norm: float
    update_norm: float | None
    relative_update: float | None
    v_mean: float | None = None
    v_max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "numel": self.numel, "weight_norm": self.weight_norm,
                "update_norm": self.update_norm, "relative_update": self.relative_update,
                "v_mean": self.v_mean, "v_max": self.v_max}


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One step of a chain's history.

    ``present`` is ``False`` for a step the chain no longer holds (compacted away): such a
    step has no numbers, and the next present step's update spans the gap (``since``).
    ``flags`` names what jumped: ``"loss"``, ``"relative_update"``, or ``"nonfinite_loss"``.
    """

    step: int
    present: bool = True
    anchor: bool = False
    since: int | None = None  # the step the update is measured from
    scalars: dict[str, float] = field(default_factory=dict)
    lrs: tuple[float, ...] = ()
    weight_norm: float | None = None
    update_norm: float | None = None
    relative_update: float | None = None
    groups: tuple[GroupStats, ...] = ()
    bytes: int = 0
    flags: tuple[str, ...] = ()

    @property
    def loss(self) -> float | None:
        return self.scalars.get("loss")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        return {"step": self.step, "present": self.present, "anchor": self.anchor, "since": self.since,
                "scalars": {k: _json_float(v) for k, v in self.scalars.items()}, "lrs": list(self.lrs),
                "weight_norm": self.weight_norm, "update_norm": self.update_norm,
                "relative_update": self.relative_update, "bytes": self.bytes, "flags": list(self.flags),
                "groups": [g.to_dict() for g in self.groups]}


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)


def group_of(name: str, depth: int) -> str:
    """The module prefix of parameter ``name`` at ``depth`` (``"layers.3"`` for
    ``"layers.3.attn.weight"`` at depth 2); never the parameter's own last component."""
    parts = name.split(".")
    return ".".join(parts[: max(1, min(depth, len(parts) - 1))])


class SpikeDetector:
    """Flags a value whose robust z-score against the trailing window exceeds the threshold.

    Only upward jumps count (a loss that drops is not a problem). With a MAD of zero (a
    window of equal values), any larger value counts as a jump. Non-finite values are always
    flagged and never enter the window.
    """

    def __init__(self, window: int = SPIKE_WINDOW, threshold: float = SPIKE_THRESHOLD,
                 min_history: int = SPIKE_MIN_HISTORY) -> None:
        self.threshold, self.min_history = threshold, min_history
        self.values: deque[float] = deque(maxlen=window)

    def score(self, x: float) -> float | None:
        """The robust z-score of ``x`` (``inf`` for a non-finite ``x``), None without enough history."""
        if not math.isfinite(x):
            return math.inf
        if len(self.values) < self.min_history:
            return None
        med = statistics.median(self.values)
        mad = statistics.median(abs(v - med) for v in self.values)
        if mad == 0.0:
            return math.inf if x > med else 0.0
        return 0.6745 * (x - med) / mad

    def add(self, x: float) -> bool:
        """Score ``x`` then add it to the window; True if it is a spike."""
        z = self.score(x)
        if math.isfinite(x):
            self.values.append(x)
        return z is not None and z > self.threshold


def rollback_step(history: list[StepStats]) -> int | None:
    """The last present step before the first flagged one: the state to roll back to."""
    last: int | None = None
    for s in history:
        if s.flags:
            return last
        if s.present:
            last = s.step
    return None
