"""How often the capture runtime checkpoints, and within which budgets (docs/capture-runtime.md "Bounded cost").

:class:`CaptureOptions` groups the cadence and pipeline settings of a
:class:`~ldformat.Checkpointer`, so that its constructor does not grow with every knob (as
Orbax's ``CheckpointManagerOptions`` and DCP's ``StateDictOptions`` do). It is frozen and
checked when made: a bad value fails before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from ..errors import UsageError

Every = int | Literal["auto"]

#: CheckFreq's bound (Mohan et al., FAST'21): the default end-to-end training slowdown.
DEFAULT_MAX_OVERHEAD = 0.035


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """Cadence and budgets of the capture runtime.

    Args:
        max_overhead: the end-to-end slowdown of training the checkpointer may cause, as a
            fraction of the step time without it (default 0.035). The runtime measures its
            own cost (docs/capture-runtime.md "Bounded cost") and, in ``xor`` mode with
            ``capture_every="auto"``, captures only every k-th step, with the smallest k that
            keeps within it. It also sizes automatic commit batches from it.
        capture_every: ``"auto"`` (the default: adapt k to ``max_overhead``) or a fixed
            interval in steps; ``1`` captures every step whatever it costs. Only ``xor`` can
            skip steps (a delta may span several, spec §11.3); the gradient modes and
            data-parallel or sharded chains capture every step.
        max_lost_s: an automatic ``batch_steps`` never leaves more than this many seconds of
            training uncommitted. It does not bound ``capture_every``: when the interval that
            fits ``max_overhead`` is longer, the budget wins and a warning says so once, with
            the measured numbers.
        lazy_snapshot: ``xor`` copies a step's parameters and optimizer state while the
            next step's forward and backward run, and fences them at its optimizer step
            (docs/capture-runtime.md "Lazy snapshot"); ``False`` copies them before
            ``optimizer.step()`` returns. Default (``None``): on for a model on CUDA, off
            on the CPU, where a memory copy costs less than the bookkeeping that defers it
            (benchmarks/results/lazy_snapshot.md).
        max_host_bytes: the host memory, in bytes, that the staging buffers of captured steps may
            take together (pinned on CUDA; docs/capture-runtime.md "Host memory"). Fewer steps
            wait for the background writer when ``queue_depth + 1`` staging sets do not fit,
            and an ``xor`` state of which one set does not fit is captured in pieces (training
            waits at the next step until the writer has read it; no Adam prediction); a tensor
            larger than the budget, or a gradient mode's set over it, is refused before anything
            is written.
            Default (``None``): a quarter of this machine's memory (or of its container's limit),
            divided by ``LOCAL_WORLD_SIZE``; 8 GiB when the memory cannot be read.
        anchor_every, batch_steps, max_stall, mtbf_hours, queue_depth, max_batch_bytes,
            encode_threads, stage_during_backward: as the :class:`~ldformat.Checkpointer`
            keywords of the same names (``None``: that keyword's default).
    """

    max_overhead: float = DEFAULT_MAX_OVERHEAD
    capture_every: Every = "auto"
    max_lost_s: float | None = None
    lazy_snapshot: bool | None = None
    max_host_bytes: int | None = None
    anchor_every: Every | None = None
    batch_steps: Every | None = None
    max_stall: float | None = None
    mtbf_hours: float | None = None
    queue_depth: int | None = None
    max_batch_bytes: int | None = None
    encode_threads: int | None = None
    stage_during_backward: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float)) or not (
                0 < self.max_overhead <= 10):
            raise UsageError(f"max_overhead must be a fraction of the step time in (0, 10], e.g. 0.035 for 3.5 %, "
                             f"got {self.max_overhead!r}")
        check_every(self.capture_every, "capture_every")
        if self.max_lost_s is not None and not (isinstance(self.max_lost_s, (int, float)) and self.max_lost_s > 0):
            raise UsageError(f"max_lost_s must be a positive number of seconds, got {self.max_lost_s!r}")
        if self.max_host_bytes is not None and (isinstance(self.max_host_bytes, bool) or not isinstance(
                self.max_host_bytes, int) or self.max_host_bytes < 1):
            raise UsageError(f"max_host_bytes must be a positive number of bytes (an int, e.g. 8 << 30 for 8 GiB), "
                             f"or None for the default; got {self.max_host_bytes!r}")
        for name in ("anchor_every", "batch_steps"):
            value = getattr(self, name)
            if value is not None:
                check_every(value, name)

    def given(self) -> dict[str, object]:
        """The Checkpointer keywords these options set (those not left ``None``)."""
        own = {"max_overhead", "capture_every", "lazy_snapshot", "max_host_bytes"}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in own and getattr(self, f.name) is not None}


def check_every(value: object, name: str) -> None:
    """``value`` is ``"auto"`` or a positive integer, else :class:`UsageError` naming ``name``."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{name} must be a positive integer or 'auto', got {value!r}")
