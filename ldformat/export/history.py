"""The flight recorder: what every step of a chain did to the model (spec §11.5-§11.6 replay,
§19.1 ``scalars``).

:func:`step_history` replays a range of a chain once and yields one :class:`StepStats` per
step: the scalars the training loop logged (``Checkpointer.log``), the learning rates the
step used, per group of parameters (module prefix) the update ``‖w_t − w_{t−1}‖``, the
relative update ``‖Δw‖/‖w‖``, the weight norm and Adam's ``exp_avg_sq`` statistics, the
bytes the step took, and whether its loss or relative update jumped (:class:`SpikeDetector`).
Every number comes from the replayed state, which is the recorded state bit for bit.

The stats and the spike detector are :mod:`.step_stats`; :func:`diff_states`, which compares
two states tensor by tensor (``ldtools diff``), is :mod:`.diff`. Both are imported from here
as before.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..chain.reader import ChainReader, Prefetcher, decode_pool, shared_pool, unexpected_as_corrupt
from ..errors import CorruptChainError, UsageError
from ..format.checks import check_extra
from ..format.jsonvalue import JSON, decode
from ..format.manifest import StepEntry
from ..format.replay import Replayer
from ..sharded.chain import ShardedReader, open_reader
from ..sharded.layout import Layout, assemble
from .diff import TensorDiff, change_ratio, diff_states, diff_steps, diff_tensor, stored_tensors
from .step_stats import SPIKE_MIN_HISTORY as SPIKE_MIN_HISTORY
from .step_stats import (
    SPIKE_THRESHOLD,
    SPIKE_WINDOW,
    GroupStats,
    SpikeDetector,
    StepStats,
    group_of,
    rollback_step,
)

# -- replaying a range once ------------------------------------------------------------------
#: Parameters of fewer elements are measured on the calling thread: handing them to the pool
#: would cost more than measuring them.
POOL_MIN_NUMEL = 1 << 16

#: One parameter measured: ‖w‖², ‖w − w_prev‖² (None: no update), and the sum, maximum and
#: number of elements of its ``exp_avg_sq`` (0, -inf, 0 without one).
_Measured = tuple[float, float | None, float, float, int]


class _Norms:
    """Per-parameter statistics of replayed states, with the previous step's weights kept (one
    contiguous copy of the parameters) to measure each update.

    Each parameter is measured in one go while it is in cache: its norm, the difference from
    the previous weights computed into their copy, that difference's norm, then the copy
    takes the new weights. Parameters of at least :data:`POOL_MIN_NUMEL` elements are
    measured on a pool of threads, each reduction on one thread: the numbers are those of
    one thread, whatever the pool's size, and the sums across parameters are added in
    parameter order."""

    def __init__(self, names: Sequence[str], depth: int) -> None:
        self.names = list(names)
        self.groups = [group_of(n, depth) for n in self.names]
        self.prev: dict[int, torch.Tensor] = {}

    def _one(self, i: int, w: torch.Tensor, v: torch.Tensor | None, update: bool) -> _Measured:
        _single_thread()
        w2 = _sq(w)
        prev = self.prev.get(i)
        if prev is not None and (prev.shape != w.shape or prev.dtype != w.dtype or prev.device != w.device):
            prev = None
        d2 = _sq(torch.sub(w, prev, out=prev)) if update and prev is not None else None
        if prev is None:
            self.prev[i] = w.clone(memory_format=torch.contiguous_format)
        else:
            prev.copy_(w)
        if v is not None and v.numel():
            return w2, d2, float(v.sum()), float(v.max()), v.numel()
        return w2, d2, 0.0, -math.inf, 0

    def measure(self, weights: Sequence[torch.Tensor | None], moments: Mapping[int, torch.Tensor],
                with_update: bool, pool: ThreadPoolExecutor | None
                ) -> tuple[float, float | None, tuple[GroupStats, ...]]:
        """(weight norm, update norm, groups) of a state, then remember its weights; per tensor
        in its dtype, across tensors in float64. Call on one torch thread (:func:`_one_thread`)."""
        present = [(i, w) for i, w in enumerate(weights) if w is not None]
        big = [i for i, w in present if w.numel() >= POOL_MIN_NUMEL] if pool is not None else []
        futures = {i: pool.submit(self._one, i, w, moments.get(i), with_update)
                   for i, w in present if i in big} if pool is not None and len(big) > 1 else {}
        try:
            done = {i: self._one(i, w, moments.get(i), with_update) for i, w in present if i not in futures}
        finally:
            wait(futures.values())  # none left running on the copies, even when one failed
        done.update({i: f.result() for i, f in futures.items()})
        acc: dict[str, list[float]] = {}  # group -> [numel, w^2, dw^2, v sum, v max, v numel]
        for i, w in present:
            w2, d2, v_sum, v_max, v_numel = done[i]
            a = acc.setdefault(self.groups[i], [0.0, 0.0, 0.0, 0.0, -math.inf, 0.0])
            a[0] += w.numel()
            a[1] += w2
            if with_update and d2 is not None:
                a[2] += d2
            if v_numel:
                a[3] += v_sum
                a[4] = max(a[4], v_max)
                a[5] += v_numel
        groups = tuple(GroupStats(
            name=g, numel=int(a[0]), weight_norm=math.sqrt(a[1]),
            update_norm=math.sqrt(a[2]) if with_update else None,
            relative_update=change_ratio(math.sqrt(a[2]), math.sqrt(a[1])) if with_update else None,
            v_mean=a[3] / a[5] if a[5] else None, v_max=a[4] if a[5] else None,
        ) for g, a in acc.items())
        w2 = sum(a[1] for a in acc.values())
        u2 = sum(a[2] for a in acc.values())
        return math.sqrt(w2), math.sqrt(u2) if with_update else None, groups


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Measure on one torch thread: the reductions are then the same whatever the thread
    count (so equal to the same formula on live states), and on a busy machine torch's
    intra-op threads, meeting the prefetcher's decoding threads, made them up to 100x
    slower (benchmarks/results/history_cost.md)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _single_thread() -> None:
    """One intra-op thread on this thread: a pool thread takes torch's thread count when it
    first runs torch, which :func:`_one_thread` has set to 1 by then; checked all the same."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _measure_pool() -> ThreadPoolExecutor | None:
    """The threads parameters are measured on: as many as torch's intra-op threads (None for
    one: the calling thread measures). Call before :func:`_one_thread` sets them to 1."""
    workers = torch.get_num_threads()
    return shared_pool(f"measure-{workers}", lambda: workers) if workers > 1 else None


