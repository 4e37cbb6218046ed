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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..chain.reader import ChainReader, chain_name, open_store
from ..chain.records import create_root_file, io_error, now, numbered, read_bounded, read_root_file, writer_name
from ..chain.sharded_probe import SHARDED_ROOT, is_sharded, rank_location
from ..errors import CorruptChainError, LockLostError, NotAChainError, StepNotFoundError
from ..format.jsonvalue import JSON, parse_json, verify_checksum, with_checksum
from ..format.manifest import KINDS, check_fields, require, require_object
from ..stores import Store
from .layout import Layout, Shard, assemble, check_covered, check_within, overlapping, overlaps_differ, parse_shape

SHARDED_FORMAT = "ldformat-sharded"


COMMIT_FORMAT = "ldformat-sharded-commit"


SHARDED_VERSION = "1.3"


#: A sharded root with ``copies`` (copy ranks, spec §20.2) is format 1.4: 1.3 readers refuse the member.
COPIES_VERSION = "1.4"


COMMITS_DIR = "commits"


MAX_SHARDED_ROOT_BYTES = 16 << 20


MAX_COMMIT_BYTES = 64 << 10


MAX_WORLD_SIZE = 100_000  # rank directories have 5 digits


MAX_DIMS = 64


#: Reads of a sharded chain that a concurrent truncation can restart (spec §20.3.2).
READ_ATTEMPTS = 5


_COMMIT_NAME = re.compile(r"^commits/(\d{12})\.json$")


def commit_path(seq: int) -> str:
    return f"{COMMITS_DIR}/{seq:012d}.json"


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
    #: Copy ranks (spec §20.2 ``copies``): rank -> the lower rank whose rank chain holds its state.
    copies: Mapping[int, int] = field(default_factory=dict)

    @property
    def chain_ranks(self) -> list[int]:
        """The ranks that have a rank chain: every rank but the copy ranks, in increasing order."""
        return [r for r in range(self.world_size) if r not in self.copies]

    def source(self, rank: int) -> int:
        """The rank whose rank chain holds ``rank``'s model and optimizer state."""
        return self.copies.get(rank, rank)

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
        if self.copies:
            doc["copies"] = {str(r): s for r, s in sorted(self.copies.items())}
        return json.dumps(with_checksum(doc), sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> ShardedRoot:
        d = parse_json(data, where, max_bytes=MAX_SHARDED_ROOT_BYTES)
        if not isinstance(d, dict) or d.get("format") != SHARDED_FORMAT:
            raise NotAChainError(f"{where}: not an ldformat sharded root")
        version = require(d, "format_version", str, where)
        m = re.fullmatch(r"1\.(\d+)", version)
        if m is None or int(m.group(1)) < 3:
            raise CorruptChainError(f"{where}: format_version {version!r} is not a sharded format (1.3 or later)")
        verify_checksum(d, where)
        check_fields(d, {"format", "format_version", "chain_id", "created", "kind", "world_size", "mesh",
                          "tensors", "checksum", *(["copies"] if int(m.group(1)) >= 4 else [])}, where)
        kind = require(d, "kind", str, where)
        if kind not in KINDS:
            raise CorruptChainError(f"{where}: unknown delta kind {kind!r}")
        world = require(d, "world_size", int, where)
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise CorruptChainError(f"{where}: world_size {world} is out of range")
        mesh = require_object(d, "mesh", where)
        check_fields(mesh, {"shape", "dim_names"}, f"{where} mesh")
        shape = parse_shape(mesh.get("shape"), f"{where} mesh")
        if not shape or any(n < 1 for n in shape) or _product(shape) != world:
            raise CorruptChainError(f"{where}: mesh shape {list(shape)} does not multiply to world_size {world}")
        names = mesh.get("dim_names")
        if names is not None and (not isinstance(names, list) or len(names) != len(shape)
                                  or not all(isinstance(n, str) for n in names)):
            raise CorruptChainError(f"{where}: mesh dim_names must be null or one string per mesh dimension")
        tensors = {name: _layout(v, world, f"{where} tensors[{name!r}]")
                   for name, v in require_object(d, "tensors", where).items()}
        for name in tensors:
            if not name.startswith("model/"):
                raise CorruptChainError(f"{where}: tensors[{name!r}] is not a model tensor name (model/<FQN>)")
        copies = _copies(d.get("copies", {}), world, tensors, where) if "copies" in d else {}
        return cls(chain_id=require(d, "chain_id", str, where), created=require(d, "created", str, where),
                   kind=kind, world_size=world, mesh_shape=shape,
                   dim_names=None if names is None else tuple(str(n) for n in names), tensors=tensors,
                   format_version=version, copies=copies)


def copy_ranks(world: int, tensors: Mapping[str, Layout]) -> dict[int, int]:
    """The copy ranks of a layout (spec §20.2 ``copies``): each rank whose block of every laid-out
    tensor equals that of a lower rank, mapped to the lowest such rank. Without laid-out tensors
    no rank is a copy (nothing tells the ranks apart, and nothing says they hold the same state)."""
    if not tensors:
        return {}
    first: dict[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], int] = {}
    out = {}
    for r in range(world):
        blocks = []
        for name in sorted(tensors):
            shard = tensors[name].of_rank(r)
            assert shard is not None  # layout rule 2: one shard per rank
            blocks.append((shard.offsets, shard.lengths))
        s = first.setdefault(tuple(blocks), r)
        if s != r:
            out[r] = s
    return out


