"""Resuming training from a chain, and re-opening it to record again (spec §19.5 "Resuming").

:func:`resume` restores the live training objects from a step; :func:`open_writer` is the
capture runtime's side (docs/capture-runtime.md "Modes and life cycle"): it re-opens the chain at
that step, truncating the steps after it (§16 "Truncation") and loading the top-k residuals
of its anchor (§14.2 "Resuming").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ..api import sync
from ..chain.commit import open_log_for_write
from ..chain.lock import WriterLock
from ..chain.reader import ChainReader, step_not_found
from ..chain.records import ROOT_FILE
from ..chain.replicate import ReplicaDivergedError
from ..chain.sharded_probe import is_sharded
from ..chain.writer import ChainWriter
from ..errors import CorruptChainError, LdformatError, StepNotFoundError, UsageError
from ..format.dtensors import has_dtensors
from ..format.manifest import FORMAT_VERSION, NEWEST_VERSION, Kind
from ..format.state import optimizer_class_name
from ..format.topk import TopK
from ..sharded.chain import ShardedReader, assemble_state, extra_of_rank
from ..stores import Store, StoreOrPath, location_name, parse_location
from ..stores import open_store as open_location
from .extra import Stateful
from .rng import restore_optimizer_rng, restore_rng
from .sharded import live_regions, load_full_state, needed_ranks
from .unwrap import unwrap_model, unwrap_optimizer, unwrap_scheduler

log = logging.getLogger("ldformat.capture")


def _chain_store(path: str | os.PathLike[str], store: Store | None,
                 storage_options: dict[str, Any] | None) -> tuple[str, Store | None]:
    """The chain's name, and ``store`` or the store of a URL, opened once for every step of
    a resume; None for a local directory (which ChainWriter.create makes if needed)."""
    if store is not None:
        return str(path), store
    if parse_location(path).is_local and not storage_options:
        return str(path), None
    return location_name(path), open_location(path, storage_options=storage_options)  # refuses options locally


def _holds_chain(path: str | os.PathLike[str], store: Store | None) -> bool:
    if store is not None:
        return store.exists(ROOT_FILE)
    local = parse_location(path).path
    return local is not None and (local / ROOT_FILE).exists()


def _exact_step(reader: ChainReader) -> int:
    """The latest anchor; for grad.topk the latest one that holds residuals (compaction anchors do not)."""
    if reader.kind == "grad.topk":
        from ..format.anchor import tensor_bytes

        for s in reversed(reader.anchors):
            entry = reader.state.anchors[s]
            if tensor_bytes(reader.read_object(entry.object, s), "compressor") > 0:
                return s
    return reader.anchors[-1]


def resume(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    data: Stateful | None = None,
    sampler: Stateful | None = None,
    compressor: TopK | None = None,
    exact: bool = False,
    step: int | None = None,
    rank: int | None = None,
    store: Store | None = None,
    storage_options: dict[str, Any] | None = None,
    mirror: StoreOrPath | None = None,
    mirror_options: dict[str, Any] | None = None,
) -> int:
    """Restore the live training objects from a chain; returns the restored step.

    Restores model, optimizer, scheduler, GradScaler, RNG states (CPU, CUDA where present,
    Python, NumPy) and the sampler position captured by a :class:`Checkpointer`. Returns 0
    and changes nothing when ``path`` holds no chain yet, so the same code starts and
    resumes a run.

    Args:
        exact: resume from the latest *anchor* instead of the latest step. In ``lowdiff``
            mode only anchors hold the top-k residuals, so only this continues exactly like
            the uninterrupted run; from a later delta step the residuals restart at zero,
            which changes the following compressed gradients (spec §14.2).
        step: an explicit step to resume from.
        rank: the data-parallel rank this process resumes (default: its rank in the default
            process group when ``torch.distributed`` is initialized, else 0): it gets that
            rank's RNG states and data position where the chain recorded them (spec §19.1
            ``ranks``; otherwise rank 0's, with a warning) and, given ``compressor``, that
            rank's top-k residuals (data-parallel ``lowdiff``).
        data: the data position object given to the Checkpointer as ``data=`` (``sampler=``
            is its former name); its ``load_state_dict`` receives the captured position.
        store, storage_options: an explicit store, or settings of the object store at the
            URL ``path`` (see :func:`ldformat.stores.open_store`).
        mirror, mirror_options: the mirror a ``Checkpointer(..., mirror=...)`` replicated
            ``path`` to. The newest valid of the two is used, by this rule (each choice
            but the plain one is logged on the ``ldformat.capture`` logger):

            1. the mirror holds no readable chain: ``path`` alone, as without ``mirror``;
            2. ``path`` holds no readable chain, or the mirror is newer: for the same chain
               (the same ``chain_id``) its log is longer (its newest record has a greater
               number: ``path`` lost records that the mirror had copied), for another chain
               its latest step is greater. ``ldformat.sync(mirror, path)`` first brings
               ``path`` up to the mirror, then ``path`` is restored (and a Checkpointer
               appends there);
            3. that sync refuses because ``path`` diverged from the mirror (or ``path``
               holds something unreadable): the mirror is restored from directly and
               ``path`` is left untouched; move it away before checkpointing to ``path``
               again;
            4. otherwise ``path``, even if the mirror diverged from it. For the same chain
               the record numbers decide, not the steps: a truncation of ``path`` (a
               deliberate rewind, spec §16) is a newer record, so ``path`` wins over a
               mirror that still holds the steps it removed, and the next sync carries the
               rewind to the mirror.

    Pass the returned step to ``Checkpointer(..., step=step)`` so that steps after it are
    truncated and re-recorded by the resumed run.
    """
    path, store = _chain_store(path, store, storage_options)
    if store is None and mirror is None and is_sharded_chain(path, storage_options):
        return _resume_sharded(path, model, optimizer, scheduler=scheduler, scaler=scaler,
                               data=data if data is not None else sampler, compressor=compressor, exact=exact,
                               step=step, storage_options=storage_options)
    if mirror is not None:
        reader = _newest(path, store, mirror, mirror_options)
        if reader is None:
            return 0
    else:
        if not _holds_chain(path, store):
            return 0
        reader = ChainReader(path, store=store)
    if reader.latest_step is None:
        return 0
    if step is None:
        step = _exact_step(reader) if exact else reader.latest_step
    elif step not in reader.steps:
        raise step_not_found(str(path), step, reader.steps)
    model, optimizer, scheduler = unwrap_model(model), unwrap_optimizer(optimizer), unwrap_scheduler(scheduler)
    refuse_other_optimizer(reader.root.schema, optimizer, path)
    reader.replay_device = replay_device(reader, model)
    state = reader.materialize(step)
    if has_dtensors(model):  # a sharded model takes its slices of the full state
        load_full_state(model, optimizer, state)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    extra = own_extra(state["extra"], rank, path)
    if "optimizer_rng" in extra:  # the optimizer's own generators, after its load_state_dict (spec §19.5)
        restore_optimizer_rng(optimizer, extra["optimizer_rng"], f"{path} (step {step})")
    if scheduler is not None and "scheduler" in extra:
        scheduler.load_state_dict(extra["scheduler"])
    if scaler is not None and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    if data is None:
        data = sampler
    if data is not None and extra.get("data") is not None:
        data.load_state_dict(extra["data"])
    if compressor is not None:
        residuals = state.get("compressor", {}) if rank == 0 else state.get("compressor_ranks", {}).get(rank, {})
        compressor.load_residuals(residuals)
    if "rng" in extra:
        restore_rng(extra["rng"])
    return step


def refuse_other_optimizer(schema: dict[str, Any], optimizer: torch.optim.Optimizer, path: str) -> None:
    """Refuse to load a chain's optimizer state into an optimizer of another class: its state
    has other keys (an SGD state into AdamW fails at the next step with ``KeyError: 'betas'``),
    so nothing is loaded (spec §5.6.2 ``class``)."""
    recorded, (live, _) = schema["optimizer"]["class"], optimizer_class_name(optimizer)
    if recorded != live:
        raise UsageError(
            f"{path}: the chain was recorded with the optimizer {recorded}, and this optimizer is {live}; "
            f"resume into a {recorded.rsplit('.', 1)[-1]} (its state does not fit another class), or start a new "
            "chain for the new optimizer; nothing was loaded")


def replay_device(reader: ChainReader, model: torch.nn.Module) -> torch.device:
    """Where to replay the gradient deltas of ``reader`` for ``model``: the model's device when
    the chain was recorded on that device type, where replay is bit-exact (spec §11.8), else
    the CPU (ChainReader's default, which warns)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return device if reader.root.environment.get("device") == device.type else torch.device("cpu")


def own_extra(extra: dict[str, Any], rank: int, where: str) -> dict[str, Any]:
    """``extra`` with rank ``rank``'s RNG states and data position (spec §19.5): a data-parallel
    chain records the other ranks' under ``ranks``."""
    if rank == 0:
        return extra
    mine = extra_of_rank(extra, rank)
    if mine is None:
        log.warning("%s: the chain holds no RNG states or data position of rank %d (recorded by one process, or "
                    "by an earlier ldformat); rank %d restores rank 0's", where, rank, rank)
        return extra
    return mine


def is_sharded_chain(path: str, storage_options: dict[str, Any] | None) -> bool:
    loc = parse_location(path)
    if loc.path is not None and not loc.path.is_dir():
        return False
    try:
        return is_sharded(open_location(path, storage_options=storage_options))
    except LdformatError:
        return False


def _resume_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    scheduler: Stateful | None, scaler: Stateful | None, data: Stateful | None,
                    compressor: TopK | None, exact: bool, step: int | None,
                    storage_options: dict[str, Any] | None) -> int:
    """:func:`resume` from a sharded chain, at this run's world size and mesh (spec §20.6)."""
    import torch.distributed as dist

    reader = ShardedReader(path, storage_options=storage_options)
    if reader.latest_step is None:
        return 0
    if step is None:
        step = reader.anchors[-1] if exact else reader.latest_step
    elif step not in reader.steps:
        raise StepNotFoundError(f"{path}: step {step} is not a committed step of the sharded chain")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    same = world == reader.world_size
    model, optimizer, scheduler = unwrap_model(model), unwrap_optimizer(optimizer), unwrap_scheduler(scheduler)
    refuse_other_optimizer(reader.ranks[reader.root.source(0)].root.schema, optimizer, path)
    # Only the blocks this rank holds, from the rank chains that hold part of them (spec §20.6):
    # at the recording layout that is this rank's own chain.
    regions = live_regions(model)
    for rank_reader in reader.ranks.values():
        rank_reader.replay_device = replay_device(rank_reader, model)
    sources = sorted(needed_ranks(reader.root, regions) | ({rank} if same else set()))
    primary = rank if same else (sources[0] if sources else 0)
    sources = sorted(set(sources) | {primary})
    parts = dict(zip(sources, reader.materialize_ranks(step, ranks=sources), strict=True))
    state = assemble_state(reader.root, parts, f"{path} (step {step})",
                           reader.ranks[reader.root.source(primary)].root.schema, primary=primary, regions=regions)
    own = parts[primary]["extra"]
    if same and rank in reader.root.copies:  # a copy rank's own RNG states and data position are rank 0's record
        mine = reader.extra_of(rank, step)
        if mine is None:
            log.warning("%s: rank chain 0 holds no RNG states or data position of copy rank %d at step %d; they are "
                        "not restored", path, rank, step)
            own = {k: v for k, v in own.items() if k not in ("rng", "data")}
        else:
            own = mine
    load_full_state(model, optimizer, state)
    if same and "optimizer_rng" in own:  # this rank's optimizer's own generators (spec §19.5)
        restore_optimizer_rng(optimizer, own["optimizer_rng"], f"{path} (step {step})")
    if scheduler is not None and "scheduler" in own:
        scheduler.load_state_dict(own["scheduler"])
    if scaler is not None and "scaler" in own:
        scaler.load_state_dict(own["scaler"])
    if same:
        if data is not None and own.get("data") is not None:
            data.load_state_dict(own["data"])
        if "rng" in own:
            restore_rng(own["rng"])
        if compressor is not None:
            compressor.load_residuals(parts[rank].get("compressor", {}))  # this rank's own shard
    elif rank == 0:
        log.warning("%s: written at world size %d, resumed at %d: model and optimizer are restored exactly; "
                    "RNG states, data positions and top-k residuals are per rank and are not restored",
                    path, reader.world_size, world)
    if not same and compressor is not None:
        compressor.load_residuals({})
    return step


