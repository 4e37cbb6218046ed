"""A chain summarized: steps, anchors, bytes, the size of a full checkpoint, a replica's lag.

:func:`chain_info` computes what ``ldtools info`` shows, for an ordinary chain and for a
sharded one (spec §20 "Sharded chains"), as a frozen :class:`ChainInfo`; ``to_dict()`` is
``ldtools info --json``. The size of a full checkpoint is measured by replaying the latest
step from its anchor, as ``materialize`` does (spec section 9.1: the anchor that step would
get). :func:`commit_log` lists the commit records (``ldtools log``), and the small probes at
the end say where a path stands relative to a sharded chain.

This module imports torch only when it measures: ``import ldformat`` stays light.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CorruptChainError, EmptyChainError, LdformatError, MissingObjectError

if TYPE_CHECKING:
    from ..chain.reader import ChainReader
    from ..sharded.chain import ShardedReader

__all__ = [
    "ChainInfo",
    "FullCheckpoint",
    "MirrorLag",
    "OrdinaryInfo",
    "ShardedInfo",
    "chain_info",
    "check_chain_location",
    "commit_log",
    "mirror_lag",
    "sharded_parent",
    "sharded_world_size",
]


@dataclass(frozen=True, kw_only=True)
class FullCheckpoint:
    """The size of one full checkpoint of the latest step, or why it could not be measured.

    ``bytes`` is None when the chain has no step, or when measuring failed (``error`` says why:
    a summary of a damaged chain still shows the rest).
    """

    step: int | None = None
    bytes: int | None = None
    model_bytes: int | None = None
    optimizer_bytes: int | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        sizes = {} if self.bytes is None else {"step": self.step, "bytes": self.bytes, "model_bytes": self.model_bytes,
                                               "optimizer_bytes": self.optimizer_bytes}
        return {**sizes, "error": self.error}


@dataclass(frozen=True, kw_only=True)
class MirrorLag:
    """How far a replica (``ldtools sync``, ``Checkpointer(mirror=)``) lags behind its chain.

    ``lag_records`` commit records it lacks, the oldest of them ``lag_seconds`` old (0 when it
    is up to date); ``ahead_records`` records it holds that the chain lacks.
    """

    mirror: str
    mirror_latest_step: int | None
    lag_steps: int
    lag_records: int
    lag_seconds: float
    ahead_records: int

    def to_dict(self) -> dict[str, Any]:
        return {"mirror": self.mirror, "mirror_latest_step": self.mirror_latest_step, "lag_steps": self.lag_steps,
                "lag_records": self.lag_records, "lag_seconds": self.lag_seconds,
                "ahead_records": self.ahead_records}


@dataclass(frozen=True, kw_only=True)
class OrdinaryInfo:
    """What only an ordinary chain's summary holds: where its bytes go, how its deltas are
    encoded, the environment it was recorded in and the capture policy of its latest step."""

    anchor_bytes: int
    delta_bytes: int
    log_bytes: int  # commit records and snapshot segments
    delta_bytes_per_step: float | None
    slot_encodings: Mapping[str, int]
    environment: Mapping[str, Any]
    capture_policy: Mapping[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class ShardedInfo:
    """What only a sharded chain's summary holds (spec §20 "Sharded chains")."""

    world_size: int
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    sharded_tensors: int
    sharded_model_bytes: int  # the laid-out model tensors at their global shapes
    copies: Mapping[int, int]  # copy rank -> the rank it copies
    pending_steps: tuple[int, ...]  # steps some ranks hold beyond the last commit record
    bytes_per_rank: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ChainInfo:
    """A summary of a chain, ordinary (``ordinary`` set) or sharded (``sharded`` set).

    ``steps`` counts the committed steps (``first_step`` .. ``latest_step``); ``anchors`` lists
    the anchor steps; ``commits`` counts the commit records. ``to_dict()`` is the JSON that
    ``ldtools info --json`` prints.
    """

    path: str
    format_version: str
    chain_id: str
    kind: str
    optimizer: str
    steps: int
    first_step: int | None
    latest_step: int | None
    anchors: tuple[int, ...]
    commits: int
    bytes_on_disk: int
    full_checkpoint: FullCheckpoint
    ordinary: OrdinaryInfo | None = None
    sharded: ShardedInfo | None = None
    mirror: MirrorLag | None = None

    @property
    def full_checkpoint_bytes(self) -> int | None:
        return self.full_checkpoint.bytes

    @property
    def compression_vs_full_checkpoints(self) -> float | None:
        """How many times smaller the chain is than one full checkpoint per step."""
        total, full = self.bytes_on_disk, self.full_checkpoint.bytes
        return (self.steps * full / total) if total and full else None

    def to_dict(self) -> dict[str, Any]:
        head = {"path": self.path, "format_version": self.format_version, "chain_id": self.chain_id,
                "kind": self.kind, "optimizer": self.optimizer}
        counts = {"steps": self.steps, "first_step": self.first_step, "latest_step": self.latest_step,
                  "anchors": list(self.anchors), "commits": self.commits}
        full = {"full_checkpoint_bytes": self.full_checkpoint_bytes, "full_checkpoint": self.full_checkpoint.to_dict(),
                "compression_vs_full_checkpoints": self.compression_vs_full_checkpoints}
        if self.sharded is not None:
            s = self.sharded
            mesh = {"shape": list(s.mesh_shape), "dim_names": None if s.dim_names is None else list(s.dim_names)}
            out: dict[str, Any] = {
                **head, "world_size": s.world_size, "mesh": mesh, "sharded_tensors": s.sharded_tensors,
                "sharded_model_bytes": s.sharded_model_bytes,
                "copies": {str(r): src for r, src in sorted(s.copies.items())}, **counts,
                "pending_steps": list(s.pending_steps), "bytes_on_disk": self.bytes_on_disk,
                "bytes_per_rank": list(s.bytes_per_rank), **full}
        else:
            o = self.ordinary
            if o is None:
                raise ValueError(f"{self.path}: a ChainInfo holds either ordinary or sharded parts")
            out = {**head, **counts, "bytes_on_disk": self.bytes_on_disk, "anchor_bytes": o.anchor_bytes,
                   "delta_bytes": o.delta_bytes, "log_bytes": o.log_bytes,
                   "delta_bytes_per_step": o.delta_bytes_per_step, "slot_encodings": dict(o.slot_encodings), **full,
                   "environment": o.environment, "capture_policy": o.capture_policy}
        if self.mirror is not None:
            out["mirror"] = self.mirror.to_dict()
        return out