def _sq(t: torch.Tensor) -> float:
    """The sum of squares of ``t``: torch's cascaded sum in the tensor's dtype (relative error
    about 1e-6 for float32), a pass over memory at SIMD speed; a float64 accumulation costs 4x
    and the measuring would weigh more than the replay it follows."""
    return float(torch.linalg.vector_norm(t)) ** 2


def _weights(replayer: Replayer, names: Sequence[str]) -> list[torch.Tensor | None]:
    """The floating-point parameters of a replayed state, by parameter index."""
    out: list[torch.Tensor | None] = []
    for n in names:
        t = replayer.tensors.get(f"model/{n}")
        out.append(t.detach() if t is not None and t.is_floating_point() else None)
    return out


def _second_moments(replayer: Replayer) -> dict[int, torch.Tensor]:
    """Adam's ``exp_avg_sq`` by parameter index, from the optimizer gradient replay is
    stepping, else from the stored tensors (``state.xor``, or before the first stepped step)."""
    # Private members of the replayer: syncing its tensors each step would rebuild the
    # optimizer's state_dict every step, for a read.
    opt, params = replayer._optimizer, replayer._params
    out: dict[int, torch.Tensor] = {}
    if opt is not None:
        for i, p in enumerate(params):
            v = opt.state.get(p, {}).get("exp_avg_sq")
            if isinstance(v, torch.Tensor):
                out[i] = v
        return out
    for name, t in replayer.tensors.items():
        if name.startswith("optimizer/") and name.endswith("/exp_avg_sq"):
            index = name[len("optimizer/"):-len("/exp_avg_sq")]
            if index.isdigit():
                out[int(index)] = t
    return out


def _lrs(entry_hyper: JSON, param_groups: JSON, scalars: dict[str, float], where: str) -> tuple[float, ...]:
    """The learning rate of each param group the step used: from its ``hyper`` (gradient
    kinds), else from the ``lr``, ``lr/<g>`` scalars the runtime records, else as recorded
    after the step (``param_groups``: after a scheduler's step, the next step's)."""
    if entry_hyper is None and "lr" in scalars:
        return tuple(scalars[k] for k in ["lr", *(f"lr/{g}" for g in range(1, 64))] if k in scalars)
    groups = decode(entry_hyper if entry_hyper is not None else param_groups, f"{where}: param groups")
    out: list[float] = []
    if isinstance(groups, list):
        for g in groups:
            lr = g.get("lr") if isinstance(g, dict) else None
            if isinstance(lr, torch.Tensor) and lr.numel() == 1:
                lr = float(lr)
            if isinstance(lr, (int, float)) and not isinstance(lr, bool):
                out.append(float(lr))
    return tuple(out)