def _latest(path: StoreOrPath, store: Store | None,
            options: dict[str, Any] | None) -> tuple[ChainReader | None, str | None]:
    """The chain at a location and its latest step, or None and why it holds no readable chain."""
    try:
        if isinstance(path, Store):
            store, path = path, repr(path)
        else:
            path, store = _chain_store(path, store, options)
        if not _holds_chain(path, store):
            return None, "no chain"
        return ChainReader(path, store=store), None
    except LdformatError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def _newest(path: str, store: Store | None, mirror: StoreOrPath,
            mirror_options: dict[str, Any] | None) -> ChainReader | None:
    """The reader to resume from, local ``path`` or ``mirror`` (the rule of :func:`resume`)."""
    from .mirror import describe

    name = describe(mirror)
    local, local_why = _latest(path, store, None)
    remote, remote_why = _latest(mirror, None, mirror_options)
    if remote is None or remote.latest_step is None:
        if remote_why != "no chain":
            log.warning("%s: the mirror is not readable (%s); resuming from %s", name, remote_why, path)
        return local
    local_step = local.latest_step if local is not None else None
    if local is not None and local_step is not None:
        if local.root.chain_id == remote.root.chain_id:
            newer = local.state.last_seq >= remote.state.last_seq  # a truncation is a newer record (spec §16)
        else:
            newer = local_step >= remote.latest_step  # another chain: only the steps compare
        if newer:
            return local
    try:
        report = sync(mirror, store if store is not None else path, src_options=mirror_options)
    except (ReplicaDivergedError, UsageError, CorruptChainError) as e:
        log.warning("%s: cannot update %s from the mirror (%s); resuming from the mirror's step %d, newer "
                    "than %s's %s; move %s away before checkpointing there again",
                    name, path, e, remote.latest_step, path, local_step if local is not None else local_why, path)
        return remote
    log.warning("%s: the mirror is ahead (record %d, step %s; %s has %s): copied %d records from it; resuming "
                "from %s", name, remote.state.last_seq, remote.latest_step, path,
                local_step if local is not None else local_why, report.records_copied, path)
    return ChainReader(path, store=store)