def chain_info(chain: str | os.PathLike[str] | ChainReader | ShardedReader, *, mirror: str | None = None,
               storage_options: dict[str, Any] | None = None) -> ChainInfo:
    """Summarize the chain at ``chain`` (a path, a URL or an open reader), ordinary or sharded.

    A latest step that is not an anchor is replayed from its anchor to measure the full
    checkpoint (the replay uses torch's threads: set them around the call).

    Args:
        chain: the chain, or a :class:`ChainReader` / :class:`ShardedReader` already open.
        mirror: also measure how far the replica at this location lags behind the chain.
        storage_options: settings of the object store at the URL ``chain``.

    Returns:
        A :class:`ChainInfo`; ``info.to_dict()`` is ``ldtools info --json``.

    Raises:
        NotAChainError: ``chain`` holds no chain.
        ReplicaDivergedError: ``mirror`` holds another chain.

    Example:
        >>> info = ldformat.chain_info("runs/chain")                   # doctest: +SKIP
        >>> info.steps, info.compression_vs_full_checkpoints            # doctest: +SKIP
        (121, 14.2)
    """
    from ..chain.reader import ChainReader
    from ..sharded.chain import ShardedReader, open_reader

    reader = chain if isinstance(chain, (ChainReader, ShardedReader)) else open_reader(
        chain, storage_options=storage_options)
    if isinstance(reader, ShardedReader):
        lag = None if mirror is None else _sharded_mirror_lag(reader, mirror)  # first: refuse a wrong mirror early
        return replace(_sharded_info(reader), mirror=lag)
    info = _ordinary_info(reader)
    return info if mirror is None else replace(info, mirror=mirror_lag(reader, mirror))