def _copies(v: JSON, world: int, tensors: Mapping[str, Layout], where: str) -> dict[int, int]:
    """Parse and check ``copies`` (spec §20.2): rank ``r`` -> a lower rank ``s`` that is no copy
    itself, whose block of every laid-out tensor is ``r``'s."""
    if not isinstance(v, dict) or not v or not tensors:
        raise CorruptChainError(f"{where}: copies must be a non-empty object (rank -> source rank), "
                                "and needs laid-out tensors")
    out = {}
    for key, src in v.items():
        if not re.fullmatch(r"0|[1-9]\d*", key) or not isinstance(src, int) or isinstance(src, bool):
            raise CorruptChainError(f"{where}: copies[{key!r}] must map a decimal rank to a rank")
        out[int(key)] = src
    for r, src in sorted(out.items()):
        if not 0 <= src < r < world or src in out:
            raise CorruptChainError(f"{where}: copies[{str(r)!r}] = {src}: a copy rank's source must be a lower "
                                    f"rank of the world of {world} that is no copy itself")
        for name, layout in sorted(tensors.items()):
            a, b = layout.of_rank(r), layout.of_rank(src)
            if a is None or b is None or (a.offsets, a.lengths) != (b.offsets, b.lengths):
                raise CorruptChainError(f"{where}: copies[{str(r)!r}] = {src}, but the ranks hold different "
                                        f"blocks of {name}")
    return out


