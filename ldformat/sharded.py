"""Sharded chains (spec §20): one ordinary chain per rank, a layout, and global commit records.

A sharded chain at ``<chain>`` is

- ``sharded.json``: the layout (:class:`ShardedRoot`), created once by rank 0;
- ``ranks/<rank:05d>/``: an ordinary chain per rank holding that rank's local tensors;
- ``commits/<seq:012d>.json``: global commit records (:class:`Commit`), each created
  exclusively by rank 0 once every rank chain holds the step it names durably.

A step is committed when it is at most the newest commit's step and committed in every rank
chain: all ranks or none. :class:`ShardedReader` assembles the full unsharded state.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptChainError, LockLostError, NotAChainError, StepNotFoundError
from .jsonvalue import JSON, parse_json, verify_checksum, with_checksum
from .log import io_error, now, numbered, read_bounded, writer_name
from .manifest import KINDS, _check_fields, _require, _require_object
from .reader import ChainReader, chain_name, open_store
from .shards import Layout, Shard, assemble, check_covered, check_within, overlaps_differ, parse_shape
from .stores import Store, parse_location

SHARDED_ROOT = "sharded.json"
SHARDED_FORMAT = "ldformat-sharded"
COMMIT_FORMAT = "ldformat-sharded-commit"
SHARDED_VERSION = "1.3"
COMMITS_DIR = "commits"
RANKS_DIR = "ranks"
MAX_SHARDED_ROOT_BYTES = 16 << 20
MAX_COMMIT_BYTES = 64 << 10
MAX_WORLD_SIZE = 1 << 20
MAX_DIMS = 64
_COMMIT_NAME = re.compile(r"^commits/(\d{12})\.json$")


def rank_location(path: str | os.PathLike[str], rank: int) -> str:
    """Where rank ``rank``'s chain of the sharded chain at ``path`` lives (a path or a URL)."""
    loc = parse_location(path)
    if loc.path is not None:
        return str(loc.path / RANKS_DIR / f"{rank:05d}")
    return f"{str(path).rstrip('/')}/{RANKS_DIR}/{rank:05d}"


def commit_path(seq: int) -> str:
    return f"{COMMITS_DIR}/{seq:012d}.json"


def is_sharded(store: Store) -> bool:
    try:
        return store.exists(SHARDED_ROOT)
    except OSError:
        return False


