"""The capture runtime: feeding a chain from a training loop without stalling it (docs/capture-runtime.md)."""

from .ddp import ResidualPeer, TopKCommState, gather_residuals, topk_comm_hook
from .options import CaptureOptions
from .policy import AdaptiveTuner, PolicyInputs, optimal_anchor_every, optimal_batch_steps, wasted_time_per_step
from .resume import resume
from .runtime import MODES, Checkpointer, Mode
from .sampler import ResumableSampler
from .stats import CaptureStats

__all__ = [
    "MODES",
    "AdaptiveTuner",
    "CaptureOptions",
    "CaptureStats",
    "Checkpointer",
    "Mode",
    "PolicyInputs",
    "ResidualPeer",
    "ResumableSampler",
    "gather_residuals",
    "TopKCommState",
    "optimal_anchor_every",
    "optimal_batch_steps",
    "resume",
    "topk_comm_hook",
    "wasted_time_per_step",
]
