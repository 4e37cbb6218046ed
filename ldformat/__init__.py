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

from . import _moved
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
    from .api import compact, open_reader, sync, truncate, validate
    from .capture import (
        CaptureOptions,
        Checkpointer,
        ResidualPeer,
        ResumableSampler,
        TopKCommState,
        resume,
        topk_comm_hook,
    )
    from .chain.maintenance import CompactionPlan
    from .chain.reader import ChainReader
    from .chain.replicate import ReplicaDivergedError, SyncReport
    from .chain.validate import Problem, ValidationReport
    from .chain.writer import ChainWriter
    from .format.manifest import FORMAT_VERSION, KINDS
    from .format.topk import TopK
    from .sharded.chain import ShardedReader
    from .stores import LocalStore, Store

__version__ = "0.3.0"

#: Where each lazily imported public name lives (a module of this package).
_LAZY: dict[str, str] = {
    "FORMAT_VERSION": ".format.manifest",
    "KINDS": ".format.manifest",
    "ChainReader": ".chain.reader",
    "ChainWriter": ".chain.writer",
    "CompactionPlan": ".chain.maintenance",
    "compact": ".api",
    "truncate": ".api",
    "Problem": ".chain.validate",
    "ValidationReport": ".chain.validate",
    "validate": ".api",
    "ShardedReader": ".sharded.chain",
    "open_reader": ".api",
    "LocalStore": ".stores",
    "Store": ".stores",
    "TopK": ".format.topk",
    "Checkpointer": ".capture",
    "CaptureOptions": ".capture",
    "ResidualPeer": ".capture",
    "ResumableSampler": ".capture",
    "TopKCommState": ".capture",
    "resume": ".capture",
    "topk_comm_hook": ".capture",
    "ReplicaDivergedError": ".chain.replicate",
    "SyncReport": ".chain.replicate",
    "sync": ".api",
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
    """The package module: importing an old module path that shares its name with a public
    function (``ldformat.chain.maintenance``, ``ldformat.chain.validate``; see :mod:`._moved`) sets the
    package's attribute of that name to the module; the public function keeps it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _LAZY and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
_moved.install()