def open_writer(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    kind: Kind,
    mode: str,
    step: int | None,
    compressor: TopK | None,
    batch_steps: int,
    truncate: bool = False,
    store: Store | None,
    first_extra: Callable[[], dict[str, object]],
    storage_options: dict[str, Any] | None = None,
    rank_chain: bool = False,
    lock: WriterLock | None = None,
) -> ChainWriter:
    """The writer a :class:`~ldformat.Checkpointer` appends with (capture hook off).

    Creates the chain (its first anchor is the live state at ``step or 0``, with
    ``first_extra()`` as extra state), or re-opens it: the chain must have ``kind`` (the
    one ``mode`` writes); steps after ``step`` are truncated with ``truncate`` and refused
    without it; ``compressor`` receives the
    residuals of ``step``'s anchor, or restarts from zero (with a warning) when the step
    holds none. ``lock``: the chain's writer lock, already held (a sharded job takes every
    rank chain's lock before it opens the chain, spec §20.3.3); it is released on failure.
    """
    try:
        return _open_writer(path, model, optimizer, kind=kind, mode=mode, step=step, compressor=compressor,
                            batch_steps=batch_steps, truncate=truncate, store=store, first_extra=first_extra,
                            storage_options=storage_options, rank_chain=rank_chain, lock=lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def load_anchor_residuals(reader: ChainReader, target: int, compressor: TopK) -> None:
    """Load the top-k residuals that ``target``'s anchor holds into ``compressor``; zero (with a
    warning) when ``target`` holds none (a delta step, or a compaction anchor)."""
    tensors = reader.load_anchor_tensors(target) if target in reader.anchors else {}
    residuals = {n[len("compressor/"):]: t for n, t in tensors.items() if n.startswith("compressor/")}
    if residuals or (target == 0 and target in reader.anchors):  # the residuals of step 0 are zero
        compressor.load_residuals(residuals)
    else:
        log.warning("%s: step %s holds no top-k residuals (a delta step or a compaction anchor): they "
                    "restart from zero; resume from a writer's anchor for an exact continuation",
                    reader.path, target)
        compressor.load_residuals({})


def _open_writer(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, kind: Kind, mode: str,
                 step: int | None, compressor: TopK | None, batch_steps: int, truncate: bool, store: Store | None,
                 first_extra: Callable[[], dict[str, object]], storage_options: dict[str, Any] | None,
                 rank_chain: bool, lock: WriterLock | None) -> ChainWriter:
    path, store = _chain_store(path, store, storage_options)
    if not _holds_chain(path, store):
        return ChainWriter.create(path, model, optimizer, kind=kind, step=step or 0, extra=first_extra(),
                                  compressor=compressor, batch_steps=batch_steps, store=store, capture_hook=False,
                                  format_version=NEWEST_VERSION if rank_chain else FORMAT_VERSION)
    reader = ChainReader(path, store=store)
    if reader.kind != kind:
        raise UsageError(f"{path}: the chain has kind {reader.kind}; mode {mode!r} writes {kind}")
    latest = reader.latest_step
    target = latest if step is None else step
    if latest is not None and target is not None and target != latest:
        if target not in reader.steps:
            raise UsageError(str(step_not_found(str(path), target, reader.steps)))
        later = [s for s in reader.steps if s > target]
        if not truncate:
            raise UsageError(
                f"{path}: the chain has {len(later)} step(s) after step {target} (up to {latest}); pass "
                f"truncate=True to delete them and continue from step {target}, or resume from step {latest}"
            )
        log.warning("%s: truncating %d step(s) after %d: training resumes from there", path, len(later), target)
        if lock is not None:
            from ..chain.maintenance import truncate_locked

            reader.records, reader.state = open_log_for_write(reader.store, reader.path, lock)
            truncate_locked(reader, lock, target)
        else:
            from ..api import truncate as truncate_chain

            truncate_chain(path, target, store=store, part_of_sharded=rank_chain)
    if compressor is not None and target is not None:
        load_anchor_residuals(reader, target, compressor)
    return ChainWriter.open(path, model, optimizer, compressor=compressor, batch_steps=batch_steps, store=store,
                            capture_hook=False, lock=lock)
