"""ldformat: differential training checkpoints for PyTorch.

A chain is periodic full anchors (safetensors) plus per-step deltas (Zarr v3) and an
append-only commit log. See ``spec/ldformat.md`` for the format.

The public names below are imported on first use (PEP 562): ``import ldformat`` loads
neither torch nor zarr, so that ``ldtools --help`` starts at once. ``from ldformat import X``
and ``ldformat.X`` work for every name in ``__all__``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .capture import (
        CaptureOptions,
        Checkpointer,
        ResidualPeer,
        ResumableSampler,
        TopKCommState,
        resume,
        topk_comm_hook,
    )
    from .compact import CompactionPlan, compact, truncate
    from .manifest import FORMAT_VERSION, KINDS
    from .reader import ChainReader
    from .replicate import ReplicaDivergedError, SyncReport, sync
    from .sharded import ShardedReader, open_reader
    from .stores import LocalStore, Store
    from .topk import TopK
    from .validate import Problem, ValidationReport, validate
    from .writer import ChainWriter

__version__ = "0.3.0"

#: Where each lazily imported public name lives (a module of this package).
_LAZY: dict[str, str] = {
    "FORMAT_VERSION": ".manifest",
    "KINDS": ".manifest",
    "ChainReader": ".reader",
    "ChainWriter": ".writer",
    "CompactionPlan": ".compact",
    "compact": ".compact",
    "truncate": ".compact",
    "Problem": ".validate",
    "ValidationReport": ".validate",
    "validate": ".validate",
    "ShardedReader": ".sharded",
    "open_reader": ".sharded",
    "LocalStore": ".stores",
    "Store": ".stores",
    "TopK": ".topk",
    "Checkpointer": ".capture",
    "CaptureOptions": ".capture",
    "ResidualPeer": ".capture",
    "ResumableSampler": ".capture",
    "TopKCommState": ".capture",
    "resume": ".capture",
    "topk_comm_hook": ".capture",
    "ReplicaDivergedError": ".replicate",
    "SyncReport": ".replicate",
    "sync": ".replicate",
}

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "ChainError",
    "ChainExistsError",
    "ChainLockedError",
    "ChainReader",
    "ChainWriter",
    "CaptureOptions",
    "Checkpointer",
    "CompactionPlan",
    "CorruptChainError",
    "EmptyChainError",
    "FormatError",
    "LdformatError",
    "LocalStore",
    "LockLostError",
    "MissingObjectError",
    "NotAChainError",
    "OutputWriteError",
    "Problem",
    "ReplayEnvironmentWarning",
    "ReplicaDivergedError",
    "ResidualPeer",
    "ResumableSampler",
    "ShardedReader",
    "StepNotFoundError",
    "Store",
    "SyncReport",
    "TopK",
    "TopKCommState",
    "UnsupportedStateError",
    "UnsupportedVersionError",
    "UsageError",
    "ValidationReport",
    "WriterIOError",
    "compact",
    "open_reader",
    "resume",
    "sync",
    "topk_comm_hook",
    "truncate",
    "validate",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package module: importing the submodule ``ldformat.compact`` (or ``.validate``)
    sets the package's attribute of that name to the module; the public function of that
    name keeps it, as it did when this package imported everything eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f".{name}":
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
