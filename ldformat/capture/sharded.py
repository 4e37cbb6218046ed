"""Sharded capture (spec §20): every rank checkpoints its own shards, rank 0 commits for all.

Each rank's :class:`~ldformat.Checkpointer` writes an ordinary chain of its local tensors at
``<chain>/ranks/<rank>``. Rank 0 also creates the layout (``sharded.json``) and runs a
:class:`Committer` that reads every rank chain's log and creates a global commit record for
the newest step that all of them hold durably. Nothing here is a collective after the
constructor: a rank that dies leaves its step uncommitted, and the others go on to fail
where training fails (their next collective).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..chain.lock import WriterLock
from ..chain.records import log_path, log_sequence_numbers, now, read_log, read_record
from ..chain.sharded_probe import is_sharded, rank_location
from ..errors import ChainLockedError, LdformatError, UnsupportedStateError, UsageError
from ..format.dtensors import is_dtensor, local, local_shard
from ..format.fold import ChainState
from ..sharded.chain import (
    COPIES_VERSION,
    SHARDED_VERSION,
    Commit,
    ShardedRoot,
    copy_ranks,
    create_commit,
    create_sharded_root,
    newest_commit,
    read_sharded_root,
)
from ..sharded.layout import Layout, Shard, overlapping
from ..stores import Store, open_store, parse_location
from .stats import CaptureStats

log = logging.getLogger("ldformat.capture")

#: torch.optim classes whose update is elementwise per parameter, so that replaying each
#: rank's gradient shard on its own reproduces the sharded step bit for bit (spec §20.5).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
                         "Adadelta", "ASGD"})
#: How often rank 0's committer looks at the rank chains between its own commits.
POLL_S = 0.5
#: How long ``close()`` on rank 0 waits for the other ranks' last commit.
DEFAULT_COMMIT_TIMEOUT_S = 60.0


@dataclass
class ShardedSetup:
    rank: int
    world_size: int
    rank_path: str  # this rank's chain
    committed: int | None  # the newest commit's step: the rank chain continues from it
    lock: WriterLock | None  # this rank's chain's lock, held since the opening (None: a new rank chain)
    copies: dict[int, int]  # the copy ranks (spec §20.2): they write no rank chain

    @property
    def chain_ranks(self) -> list[int]:
        """The ranks that write a rank chain: every rank but the copy ranks."""
        return [r for r in range(self.world_size) if r not in self.copies]

    @property
    def is_copy(self) -> bool:
        """Whether this rank is a copy rank: its state is in a lower rank's chain."""
        return self.rank in self.copies


def _group_rank0(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_global_rank(group, 0)) if group is not None else 0


def _refuse_optimizer(optimizer: torch.optim.Optimizer, kind: str) -> None:
    cls = type(optimizer)
    if kind.startswith("grad.") and not (cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE):
        raise UnsupportedStateError(
            f"mode with kind {kind!r} replays each rank's gradient shard on its own, which is exact only for "
            f"optimizers whose update is elementwise ({', '.join(sorted(ELEMENTWISE))} of torch.optim); "
            f"{cls.__module__}.{cls.__name__} is not one of them: use mode='xor' with a sharded model"
        )


def _own_layout(model: torch.nn.Module, rank: int) -> dict[str, tuple[str, list[int], list[int], list[int]]]:
    from ..format.dtypes import dtype_name

    out = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or not is_dtensor(t):
            continue
        seen.add(id(t))
        offsets, lengths = local_shard(t)
        out[f"model/{name}"] = (dtype_name(t.dtype), list(t.shape), list(offsets), list(lengths))
    return out


