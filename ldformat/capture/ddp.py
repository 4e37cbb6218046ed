"""Data-parallel ``lowdiff``: the top-k comm hook and every rank's residuals (spec §14.1 "Data-parallel residuals").

Each rank selects the top-k entries of every parameter's gradient (with its own
per-parameter residual, not per bucket: DDP rebuilds its buckets after the first
iteration), all ranks all-gather the (index, value) pairs, and every rank rebuilds the same
dense average. The union of the gathered indices is what the optimizer consumes: it is
handed to the :class:`~ldformat.TopK` so that a ``grad.topk`` chain records exactly that.

The residuals stay per rank. At every anchor step rank 0's :class:`~ldformat.Checkpointer`
and a :class:`ResidualPeer` on every other rank join one all-gather of them
(:func:`gather_residuals`), and rank 0 writes rank ``r``'s as ``compressor@<r>/<name>``.

How the ranks are set up: docs/capture-runtime.md "Data-parallel `lowdiff`".
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..chain.captured import around_closure, nested_step
from ..errors import LdformatError
from ..format.topk import TopK
from .extra import Stateful
from .hooks import call_after, open_at_exit
from .rng import capture_rng
from .tuning import positive_interval


class TopKCommState:
    """State of :func:`topk_comm_hook`: the compressor and parameter names.

    Args:
        topk: the compressor (its residuals are this rank's).
        model: the module wrapped by DDP (for parameter names).
        process_group: defaults to the world.
    """

    def __init__(self, topk: TopK, model: torch.nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        self.topk = topk
        self.process_group = process_group
        self.names = {id(p): name for name, p in model.named_parameters()}


# DDP compares the annotation with dist.GradBucket itself, which torch's stubs do not re-export.
def topk_comm_hook(
    state: TopKCommState, bucket: dist.GradBucket  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """``ddp_model.register_comm_hook(state, topk_comm_hook)``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    params = bucket.parameters()
    grads = bucket.gradients()
    names = [state.names[id(p)] for p in params]
    selected = [state.topk.select(name, g.reshape(-1).clone()) for name, g in zip(names, grads, strict=True)]
    sizes = [idx.numel() for idx, _ in selected]
    indices = torch.cat([idx for idx, _ in selected])
    values = torch.cat([v for _, v in selected])
    gathered_idx = [torch.empty_like(indices) for _ in range(world)]
    gathered_val = [torch.empty_like(values) for _ in range(world)]
    # On gloo, chain the two futures with collect_all: a wait() nested in then() can hang.
    f_idx = dist.all_gather(gathered_idx, indices, group=group, async_op=True).get_future()
    f_val = dist.all_gather(gathered_val, values, group=group, async_op=True).get_future()
    buffer = bucket.buffer()
    numels = [g.numel() for g in grads]

    def decompress(_: object) -> torch.Tensor:
        out = torch.zeros_like(buffer)
        offset = 0
        starts = []
        for n in numels:
            starts.append(offset)
            offset += n
        for r in range(world):  # same order on every rank: identical bits everywhere
            pos = 0
            for j, k in enumerate(sizes):
                seg = out[starts[j] : starts[j] + numels[j]]
                seg.index_add_(0, gathered_idx[r][pos : pos + k], gathered_val[r][pos : pos + k])
                pos += k
        out.div_(world)
        pos = 0
        for j, k in enumerate(sizes):
            union = torch.cat([gathered_idx[r][pos : pos + k] for r in range(world)])
            state.topk.indices[names[j]] = torch.unique(union, sorted=True)
            pos += k
        state.topk.generation += 1
        return out

    return torch.futures.collect_all([f_idx, f_val]).then(decompress)


def world_size(group: dist.ProcessGroup | None) -> int:
    """The ranks of ``group``; 1 when ``torch.distributed`` is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def gather_residuals(
    topk: TopK, names: list[str], group: dist.ProcessGroup | None
) -> dict[int, dict[str, torch.Tensor]]:
    """All-gather every rank's top-k residuals (a collective: every rank must call it)."""
    world = dist.get_world_size(group)
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(world)}
    for name in dict.fromkeys(names):
        residual = topk.residuals.get(name)
        if residual is None:
            continue
        parts = [torch.empty_like(residual) for _ in range(world)]
        dist.all_gather(parts, residual.contiguous(), group=group)
        for r, t in enumerate(parts):
            out[r][name] = t.to("cpu", copy=True)
    return out


