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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..chain.reader import ChainReader, chain_name, open_store
from ..chain.sharded_probe import SHARDED_ROOT, is_sharded, rank_location
from ..errors import CorruptChainError, NotAChainError, StepNotFoundError
from .commits import (
    COMMIT_FORMAT,
    COMMITS_DIR,
    COPIES_VERSION,
    MAX_COMMIT_BYTES,
    MAX_DIMS,
    MAX_SHARDED_ROOT_BYTES,
    MAX_WORLD_SIZE,
    SHARDED_FORMAT,
    SHARDED_VERSION,
    Commit,
    ShardedRoot,
    commit_numbers,
    commit_path,
    copy_ranks,
    create_commit,
    create_sharded_root,
    element_count,
    newest_commit,
    read_commit,
    read_commits,
    read_sharded_root,
)
from .layout import Layout, assemble, overlapping, overlaps_differ

#: The sharded root and the commit records are :mod:`.commits`; their names are imported from here
#: as before.
__all__ = ["COMMITS_DIR", "COMMIT_FORMAT", "COPIES_VERSION", "MAX_COMMIT_BYTES", "MAX_DIMS",
           "MAX_SHARDED_ROOT_BYTES", "MAX_WORLD_SIZE", "READ_ATTEMPTS", "SHARDED_FORMAT", "SHARDED_VERSION",
           "Commit", "Region", "ShardedReader", "ShardedRoot", "assemble_state", "commit_numbers",
           "commit_path", "copy_ranks", "create_commit", "create_sharded_root", "extra_of_rank",
           "newest_commit", "open_reader", "read_commit", "read_commits", "read_sharded_root",
           "replica_problems"]

#: Reads of a sharded chain that a concurrent truncation can restart (spec §20.3.2).
READ_ATTEMPTS = 5



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
        if shard is None or t.numel() != element_count(shard.lengths):
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