def _scalars(extra: JSON, where: str) -> dict[str, float]:
    """``extra.scalars`` (spec §19.1), decoded alone: the rest of the extra (RNG states) costs
    milliseconds a step to decode."""
    if not isinstance(extra, dict):
        check_extra(extra, where)  # raises: an extra that is not an object
        return {}
    found = decode(extra.get("scalars"), f"{where}: extra.scalars")
    if not isinstance(found, dict):
        return {}
    return {k: float(v) for k, v in found.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)}


def step_history(chain: str | os.PathLike[str] | ChainReader | ShardedReader, *, first: int | None = None,
                 last: int | None = None, depth: int = 1) -> Iterator[StepStats]:
    """Replay steps ``first``..``last`` of ``chain`` once, yielding each step's statistics.

    Args:
        chain: a path or URL, or an open :class:`ChainReader` or :class:`ShardedReader`. A
            sharded chain (spec §20) replays its rank chains side by side, and measures the
            full tensors, by FQN, assembled from their shards; scalars and learning rates are
            rank 0's, bytes those of every rank chain.
        first, last: the range (default: the whole chain). The state before ``first`` is
            replayed too (without a record), so that ``first`` has an update.
        depth: parameters are grouped by the first ``depth`` components of their names.

    Yields:
        :class:`StepStats` in step order, ``present=False`` for steps the chain no longer
        holds. Flags come from a :class:`SpikeDetector` per series (loss, relative update).

    Raises:
        UsageError: an empty range or a ``depth`` below 1.
        CorruptChainError, MissingObjectError: as :meth:`ChainReader.materialize`.

    Example:
        >>> for s in step_history("runs/chain", first=100):           # doctest: +SKIP
        ...     print(s.step, s.loss, s.relative_update, s.flags)
    """
    if depth < 1:
        raise UsageError(f"depth must be at least 1, not {depth}")
    reader = chain if isinstance(chain, (ChainReader, ShardedReader)) else open_reader(chain)
    steps = reader.steps
    lo = steps[0] if first is None or (steps and first < steps[0]) else first
    hi = steps[-1] if last is None else last
    wanted = [s for s in steps if lo <= s <= hi]
    if not wanted:
        raise UsageError(f"{reader.path}: no committed step in {lo}..{hi} (committed: {steps[0] if steps else '-'}"
                         f"..{steps[-1] if steps else '-'}); pick a range inside the chain")
    before = max((s for s in steps if s < wanted[0]), default=None)
    detectors = {"loss": SpikeDetector(), "relative_update": SpikeDetector()}
    decode_pool()  # sized by torch's thread count: before _one_thread ever sets it to 1
    pool = _measure_pool()  # likewise
    if isinstance(reader, ShardedReader):
        history = _sharded_history(reader, wanted, before, depth, pool)
    else:
        history = _plain_history(reader, wanted, before, depth, pool)
    for stats in history:
        yield _flag(stats, detectors)


def _flag(stats: StepStats, detectors: dict[str, SpikeDetector]) -> StepStats:
    if not stats.present:
        return stats
    flags: list[str] = []
    loss = stats.loss
    if loss is not None:
        if not math.isfinite(loss):
            flags.append("nonfinite_loss")
        if detectors["loss"].add(loss) and math.isfinite(loss):
            flags.append("loss")
    # An update over a gap of compacted steps is not one step's: kept out of the window.
    if stats.relative_update is not None and stats.since == stats.step - 1:
        if detectors["relative_update"].add(stats.relative_update):
            flags.append("relative_update")
    if not flags:
        return stats
    return StepStats(**{**_fields(stats), "flags": tuple(flags)})