def _product(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _layout(v: JSON, world: int, where: str) -> Layout:
    from ..format.jsonvalue import parse_dtype

    if not isinstance(v, dict):
        raise CorruptChainError(f"{where}: not an object")
    check_fields(v, {"dtype", "shape", "shards"}, where)
    dtype = require(v, "dtype", str, where)
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
        check_fields(s, {"rank", "offsets", "lengths"}, where)
        rank = require(s, "rank", int, where)
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
        check_fields(d, {"format", "seq", "step", "prev", "time", "writer", "checksum"}, where)
        seq, step = require(d, "seq", int, where), require(d, "step", int, where)
        prev = d.get("prev")
        if seq < 1 or step < 0 or not (prev is None or isinstance(prev, str)):
            raise CorruptChainError(f"{where}: malformed seq, step or prev")
        return cls(seq=seq, step=step, prev=prev, time=require(d, "time", str, where),
                   writer=require(d, "writer", str, where), checksum=require(d, "checksum", str, where))


def read_sharded_root(store: Store, where: str) -> ShardedRoot:
    data = read_root_file(store, SHARDED_ROOT, MAX_SHARDED_ROOT_BYTES, where, "a sharded ldformat chain")
    return ShardedRoot.from_bytes(data, f"{where}/{SHARDED_ROOT}")


def create_sharded_root(store: Store, root: ShardedRoot, where: str) -> None:
    create_root_file(store, SHARDED_ROOT, root.to_bytes(), where, "sharded chain")


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
    """Every commit record, checked: consecutive numbers and linked checksums (a record that
    truncates may name an earlier step than the one before it, spec §20.3.1)."""
    out: list[Commit] = []
    for expected, seq in enumerate(commit_numbers(store), start=1):
        if seq != expected:
            raise CorruptChainError(f"{where}/{commit_path(expected)}: commit record missing (the log jumps to {seq})")
        c = read_commit(store, seq, where)
        if out and c.prev != out[-1].checksum:
            raise CorruptChainError(f"{where}/{commit_path(seq)}: prev does not match record {seq - 1}")
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

    def __init__(self, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                 replay_device: torch.device | str | None = None) -> None:
        self.path = chain_name(path, None)
        self._location, self._options = path, storage_options
        self._replay_device = replay_device
        self.store = open_store(path, None, storage_options)
        self.root = read_sharded_root(self.store, self.path)
        self.refresh()

    def refresh(self) -> None:
        """Read the newest commit record and every rank chain's log again."""
        if self.store.exists("ldformat.json"):
            raise CorruptChainError(f"{self.path}: holds both {SHARDED_ROOT} and ldformat.json (spec §20.1)")
        self.commit = newest_commit(self.store, self.path)
        #: The rank chains, by rank: every rank but the copy ranks (spec §20.2 ``copies``).
        self.ranks: dict[int, ChainReader] = {}
        for r in self.root.chain_ranks:
            location = rank_location(self._location, r)
            try:
                self.ranks[r] = ChainReader(location, storage_options=self._options, replay_device=self._replay_device)
            except NotAChainError as e:
                raise CorruptChainError(f"{location}: rank {r}'s chain of the sharded chain {self.path} is "
                                        f"missing or unreadable ({e})") from None
        for r, reader in self.ranks.items():
            if reader.kind != self.root.kind:
                raise CorruptChainError(f"{reader.path}: rank {r}'s chain has kind {reader.kind}, "
                                        f"the sharded chain {self.root.kind}")

    def truncated_since(self, step: int) -> bool:
        """Whether a record newer than the one read names a step below ``step`` (spec §20.3.2 rule 5):
        a truncation ran meanwhile, and what was read may mix two versions of the chain."""
        seq = 0 if self.commit is None else self.commit.seq
        while True:
            seq += 1
            try:
                newer = read_commit(self.store, seq, self.path)
            except FileNotFoundError:
                return False
            if newer.step < step:
                return True

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
        for reader in self.ranks.values():
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
        for reader in self.ranks.values():
            common &= set(reader.anchors)
        return sorted(common & steps)

    def bytes_on_disk(self) -> int:
        return sum(r.bytes_on_disk() for r in self.ranks.values())

    def check_step(self, step: int | None) -> int:
        steps = self.steps
        if step is None:
            if not steps:
                from ..errors import EmptyChainError

                raise EmptyChainError(f"{self.path}: the chain has no committed step yet")
            return steps[-1]
        if step not in steps:
            raise StepNotFoundError(f"{self.path}: step {step} is not a committed step of the sharded chain "
                                    f"(committed: {len(steps)} steps, latest {steps[-1] if steps else None})")
        return step

    def materialize_ranks(self, step: int | None = None, progress: Callable[[int, int], None] | None = None,
                          ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Each rank chain's state at ``step`` (local shards), as :meth:`ChainReader.materialize`
        gives it, for every rank chain or for ``ranks``, in that order; a copy rank's is its
        source's (spec §20.2 ``copies``), read once."""
        wanted = self.root.chain_ranks if ranks is None else list(ranks)
        for _attempt in range(READ_ATTEMPTS):
            target = self.check_step(step)
            read: dict[int, dict[str, Any]] = {}
            for n, r in enumerate(wanted, 1):
                src = self.root.source(r)
                if src not in read:
                    read[src] = self.ranks[src].materialize(target)
                if progress is not None:
                    progress(n, len(wanted))
            out = [read[self.root.source(r)] for r in wanted]
            if not self.truncated_since(target):
                return out
            self.refresh()
        raise CorruptChainError(f"{self.path}: the chain was truncated {READ_ATTEMPTS} times while it was read; "
                                "read it again when its maintenance is over")

    def materialize(self, step: int | None = None, *,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """The full unsharded state after ``step`` (default: the latest committed step).

        Returns ``{"model", "optimizer", "step", "extra", "rank_extra"}`` as
        :meth:`ChainReader.materialize` does for one process: model keys are FQNs, the
        optimizer state is in ``optimizer.state_dict()`` layout with parameter indices;
        ``extra`` is rank 0's and ``rank_extra`` every rank's (RNG states, data position).
        """
        step = self.check_step(step)
        parts = self.materialize_ranks(step, progress, ranks=range(self.world_size))  # a copy rank's: its source's
        state = assemble_state(self.root, dict(enumerate(parts)), f"{self.path} (step {step})",
                               self.ranks[0].root.schema)
        state["rank_extra"] = [extra_of_rank(state["extra"], r) if r in self.root.copies else own
                               for r, own in enumerate(state["rank_extra"])]
        return state

    def extra_of(self, rank: int, step: int) -> dict[str, Any] | None:
        """Rank ``rank``'s ``extra`` at ``step`` (spec §20.6): its rank chain's, or, for a copy
        rank, rank chain 0's with that rank's RNG states and data position (None when rank
        chain 0 does not hold them)."""
        if rank in self.ranks:
            return self.ranks[rank].extra(step)
        return extra_of_rank(self.ranks[0].extra(step), rank)


def extra_of_rank(extra: Mapping[str, Any], rank: int) -> dict[str, Any] | None:
    """``extra`` (rank 0's) with rank ``rank``'s RNG states and data position from its ``ranks``
    member (spec §19.1), as that rank's own; None when ``ranks`` does not hold the rank."""
    ranks = extra.get("ranks")
    mine = ranks.get(str(rank)) if isinstance(ranks, dict) else None
    if not isinstance(mine, dict):
        return None
    out = dict(extra)
    if "rng" in mine:
        out["rng"] = mine["rng"]
    out["data"] = mine.get("data")
    return out


Region = tuple[tuple[int, ...], tuple[int, ...]]


"""(offsets, lengths) of a block of a global tensor."""


def assemble_state(root: ShardedRoot, parts: Mapping[int, dict[str, Any]], where: str,
                   schema: Mapping[str, Any], *, primary: int = 0,
                   regions: Mapping[str, Region] | None = None) -> dict[str, Any]:
    """The full state from the ranks' local states (spec §20.4), or, with ``regions``
    (model name -> block), only those blocks of the laid-out tensors and of the optimizer
    state sharded like them: what one rank of a resharded job needs (spec §20.6).

    ``parts`` maps rank -> :meth:`ChainReader.materialize` of its rank chain; it must hold
    every rank whose shard overlaps a block asked for. Replicated tensors, the optimizer
    structure and the param groups are ``primary``'s (identical in every rank chain); where
    blocks overlap the first listed shard wins; validation compares copies
    (:func:`replica_problems`).
    """
    first = parts[primary]
    wanted = regions or {}

    def block(stored: str, name: str, layout: Layout | None, pick: Callable[[dict[str, Any]], Any]) -> Any:
        if layout is None:
            return pick(first)
        return assemble(layout, {r: pick(p) for r, p in parts.items() if r in overlapping(layout, wanted.get(name))},
                        f"{where} {stored}", wanted.get(name))

    aliases = {e["name"]: e["alias_of"] for e in schema["model"] if e.get("alias_of") is not None}
    full = {name: block(f"model/{name}", name, root.tensors.get(f"model/{name}"), _model_tensor(name))
            for name in first["model"] if name not in aliases}
    model = {name: full[aliases.get(name, name)] for name in first["model"]}  # tied weights stay one tensor
    optimizer = dict(first["optimizer"])
    names: list[str] = list(schema["optimizer"]["params"])
    state = {}
    for key, value in first["optimizer"].get("state", {}).items():
        if not (isinstance(key, int) and 0 <= key < len(names) and isinstance(value, dict)):
            state[key] = value
            continue
        name = names[key]
        layout = root.tensors.get(f"model/{name}")
        entry = {}
        for k, v in value.items():
            sharded = (layout is not None and layout.split and isinstance(v, torch.Tensor)
                       and all(isinstance(t := p["optimizer"]["state"][key][k], torch.Tensor)
                               and (s := layout.of_rank(r)) is not None and tuple(t.shape) == s.lengths
                               for r, p in parts.items()))
            if isinstance(v, torch.Tensor):
                entry[k] = block(f"optimizer/{key}/{k}", name, layout if sharded else None, _state_tensor(key, k))
            else:
                entry[k] = v
        state[key] = entry
    if "state" in optimizer:
        optimizer["state"] = state
    result: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": first["step"], "extra": first["extra"]}
    if regions is None:
        result["rank_extra"] = [parts[r]["extra"] for r in sorted(parts)]
        if "compressor" in first:  # top-k residuals, flat per parameter: per shard, then as the full flat tensor
            result["compressor"] = {n: _residual(root, n, [parts[r]["compressor"][n] for r in sorted(parts)], where)
                                    for n in first["compressor"]}
    return result


def _model_tensor(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda part: part["model"][name]


def _state_tensor(index: int, key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda part: part["optimizer"]["state"][index][key]


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


def replica_problems(root: ShardedRoot, schema: Mapping[str, Any], tensors: Mapping[int, Mapping[str, torch.Tensor]]
                     ) -> list[str]:
    """What differs between the rank chains' stored tensors of one step, by rank (spec §20.7
    checks 4 and 5): names and dtypes, overlapping blocks of laid-out tensors, replicated tensors
    other than buffers."""
    from ..format.state import bits_view

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits_view(a.contiguous()),
                                                                         bits_view(b.contiguous()))

    problems = []
    base = tensors[0]
    names = {n for n in base if not n.startswith(("compressor/", "optimizer/ref/"))}
    # Buffers are per rank (spec §20.4 item 3): FSDP2 does not synchronize BatchNorm statistics.
    own = {f"model/{e['name']}" for e in schema["model"] if e.get("role") == "buffer"}
    for r, t in tensors.items():
        if r == 0:
            continue
        mine = {n for n in t if not n.startswith(("compressor/", "optimizer/ref/"))}
        if mine != names:
            problems.append(f"rank {r} stores other tensors than rank 0 ({sorted(mine ^ names)[0]})")
        for n in mine & names:
            if t[n].dtype != base[n].dtype:
                problems.append(f"rank {r} stores {n} as {t[n].dtype}, rank 0 as {base[n].dtype}")
    params: list[str] = list(schema["optimizer"]["params"])
    for name in sorted(names):
        pieces = {r: t.get(name) for r, t in tensors.items()}
        if any(p is None for p in pieces.values()):
            continue
        by_rank = {r: p for r, p in pieces.items() if p is not None}
        layout = root.tensors.get(name)
        if name.startswith("optimizer/"):
            index = name.split("/")[1]
            param = params[int(index)] if index.isdigit() and int(index) < len(params) else None
            candidate = root.tensors.get(f"model/{param}") if param is not None else None
            if candidate is not None and candidate.split and all(
                    (s := candidate.of_rank(r)) is not None and tuple(p.shape) == s.lengths
                    for r, p in by_rank.items()):
                layout = candidate
        if layout is not None:
            differ = overlaps_differ(layout, by_rank)
            if differ:
                problems.append(f"rank {differ[0]}'s copy of a replicated block of {name} differs from an "
                                "earlier rank's")
        elif name not in own:
            for r, p in by_rank.items():
                if r and not same(p, by_rank[0]):
                    problems.append(f"rank {r}'s copy of the replicated tensor {name} differs from rank 0's")
                    break
    return problems


def open_reader(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                replay_device: torch.device | str | None = None) -> ChainReader | ShardedReader:
    """A reader for the chain at ``path``: :class:`ShardedReader` for a sharded chain (spec §20),
    else :class:`ChainReader` (``replay_device``: see :class:`ChainReader`)."""
    store = open_store(path, None, storage_options)
    if is_sharded(store):
        return ShardedReader(path, storage_options=storage_options, replay_device=replay_device)
    return ChainReader(path, storage_options=storage_options, replay_device=replay_device)