def peer_residual_tensors(topk: TopK, names: list[str], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Rank 0's side of :func:`gather_residuals`: the other ranks' residuals as anchor tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for r, residuals in gather_residuals(topk, names, group).items():
        if r > 0:
            tensors.update({f"compressor@{r}/{n}": t for n, t in residuals.items()})
    return tensors


#: How long a rank waits for the others in the exchange of extra state: when the Checkpointers
#: are constructed (a rank that constructs none is reported after this instead of hanging),
#: and at each step (a rank that died, or stopped stepping).
EXTRAS_TIMEOUT_S = 300.0
#: Steps whose exchange a rank may have handed to its exchange thread without it having run;
#: past that the training thread waits (back-pressure). Rank 0 waits for the previous step's at
#: every step, so with lockstep data parallelism a peer is never more than a step or two ahead.
MAX_PENDING_EXCHANGES = 8

RankStates = dict[str, dict[str, object]]
_Mine = tuple[dict[str, object] | None, object, str | None]  # a step's RNG states, data position, digest


class RankExtras:
    """Every data-parallel rank's RNG states and data position, sent to rank 0 once per step
    on a gloo side group, so that rank 0 records each rank's own (spec §19.1 ``ranks``) and a
    resumed rank gets its own back (§19.5). Constructing it is a collective of the group."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int] | None = None,
                 copies: dict[int, int] | None = None) -> None:
        """``ranks``: the ranks of ``group`` that take part, rank 0 first (default: all of them);
        only they construct it. ``copies``: a sharded job's copy ranks and their sources (spec
        §20.2): the copy ranks send their state, which rank chain 0 records, and their sources
        only the digest that each copy rank's is compared with."""
        from datetime import timedelta

        self.ranks = ranks if ranks is not None else list(range(dist.get_world_size(group)))
        self.copies = dict(copies or {})
        members = [int(dist.get_global_rank(group, r)) if group is not None else r for r in self.ranks]
        self.rank = dist.get_rank(group)
        self.world = len(members)
        self.dst = members[0]
        try:
            self.group = dist.new_group(ranks=members, backend="gloo",
                                        timeout=timedelta(seconds=EXTRAS_TIMEOUT_S), use_local_synchronization=True)
        except (RuntimeError, dist.DistError) as e:
            raise LdformatError(
                f"the data-parallel ranks {members} did not all construct a Checkpointer within "
                f"{EXTRAS_TIMEOUT_S:g} s ({e}); with data parallelism every rank constructs it, with the same "
                "arguments") from None

    def exchange(self, rng: dict[str, object] | None, data: object,
                 digest: str | None = None) -> RankStates | None:
        """Send this rank's state of the step to rank 0; on rank 0, every other rank's, by rank
        (with copy ranks: theirs only).

        ``digest``: a sharded job's copy ranks and their sources pass the crc of their unsharded
        tensors (:func:`~ldformat.capture.sharded.buffer_digest`); rank 0 raises when a copy
        rank's differs from its source's, since no rank chain holds the copy rank's own."""
        gathered: list[object] | None = [None] * self.world if self.rank == 0 else None
        mine: dict[str, object] = {"rng": rng or {}, "data": data}
        try:
            dist.gather_object(mine if digest is None else {**mine, "buffers": digest}, gathered, dst=self.dst,
                               group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise LdformatError(f"data-parallel rank {self.rank}: the exchange of RNG states and data positions "
                                f"with the other ranks failed ({e}); a rank died, or stopped stepping") from None
        if gathered is None:
            return None
        out: dict[str, dict[str, object]] = {}
        digests: dict[int, object] = {0: digest}
        for r, got in zip(self.ranks[1:], gathered[1:], strict=True):
            assert isinstance(got, dict)
            digests[r] = got.pop("buffers", None)
            if not self.copies or r in self.copies:  # a source's state is in its own rank chain
                out[str(r)] = got
        for r, source in sorted(self.copies.items()):
            copied, held = digests.get(r), digests.get(source)
            if copied is not None and held is not None and copied != held:
                raise LdformatError(
                    f"copy rank {r}'s unsharded tensors (buffers such as BatchNorm statistics, or unsharded "
                    f"parameters) differ from those of rank {source}, its source: its replicas drift apart, and "
                    f"the chain, which records a copy rank's state once for its replica group, cannot hold them "
                    f"(spec §20.2). Construct the Checkpointer with copy_ranks=False, so that every rank writes "
                    f"its own rank chain")
        return out

    def announce_start(self, step: int | None, anchor_every: int | None, error: BaseException | None = None) -> None:
        """Rank 0's side of :meth:`learn_start`: the step its chain continues from and its
        ``anchor_every``, or the error that stopped its Checkpointer, so that no peer waits for
        a collective that rank 0 will never join. On this gloo side group, not the training's
        (whose NCCL collectives would need CUDA tensors)."""
        box: list[object] = [None if error is None else f"{type(error).__name__}: {error}", step, anchor_every]
        self._broadcast(box)

    def learn_start(self) -> tuple[int, int | None]:
        """A peer's side of :meth:`announce_start`: rank 0's start step and ``anchor_every``
        (None when rank 0's is automatic)."""
        box: list[object] = [None, None, None]
        self._broadcast(box)
        failed, step, anchor_every = box
        if failed is not None:
            raise LdformatError(f"rank 0's Checkpointer failed, so this rank stops too: {failed}")
        assert isinstance(step, int) and (anchor_every is None or isinstance(anchor_every, int))
        return step, anchor_every

    def _broadcast(self, box: list[object]) -> None:
        try:
            dist.broadcast_object_list(box, src=self.dst, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise LdformatError(f"data-parallel rank {self.rank}: the start handshake with rank 0 failed ({e}); "
                                "a rank died while the Checkpointers were constructed") from None


class ExchangeThread:
    """Runs :meth:`RankExtras.exchange` for every step on a thread of its own, in step order.

    The training thread only captures its state (RNG states, data position, digest) and hands
    it over; the gather on the gloo side group, which waits for every rank, runs here, while
    training goes on with the next step's forward and backward. Rank 0 gets a future of the
    other ranks' states, which its background writer resolves before it writes the step.
    """

    def __init__(self, extras: RankExtras, max_pending: int = MAX_PENDING_EXCHANGES) -> None:
        self.extras = extras
        self.error: BaseException | None = None
        self._queue: queue.Queue[tuple[Future[RankStates | None], _Mine] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="ldformat-rank-extras", daemon=True)
        self._thread.start()

    def submit(self, rng: dict[str, object] | None, data: object,
               digest: str | None = None) -> Future[RankStates | None]:
        """Queue this step's exchange (waits while :data:`MAX_PENDING_EXCHANGES` are queued).

        Raises the error of an earlier exchange, which stops every later one."""
        self.raise_if_failed()
        done: Future[RankStates | None] = Future()
        self._queue.put((done, (rng, data, digest)))
        return done

    def settle(self) -> None:
        """Wait until every queued exchange has run; raise the error of one that failed."""
        self._queue.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                done, (rng, data, digest) = item
                if self.error is not None:
                    done.set_exception(self.error)
                    continue
                try:
                    done.set_result(self.extras.exchange(rng, data, digest))
                except BaseException as e:  # noqa: BLE001 (handed to the training thread)
                    self.error = e
                    done.set_exception(e)
            finally:
                self._queue.task_done()

    def close(self, timeout: float) -> bool:
        """Let the queued exchanges run, at most ``timeout`` seconds; True when they all did."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=max(timeout, 0.001))
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class ExtrasPeer:
    """A rank whose state rank 0's chain records: it counts steps as the Checkpointer does (one
    per ``optimizer.step()``, or, given the GradScaler, one per ``scaler.update()``, skipped
    steps included) and after every step sends rank 0 its RNG states and data position
    (spec §19.1 ``ranks``). A sharded job's copy ranks are such peers (spec §20.2 ``copies``).

    Given ``compress`` (a copy rank in ``lowdiff`` mode, whose source rank's Checkpointer
    sparsifies the gradient the optimizer consumes), it sparsifies this rank's gradient the same
    way before every step, with its own residuals, so that the copy keeps its source's state.
    Given ``digest``, it sends ``digest()`` with every step, which rank 0 compares with its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, extras: RankExtras, *, start: int,
                 scaler: torch.amp.GradScaler | None = None, data: Stateful | None = None,
                 compress: tuple[TopK, torch.nn.Module] | None = None,
                 digest: Callable[[], str | None] | None = None) -> None:
        self.data = data
        self._digest = digest
        self.extras = extras
        self.exchanges = ExchangeThread(extras)
        self.path = f"data-parallel rank {extras.rank}"  # for open_at_exit's messages
        self._closed = False
        open_at_exit.add(self)  # a rank that exits without close() still hands over its last step
        self.step = start
        self._compress = compress
        self._pre_handle = optimizer.register_step_pre_hook(self._pre_hook) if compress is not None else None
        self._handle = optimizer.register_step_post_hook(self._post_hook)
        self._scaler = scaler
        self._unwrap = call_after(scaler, "update", self._count_step) if scaler is not None else None

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]] | None:
        """As the Checkpointer's: top-k of the gradient about to be consumed (after a closure)."""
        if nested_step(optimizer) or self._compress is None:
            return None
        topk, model = self._compress

        def compress() -> None:
            found_inf = getattr(optimizer, "found_inf", None)
            if found_inf is None or float(found_inf) == 0.0:  # a skipped step consumes nothing
                topk.compress_(model)

        wrapped = around_closure(args, kwargs, compress, lambda: None)
        if wrapped is None:
            compress()
        return wrapped

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if self._scaler is None and not nested_step(optimizer):
            self._count_step()

    def _count_step(self) -> None:
        self.step += 1
        self.exchange()

    def exchange(self) -> None:
        """Hand this step's state to the exchange thread (the gather with rank 0 runs there)."""
        self.exchanges.submit(capture_rng(), self._data_state(), None if self._digest is None else self._digest())

    def _data_state(self) -> object:
        return self.data.state_dict() if self.data is not None else None

    def close(self) -> None:
        """Remove the hooks and let the queued exchanges run (at most :data:`EXTRAS_TIMEOUT_S`).

        Raises:
            LdformatError: an exchange failed (rank 0 stopped, or a rank died), or did not end.
        """
        if self._closed:
            return
        self._closed = True
        open_at_exit.discard(self)
        self._handle.remove()
        if self._pre_handle is not None:
            self._pre_handle.remove()
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if not self.exchanges.close(EXTRAS_TIMEOUT_S):
            raise LdformatError(f"data-parallel rank {self.extras.rank}: rank 0 did not take this rank's last "
                                f"RNG states and data position within {EXTRAS_TIMEOUT_S:g} s")
        self.exchanges.raise_if_failed()


