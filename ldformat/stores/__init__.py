"""Storage backends. Every backend passes :mod:`ldformat.testing.store_contract`."""

from .base import Part, Store, byte_view, check_relative_path
from .local import LocalStore

__all__ = ["LocalStore", "Part", "Store", "byte_view", "check_relative_path"]
