"""The capture runtime: feeding a chain from a training loop without stalling it."""

from .ddp import TopKCommState, topk_comm_hook
from .policy import AdaptiveTuner, PolicyInputs, optimal_anchor_every, optimal_batch_steps, wasted_time_per_step
from .resume import resume
from .runtime import MODES, CaptureStats, Checkpointer, ResidualPeer, gather_residuals
from .sampler import ResumableSampler

__all__ = [
    "MODES",
    "AdaptiveTuner",
    "CaptureStats",
    "Checkpointer",
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