# -- the size of a full checkpoint -----------------------------------------------------------------
def _stored_state(reader: ChainReader, step: int) -> dict[str, Any]:
    """The tensors of ``step`` as an anchor stores them (``model/<name>``, tied weights once;
    ``optimizer/<index>/<key>``, ``optimizer/ref/...``), replayed from its anchor if need be,
    without top-k residuals."""
    anchor_step, path = reader.state.replay_path(step)
    if path:
        replayer = reader.start_replay(anchor_step)
        reader.replay_steps(replayer, path)
        replayer.sync_optimizer_tensors()
        tensors = replayer.tensors
    else:
        tensors = reader.load_anchor_tensors(step)
    return {n: t for n, t in tensors.items() if not n.startswith("compressor")}


def _full_checkpoint(reader: ChainReader) -> FullCheckpoint:
    """The size of one full checkpoint of the latest step: the anchor that step would get.

    That is the state ``materialize`` returns, as an anchor object stores it (spec section
    9.1): model tensors (tied weights once) and optimizer state, in a safetensors file, header
    included, without top-k residuals (which only a compressor needs). A latest step that is
    not an anchor is replayed from its anchor, as ``materialize`` does: the size of an older
    anchor misses what the optimizer state gained since (the anchor a chain is created with,
    written before the first optimizer step, holds no optimizer state at all).
    """
    from ..format.anchor import anchor_parts

    step = reader.latest_step
    if step is None:
        raise EmptyChainError(f"{reader.path}: the chain has no committed step yet")
    state = _stored_state(reader, step)

    def nbytes(prefix: str) -> int:
        return sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith(prefix))

    return FullCheckpoint(step=step, bytes=anchor_parts(state, step).size, model_bytes=nbytes("model/"),
                          optimizer_bytes=nbytes("optimizer/"))


def _sharded_full_state(reader: ShardedReader) -> FullCheckpoint:
    """The size of the full unsharded state of the latest committed step of a sharded chain.

    Measured without assembling it: rank 0's chain is replayed to that step, and each of its
    tensors counts at the global shape the layout gives it (a model tensor the layout splits,
    and an optimizer state tensor shaped like its parameter's shard), else once (a replicated
    tensor, a scalar such as Adam's ``step``). Model and optimizer bytes of the tensors, tied
    weights once; unlike :func:`_full_checkpoint`, no file header.
    """
    step = reader.latest_step
    if step is None:
        raise EmptyChainError(f"{reader.path}: the chain has no committed step yet")
    rank0 = reader.ranks[0]
    layouts = reader.root.tensors
    params: list[str] = list(rank0.root.schema["optimizer"]["params"])
    sizes = {"model/": 0, "optimizer/": 0}
    for name, t in _stored_state(rank0, step).items():
        numel = t.numel()
        if name.startswith("model/"):
            layout = layouts.get(name)
            if layout is not None:
                shard = layout.of_rank(0)
                if shard is not None and tuple(t.shape) != shard.lengths:
                    raise CorruptChainError(
                        f"{rank0.path} (step {step}) {name}: rank 0 stores shape {list(t.shape)}, the layout of "
                        f"{reader.path} says {list(shard.lengths)}")
                numel = _numel(layout.shape)
        elif name.startswith("optimizer/"):
            _, index, _key = (name.split("/", 2) + ["", ""])[:3]
            param = params[int(index)] if index.isdigit() and int(index) < len(params) else None
            layout = layouts.get(f"model/{param}") if param is not None else None
            if layout is not None and layout.split:
                shard = layout.of_rank(0)
                mine = shard.lengths if shard is not None else None
                if tuple(t.shape) == mine or (mine is None and t.dim() == len(layout.shape) and t.dim() > 0):
                    numel = _numel(layout.shape)
        else:
            continue
        sizes["model/" if name.startswith("model/") else "optimizer/"] += numel * t.element_size()
    return FullCheckpoint(step=step, bytes=sizes["model/"] + sizes["optimizer/"], model_bytes=sizes["model/"],
                          optimizer_bytes=sizes["optimizer/"])


