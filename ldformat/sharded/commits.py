"""The files of a sharded chain besides its rank chains (spec §20.2, §20.3 "Commits"): the
sharded root ``sharded.json`` (:class:`ShardedRoot`) and the global commit records
``commits/<seq:012d>.json`` (:class:`Commit`), parsed, checked, read and created.

This module does no tensor work: reading a sharded chain's state is :mod:`.chain`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..chain.records import create_root_file, io_error, now, numbered, read_bounded, read_root_file, writer_name
from ..chain.sharded_probe import SHARDED_ROOT
from ..errors import CorruptChainError, LockLostError, NotAChainError
from ..format.checksum import verify_checksum, with_checksum
from ..format.jsonvalue import JSON, parse_json
from ..format.manifest import KINDS, check_fields, require, require_object
from ..stores import Store
from .layout import Layout, Shard, check_covered, check_within, parse_shape

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
        if not shape or any(n < 1 for n in shape) or element_count(shape) != world:
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


def element_count(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _layout(v: JSON, world: int, where: str) -> Layout:
    from ..format.dtypes import parse_dtype

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
