"""What the capture runtime measured about itself (docs/capture-runtime.md "Pipeline", "Bounded cost").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class CaptureStats:
    """What the runtime measured. Times in seconds."""

    steps: int = 0
    stall_s: float = 0.0  # training thread inside ldformat: hooks, copies, back-pressure
    backpressure_s: float = 0.0  # part of stall_s spent waiting for a free buffer set
    background_cpu_s: float = 0.0  # CPU time of the background writer thread
    background_wall_s: float = 0.0
    commits: int = 0
    anchors_written: int = 0
    # The most recent per-step measurements (bounded: the policy reads the last 50).
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    optimizer_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    stalls: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    policy: dict[str, object] = field(default_factory=dict)
    # Background replication (``Checkpointer(mirror=...)``, :mod:`.mirror`); stays 0/None without one.
    mirror_lag_steps: int = 0  # local latest committed step minus the mirror's
    mirror_last_error: str | None = None  # the last failed sync ("Type: message"), kept after recovery
    mirror_syncs: int = 0  # successful syncs
    mirror_step: int | None = None  # the mirror's latest step, as the last successful sync saw it
    mirror_behind_since: float | None = None  # time.monotonic() of the oldest local commit the mirror lacks
    # Sharded chains, rank 0 (:mod:`.sharded`): from the end of a step on rank 0 to its global commit record.
    commit_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    global_commits: int = 0
    # The capture interval (docs/capture-runtime.md "Bounded cost", :mod:`.cadence`).
    captured: int = 0  # steps captured (``steps`` counts every step the optimizer took)
    capture_every: int = 1  # k in force
    overhead: float | None = None  # the latest measured overhead fraction (None: not measured yet)
    durable_at: float | None = None  # time.monotonic() when the durable step's state was live
    # Host memory of the staging buffers (docs/capture-runtime.md "Host memory"), as the budget counts it.
    max_host_bytes: int = 0  # the budget in force
    host_bytes: int = 0  # allocated now, every buffer set together
    host_bytes_peak: int = 0  # the most ever allocated at once
    staging_sets: int = 0  # buffer sets the budget allows (at most queue_depth + 1)
    pieces: bool = False  # an xor state larger than the budget, captured in pieces
    pieces_wait_s: float = 0.0  # part of stall_s: training held until the writer had read every piece

    @property
    def seconds_at_risk(self) -> float:
        """Seconds of training since the state of the latest durable step: what a crash now loses."""
        since = self.durable_at
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @property
    def mirror_lag_seconds(self) -> float:
        """Seconds since the oldest local commit that the mirror has not got yet (0 when caught up)."""
        since = self.mirror_behind_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def to_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "stall_s": self.stall_s,
            "backpressure_s": self.backpressure_s,
            "background_cpu_s": self.background_cpu_s,
            "background_wall_s": self.background_wall_s,
            "commits": self.commits,
            "anchors_written": self.anchors_written,
            "policy": self.policy,
            "mirror_lag_steps": self.mirror_lag_steps,
            "mirror_lag_seconds": self.mirror_lag_seconds,
            "mirror_last_error": self.mirror_last_error,
            "global_commits": self.global_commits,
            "commit_latency_s": list(self.commit_latency_s),
            "mirror_syncs": self.mirror_syncs,
            "captured": self.captured,
            "capture_every": self.capture_every,
            "overhead": self.overhead,
            "seconds_at_risk": self.seconds_at_risk,
            "max_host_bytes": self.max_host_bytes,
            "host_bytes": self.host_bytes,
            "host_bytes_peak": self.host_bytes_peak,
            "staging_sets": self.staging_sets,
            "pieces": self.pieces,
            "pieces_wait_s": self.pieces_wait_s,
        }