_Reader = TypeVar("_Reader", "ChainReader", "ShardedReader")


def _full_state_or_error(reader: _Reader, measure: Callable[[_Reader], FullCheckpoint]) -> FullCheckpoint:
    """``measure(reader)``, or why not (a summary of a damaged chain still shows the rest)."""
    if reader.latest_step is None:
        return FullCheckpoint()
    try:
        try:
            return measure(reader)
        except MissingObjectError:
            reader.refresh()  # a compaction removed what this view of the log referenced
            return measure(reader)
    except LdformatError as e:
        return FullCheckpoint(error=str(e))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- the summaries ---------------------------------------------------------------------------------
def _ordinary_info(reader: ChainReader) -> ChainInfo:
    full = _full_state_or_error(reader, _full_checkpoint)  # first: it may re-read the log
    # Sizes read every segment: one consistent view, re-read if a compaction removes one meanwhile.
    return reader.retrying(lambda: _ordinary_sizes(reader, full))


def _ordinary_sizes(reader: ChainReader, full: FullCheckpoint) -> ChainInfo:
    state = reader.state
    anchors = sorted(state.anchors.items())
    delta_bytes = sum(o.size for d in state.delta_entries() for o in d.objects)
    n_deltas = len(state.deltas)
    total = reader.bytes_on_disk()
    anchor_bytes = sum(a.object.size for _, a in anchors)
    steps = reader.steps
    encodings = Counter(s.encoding for d in state.delta_entries() for s in d.slots)
    return ChainInfo(
        path=reader.path, format_version=reader.root.format_version, chain_id=reader.root.chain_id, kind=reader.kind,
        optimizer=reader.root.schema["optimizer"]["class"], steps=len(steps),
        first_step=steps[0] if steps else None, latest_step=reader.latest_step, anchors=tuple(s for s, _ in anchors),
        commits=len(reader.records), bytes_on_disk=total, full_checkpoint=full,
        ordinary=OrdinaryInfo(
            anchor_bytes=anchor_bytes, delta_bytes=delta_bytes, log_bytes=total - anchor_bytes - delta_bytes,
            delta_bytes_per_step=delta_bytes / n_deltas if n_deltas else None,
            slot_encodings=dict(sorted(encodings.items())), environment=reader.root.environment,
            capture_policy=_capture_policy(reader)))


def _sharded_info(reader: ShardedReader) -> ChainInfo:
    """What ``ldtools info`` says of a sharded chain (spec section 20)."""
    from ..format.dtypes import parse_dtype
    from ..sharded.chain import commit_numbers

    full = _full_state_or_error(reader, _sharded_full_state)  # first: it may re-read the logs
    steps = reader.steps
    root = reader.root
    laid_out = sum(parse_dtype(lay.dtype).itemsize * _numel(lay.shape) for lay in root.tensors.values())
    per_rank = tuple(reader.ranks[r].bytes_on_disk() if r in reader.ranks else 0 for r in range(root.world_size))
    return ChainInfo(
        path=reader.path, format_version=root.format_version, chain_id=root.chain_id, kind=reader.kind,
        optimizer=reader.ranks[0].root.schema["optimizer"]["class"], steps=len(steps),
        first_step=steps[0] if steps else None, latest_step=reader.latest_step, anchors=tuple(reader.anchors),
        commits=len(commit_numbers(reader.store)), bytes_on_disk=sum(per_rank), full_checkpoint=full,
        sharded=ShardedInfo(
            world_size=root.world_size, mesh_shape=tuple(root.mesh_shape),
            dim_names=None if root.dim_names is None else tuple(root.dim_names), sharded_tensors=len(root.tensors),
            sharded_model_bytes=laid_out, copies=dict(sorted(root.copies.items())),
            pending_steps=tuple(sorted({s for r in reader.ranks.values() for s in r.steps} - set(steps))),
            bytes_per_rank=per_rank))