def _mesh(model: torch.nn.Module, world: int) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The job's device mesh: the root of the DTensors' meshes (FSDP2 on a 2-D mesh places its
    parameters on the data-parallel submesh); the world as one dimension if none spans it."""
    for t in model.state_dict(keep_vars=True).values():
        if is_dtensor(t):
            mesh = t.device_mesh
            root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
            for m in (root, mesh):
                if m.size() == world:
                    names = m.mesh_dim_names
                    return tuple(int(n) for n in m.shape), None if names is None else tuple(str(n) for n in names)
    return (world,), None


def unsynchronized_statistics(model: torch.nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` that keep running statistics of their own rank's data:
    FSDP2 and tensor parallelism do not synchronize buffers, so these differ between replicas
    (SyncBatchNorm, which all-reduces them, is not listed)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [name for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm) and m.track_running_stats]


def buffer_digest(model: torch.nn.Module) -> str:
    """A crc32c of this rank's buffers that are not DTensors (in ``state_dict`` order): a copy rank
    and its source send it with every step so that rank 0 notices replicas whose buffers
    drifted apart."""
    from ..stores.crc32c import crc32c_extend

    crc = 0
    for t in model.state_dict(keep_vars=True).values():
        if not is_dtensor(t) and t.numel():
            crc = crc32c_extend(crc, t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return f"{crc:08x}"


def setup(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, kind: str, group: Any,
          storage_options: dict[str, Any] | None, check: Any, copies_allowed: bool = True) -> ShardedSetup:
    """Agree with every rank on the layout and create (or check) ``sharded.json``.

    Collective: every rank of ``group`` calls it. ``check()`` runs each rank's own refusals
    (the schema of its rank chain) first, so that a refusal anywhere leaves nothing on disk.
    ``copies_allowed``: whether a new chain may have copy ranks (spec §20.2; rank 0's says).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("a model with DTensor parameters is sharded: initialize torch.distributed first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    src = _group_rank0(group)
    error: BaseException | None = None
    mine: Any = None
    try:
        _refuse_optimizer(optimizer, kind)
        check()
        mine = _own_layout(model, rank)
    except LdformatError as e:
        error = e
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, mine), group=group)
    for refused, _ in gathered:
        if refused is not None:
            raise refused
    if rank == 0:
        layouts: dict[str, Layout] = {}
        for r, (_, own) in enumerate(gathered):
            for name, (dtype, shape, offsets, lengths) in own.items():
                lay = layouts.get(name)
                shard = Shard(r, tuple(offsets), tuple(lengths))
                layouts[name] = Layout(dtype, tuple(shape), (*(lay.shards if lay else ()), shard))
        mesh_shape, dim_names = _mesh(model, world)
        copies = copy_ranks(world, layouts) if copies_allowed else {}
        root = ShardedRoot(chain_id=os.urandom(16).hex(), created=now(), kind=kind, world_size=world,
                           mesh_shape=mesh_shape, dim_names=dim_names, tensors=layouts, copies=copies,
                           format_version=COPIES_VERSION if copies else SHARDED_VERSION)
        try:
            copies = _create_or_check(path, root, storage_options)
        except LdformatError as e:
            error = e
    copies = _agree(error, copies if rank == 0 else None, group, src)
    # Opening (spec §20.3.3): every rank holds its rank chain's lock (a takeover fences that
    # rank chain), then rank 0 fences the commit records with a record for the newest committed
    # step N, before any rank chain is truncated.
    location = rank_location(path, rank)
    lock = None
    try:
        error = None
        try:
            if rank not in copies and _exists(location, storage_options):
                lock = WriterLock.acquire(open_store(location, storage_options=storage_options), location)
        except ChainLockedError as e:
            error = ChainLockedError(f"{e} (rank {rank}'s chain; stop that job first)")
        except LdformatError as e:
            error = e
        gathered = [None] * world
        dist.all_gather_object(gathered, error, group=group)
        for refused in gathered:
            if refused is not None:
                raise refused
        committed: int | None = None
        error = None
        if rank == 0:
            try:
                store = _top_store(path, storage_options)
                if lock is not None:
                    lock.check()  # rule L
                last = newest_commit(store, path)
                if last is not None:
                    committed = create_commit(store, path, last.step, last).step
            except LdformatError as e:
                error = e
        box: list[Any] = [error, committed]
        dist.broadcast_object_list(box, src=src, group=group)
        if box[0] is not None:
            raise box[0]
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return ShardedSetup(rank=rank, world_size=world, rank_path=location, committed=box[1], lock=lock,
                        copies=copies)


