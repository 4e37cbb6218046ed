"""Creating and opening a chain for a writer: the schema of the live model and optimizer, the
root a creation writes, the location and lock it claims, and the checks before an append
(spec §5 "Root metadata (`ldformat.json`)", §5.6 "`schema`", §7.4 "Commit protocol", §7.5
"Leftovers and garbage", §15 "Writer lock and crash takeover").

A creation runs in named steps (:meth:`ldformat.ChainWriter.create` calls them in order):

1. :func:`new_root`: check the arguments, build the schema from the live objects (refusing
   what format 1.x cannot replay or store) and the root that will be written.
2. :meth:`CreationSite.claim`: open the location (making the directory when it is new),
   refuse one that holds a chain or anything but an unfinished creation, take the writer
   lock, and remove an unfinished creation's leftovers under it.
3. The writer writes the anchor of the current state and commits record 1; the root comes
   last, so a root always has a log (spec §7.4).
4. On failure, :meth:`CreationSite.undo` deletes only what this creation wrote, and nothing
   once another process took the lock over.

Opening checks the live objects against the stored schema (:func:`check_open`) and fences
the log after a takeover (:func:`open_for_append`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..errors import ChainExistsError, ChainLockedError, LdformatError, UnsupportedStateError, UsageError
from ..format.fold import ChainState
from ..format.manifest import FORMAT_VERSION, KINDS, RootMetadata, refuse_newer
from ..format.optstate import probe_unstorable_state
from ..format.state import (
    check_schema_matches,
    encode_param_groups,
    model_schema,
    optimizer_class_name,
    optimizer_param_names,
    optimizer_params,
    resolve_implementation,
)
from ..format.topk import TopK
from ..stores import LocalStore, Store, parse_location
from ..stores import open_store as open_location
from ..stores.local import make_directory
from .commit import collect_garbage, open_log_for_write
from .lock import WriterLock
from .reader import SHARDED_ROOT_FILE, chain_name
from .records import ROOT_FILE, io_error, lock_path, now

#: Versions :meth:`ChainWriter.create` can write (1.0 and 1.1 chains are only appended to).
WRITABLE_VERSIONS = ("1.2", "1.3", "1.4", "1.5", "1.6")

#: The replay environment of a device type (``format.environment.current_environment``).
EnvironmentOf = Callable[[str], dict[str, Any]]


# -- the schema --------------------------------------------------------------------------
def refuse_tensor_hyperparameters(optimizer: torch.optim.Optimizer, kind: str) -> None:
    """Gradient kinds replay ``torch.optim``, whose checks take Python numbers as hyperparameters."""
    for i, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k != "params" and isinstance(v, torch.Tensor):
                raise UnsupportedStateError(
                    f"param group {i} has a tensor-valued {k!r}; kind {kind!r} replays torch.optim, whose "
                    "checks take a Python number there: use a float, or mode='xor' (kind='state.xor'), "
                    "which stores tensor hyperparameters as they are")


def build_schema(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, kind: str, compressor: TopK | None
) -> dict[str, Any]:
    class_name, replayable = optimizer_class_name(optimizer)
    if kind.startswith("grad.") and not replayable:
        raise UnsupportedStateError(
            f"kind {kind!r} replays the optimizer, and {class_name} is not a torch.optim class; "
            "use mode='xor' (Checkpointer) or kind='state.xor' (ChainWriter) for other optimizers"
        )
    if kind.startswith("grad.") and isinstance(optimizer, torch.optim.LBFGS):
        raise UnsupportedStateError("LBFGS needs a closure to step, which replay cannot re-run; "
                                    "use mode='xor' (Checkpointer) or kind='state.xor' (ChainWriter)")
    encode_param_groups(optimizer, with_params=False)  # refuses hyperparameters JSON cannot hold, early
    if kind.startswith("grad."):
        refuse_tensor_hyperparameters(optimizer, kind)
    if not replayable:  # torch.optim classes keep storable state; others are probed before training
        probe_unstorable_state(optimizer)
    return {
        "model": model_schema(model),
        "optimizer": {
            "class": class_name,
            "params": optimizer_param_names(model, optimizer),
            "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        },
        "compressor": None
        if compressor is None
        else {"name": "topk", "ratio": compressor.ratio, "error_feedback": compressor.error_feedback},
    }


# -- creating ----------------------------------------------------------------------------
def check_create_arguments(kind: str, compressor: TopK | None, format_version: str) -> None:
    if kind not in KINDS:
        raise UsageError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if format_version not in WRITABLE_VERSIONS:
        raise UsageError(f"format_version must be one of {', '.join(WRITABLE_VERSIONS)} (default {FORMAT_VERSION})")
    if kind == "grad.topk" and not isinstance(compressor, TopK):
        raise UsageError("kind 'grad.topk' needs compressor=ldformat.TopK(...) (the one that compresses p.grad)")
    if kind != "grad.topk" and compressor is not None:
        raise UsageError(f"kind {kind!r} takes no compressor; use kind='grad.topk' with a TopK compressor")


def new_root(model: torch.nn.Module, optimizer: torch.optim.Optimizer, kind: str, compressor: TopK | None,
             format_version: str, environment_of: EnvironmentOf) -> RootMetadata:
    """Step 1 of a creation: the root it will write, once the arguments and the live objects
    are checked (spec §5)."""
    check_create_arguments(kind, compressor, format_version)
    schema = build_schema(model, optimizer, kind, compressor)
    device = str(next(iter(optimizer_params(optimizer)), torch.empty(0)).device.type)
    environment = {**environment_of(device), "implementation": resolve_implementation(optimizer)}
    return RootMetadata(
        format_version=format_version,
        chain_id=secrets.token_hex(16),
        created=now(),
        kind=kind,
        schema=schema,
        environment=environment,
    )


@dataclass
class CreationSite:
    """The location a creation claimed: its store, the lock taken there, and the directory the
    creation made (removed again if the creation fails)."""

    where: str
    store: Store
    lock: WriterLock
    owned_dir: Path | None

    @classmethod
    def claim(cls, path: str | os.PathLike[str], store: Store | None,
              storage_options: dict[str, Any] | None) -> CreationSite:
        """Step 2 of a creation: open the location, refuse one that is not free, take the lock
        and remove what a crashed creation left there."""
        where = chain_name(path, store)
        store, owned_dir = _creation_store(path, store, storage_options, where)
        _refuse_taken(store, owned_dir, where)
        try:
            lock = WriterLock.acquire(store, where)
        except ChainLockedError as e:
            raise ChainLockedError(f"{e} (another process is creating a chain here)") from None
        except BaseException:
            _remove_creation(store, owned_dir)
            raise
        try:
            _remove_unfinished_creation(store, where, lock)
        except BaseException:
            lock.release()  # the directory holds something else now: touch nothing
            raise
        return cls(where=where, store=store, lock=lock, owned_dir=owned_dir)

    def undo(self, written: list[str]) -> None:
        """Undo a creation that failed before its root existed, deleting only what it wrote itself.

        Nothing is deleted once another process took the lock over (it may be creating the chain
        now), and never a name another process could reuse: the objects written have fresh names;
        record 1, if it exists, stays as an unfinished creation that the next creator reclaims
        (spec §7.4). The lock's own generations go too when no other holder checks them (this
        creation took over nobody), so that a refused creation leaves nothing behind.
        """
        store, lock = self.store, self.lock
        try:
            if store.exists(ROOT_FILE):
                lock.release()
                return
            lock.check()
        except (LdformatError, OSError):
            return  # taken over, or unreachable: touch nothing, keep the lock as it is
        try:
            for p in written:
                store.delete(p)
        except OSError:
            pass  # best effort: what is left is an unfinished creation, which create() reclaims
        mine = lock.generation
        if lock.release() and lock.owner.takeover is False and lock.previous is None:
            try:
                for g in (mine, mine + 1):  # ours and the release: a taker starts again from nothing
                    store.delete(lock_path(g))
            except OSError:
                pass
        _remove_creation(store, self.owned_dir)


def _creation_store(path: str | os.PathLike[str], store: Store | None, storage_options: dict[str, Any] | None,
                    where: str) -> tuple[Store, Path | None]:
    """The store to create the chain in, and the directory made for it (None if it existed)."""
    if store is not None:
        return store, None
    location = parse_location(path)
    if location.path is None or storage_options:
        # An object store or memory:// URL (storage_options are refused for a directory).
        return open_location(path, storage_options=storage_options), None
    p = location.path
    if p.exists() and not p.is_dir():
        raise UsageError(f"{where}: exists and is not a directory")
    owned_dir = None if p.exists() else p
    make_directory(p)
    return LocalStore(p), owned_dir


def _refuse_taken(store: Store, owned_dir: Path | None, where: str) -> None:
    """Refuse a location that holds a chain, or anything but an unfinished creation."""
    try:
        exists = store.exists(ROOT_FILE)
        if not exists:
            _check_empty_or_unfinished(store, where)
    except LdformatError:
        raise
    except OSError as e:
        _remove_creation(store, owned_dir)
        raise io_error(f"{where}: cannot look at the location to create a chain", e) from None
    if exists:
        raise ChainExistsError(f"{where}: already holds a chain; use ChainWriter.open to append")


def _unfinished_creation_leftovers(store: Store) -> list[str] | None:
    """The objects of a creation that never created the root, or None if ``store`` holds more.

    Creation writes the anchor of step 0, record 1 and last the root (spec §7.4), so a
    directory without a root whose log holds at most record 1, with at most one anchor and no
    batch, is an unfinished creation. Anything else is refused: it may be someone's data.
    """
    paths = store.list("")
    rest = [p for p in paths if not p.startswith((".tmp-", "lock/"))]
    records = [p for p in rest if p.startswith("log/") and not p.split("/")[-1].startswith(".tmp-")]
    anchors = [p for p in rest if p.startswith("anchors/")]
    other = [p for p in rest if not p.startswith(("log/", "anchors/"))]
    if other or len(anchors) > 1 or records not in ([], ["log/000000000001.json"]):
        return None
    return rest


def _check_empty_or_unfinished(store: Store, where: str) -> None:
    if _unfinished_creation_leftovers(store) is None:
        _refuse_not_empty(store, where)


def _refuse_not_empty(store: Store, where: str) -> NoReturn:
    """Raise for a location that holds more than an unfinished creation.

    Listed first, the root checked after: a creator that won a concurrent race creates the
    root before anything else a listing could show, so a loser sees it here and is told
    that a chain exists, not that the location is not empty.
    """
    if store.exists(ROOT_FILE):
        raise ChainExistsError(f"{where}: another process created a chain here concurrently; use "
                               "ChainWriter.open to append")
    if store.exists(SHARDED_ROOT_FILE):
        raise UsageError(
            f"{where}: holds a sharded chain (spec §20), written by a job whose model was sharded across ranks; "
            "this run's model is not sharded that way (another world size, or a plain model), so its layout "
            "differs and it cannot append there. Resume from that chain (ldformat.resume reshards it) and "
            "checkpoint this run to a new path")
    raise UsageError(f"{where}: directory (or prefix) is not empty; create a chain in a new or empty one")


def _remove_unfinished_creation(store: Store, where: str, lock: WriterLock) -> None:
    """Holding the lock, remove what a crashed creation left (re-checked under the lock)."""
    leftovers = _unfinished_creation_leftovers(store)
    if leftovers is None or store.exists(ROOT_FILE):
        _refuse_not_empty(store, where)
    lock.check()
    for p in leftovers + [p for p in store.list("") if p.startswith(".tmp-")]:
        store.delete(p)


def _remove_creation(store: Store, owned_dir: Path | None) -> None:
    """Remove the directory a creation that never took the lock made, if it is still empty."""
    try:
        if owned_dir is not None:
            owned_dir.rmdir()
    except OSError:
        pass


# -- opening -----------------------------------------------------------------------------
def check_open(root: RootMetadata, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               compressor: TopK | None, where: str) -> None:
    """Refuse to append with live objects that differ from the chain's schema (spec §5.6)."""
    refuse_newer(root.format_version, where, "append to it")
    live_schema = build_schema(model, optimizer, root.kind, compressor)
    check_schema_matches(root.schema["model"], live_schema["model"], where)
    if root.schema["optimizer"]["params"] != live_schema["optimizer"]["params"]:
        raise UsageError(f"{where}: the optimizer's parameters differ from the chain's schema")
    if root.schema["optimizer"]["class"] != live_schema["optimizer"]["class"]:
        raise UsageError(
            f"{where}: the chain was written with {root.schema['optimizer']['class']}, "
            f"not {live_schema['optimizer']['class']}"
        )
    if root.kind == "grad.topk" and not isinstance(compressor, TopK):
        raise UsageError("this grad.topk chain needs compressor=ldformat.TopK(...)")


def open_for_append(store: Store, where: str, lock: WriterLock) -> ChainState:
    """The committed state, holding the lock: the log fenced after a takeover (spec §15.3) and
    the garbage of a dead writer removed (spec §7.5)."""
    _, state = open_log_for_write(store, where, lock)
    collect_garbage(store, state, lock, where)
    return state