def _capture_policy(reader: ChainReader) -> dict[str, Any] | None:
    """The anchor interval and batch size a Checkpointer chose, from the latest step's extra state."""
    from ..format.jsonvalue import decode

    latest = reader.latest_step
    if latest is None:
        return None
    entry = reader.state.deltas.get(latest)
    extra = entry[1].extra if entry is not None else reader.state.anchors[latest].extra
    decoded = decode(extra)
    policy = decoded.get("policy") if isinstance(decoded, dict) else None
    return policy if isinstance(policy, dict) else None


# -- a replica's lag -------------------------------------------------------------------------------
def mirror_lag(reader: ChainReader | ShardedReader, mirror: str) -> MirrorLag:
    """How far the replica at ``mirror`` (made by ``ldtools sync`` or ``Checkpointer(mirror=)``)
    lags behind ``reader``'s chain: committed steps and records it lacks, and the age of the
    oldest commit it lacks (by the record's time; 0 when it is up to date). For a sharded chain,
    the commit records of spec §20.12.

    Raises:
        ReplicaDivergedError: ``mirror`` holds another chain.
    """
    from ..chain.reader import ChainReader
    from ..chain.replicate import ReplicaDivergedError

    if not isinstance(reader, ChainReader):
        return _sharded_mirror_lag(reader, mirror)
    replica = ChainReader(mirror)
    if replica.root.chain_id != reader.root.chain_id:
        raise ReplicaDivergedError(
            f"{mirror}: holds another chain (chain_id {replica.root.chain_id}), not a replica of {reader.path} "
            f"(chain_id {reader.root.chain_id})")
    last_seq = replica.records[-1].seq if replica.records else 0
    missing = [(r.seq, r.time) for r in reader.records if r.seq > last_seq]
    ours = reader.records[-1].seq if reader.records else 0
    ahead = len([r for r in replica.records if r.seq > ours])
    return _lag(reader.steps, replica.path, replica.latest_step, missing, ahead)


def _sharded_mirror_lag(reader: ShardedReader, mirror: str) -> MirrorLag:
    from ..chain.replicate import ReplicaDivergedError
    from ..sharded.chain import ShardedReader, open_reader, read_commits

    replica = open_reader(mirror)
    if not isinstance(replica, ShardedReader) or replica.root.chain_id != reader.root.chain_id:
        raise ReplicaDivergedError(f"{mirror}: holds another chain, not a replica of the sharded chain "
                                   f"{reader.path} (chain_id {reader.root.chain_id})")
    last_seq = replica.commit.seq if replica.commit is not None else 0
    missing = [(c.seq, c.time) for c in read_commits(reader.store, reader.path) if c.seq > last_seq]
    ours = reader.commit.seq if reader.commit is not None else 0
    ahead = len([c for c in read_commits(replica.store, replica.path) if c.seq > ours])
    return _lag(reader.steps, replica.path, replica.latest_step, missing, ahead)


def _lag(steps: list[int], mirror: str, theirs: int | None, missing: list[tuple[int, str]],
         ahead: int) -> MirrorLag:
    """The lag of a replica at ``theirs`` that lacks the records ``missing`` (number, time) and
    holds ``ahead`` records the chain lacks."""
    age = None
    if missing:
        oldest = dt.datetime.fromisoformat(missing[0][1].replace("Z", "+00:00"))
        age = max(0.0, (dt.datetime.now(dt.timezone.utc) - oldest).total_seconds())
    return MirrorLag(mirror=mirror, mirror_latest_step=theirs,
                     lag_steps=len([s for s in steps if theirs is None or s > theirs]), lag_records=len(missing),
                     lag_seconds=0.0 if age is None else round(age, 3), ahead_records=ahead)