def _agree(error: BaseException | None, copies: dict[int, int] | None, group: Any, src: int) -> dict[int, int]:
    """Rank 0's error, raised on every rank; else rank 0's copy ranks, on every rank."""
    import torch.distributed as dist

    box: list[Any] = [error, copies]
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is not None:
        raise box[0]
    return dict(box[1])


def _exists(location: str, storage_options: dict[str, Any] | None) -> bool:
    from ..chain.records import ROOT_FILE

    loc = parse_location(location)
    if loc.path is not None:
        return (loc.path / ROOT_FILE).is_file()
    return open_store(location, storage_options=storage_options).exists(ROOT_FILE)


def _top_store(path: str, storage_options: dict[str, Any] | None) -> Store:
    loc = parse_location(path)
    if loc.path is not None:
        loc.path.mkdir(parents=True, exist_ok=True)
    return open_store(path, storage_options=storage_options)


def _create_or_check(path: str, root: ShardedRoot, storage_options: dict[str, Any] | None) -> dict[int, int]:
    """Create ``sharded.json``, or check that the one there has this run's layout; returns the
    copy ranks in force (an existing chain's, which a writer of format 1.3 left empty)."""
    from ..chain.records import ROOT_FILE

    store = _top_store(path, storage_options)
    if not is_sharded(store):
        if store.exists(ROOT_FILE):
            raise UsageError(f"{path}: holds an unsharded chain; a sharded model checkpoints to a new path")
        create_sharded_root(store, root, path)
        return dict(root.copies)
    have = read_sharded_root(store, path)
    if have.kind != root.kind:
        raise UsageError(f"{path}: the chain has kind {have.kind}; this mode writes {root.kind}")
    if have.world_size != root.world_size or have.tensors != root.tensors:
        raise UsageError(
            f"{path}: the chain was written at world size {have.world_size} with mesh {list(have.mesh_shape)} "
            f"and a different layout than this run's (world size {root.world_size}, mesh {list(root.mesh_shape)}); "
            "resume from it with ldformat.resume() and checkpoint the resharded run to a new path"
        )
    return dict(have.copies)


class _RankLog:
    """What one rank chain's log says, read incrementally (only records newer than the last poll)."""

    def __init__(self, location: str, storage_options: dict[str, Any] | None) -> None:
        self.where = location
        self.store = open_store(location, storage_options=storage_options)
        self.state: ChainState | None = None

    def refresh(self) -> ChainState:
        seqs = log_sequence_numbers(self.store)
        state = self.state
        if state is None or not seqs or seqs[0] > state.last_seq + 1 or state.last_seq not in seqs:
            _, state = read_log(self.store, self.where)
        else:
            for seq in seqs:
                if seq > state.last_seq:
                    state.apply(read_record(self.store, seq, self.where))
        self.state = state
        return state


