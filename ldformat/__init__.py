"""ldformat: differential training checkpoints for PyTorch.

A chain is periodic full anchors (safetensors) plus per-step deltas (Zarr v3) and an
append-only commit log. See ``spec/ldformat.md`` for the format.
"""

from .compact import CompactionPlan, compact, truncate
from .errors import (
    ChainError,
    ChainExistsError,
    ChainLockedError,
    CorruptChainError,
    EmptyChainError,
    FormatError,
    LdformatError,
    LockLostError,
    MissingObjectError,
    NotAChainError,
    OutputWriteError,
    ReplayEnvironmentWarning,
    StepNotFoundError,
    UnsupportedStateError,
    UnsupportedVersionError,
    UsageError,
    WriterIOError,
)
from .manifest import FORMAT_VERSION, KINDS
from .reader import ChainReader
from .sharded import ShardedReader, open_reader
from .stores import LocalStore, Store
from .topk import TopK
from .validate import Problem, ValidationReport, validate
from .writer import ChainWriter

__version__ = "0.3.0"

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "ChainError",
    "ChainExistsError",
    "ChainLockedError",
    "ChainReader",
    "ChainWriter",
    "CompactionPlan",
    "CorruptChainError",
    "EmptyChainError",
    "FormatError",
    "LdformatError",
    "LockLostError",
    "LocalStore",
    "MissingObjectError",
    "NotAChainError",
    "OutputWriteError",
    "Problem",
    "ReplayEnvironmentWarning",
    "ShardedReader",
    "StepNotFoundError",
    "Store",
    "TopK",
    "UnsupportedStateError",
    "UnsupportedVersionError",
    "UsageError",
    "ValidationReport",
    "WriterIOError",
    "compact",
    "open_reader",
    "truncate",
    "validate",
]

from .capture import (  # noqa: E402
    Checkpointer,
    ResidualPeer,
    ResumableSampler,
    TopKCommState,
    resume,
    topk_comm_hook,
)

__all__ += ["Checkpointer", "ResidualPeer", "ResumableSampler", "TopKCommState", "resume", "topk_comm_hook"]

from .replicate import ReplicaDivergedError, SyncReport, sync  # noqa: E402

__all__ += ["ReplicaDivergedError", "SyncReport", "sync"]