# -- the commit log --------------------------------------------------------------------------------
def commit_log(reader: ChainReader | ShardedReader) -> list[dict[str, Any]]:
    """The commit records in effect, oldest first, as ``ldtools log --json`` prints them.

    An ordinary chain's records: ``seq``, ``type``, ``reason``, ``time``, ``anchors``,
    ``delta_steps`` (first and last, or None), ``delta_count``, ``segments`` and ``bytes``. A
    sharded chain's global commit records (spec §20.3): ``seq``, ``time``, ``step``, ``writer``.
    """
    from ..chain.reader import ChainReader
    from ..format.manifest import expand, range_count
    from ..sharded.chain import read_commits

    if not isinstance(reader, ChainReader):
        return [{"seq": c.seq, "time": c.time, "step": c.step, "writer": c.writer}
                for c in read_commits(reader.store, reader.path)]
    rows: list[dict[str, Any]] = []
    for r in reader.records:
        # A snapshot's segments list their steps (spec §7.9); their entries are not read here,
        # so its bytes are those of its segment objects and inline entries.
        steps = sorted([s.step for d in r.deltas for s in d.steps]
                       + [step for g in r.segments if g.delta_steps for step in (g.delta_steps[0][0],
                                                                                 g.delta_steps[-1][1])])
        anchors = sorted([a.step for a in r.anchors] + [s for g in r.segments for s in expand(g.anchor_steps)])
        rows.append({
            "seq": r.seq,
            "type": r.type,
            "reason": r.reason,
            "time": r.time,
            "anchors": anchors,
            "delta_steps": [steps[0], steps[-1]] if steps else None,
            # Fewer than the span when the capture runtime captured every k-th step.
            "delta_count": sum(len(d.steps) for d in r.deltas) + sum(range_count(g.delta_steps) for g in r.segments),
            "segments": len(r.segments),
            "bytes": sum(a.object.size for a in r.anchors) + sum(o.size for d in r.deltas for o in d.objects)
            + sum(g.object.size for g in r.segments),
        })
    return rows


# -- where a path stands -----------------------------------------------------------------------------
def sharded_parent(chain: str) -> tuple[str, int] | None:
    """``(sharded chain, rank)`` when ``chain`` is one rank's chain of a sharded chain
    (``<sharded>/ranks/<rank:05d>``), else None (also when that cannot be read)."""
    from ..chain.reader import open_store
    from ..chain.sharded_probe import RANKS_DIR, SHARDED_ROOT, is_sharded
    from ..stores import parse_location

    try:
        loc = parse_location(chain)
        if loc.path is not None:
            here = loc.path
            if re.fullmatch(r"\d{5}", here.name) and here.parent.name == RANKS_DIR and (
                    here.parent.parent / SHARDED_ROOT).is_file():
                return str(here.parent.parent), int(here.name)
            return None
        found = re.match(rf"^(.+)/{RANKS_DIR}/(\d{{5}})/*$", chain)
        if found is not None and is_sharded(open_store(found.group(1), None, None)):
            return found.group(1), int(found.group(2))
    except (OSError, LdformatError):
        pass
    return None


def sharded_world_size(chain: str) -> int | None:
    """The world size of the sharded chain ``chain``; None for any other (or unreadable) path."""
    from ..chain.reader import chain_name, open_store
    from ..chain.sharded_probe import is_sharded
    from ..sharded.chain import read_sharded_root

    try:
        store = open_store(chain, None, None)
        return read_sharded_root(store, chain_name(chain, None)).world_size if is_sharded(store) else None
    except (OSError, LdformatError):
        return None


def check_chain_location(chain: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
    """Refuse a local ``chain`` that is missing or not a directory, as every reader does; a URL
    is not requested.

    Raises:
        NotAChainError: a local path that is missing or not a directory.
        UsageError: an unsupported URL scheme, or ``storage_options`` for a local path.
    """
    from ..chain.reader import open_store

    open_store(chain, None, storage_options)