class Committer:
    """Rank 0's global commits (spec §20.3): a step is committed once every rank chain holds it."""

    def __init__(self, path: str, chain_ranks: list[int], storage_options: dict[str, Any] | None,
                 stats: CaptureStats | None = None) -> None:
        self.path = path
        self.stats = stats
        #: Called with the step of each commit record this committer creates (the mirror).
        self.on_commit: Callable[[int], None] | None = None
        self._ended: dict[int, float] = {}  # step -> when rank 0 finished it (for commit latency)
        self.store = _top_store(path, storage_options)
        self.rank_ids = chain_ranks  # every rank but the copy ranks, which write no chain
        self.ranks = [_RankLog(rank_location(path, r), storage_options) for r in chain_ranks]
        self.last: Commit | None = newest_commit(self.store, path)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ldformat-committer", daemon=True)
        self._thread.start()

    @property
    def committed(self) -> int | None:
        return None if self.last is None else self.last.step

    def step_ended(self, step: int) -> None:
        self._ended[step] = time.monotonic()

    def nudge(self, _step: int | None = None) -> None:
        """Rank 0 committed in its own chain: look at the others now."""
        self._wake.set()

    def common_step(self) -> tuple[int | None, list[int]]:
        """The newest step every rank chain holds, and the ranks that hold less than the newest of all."""
        states = [r.refresh() for r in self.ranks]
        latest = [s.latest_step for s in states]
        if any(x is None for x in latest):
            return None, [r for r, x in zip(self.rank_ids, latest, strict=True) if x is None]
        newest = max(x for x in latest if x is not None)
        behind = [r for r, x in zip(self.rank_ids, latest, strict=True) if x != newest]
        low = min(x for x in latest if x is not None)
        if all(low in s.anchors or low in s.deltas for s in states):
            return low, behind
        common = set(states[0].steps)
        for s in states[1:]:
            common &= set(s.steps)
        return (max(common) if common else None), behind

    def poll(self) -> int | None:
        """Commit the newest step all ranks hold, if it is newer than the last commit."""
        with self._lock:
            step, _ = self.common_step()
            if step is not None and (self.last is None or step > self.last.step):
                for r in self.ranks:  # rule D: a record read before its writer's directory sync is not durable yet
                    if r.state is not None:
                        r.store.sync([log_path(r.state.last_seq)])
                self.last = create_commit(self.store, self.path, step, self.last)
                if self.on_commit is not None:
                    self.on_commit(step)
                ended = self._ended.pop(step, None)
                for s in [s for s in self._ended if s < step]:
                    del self._ended[s]
                if self.stats is not None:
                    self.stats.global_commits += 1
                    if ended is not None:
                        self.stats.commit_latency_s.append(time.monotonic() - ended)
            return self.committed

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._stop:
                break
            try:
                self.poll()
                self.error = None
            except Exception as e:  # retried at the next poll; close() reports what remains
                self.error = e

    def finish(self, step: int | None, timeout_s: float) -> int | None:
        """Wait until every rank holds ``step`` (rank 0's last), commit it, stop."""
        deadline = time.monotonic() + timeout_s
        try:
            while step is not None:
                committed = self.poll()
                if committed is not None and committed >= step:
                    break
                if time.monotonic() >= deadline:
                    _, behind = self.common_step()
                    raise LdformatError(
                        f"{self.path}: rank(s) {behind or '?'} did not commit step {step} within {timeout_s:g} s "
                        f"(a rank died or is still writing); the newest committed step stays {self.committed}. "
                        "The chain is valid; resume from that step"
                    )
                time.sleep(0.05)
        finally:
            self.stop()
        return self.committed

    def stop(self) -> None:
        """End the background polls (what is committed stays)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)


def commit_now(committer: Committer | None, group: Any, failed: BaseException | None = None) -> None:
    """The opening's last collective: every rank calls it once its rank chain is open, or with
    the error that stopped it (``failed``), so that a rank that failed to open never leaves the
    others waiting for it until the process group's timeout. Then rank 0 commits the step they
    all start from, and its failure to do so stops every rank as well."""
    import torch.distributed as dist

    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, None if failed is None else _described(failed), group=group)
    if failed is not None:
        raise failed
    for rank, why in enumerate(said):
        if why is not None:
            raise LdformatError(f"rank {rank} could not open its checkpoint ({why}), so this rank stops too; "
                                "nothing was committed: fix that rank's problem and start the job again")
    error: BaseException | None = None
    if committer is not None:
        try:
            committer.poll()
        except Exception as e:
            error = e
    box: list[Any] = [None if error is None else _described(error)]
    dist.broadcast_object_list(box, src=_group_rank0(group), group=group)
    if error is not None:
        raise error
    if box[0] is not None:
        raise LdformatError(f"rank 0 could not commit the step the ranks start from ({box[0]}), so this rank "
                            "stops too")


def _described(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def rank_budget(max_bytes: int | None, group: Any) -> int | None:
    """Each rank's share of a sharded chain's disk budget: ``max_bytes`` split evenly over the
    rank chains (a rank's retention only sees its own rank chain)."""
    import torch.distributed as dist

    if max_bytes is None or not isinstance(max_bytes, int) or not dist.is_initialized():
        return max_bytes
    return max_bytes // dist.get_world_size(group)


def newest_committed(path: str, storage_options: dict[str, Any] | None) -> Callable[[], int | None]:
    """The step of the sharded chain's newest commit record, read when called: a rank chain's
    retention keeps everything from the newest anchor at or below it, so that the newest
    committed step stays committed whatever the other ranks drop (spec §20.8)."""
    store = open_store(path, storage_options=storage_options)
    failing: list[str] = []  # the error last warned about: a caller that polls gets one warning per new error

    def step() -> int | None:
        try:
            last = newest_commit(store, path)
        except (OSError, LdformatError) as e:
            repeated = failing == [str(e)]
            failing[:] = [str(e)]
            log.log(logging.DEBUG if repeated else logging.WARNING,
                    "%s: cannot read the newest commit record (%s); no history is dropped this time", path, e)
            return None
        failing.clear()
        return None if last is None else last.step

    return step


def live_regions(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The block (offsets, lengths) of every DTensor this rank holds, by state_dict key."""
    return {name: local_shard(t) for name, t in model.state_dict(keep_vars=True).items() if is_dtensor(t)}


def needed_ranks(root: ShardedRoot, regions: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> set[int]:
    """The rank chains that hold part of what this rank needs: the blocks of ``regions``, and
    the whole of every laid-out tensor this rank holds unsharded."""
    out: set[int] = set()
    for name, layout in root.tensors.items():
        out |= overlapping(layout, regions.get(name[len("model/"):]))
    return out


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Load a state into live objects that may be sharded (spec §20.6): a DTensor takes its own
    block, given either as that block or within the full tensor, so any world size or mesh
    reads any chain."""
    live = model.state_dict(keep_vars=True)
    missing = sorted(set(live) - set(state["model"]))
    if missing:
        raise UsageError(f"the checkpoint lacks model state {missing[0]!r} (and {len(missing) - 1} more): "
                         "is it the same model?")
    with torch.no_grad():
        for name, t in live.items():
            piece = _block(t, state["model"][name])
            if piece is None:
                raise UsageError(f"model state {name!r} is {tuple(state['model'][name].shape)} in the checkpoint, "
                                 f"{tuple(t.shape)} in the model")
            local(t).copy_(piece)
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    osd = state["optimizer"]
    per_param = {}
    for key, value in osd.get("state", {}).items():
        p = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        if p is None or not is_dtensor(p) or not isinstance(value, dict):
            per_param[key] = value
            continue
        per_param[key] = {k: _like(p, v) for k, v in value.items()}
    optimizer.load_state_dict({**osd, "state": per_param} if "state" in osd else osd)


def _block(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    """``src`` as the part of ``t`` this rank holds: ``t``'s own block, or cut from the full tensor."""
    if not is_dtensor(t):
        return src if tuple(src.shape) == tuple(t.shape) else None
    offsets, lengths = local_shard(t)
    if tuple(src.shape) == lengths:
        return src
    if tuple(src.shape) == tuple(t.shape):
        return src[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    return None


def _like(p: torch.Tensor, v: object) -> object:
    """A state tensor of the DTensor parameter ``p`` (its shape, or its block's) as a DTensor placed like ``p``."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    piece = _block(p, v)
    if piece is None:
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(piece.clone(), p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              shape=p.shape, stride=p.stride(), run_check=False)