def _fields(s: StepStats) -> dict[str, Any]:
    return {k: getattr(s, k) for k in s.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class _Frame:
    """One step of a chain replayed: ``replayer`` holds its state until the next frame."""

    reader: ChainReader
    replayer: Replayer
    step: int
    since: int | None  # the step the update is measured from (None: no update)
    entry: StepEntry | None  # the step's delta entry; None for a step only an anchor holds
    anchor: bool
    record: bool = True  # False: the state before the range, only measured from


def _frames(reader: ChainReader, wanted: list[int], before: int | None) -> Generator[_Frame | int, None, None]:
    """The states of ``wanted`` (and first of ``before``), one after another; an ``int`` is a
    step between two wanted ones that the chain no longer holds (compacted away).

    Runs of deltas that continue the previous step are streamed through one prefetcher; an
    anchor step is loaded from its anchor, and a step whose base is not the step before it
    (compacted steps) is replayed from its anchor. What is yielded depends on ``wanted`` and
    ``before`` alone, not on how the chain stores them: the rank chains of a sharded chain
    yield the same sequence."""
    state = reader.state
    replayer: Replayer | None = None
    cur: int | None = None
    if before is not None:
        replayer = _replay_to(reader, before)
        yield _Frame(reader=reader, replayer=replayer, step=before, since=None, entry=None, anchor=False, record=False)
        cur = before
    i = 0
    while i < len(wanted):
        run: list[int] = []
        while i < len(wanted):
            d = state.deltas.get(wanted[i])
            # An anchor step is read from its anchor, as materialize reads it: a lowdiff+ anchor
            # recorded on a GPU is the live state, which CPU replay of its delta matches only
            # to the last bits, and the next steps' deltas are based on the anchor.
            if replayer is None or d is None or d[1].base != (run[-1] if run else cur) or wanted[i] in state.anchors:
                break
            run.append(wanted[i])
            i += 1
        if run and replayer is not None:
            yield from _stream(reader, replayer, run, cur)
            cur = run[-1]
            continue
        s = wanted[i]
        if cur is not None:
            yield from range(cur + 1, s)
        replayer = reader.start_replay(s) if s in state.anchors else _replay_to(reader, s)
        yield _Frame(reader=reader, replayer=replayer, step=s, since=cur, entry=_entry_of(reader, s),
                     anchor=s in state.anchors)
        cur = s
        i += 1


def _replay_to(reader: ChainReader, step: int) -> Replayer:
    anchor, path = reader.state.replay_path(step)
    replayer = reader.start_replay(anchor)
    reader.replay_steps(replayer, path)
    return replayer


def _entry_of(reader: ChainReader, step: int) -> StepEntry | None:
    d = reader.state.deltas.get(step)
    return d[1] if d is not None else None


def _stream(reader: ChainReader, replayer: Replayer, run: list[int], cur: int | None
            ) -> Generator[_Frame | int, None, None]:
    """Apply the deltas of ``run`` (each based on the one before it) one by one."""
    prev = cur
    batches = Prefetcher(reader, run)
    try:
        for entry, batch, items in batches:
            slots = {slot.name: slot for slot in entry.slots}
            for s, step_entry in items:
                where = f"{reader.path}/{entry.path} (step {s})"
                if prev is not None and s != prev + 1:
                    yield from range(prev + 1, s)
                with unexpected_as_corrupt(where):
                    if reader.kind == "state.xor":
                        replayer.apply_xor_step(step_entry, batch.row(step_entry.row), slots, where)
                    else:
                        replayer.apply_grad_step(step_entry, batch.row(step_entry.row), slots, where)
                yield _Frame(reader=reader, replayer=replayer, step=s, since=prev, entry=step_entry,
                             anchor=s in reader.state.anchors)
                prev = s
            del batch
    finally:
        batches.close()


def _plain_history(reader: ChainReader, wanted: list[int], before: int | None, depth: int,
                   pool: ThreadPoolExecutor | None) -> Iterator[StepStats]:
    norms: _Norms | None = None
    for frame in _frames(reader, wanted, before):
        if isinstance(frame, int):
            yield StepStats(step=frame, present=False)
            continue
        if norms is None:
            norms = _Norms(frame.replayer.schema.params, depth)
        with _one_thread():
            measured = norms.measure(_weights(frame.replayer, norms.names), _second_moments(frame.replayer),
                                     frame.since is not None, pool)
        if frame.record:
            yield _record(frame, measured, _step_bytes(frame), anchor=frame.anchor)


class _Assembled:
    """The full parameters and ``exp_avg_sq`` of a sharded chain's replayed state, assembled
    from the rank chains' shards (spec §20.4, as :func:`~ldformat.sharded.chain.assemble_state`)
    into buffers reused from step to step."""

    def __init__(self, reader: ShardedReader, names: Sequence[str]) -> None:
        self.root, self.path, self.names = reader.root, reader.path, list(names)
        self.layouts = [reader.root.tensors.get(f"model/{n}") for n in self.names]
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}

    def _whole(self, i: int, key: str, layout: Layout, pieces: Mapping[int, torch.Tensor], step: int) -> torch.Tensor:
        by_rank = {r: pieces[self.root.source(r)] for r in range(self.root.world_size) if self.root.source(r) in pieces}
        out = assemble(layout, by_rank, f"{self.path} (step {step}) {key}", out=self.buffers.get((i, key)))
        self.buffers[(i, key)] = out
        return out

    def weights(self, replayers: Mapping[int, Replayer], step: int) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for i, (t, layout) in enumerate(zip(_weights(replayers[0], self.names), self.layouts, strict=True)):
            name = f"model/{self.names[i]}"
            if t is None or layout is None:  # not floating point, or replicated: rank 0's
                out.append(t)
                continue
            pieces = {r: rp.tensors[name].detach() for r, rp in replayers.items() if name in rp.tensors}
            out.append(self._whole(i, name, layout, pieces, step))
        return out

    def moments(self, replayers: Mapping[int, Replayer], step: int) -> dict[int, torch.Tensor]:
        ranks = {r: _second_moments(rp) for r, rp in replayers.items()}
        out = {}
        for i, v in ranks[0].items():
            layout = self.layouts[i] if i < len(self.layouts) else None
            # Sharded like its parameter when every rank's piece has the shape of its shard.
            if layout is not None and layout.split and all(
                    (shard := layout.of_rank(r)) is not None and (piece := ranks[self.root.source(r)].get(i))
                    is not None and tuple(piece.shape) == shard.lengths for r in range(self.root.world_size)):
                out[i] = self._whole(i, f"optimizer/{i}/exp_avg_sq", layout,
                                     {r: m[i] for r, m in ranks.items() if i in m}, step)
            else:
                out[i] = v
        return out