class ResidualPeer(ExtrasPeer):
    """On ranks other than 0 of a data-parallel job: hand this rank's state to rank 0's chain.

    Rank 0 runs a :class:`~ldformat.Checkpointer`. Every other rank runs a ResidualPeer
    (a ``Checkpointer`` constructed on every rank makes one itself). In its constructor it
    sends this rank's RNG states and data position to rank 0, then learns rank 0's start
    step and ``anchor_every`` (collectives); after every step it sends them again, so that
    rank 0 records each rank's own (spec §19.1 ``ranks``). In ``lowdiff`` mode (with a
    ``compressor``, rank 0's ``anchor_every`` an integer) both sides also join one all-gather
    of the top-k residuals at every anchor step. It counts steps as the Checkpointer does:
    one per ``optimizer.step()``, or, given the GradScaler, one per ``scaler.update()``,
    skipped steps included.

    Raises:
        UsageError: ``anchor_every`` or ``step``, when given, differ from rank 0's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: TopK | None, *,
                 anchor_every: int | None = None, model: torch.nn.Module, step: int | None = None,
                 process_group: dist.ProcessGroup | None = None, scaler: torch.amp.GradScaler | None = None,
                 data: Stateful | None = None) -> None:
        from ..errors import UsageError

        if anchor_every is not None:
            positive_interval(anchor_every, "anchor_every")
        extras = RankExtras(process_group)
        extras.exchange(capture_rng(), data.state_dict() if data is not None else None)  # the start step's
        start, every = extras.learn_start()
        if compressor is not None and every is None:
            raise UsageError("ResidualPeer: rank 0's Checkpointer has an automatic anchor_every; data-parallel "
                             "'lowdiff' needs an integer one on every rank")
        if anchor_every is not None and anchor_every != every:
            raise UsageError(f"ResidualPeer: anchor_every={anchor_every}, but rank 0's Checkpointer anchors every "
                             f"{every} steps; give the same (or leave it out)")
        if step is not None and step != start:
            raise UsageError(f"ResidualPeer: step={step}, but rank 0's chain continues from step {start}")
        self.compressor = compressor
        self.anchor_every = every
        self.process_group = process_group
        by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), name)
        self._names = [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
        self._last_anchor = start
        super().__init__(optimizer, extras, start=start, scaler=scaler, data=data)

    def _count_step(self) -> None:
        self.step += 1
        if self.compressor is not None and self.anchor_every is not None and (
                self.step - self._last_anchor >= self.anchor_every):
            gather_residuals(self.compressor, self._names, self.process_group)
            self._last_anchor = self.step
        self.exchange()  # after the residuals, as rank 0 does
