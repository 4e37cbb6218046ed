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
    from .export.dcp import export_dcp
    from .export.files import check_output, save_step, write_output
    from .export.history import StepStats, TensorDiff, diff_steps, rollback_step, step_history
    from .export.info import (
        ChainInfo,
        FullCheckpoint,
        MirrorLag,
        OrdinaryInfo,
        ShardedInfo,
        chain_info,
        check_chain_location,
        commit_log,
        sharded_parent,
        sharded_world_size,
    )
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
    "ChainInfo": ".export.info",
    "FullCheckpoint": ".export.info",
    "MirrorLag": ".export.info",
    "OrdinaryInfo": ".export.info",
    "ShardedInfo": ".export.info",
    "chain_info": ".export.info",
    "check_chain_location": ".export.info",
    "commit_log": ".export.info",
    "sharded_parent": ".export.info",
    "sharded_world_size": ".export.info",
    "check_output": ".export.files",
    "save_step": ".export.files",
    "write_output": ".export.files",
    "export_dcp": ".export.dcp",
    "StepStats": ".export.history",
    "TensorDiff": ".export.history",
    "diff_steps": ".export.history",
    "rollback_step": ".export.history",
    "step_history": ".export.history",
}

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "ChainError",
    "ChainInfo",
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
    "FullCheckpoint",
    "LdformatError",
    "LocalStore",
    "LockLostError",
    "MirrorLag",
    "MissingObjectError",
    "NotAChainError",
    "OrdinaryInfo",
    "OutputWriteError",
    "Problem",
    "ReplayEnvironmentWarning",
    "ReplicaDivergedError",
    "ResidualPeer",
    "ResumableSampler",
    "ShardedInfo",
    "ShardedReader",
    "StepNotFoundError",
    "StepStats",
    "Store",
    "SyncReport",
    "TensorDiff",
    "TopK",
    "TopKCommState",
    "UnsupportedStateError",
    "UnsupportedVersionError",
    "UsageError",
    "ValidationReport",
    "WriterIOError",
    "chain_info",
    "check_chain_location",
    "check_output",
    "commit_log",
    "compact",
    "diff_steps",
    "export_dcp",
    "open_reader",
    "resume",
    "rollback_step",
    "save_step",
    "sharded_parent",
    "sharded_world_size",
    "step_history",
    "sync",
    "topk_comm_hook",
    "truncate",
    "validate",
    "write_output",
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
    function (``ldformat.compact``, ``ldformat.validate``; see :mod:`._moved`) sets the
    package's attribute of that name to the module; the public function keeps it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _LAZY:
            # The public name, from where _LAZY says it lives: the old module's function of that
            # name may be another one (ldformat.validate is api.validate, not chain.validate's).
            value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
_moved.install()