@dataclass(frozen=True)
class ShardedRoot:
    """``sharded.json``: kind, world size, mesh and the layout of every split tensor."""

    chain_id: str
    created: str
    kind: str
    world_size: int
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    tensors: dict[str, Layout]
    format_version: str = SHARDED_VERSION

    def to_bytes(self) -> bytes:
        import json

        doc: dict[str, JSON] = {
            "format": SHARDED_FORMAT,
            "format_version": self.format_version,
            "chain_id": self.chain_id,
            "created": self.created,
            "kind": self.kind,
            "world_size": self.world_size,
            "mesh": {"shape": list(self.mesh_shape),
                     "dim_names": None if self.dim_names is None else list(self.dim_names)},
            "tensors": {n: lay.to_dict() for n, lay in sorted(self.tensors.items())},
        }
        return json.dumps(with_checksum(doc), sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ShardedRoot:
        d = parse_json(data, where, max_bytes=MAX_SHARDED_ROOT_BYTES)
        if not isinstance(d, dict) or d.get("format") != SHARDED_FORMAT:
            raise NotAChainError(f"{where}: not an ldformat sharded root")
        version = _require(d, "format_version", str, where)
        m = re.fullmatch(r"1\.(\d+)", version)
        if m is None or int(m.group(1)) < 3:
            raise CorruptChainError(f"{where}: format_version {version!r} is not a sharded format (1.3 or later)")
        verify_checksum(d, where)
        _check_fields(d, {"format", "format_version", "chain_id", "created", "kind", "world_size", "mesh",
                          "tensors", "checksum"}, where)
        kind = _require(d, "kind", str, where)
        if kind not in KINDS:
            raise CorruptChainError(f"{where}: unknown delta kind {kind!r}")
        world = _require(d, "world_size", int, where)
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise CorruptChainError(f"{where}: world_size {world} is out of range")
        mesh = _require_object(d, "mesh", where)
        _check_fields(mesh, {"shape", "dim_names"}, f"{where} mesh")
        shape = parse_shape(mesh.get("shape"), f"{where} mesh")
        if not shape or any(n < 1 for n in shape) or _product(shape) != world:
            raise CorruptChainError(f"{where}: mesh shape {list(shape)} does not multiply to world_size {world}")
        names = mesh.get("dim_names")
        if names is not None and (not isinstance(names, list) or len(names) != len(shape)
                                  or not all(isinstance(n, str) for n in names)):
            raise CorruptChainError(f"{where}: mesh dim_names must be null or one string per mesh dimension")
        tensors = {name: _layout(v, world, f"{where} tensors[{name!r}]")
                   for name, v in _require_object(d, "tensors", where).items()}
        for name in tensors:
            if not name.startswith("model/"):
                raise CorruptChainError(f"{where}: tensors[{name!r}] is not a model tensor name (model/<FQN>)")
        return cls(chain_id=_require(d, "chain_id", str, where), created=_require(d, "created", str, where),
                   kind=kind, world_size=world, mesh_shape=shape,
                   dim_names=None if names is None else tuple(str(n) for n in names), tensors=tensors,
                   format_version=version)


def _product(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _layout(v: JSON, world: int, where: str) -> Layout:
    from .jsonvalue import parse_dtype

    if not isinstance(v, dict):
        raise CorruptChainError(f"{where}: not an object")
    _check_fields(v, {"dtype", "shape", "shards"}, where)
    dtype = _require(v, "dtype", str, where)
    try:
        parse_dtype(dtype)
    except Exception:
        raise CorruptChainError(f"{where}: unknown dtype {dtype!r}") from None
    shape = parse_shape(v.get("shape"), where)
    if len(shape) > MAX_DIMS:
        raise CorruptChainError(f"{where}: {len(shape)} dimensions, more than {MAX_DIMS}")
    shards_json = v.get("shards")
    if not isinstance(shards_json, list) or not shards_json:
        raise CorruptChainError(f"{where}: shards must be a non-empty list")
    shards = []
    for s in shards_json:
        if not isinstance(s, dict):
            raise CorruptChainError(f"{where}: a shard is not an object")
        _check_fields(s, {"rank", "offsets", "lengths"}, where)
        rank = _require(s, "rank", int, where)
        if not 0 <= rank < world:
            raise CorruptChainError(f"{where}: shard rank {rank} is outside the world of {world}")
        shard = Shard(rank, parse_shape(s.get("offsets"), where), parse_shape(s.get("lengths"), where))
        check_within(shape, shard, where)
        shards.append(shard)
    if len({s.rank for s in shards}) != len(shards):
        raise CorruptChainError(f"{where}: a rank is listed twice")
    check_covered(shape, shards, where)
    return Layout(dtype, shape, tuple(shards))


@dataclass(frozen=True)
class Commit:
    """One global commit record: every rank chain holds ``step`` durably."""

    seq: int
    step: int
    prev: str | None
    time: str
    writer: str
    checksum: str = ""

    def to_bytes(self) -> bytes:
        import json

        doc: dict[str, JSON] = {"format": COMMIT_FORMAT, "seq": self.seq, "step": self.step, "prev": self.prev,
                                "time": self.time, "writer": self.writer}
        return json.dumps(with_checksum(doc), sort_keys=True, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Commit:
        d = parse_json(data, where, max_bytes=MAX_COMMIT_BYTES)
        if not isinstance(d, dict) or d.get("format") != COMMIT_FORMAT:
            raise CorruptChainError(f"{where}: not a sharded commit record")
        verify_checksum(d, where)
        _check_fields(d, {"format", "seq", "step", "prev", "time", "writer", "checksum"}, where)
        seq, step = _require(d, "seq", int, where), _require(d, "step", int, where)
        prev = d.get("prev")
        if seq < 1 or step < 0 or not (prev is None or isinstance(prev, str)):
            raise CorruptChainError(f"{where}: malformed seq, step or prev")
        return cls(seq=seq, step=step, prev=prev, time=_require(d, "time", str, where),
                   writer=_require(d, "writer", str, where), checksum=_require(d, "checksum", str, where))


def read_sharded_root(store: Store, where: str) -> ShardedRoot:
    try:
        data = read_bounded(store, SHARDED_ROOT, MAX_SHARDED_ROOT_BYTES, f"{where}/{SHARDED_ROOT}")
    except FileNotFoundError:
        raise NotAChainError(f"{where}: not a sharded ldformat chain (no {SHARDED_ROOT})") from None
    return ShardedRoot.from_bytes(data, f"{where}/{SHARDED_ROOT}")


def create_sharded_root(store: Store, root: ShardedRoot, where: str) -> None:
    try:
        store.create_exclusive(SHARDED_ROOT, root.to_bytes())
    except FileExistsError:
        from .errors import ChainExistsError

        raise ChainExistsError(f"{where}: another process created a sharded chain here concurrently") from None
    except OSError as e:
        raise io_error(f"{where}/{SHARDED_ROOT}: cannot create the sharded chain", e) from None


def commit_numbers(store: Store) -> list[int]:
    return numbered(store, COMMITS_DIR, _COMMIT_NAME)


def read_commit(store: Store, seq: int, where: str) -> Commit:
    path = commit_path(seq)
    commit = Commit.from_bytes(read_bounded(store, path, MAX_COMMIT_BYTES, f"{where}/{path}"), f"{where}/{path}")
    if commit.seq != seq:
        raise CorruptChainError(f"{where}/{path}: the record says seq {commit.seq}")
    return commit


def newest_commit(store: Store, where: str) -> Commit | None:
    """The newest global commit record (only it is read: it alone says what is committed)."""
    seqs = commit_numbers(store)
    return read_commit(store, seqs[-1], where) if seqs else None


def read_commits(store: Store, where: str) -> list[Commit]:
    """Every commit record, checked: consecutive numbers, linked checksums, steps never decreasing."""
    out: list[Commit] = []
    for expected, seq in enumerate(commit_numbers(store), start=1):
        if seq != expected:
            raise CorruptChainError(f"{where}/{commit_path(expected)}: commit record missing (the log jumps to {seq})")
        c = read_commit(store, seq, where)
        if out and (c.prev != out[-1].checksum or c.step < out[-1].step):
            raise CorruptChainError(f"{where}/{commit_path(seq)}: prev does not match record {seq - 1}, or its step "
                                    "goes back")
        if not out and c.prev is not None:
            raise CorruptChainError(f"{where}/{commit_path(seq)}: the first record has a prev checksum")
        out.append(c)
    return out


def create_commit(store: Store, where: str, step: int, previous: Commit | None) -> Commit:
    """Create the next commit record exclusively; an existing one means another writer took over."""
    commit = Commit(seq=1 if previous is None else previous.seq + 1, step=step,
                    prev=None if previous is None else previous.checksum, time=now(), writer=writer_name())
    data = commit.to_bytes()
    path = commit_path(commit.seq)
    try:
        store.create_exclusive(path, data)
    except FileExistsError:
        raise LockLostError(f"{where}/{path}: another writer committed this record; this writer stops "
                            "(re-open the chain to continue)") from None
    except OSError as e:
        raise io_error(f"{where}/{path}: cannot create the commit record; the chain is unchanged", e) from None
    return Commit.from_bytes(data, f"{where}/{path}")


class ShardedReader:
    """Reads a sharded chain: committed steps, and the full unsharded state of any of them."""

    def __init__(self, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
        self.path = chain_name(path, None)
        self.store = open_store(path, None, storage_options)
        self.root = read_sharded_root(self.store, self.path)
        self.commit = newest_commit(self.store, self.path)
        self.ranks = [ChainReader(rank_location(path, r), storage_options=storage_options)
                      for r in range(self.root.world_size)]
        for r, reader in enumerate(self.ranks):
            if reader.kind != self.root.kind:
                raise CorruptChainError(f"{reader.path}: rank {r}'s chain has kind {reader.kind}, "
                                        f"the sharded chain {self.root.kind}")

    @property
    def kind(self) -> str:
        return self.root.kind

    @property
    def world_size(self) -> int:
        return self.root.world_size

    @property
    def steps(self) -> list[int]:
        """Committed steps: at most the newest commit's step, and in every rank chain."""
        if self.commit is None:
            return []
        common = set(self.ranks[0].steps)
        for reader in self.ranks[1:]:
            common &= set(reader.steps)
        return sorted(s for s in common if s <= self.commit.step)

    @property
    def latest_step(self) -> int | None:
        steps = self.steps
        return steps[-1] if steps else None

    @property
    def anchors(self) -> list[int]:
        """Steps that are an anchor in every rank chain."""
        steps = set(self.steps)
        common = set(self.ranks[0].anchors)
        for reader in self.ranks[1:]:
            common &= set(reader.anchors)
        return sorted(common & steps)

    def bytes_on_disk(self) -> int:
        return sum(r.bytes_on_disk() for r in self.ranks)

    def check_step(self, step: int | None) -> int:
        steps = self.steps
        if step is None:
            if not steps:
                from .errors import EmptyChainError

                raise EmptyChainError(f"{self.path}: the chain has no committed step yet")
            return steps[-1]
        if step not in steps:
            raise StepNotFoundError(f"{self.path}: step {step} is not a committed step of the sharded chain "
                                    f"(committed: {len(steps)} steps, latest {steps[-1] if steps else None})")
        return step

    def materialize_ranks(self, step: int | None = None,
                          progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """Every rank's own state at ``step`` (local shards), as :meth:`ChainReader.materialize` gives it."""
        step = self.check_step(step)
        out = []
        for r, reader in enumerate(self.ranks):
            out.append(reader.materialize(step))
            if progress is not None:
                progress(r + 1, len(self.ranks))
        return out

    def materialize(self, step: int | None = None, *,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """The full unsharded state after ``step`` (default: the latest committed step).

        Returns ``{"model", "optimizer", "step", "extra", "rank_extra"}`` as
        :meth:`ChainReader.materialize` does for one process: model keys are FQNs, the
        optimizer state is in ``optimizer.state_dict()`` layout with parameter indices;
        ``extra`` is rank 0's and ``rank_extra`` every rank's (RNG states, data position).
        """
        step = self.check_step(step)
        parts = self.materialize_ranks(step, progress)
        return assemble_state(self.root, parts, f"{self.path} (step {step})", self.ranks[0].root.schema)


def assemble_state(root: ShardedRoot, parts: list[dict[str, Any]], where: str,
                   schema: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """The full state from every rank's local state (spec §20.4).

    Replicated copies are taken from the first rank listed (rank 0 for tensors outside the
    layout); ``strict`` (validation) raises CorruptChainError where another copy differs.
    """
    first = parts[0]
    full: dict[int, torch.Tensor] = {}  # id of rank 0's tensor -> the assembled one (keeps tied weights tied)

    def whole(name: str, pieces: list[torch.Tensor], layout: Layout | None) -> torch.Tensor:
        w = f"{where} {name}"
        if layout is None:
            if strict:
                _check_replicated(pieces, w)
            return pieces[0]
        by_rank = dict(enumerate(pieces))
        if strict and overlaps_differ(layout, by_rank):
            raise CorruptChainError(f"{w}: rank {overlaps_differ(layout, by_rank)[0]}'s replicated copy differs "
                                    "from an earlier rank's")
        return assemble(layout, by_rank, w)

    model = {}
    for name, t in first["model"].items():
        if id(t) not in full:
            full[id(t)] = whole(f"model/{name}", [p["model"][name] for p in parts], root.tensors.get(f"model/{name}"))
        model[name] = full[id(t)]
    optimizer = dict(first["optimizer"])
    names: list[str] = list(schema["optimizer"]["params"])
    state = {}
    for key, value in first["optimizer"].get("state", {}).items():
        if not (isinstance(key, int) and 0 <= key < len(names) and isinstance(value, dict)):
            state[key] = value
            continue
        layout = root.tensors.get(f"model/{names[key]}")
        entry = {}
        for k, v in value.items():
            pieces = [p["optimizer"]["state"][key][k] for p in parts]
            sharded = (layout is not None and layout.split and isinstance(v, torch.Tensor)
                       and all(isinstance(t, torch.Tensor) and (s := layout.of_rank(r)) is not None
                               and tuple(t.shape) == s.lengths for r, t in enumerate(pieces)))
            if isinstance(v, torch.Tensor):
                entry[k] = whole(f"optimizer/{key}/{k}", pieces, layout if sharded else None)
            else:
                entry[k] = v
        state[key] = entry
    if "state" in optimizer:
        optimizer["state"] = state
    result: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": first["step"],
                              "extra": first["extra"], "rank_extra": [p["extra"] for p in parts]}
    if "compressor" in first:  # top-k residuals, flat per parameter: per shard, then as the full flat tensor
        result["compressor"] = {n: _residual(root, n, [p["compressor"][n] for p in parts], where)
                                for n in first["compressor"]}
    return result


def _residual(root: ShardedRoot, name: str, pieces: list[torch.Tensor], where: str) -> torch.Tensor:
    layout = root.tensors.get(f"model/{name}")
    if layout is None:
        return pieces[0]
    shaped = {}
    for r, t in enumerate(pieces):
        shard = layout.of_rank(r)
        if shard is None or t.numel() != _product(shard.lengths):
            raise CorruptChainError(f"{where} compressor/{name}: rank {r}'s residuals do not match its shard")
        shaped[r] = t.reshape(shard.lengths)
    return assemble(layout, shaped, f"{where} compressor/{name}").reshape(-1)


def _check_replicated(pieces: list[Any], where: str) -> None:
    from .state import bits_view

    base = pieces[0]
    for r, t in enumerate(pieces[1:], start=1):
        if not isinstance(t, torch.Tensor) or t.shape != base.shape or t.dtype != base.dtype or not torch.equal(
                bits_view(t.contiguous()), bits_view(base.contiguous())):
            raise CorruptChainError(f"{where}: rank {r}'s copy of a replicated tensor differs from rank 0's")


def open_reader(path: str | os.PathLike[str], *,
                storage_options: dict[str, Any] | None = None) -> ChainReader | ShardedReader:
    """A reader for the chain at ``path``: :class:`ShardedReader` for a sharded chain (spec §20),
    else :class:`ChainReader`."""
    store = open_store(path, None, storage_options)
    if is_sharded(store):
        return ShardedReader(path, storage_options=storage_options)
    return ChainReader(path, storage_options=storage_options)

