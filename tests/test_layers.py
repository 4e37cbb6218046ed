"""The package's imports point one way: from a layer to the layers below it, never back.

``errors`` → ``stores`` → ``format`` → ``chain`` → ``sharded`` → ``export`` → ``api`` →
``capture`` → ``integrations`` → ``testing``. Every import counts: at module level, inside a
function and under ``TYPE_CHECKING``. Within a layer the modules import each other without a
cycle. ``ldtools`` uses only the names ``ldformat`` exports (``ldformat.__all__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ldformat

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["errors", "_moved", "stores", "format", "chain", "sharded", "export", "api", "capture", "integrations",
          "testing"]
#: Modules of one rank: the leaves below everything.
SAME_RANK = {"_moved": "errors"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in ``path``."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
    return out


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The modules an import loads: ``from .x import y`` loads ``x.y`` when that is a module."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    if found:
        return found
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return [target] if target else []


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's __init__: the public front, above every layer
    top = SAME_RANK.get(parts[1], parts[1])
    return LAYERS.index(top)


def _graph() -> dict[str, set[str]]:
    modules = _modules("ldformat")
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target, names in _imports(path):
            if target.startswith("ldformat"):
                graph[module] |= {t for t in _resolve(target, names, modules) if t != module}
    return graph


def test_every_module_has_a_layer() -> None:
    unknown = [m for m in _modules("ldformat") if m != "ldformat" and m.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_imports_point_down_the_layers() -> None:
    bad = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in sorted(targets):
            there = _layer(target)
            if here is not None and (there is None or there > here):
                bad.append(f"{module} imports {target}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_ldtools_uses_only_public_names() -> None:
    bad = []
    for path in _modules("ldtools").values():
        for line, target, names in _imports(path):
            if not target.startswith("ldformat"):
                continue
            private = [n for n in names if n not in ldformat.__all__] if target == "ldformat" else names or [target]
            if target != "ldformat" or private:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {target} {private}")
    assert not bad, "ldtools imports beyond ldformat.__all__:\n" + "\n".join(bad)


def test_every_relative_import_resolves() -> None:
    """mypy is told to ignore missing imports (for the optional extras), so a relative import
    left pointing at a module that moved would only fail when its function runs."""
    missing = []
    for path in _modules("ldformat").values():
        for line, target, _ in _imports(path):
            parts = target.split(".")
            if parts[0] == "ldformat":
                where = ROOT.joinpath(*parts)
                if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_an_upward_import_inside_a_function_is_seen() -> None:
    """The walk sees imports inside functions, where the cycles of earlier layouts hid."""
    code = "def f():\n    from ..chain.writer import ChainWriter\n"
    tree = ast.parse(code)
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert node.level == 2 and node.module == "chain.writer"
    assert _layer("ldformat.chain.writer") > _layer("ldformat.stores.base")  # type: ignore[operator]


def test_old_module_paths_import_the_moved_modules() -> None:
    """Every module path of earlier releases still imports: the module at its new path, the
    same object, with a DeprecationWarning that names it."""
    import importlib
    import sys
    import warnings

    from ldformat._moved import MOVED, SPLIT

    for old, new in MOVED.items():
        sys.modules.pop(f"ldformat.{old}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"ldformat.{old}")
        target = importlib.import_module(f"ldformat.{new}")
        if old in SPLIT:  # every name of the new modules, from the one old path
            for part in (target, *(importlib.import_module(f"ldformat.{o}") for o in SPLIT[old])):
                names = [n for n in vars(part) if not n.startswith("__")]
                assert all(getattr(module, n) is getattr(part, n) for n in names if n not in vars(target)), old
        else:
            assert module is target, old
        assert any(issubclass(w.category, DeprecationWarning) and f"ldformat.{new}" in str(w.message)
                   for w in caught), old
    # A public function that shares its name with an old module keeps its name on the package.
    assert callable(ldformat.compact) and callable(ldformat.validate)
    from ldformat.log import current_lock as old_current_lock  # log.py went to records, lock and commit

    from ldformat.chain.lock import current_lock
    assert old_current_lock is current_lock
    # ``ldformat.sharded`` was a module and is a package now: its old names still resolve.
    from ldformat.chain.sharded_probe import is_sharded
    from ldformat.sharded.chain import ShardedReader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from ldformat.sharded import ShardedReader as old_reader
        from ldformat.sharded import is_sharded as old_is_sharded
    assert (old_reader, old_is_sharded) == (ShardedReader, is_sharded)
    warned = {str(w.message).split()[0] for w in caught if issubclass(w.category, DeprecationWarning)}
    assert warned == {"ldformat.sharded.ShardedReader", "ldformat.sharded.is_sharded"}
