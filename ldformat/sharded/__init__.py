"""Sharded chains (spec §20): one ordinary chain per rank, a layout, and global commit records.

:mod:`.chain` reads and creates the sharded root and the commit records and assembles the
full state (:class:`~.chain.ShardedReader`); :mod:`.layout` maps DTensor shards onto it;
:mod:`.maintenance`, :mod:`.replicate` and :mod:`.validate` are truncation and compaction,
replication and validation of a whole sharded chain.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    """The names of the module ``ldformat.sharded`` of earlier releases, now :mod:`.chain`
    (and :mod:`ldformat.chain.sharded_probe` for the few that ordinary chains need)."""
    for module in ("ldformat.sharded.chain", "ldformat.chain.sharded_probe"):
        found = importlib.import_module(module)
        if hasattr(found, name):
            warnings.warn(f"ldformat.sharded.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=2)
            return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
