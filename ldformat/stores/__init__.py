"""Storage backends (spec §7.4). Every backend passes :mod:`ldformat.testing.store_contract`.

:class:`Store` is the interface and its contract; :class:`LocalStore` keeps a chain in a
directory, :class:`MemoryStore` in memory (with simulated crashes), and
:class:`FaultyStore` wraps any store to inject I/O errors, torn writes and stalls.
"""

from .base import Part, Store, byte_view, check_relative_path
from .faults import OPS, WRITES, Fault, FaultyStore, Op
from .local import LocalStore
from .memory import MemoryStore

__all__ = [
    "OPS",
    "WRITES",
    "Fault",
    "FaultyStore",
    "LocalStore",
    "MemoryStore",
    "Op",
    "Part",
    "Store",
    "byte_view",
    "check_relative_path",
]
