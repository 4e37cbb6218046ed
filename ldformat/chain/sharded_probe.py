"""Whether a location holds a sharded chain (spec §20.1), asked by the modules of ordinary chains
before they act: they read and change only ordinary chains, and refuse the rest.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import NotAChainError
from ..stores import Store, parse_location
from .reader import open_store

SHARDED_ROOT = "sharded.json"


RANKS_DIR = "ranks"


_RANK_DIR = re.compile(r"^(.*)/ranks/\d{5}/?$")


def refuse_sharded(path: str | os.PathLike[str], store: Store | None, storage_options: dict[str, Any] | None,
                   what: str) -> None:
    """Refuse to change a sharded chain, or one of its rank chains on its own (spec §20.1, §20.8)."""
    from ..errors import UsageError

    if store is not None:
        if is_sharded(store):
            raise UsageError(f"{path}: a sharded chain is not {what} by this version of ldformat; "
                             "materialize a step, or resume from it and checkpoint to a new path")
        return
    sharded_here, sharded_above = _sharded_status(path, storage_options)
    if sharded_here:
        raise UsageError(f"{path}: a sharded chain is not {what} by this version of ldformat; "
                         "materialize a step, or resume from it and checkpoint to a new path")
    if sharded_above:
        raise UsageError(f"{path}: this is one rank's chain of a sharded chain; it is {what} only with the "
                         "others (spec §20.8), never on its own")


def is_sharded_location(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> bool:
    """Whether ``path`` holds a sharded chain (``sharded.json``); False when it cannot be read."""
    return _sharded_status(path, storage_options)[0]


def _sharded_status(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> tuple[bool, bool]:
    """(``path`` is a sharded chain, ``path`` is a rank chain of one); False when unreadable."""
    loc = parse_location(path)
    try:
        if loc.path is not None:
            top = loc.path
            parent = loc.path.parent.parent if re.fullmatch(r"\d{5}", loc.path.name) and (
                loc.path.parent.name == RANKS_DIR) else None
            return (top / SHARDED_ROOT).is_file(), parent is not None and (parent / SHARDED_ROOT).is_file()
        here = is_sharded(open_store(path, None, storage_options))
        m = _RANK_DIR.match(str(path))
        return here, m is not None and is_sharded(open_store(m.group(1), None, storage_options))
    except (OSError, NotAChainError):
        return False, False  # not readable: the operation itself reports it


def rank_location(path: str | os.PathLike[str], rank: int) -> str:
    """Where rank ``rank``'s chain of the sharded chain at ``path`` lives (a path or a URL)."""
    loc = parse_location(path)
    if loc.path is not None:
        return str(loc.path / RANKS_DIR / f"{rank:05d}")
    return f"{str(path).rstrip('/')}/{RANKS_DIR}/{rank:05d}"


def is_sharded(store: Store) -> bool:
    try:
        return store.exists(SHARDED_ROOT)
    except OSError:
        return False
