"""Module paths of earlier releases, kept importable (``import ldformat.writer`` still works).

The package was split into subpackages by concept (``format``, ``chain``, ``sharded``,
``export``). An import of an old module path returns the module at its new path, the same
object, with a :class:`DeprecationWarning` that names the new path. An old module whose names
went to several new ones (:data:`SPLIT`) imports as a module that finds each name in them.
Public names are imported from ``ldformat`` itself and never moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

#: Old module (below ``ldformat.``) -> its new path.
MOVED: dict[str, str] = {
    "jsonvalue": "format.jsonvalue",
    "manifest": "format.manifest",
    "fold": "format.fold",
    "optstate": "format.optstate",
    "anchor": "format.anchor",
    "predict": "format.predict",
    "environment": "format.environment",
    "delta": "format.delta",
    "topk": "format.topk",
    "state": "format.state",
    "state_delta": "chain.state_delta",
    "checks": "format.checks",
    "replay": "format.replay",
    "log": "chain.records",
    "snapshots": "chain.snapshots",
    "compact": "chain.maintenance",
    "captured": "chain.captured",
    "writer": "chain.writer",
    "reader": "chain.reader",
    "validate": "chain.validate",
    "replicate": "chain.replicate",
    "shards": "sharded.layout",
    "sharded_maintenance": "sharded.maintenance",
    "replicate_sharded": "sharded.replicate",
    "history": "export.history",
    "dcp": "export.dcp",
}

#: Old modules whose names left for more modules than the one in :data:`MOVED`.
SPLIT: dict[str, tuple[str, ...]] = {
    "log": ("chain.lock", "chain.commit"),
    "jsonvalue": ("format.dtypes", "format.checksum", "stores.crc32c"),
    "shards": ("format.dtensors",),
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (or the public name from ldformat)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        others = SPLIT.get(spec.name.partition(".")[2])
        return _Merged(spec.name, module, others) if others else module

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the module at the new path is already executed


class _Merged(types.ModuleType):
    """An old module whose names now live in several modules: each name from the first that has it."""

    def __init__(self, name: str, main: types.ModuleType, others: Sequence[str]) -> None:
        super().__init__(name, main.__doc__)
        self._modules = [main] + [importlib.import_module(f"ldformat.{o}") for o in others]

    def __getattr__(self, name: str) -> object:
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds ``ldformat.<old>`` for every old path in :data:`MOVED`."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, rest = fullname.partition(".")
        if package != "ldformat" or rest not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"ldformat.{MOVED[rest]}"))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
