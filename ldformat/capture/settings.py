"""The settings of one :class:`~ldformat.Checkpointer`, checked in one place (docs/capture-runtime.md
"Modes and life cycle", "Bounded cost", "Anchor interval and batch size").

A Checkpointer takes its cadence and pipeline settings either as keywords or in a
:class:`CaptureOptions` (one way each, not both). :meth:`Settings.from_arguments` merges the
two and checks the values that need no model, in the order the constructor always checked
them, before anything is written; what needs the model (the host budget, the disk budget,
a sharded or data-parallel job) is checked by :mod:`.setup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

from ..errors import UsageError
from ..format.delta import check_encode_threads
from ..format.manifest import Kind
from ..format.topk import TopK
from .options import CaptureOptions
from .tuning import DEFAULT_MAX_LOST_S, Interval, default_max_host_bytes

T = TypeVar("T")

Mode = Literal["lowdiff", "lowdiff+", "xor"]
MODES: dict[Mode, Kind] = {"lowdiff": "grad.topk", "lowdiff+": "grad.dense", "xor": "state.xor"}
DEFAULT_MODE: Mode = "xor"
"""The mode without a ``mode=`` argument: lossless, exact in any environment, any optimizer
(docs/capture-runtime.md "The default mode" gives the measurements behind the choice)."""
#: Steps that may wait for the background writer, by mode: an ``xor`` step is the whole state
#: (benchmarks/results/queue_depth.md).
DEFAULT_QUEUE_DEPTH: dict[Mode, int] = {"lowdiff": 2, "lowdiff+": 2, "xor": 0}

#: The Checkpointer keywords that CaptureOptions may give instead, with their keyword defaults.
KEYWORD_DEFAULTS: dict[str, object] = {
    "anchor_every": "auto", "batch_steps": "auto", "max_stall": 0.035, "mtbf_hours": 24.0,
    "max_lost_s": DEFAULT_MAX_LOST_S, "queue_depth": None, "max_batch_bytes": 1 << 30, "encode_threads": None,
    "stage_during_backward": None,
}


@dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """When anchors and commits come (docs/capture-runtime.md "Anchor interval and batch size")."""

    anchor_every: Interval
    batch_steps: Interval
    max_stall: float
    mtbf_hours: float
    max_lost_s: float


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """How steps reach the background writer (docs/capture-runtime.md "Pipeline", "Host memory")."""

    queue_depth: int
    max_batch_bytes: int
    encode_threads: int | None
    stage_during_backward: bool | None  # None: decided by the device (on CUDA only)
    max_host_bytes: int  # the budget in force: the option, or this machine's default


@dataclass(frozen=True, kw_only=True)
class Settings:
    """A Checkpointer's mode and settings, merged from its keywords and ``options`` and checked."""

    mode: Mode
    options: CaptureOptions
    policy: PolicySettings
    pipeline: PipelineSettings
    compressor: TopK | None  # as given (``None``: lowdiff makes its own from topk_ratio)
    topk_ratio: float
    compress: bool

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.compressor is not None and self.mode != "lowdiff":
            raise UsageError(f"mode {self.mode!r} takes no compressor; use mode='lowdiff' with a TopK compressor")
        depth = self.pipeline.queue_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise UsageError(f"queue_depth must be an integer >= 0, not {depth!r}")
        if self.pipeline.encode_threads is not None:
            check_encode_threads(self.pipeline.encode_threads)

    @property
    def kind(self) -> Kind:
        return MODES[self.mode]

    @classmethod
    def from_arguments(cls, *, mode: Mode, options: CaptureOptions | None, compressor: TopK | None,
                       topk_ratio: float, compress: bool, **keywords: object) -> Settings:
        """Merge the Checkpointer keywords in :data:`KEYWORD_DEFAULTS` with ``options``.

        Raises:
            UsageError: an unknown mode, ``options`` that is not a CaptureOptions, a setting
                given both ways, or a value out of range.
        """
        check_mode(mode)  # first, as always: the other checks depend on the mode
        if options is None:
            options = CaptureOptions()
        elif not isinstance(options, CaptureOptions):
            raise UsageError(f"options must be a CaptureOptions, not {type(options).__name__}")
        given = options.given()
        merged = {name: _one_way(given, name, keywords[name], default) for name, default in KEYWORD_DEFAULTS.items()}
        depth = merged["queue_depth"]
        policy = PolicySettings(
            anchor_every=merged["anchor_every"], batch_steps=merged["batch_steps"],  # type: ignore[arg-type]
            max_stall=merged["max_stall"], mtbf_hours=merged["mtbf_hours"],  # type: ignore[arg-type]
            max_lost_s=merged["max_lost_s"])  # type: ignore[arg-type]
        pipeline = PipelineSettings(
            queue_depth=DEFAULT_QUEUE_DEPTH[mode] if depth is None else depth,  # type: ignore[arg-type]
            max_batch_bytes=merged["max_batch_bytes"], encode_threads=merged["encode_threads"],  # type: ignore[arg-type]
            stage_during_backward=merged["stage_during_backward"],  # type: ignore[arg-type]
            max_host_bytes=(options.max_host_bytes if options.max_host_bytes is not None
                            else default_max_host_bytes()))
        return cls(mode=mode, options=options, policy=policy, pipeline=pipeline, compressor=compressor,
                   topk_ratio=topk_ratio, compress=compress)


def check_mode(mode: object) -> None:
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def _one_way(given: dict[str, object], name: str, keyword: T, default: T) -> T:
    """A setting given as a Checkpointer keyword or in ``options``, not both."""
    if name not in given:
        return keyword
    if keyword != default:
        raise UsageError(f"{name} is given both as a keyword and in options=; give it one way")
    return given[name]  # type: ignore[return-value]  # CaptureOptions checked its type