def _sharded_history(reader: ShardedReader, wanted: list[int], before: int | None, depth: int,
                     pool: ThreadPoolExecutor | None) -> Iterator[StepStats]:
    """The rank chains replayed side by side, each as a plain chain's history replays it: the
    frames of one step are measured together on the assembled full tensors."""
    ranks = reader.root.chain_ranks
    walks = [_frames(reader.ranks[r], wanted, before) for r in ranks]
    assembled: _Assembled | None = None
    norms: _Norms | None = None
    try:
        for got in zip(*walks, strict=True):
            frames = [f for f in got if isinstance(f, _Frame)]
            if not frames:
                yield StepStats(step=cast(int, got[0]), present=False)
                continue
            head = frames[0]
            if len(frames) != len(got) or any(f.step != head.step for f in frames):
                raise CorruptChainError(f"{reader.path}: the rank chains replay different steps at step {head.step}")
            if assembled is None or norms is None:
                assembled = _Assembled(reader, head.replayer.schema.params)
                norms = _Norms(head.replayer.schema.params, depth)
            replayers = {r: f.replayer for r, f in zip(ranks, frames, strict=True)}
            with _one_thread():
                weights = assembled.weights(replayers, head.step)
                measured = norms.measure(weights, assembled.moments(replayers, head.step), head.since is not None,
                                         pool)
            if head.record:
                yield _record(head, measured, sum(_step_bytes(f) for f in frames),
                              anchor=all(f.anchor for f in frames))
    finally:
        for walk in walks:
            walk.close()
    if reader.truncated_since(wanted[-1]):
        raise CorruptChainError(f"{reader.path}: the chain was truncated while its history was read; "
                                "read it again when its maintenance is over")


def _step_bytes(frame: _Frame) -> int:
    """The bytes ``frame``'s step took: its share of its delta batch, and its anchor."""
    nbytes = 0
    if frame.entry is not None:
        delta = frame.reader.state.deltas[frame.step][0]
        nbytes += sum(o.size for o in delta.objects) // max(1, delta.rows)  # the step's share of its batch
    if frame.anchor:
        nbytes += frame.reader.state.anchors[frame.step].object.size
    return nbytes


def _record(frame: _Frame, measured: tuple[float, float | None, tuple[GroupStats, ...]], nbytes: int, *,
            anchor: bool) -> StepStats:
    where = f"{frame.reader.path} (step {frame.step})"
    weight, update, groups = measured
    if frame.entry is not None:
        scalars = _scalars(frame.entry.extra, where)
        lrs = _lrs(frame.entry.hyper, frame.entry.param_groups, scalars, where)
    else:
        a = frame.reader.state.anchors[frame.step]
        scalars = _scalars(a.extra, where)
        lrs = _lrs(None, a.param_groups, scalars, where)
    return StepStats(step=frame.step, anchor=anchor, since=frame.since, scalars=scalars, lrs=lrs, weight_norm=weight,
                     update_norm=update, relative_update=change_ratio(update, weight) if update is not None else None,
                     groups=groups, bytes=nbytes)


__all__ = ["GroupStats", "SPIKE_THRESHOLD", "SPIKE_WINDOW", "SpikeDetector", "StepStats", "TensorDiff",
           "diff_states", "diff_steps", "diff_tensor", "group_of", "rollback_step", "step_history",
           "stored_tensors"]
