"""The capture runtime: checkpoint every step without stalling training (docs/capture-runtime.md).

``Checkpointer`` hooks into the optimizer and captures each step at the points where its
parts are final (docs/capture-runtime.md "Capture points"):

* the optimizer step **pre-hook** of step ``t``: the gradients the optimizer consumes (after
  clipping and unscaling) and the hyperparameters it uses;
* the step **post-hook**: buffers (and for ``xor`` the whole state), RNG states, the data
  position;
* when the wrapped ``scheduler.step()`` (else ``scaler.update()``, else the post-hook)
  returns: the live param groups, scheduler and scaler state (§19 "Extra state written by
  the capture runtime"). The step is then complete and queued.

The training thread only copies into reused host buffers (:mod:`.staging`); a background
thread encodes, writes and commits (:mod:`.background`, docs/capture-runtime.md
"Pipeline"). Training blocks only when every buffer set is in flight. The rest lives next door: the ``lowdiff+`` replica
in :mod:`.replica`, data-parallel residuals in :mod:`.ddp`, the anchor interval and batch
size in :mod:`.tuning`, the extra state in :mod:`.extra`, opening and resuming in
:mod:`.resume`, hook bookkeeping in :mod:`.hooks`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import numpy as np
import torch

from ..chain.captured import (
    CapturedStep,
    CapturedTensor,
    CopyToHost,
    around_closure,
    capture_gradients,
    capture_tensors,
    inverse_scale,
    live_buffers,
    nested_step,
)
from ..chain.reader import ChainReader
from ..chain.sharded_probe import rank_location
from ..chain.writer import ChainWriter, build_schema
from ..errors import LdformatError, UsageError
from ..format.delta import check_encode_threads
from ..format.dtensors import has_dtensors, local
from ..format.jsonvalue import JSON, dtype_name
from ..format.manifest import Kind
from ..format.state import encode_param_groups
from ..format.topk import TopK
from ..stores import Store
from .background import BackgroundWriter, Queued
from .cadence import Cadence
from .ddp import (
    EXTRAS_TIMEOUT_S,
    ExchangeThread,
    ExtrasPeer,
    RankExtras,
    RankStates,
    ResidualPeer,
    peer_residual_tensors,
    world_size,
)
from .extra import MAX_LR_GROUPS, MAX_SCALARS, Stateful, check_scalars, loop_extra, step_lrs
from .hooks import Hooks, open_at_exit
from .mirror import DEFAULT_MIRROR_TIMEOUT_S, Location, Mirror
from .options import CaptureOptions
from .policy import AdaptiveTuner, PolicyInputs
from .replica import Replica
from .resume import load_anchor_residuals, open_writer
from .rng import capture_rng
from .sharded import (
    DEFAULT_COMMIT_TIMEOUT_S,
    Committer,
    ShardedSetup,
    buffer_digest,
    commit_now,
    newest_committed,
    rank_budget,
    unsynchronized_statistics,
)
from .sharded import setup as sharded_setup
from .snapshot import LazySnapshots
from .staging import BufferPool, BufferSet, Stager, arena_bytes, host_bytes
from .stats import CaptureStats
from .tuning import (
    DEFAULT_MAX_LOST_S,
    Interval,
    Tuning,
    check_budget,
    default_max_host_bytes,
    staging_set_bytes,
    xor_staged_tensors,
)
from .unwrap import unwrap_model, unwrap_optimizer, unwrap_scheduler

if TYPE_CHECKING:
    import torch.distributed as dist

T = TypeVar("T")

log = logging.getLogger("ldformat.capture")

Mode = Literal["lowdiff", "lowdiff+", "xor"]
MODES: dict[Mode, Kind] = {"lowdiff": "grad.topk", "lowdiff+": "grad.dense", "xor": "state.xor"}
DEFAULT_MODE: Mode = "xor"
"""The mode without a ``mode=`` argument: lossless, exact in any environment, any optimizer
(docs/capture-runtime.md "The default mode" gives the measurements behind the choice)."""
#: Steps that may wait for the background writer, by mode: an ``xor`` step is the whole state
#: (benchmarks/results/queue_depth.md).
DEFAULT_QUEUE_DEPTH: dict[Mode, int] = {"lowdiff": 2, "lowdiff+": 2, "xor": 0}
PIECES = "\0pieces"  # the buffer of a set that a step captured in pieces is read through (no stored name)
PIECE_ALIGN = 64  # bytes: each tensor of a piece starts at a multiple, so that any dtype may view it


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN


@dataclass
class _Pending:
    """The step being captured on the training thread, until it is finalized and queued."""

    step: int
    buffers: BufferSet
    stepped: bool
    hyper: JSON = None
    tensors: dict[str, CapturedTensor] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    optimizer: JSON = None  # xor: the optimizer structure after the step (spec §8.2)
    post_done: bool = False
    pre_end: float = 0.0
    # Data parallel, exchanged when the step ends (before any collective of the next step):
    ranks: Future[RankStates | None] | None = None  # the other ranks' RNG states and data positions
    valid: Future[bool] | None = None  # xor's lazy snapshot: resolved at the next fence (snapshot.py)
    peer_residuals: dict[str, torch.Tensor] | None = None  # 'lowdiff' anchors: the other ranks' residuals
    # xor in pieces (docs/capture-runtime.md "Host memory"): the live tensors the writer reads
    # piece by piece, and their versions when the step ended (a change before they are read fails).
    live: dict[str, torch.Tensor] | None = None
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    nbytes: int = 0  # the state's bytes (the policy's step size)


def per_rank_statistics_note(broadcast_buffers: bool | None, statistics: list[str]) -> str | None:
    """What a data-parallel chain does not hold: the chain records rank 0's buffers only, so
    with DDP's ``broadcast_buffers=False`` every other rank's own BatchNorm running statistics
    (which its evaluation uses) are not recorded, and ``resume`` gives every rank rank 0's.
    (With broadcasting, each forward starts from rank 0's anyway.)"""
    if broadcast_buffers is not False or not statistics:
        return None
    return (f"DDP with broadcast_buffers=False: {', '.join(statistics[:3])} keep running statistics per rank, and "
            "the chain records rank 0's only (resume restores rank 0's on every rank); use SyncBatchNorm or "
            "broadcast_buffers=True to keep them equal on every rank")


class Checkpointer:
    """Checkpoint every optimizer step into an ldformat chain, off the training thread.

    Args:
        path: the chain directory (created, or re-opened to append), or a URL
            (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://name``, ...; see
            :func:`ldformat.stores.open_store`).
        model, optimizer: the live training objects; wrappers are unwrapped (DDP,
            ``torch.compile``, accelerate's ``AcceleratedOptimizer``/``AcceleratedScheduler``,
            Lightning's ``LightningOptimizer``), so stored names carry no ``module.`` or
            ``_orig_mod.`` prefix.
        mode: ``"xor"`` (the default: bitwise state deltas, kind ``state.xor``; lossless,
            exact in any environment, any optimizer), ``"lowdiff+"`` (dense gradients
            staged during backward plus a CPU replica, ``grad.dense``; lossless, smaller and
            cheaper, but exact only when replayed in the recorded environment, and
            ``torch.optim`` classes only) or ``"lowdiff"`` (top-k compressed gradients,
            ``grad.topk``): **lowdiff changes training** (the optimizer consumes the
            compressed gradient) unless the training already compresses its gradients,
            e.g. with the DDP top-k hook (``compressor=``, ``compress=False``).
        scheduler, scaler: an LR scheduler and a GradScaler whose state is captured (their
            ``step``/``update`` methods are wrapped while the checkpointer is open).
        data: the data position: any object with ``state_dict``/``load_state_dict``
            (a :class:`ResumableSampler`, torchdata's ``StatefulDataLoader``, ...), captured
            with every step and restored by :func:`resume`.
        sampler: the former name of ``data`` (pass one or the other).
        anchor_every, batch_steps: in steps, or ``"auto"`` (wasted-time model,
            docs/capture-runtime.md "Anchor interval and batch size").
        topk_ratio: the top-k ratio of ``lowdiff`` mode.
        compressor: a :class:`TopK` to use in ``lowdiff`` mode (e.g. the one a DDP comm hook
            runs); with ``compress=False`` the checkpointer does not compress, it only reads
            the compressor's indices.
        max_stall: bound on the measured stall fraction the adaptive tuner keeps.
        mtbf_hours: mean time between failures, for the policy.
        max_lost_s: an automatic ``batch_steps`` never puts more than this many seconds of
            measured training at risk (the steps of an uncommitted batch), whatever the
            wasted-time model or the stall tuner would choose. Shown by ``ldtools info``.
        max_bytes: a disk budget for the chain. After each commit that leaves the chain
            above it, the steps before the newest anchor are dropped (live retention, as
            ``compact(keep_last=...)``), and an automatic ``anchor_every`` is kept small enough
            that two anchors and the deltas between them fit. Refused before anything is
            written when it cannot hold two anchors of the current state. With a sharded
            model each rank's chain gets an equal share (``max_bytes`` divided by the world
            size), and a rank never drops the sharded chain's newest committed step.
        queue_depth: steps that may wait for the background writer before training blocks
            (each holds one staged copy of what a step captures). Default: 2 for ``lowdiff``
            and ``lowdiff+``; 0 for ``xor``, whose steps are the whole state: training refills
            the one staging set once the writer has encoded the previous step (it has the next
            step's forward and backward to do so; the disk writes come after), so the pipeline
            holds 2x the state (the set and the XOR base) instead of 4x.
        max_batch_bytes: a batch is committed early once its captured steps hold this much.
        encode_threads: threads that compress the deltas alongside the background writer
            (:attr:`ChainWriter.encode_threads`). Default: half the cores this process may
            use, at most 8, and none besides the writer's own on 3 cores or fewer, where
            they would compete with training.
        stage_during_backward: ``lowdiff+`` copies each gradient to host memory as soon as
            backward has accumulated it, overlapping the copy with the rest of backward.
            Default: only on CUDA; on a CPU nothing runs alongside, so the copy is made
            once at ``optimizer.step()`` instead (clipping or accumulation would otherwise
            make it copy twice).
        step: the step the live state is at when re-opening a chain (default: the chain's
            latest step). A chain with steps after it is refused unless ``truncate=True``.
        truncate: with ``step=``, delete the chain's steps after ``step`` (training will
            redo them). Without it, such a chain raises :class:`UsageError` before anything
            is written.
        extra: the user's own JSON-able dict, recorded as ``extra.user`` with every step; update
            ``ck.user_extra`` between steps to record something new (each step records it as it is then).
        store: a :class:`Store` to write to instead of the directory ``path``.
        storage_options: settings of the object store at the URL ``path``, overriding its
            environment variables (see :class:`~ldformat.stores.ObjectStore`).
        process_group: the group of the data-parallel or sharded job (default: the default
            group). With replicated parameters (DDP) in ``xor`` and ``lowdiff+``, every rank
            constructs the Checkpointer (a collective: a rank that does not makes the others
            fail after 5 minutes, before anything is written): rank 0 records the state every rank holds alike,
            once, and the others send rank 0 their own RNG states and data position every
            step (one gather on a gloo side group), recorded as ``extra["ranks"]`` for
            ``resume`` to restore per rank. Data-parallel ``lowdiff`` (docs/capture-runtime.md "Data-parallel
            `lowdiff`"): every rank constructs the Checkpointer with ``compressor=`` (the
            TopK of its ``topk_comm_hook``) and an integer ``anchor_every``; rank 0 records,
            and every other rank's becomes a :class:`ResidualPeer` that hands its residuals
            to rank 0's anchors.
        mirror: replicate the chain in the background to this location (``s3://...``,
            ``memory://name``, a local directory, or a :class:`Store`): training commits
            locally as usual, and a mirror thread runs :func:`ldformat.sync` after commits
            (at most one at a time; commits made meanwhile schedule one more). Mirror
            failures never reach training: they are retried with exponential backoff (1 s
            to 60 s), logged once per change of state on the ``ldformat.capture`` logger and
            shown in :attr:`stats` (``mirror_lag_steps``, ``mirror_lag_seconds``,
            ``mirror_last_error``, ``mirror_syncs``). A mirror that diverged
            (:class:`~ldformat.ReplicaDivergedError`) is reported once and no longer synced.
        mirror_options: ``storage_options`` of the object store at ``mirror``. With a sharded
            model, rank 0 replicates the whole sharded chain after its commit records (spec
            §20.12); the other ranks do nothing for the mirror.
        mirror_timeout: :meth:`close` commits locally, then waits at most this many seconds
            for one final sync, and warns if the mirror is still behind.
        commit_timeout: sharded models only: :meth:`close` on rank 0 waits at most this many
            seconds for every rank's last step before it commits it for all.
        options: a :class:`CaptureOptions`: the overhead budget (``max_overhead``, default
            3.5 %) and the capture interval (``capture_every``, default ``"auto"``: in
            ``xor`` mode every k-th step, with the smallest k whose measured cost fits the
            budget; docs/capture-runtime.md "Bounded cost"), and any of the cadence and
            pipeline keywords above (give each one way, not both).
        copy_ranks: sharded models only: whether a new chain may make a rank whose blocks are
            those of a lower rank (a replica of hybrid sharding, HSDP) a copy rank that writes
            nothing (spec §20.2). Default: yes, unless the model has BatchNorm layers with running
            statistics (not SyncBatchNorm), which FSDP2 leaves different on every rank. ``False``
            for replicas that drift apart by design (local SGD). With copy ranks, rank 0 compares
            every copy rank's unsharded tensors with its source's at every step and fails with a
            clear error if they differ, rather than record a state the copy rank does not have.

    Sharded models (FSDP2 ``fully_shard``, tensor parallel, both): every rank constructs the
    Checkpointer with the same ``path`` (a collective) and calls :meth:`close`. Each rank
    writes its local shards into its own chain under ``path``; rank 0 commits a step for all
    ranks once every rank holds it (spec §20). ``mode='xor'`` works with any optimizer; the
    gradient modes with elementwise ``torch.optim`` optimizers (others are refused up front).

    Example:
        >>> ck = Checkpointer("runs/chain", model, optimizer, mode="lowdiff")   # doctest: +SKIP
        >>> for x, y in loader:                                                  # doctest: +SKIP
        ...     optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        >>> ck.close()                                                           # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mode: Mode = DEFAULT_MODE,
        scheduler: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        data: Stateful | None = None,
        sampler: Stateful | None = None,
        anchor_every: Interval = "auto",
        batch_steps: Interval = "auto",
        topk_ratio: float = 0.01,
        compressor: TopK | None = None,
        compress: bool = True,
        max_stall: float = 0.035,
        mtbf_hours: float = 24.0,
        max_lost_s: float = DEFAULT_MAX_LOST_S,
        max_bytes: int | None = None,
        queue_depth: int | None = None,
        max_batch_bytes: int = 1 << 30,
        encode_threads: int | None = None,
        stage_during_backward: bool | None = None,
        step: int | None = None,
        truncate: bool = False,
        extra: dict[str, object] | None = None,
        store: Store | None = None,
        process_group: dist.ProcessGroup | None = None,
        storage_options: dict[str, Any] | None = None,
        mirror: Location | None = None,
        mirror_options: dict[str, Any] | None = None,
        mirror_timeout: float = DEFAULT_MIRROR_TIMEOUT_S,
        commit_timeout: float = DEFAULT_COMMIT_TIMEOUT_S,
        copy_ranks: bool | None = None,
        options: CaptureOptions | None = None,
    ) -> None:
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if options is None:
            options = CaptureOptions()
        elif not isinstance(options, CaptureOptions):
            raise UsageError(f"options must be a CaptureOptions, not {type(options).__name__}")
        given = options.given()
        anchor_every = _one_way(given, "anchor_every", anchor_every, "auto")
        batch_steps = _one_way(given, "batch_steps", batch_steps, "auto")
        max_stall = _one_way(given, "max_stall", max_stall, 0.035)
        mtbf_hours = _one_way(given, "mtbf_hours", mtbf_hours, 24.0)
        max_lost_s = _one_way(given, "max_lost_s", max_lost_s, DEFAULT_MAX_LOST_S)
        queue_depth = _one_way(given, "queue_depth", queue_depth, None)
        max_batch_bytes = _one_way(given, "max_batch_bytes", max_batch_bytes, 1 << 30)
        encode_threads = _one_way(given, "encode_threads", encode_threads, None)
        stage_during_backward = _one_way(given, "stage_during_backward", stage_during_backward, None)
        self.options = options
        if compressor is not None and mode != "lowdiff":
            raise UsageError(f"mode {mode!r} takes no compressor; use mode='lowdiff' with a TopK compressor")
        if queue_depth is None:
            queue_depth = DEFAULT_QUEUE_DEPTH[mode]
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 0:
            raise UsageError(f"queue_depth must be an integer >= 0, not {queue_depth!r}")
        if encode_threads is not None:
            check_encode_threads(encode_threads)  # before anything is written
        broadcast_buffers = getattr(model, "broadcast_buffers", None)  # DDP's; None for another wrapper
        model = unwrap_model(model)
        optimizer = unwrap_optimizer(optimizer)
        scheduler = unwrap_scheduler(scheduler)
        self.sharded = has_dtensors(model)
        every = options.capture_every
        if isinstance(every, int) and every > 1 and (mode != "xor" or self.sharded or world_size(process_group) > 1):
            raise UsageError(f"capture_every={every}: only mode 'xor' with one recording process can skip steps (a "
                             "gradient delta needs every step; data-parallel and sharded ranks would have to agree "
                             "on the steps); give capture_every=1 or 'auto'")
        if max_bytes is not None and not self.sharded:
            check_budget(max_bytes, model, optimizer)
        self.path = str(path)
        self.mode = mode
        self.kind = MODES[mode]
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        if data is not None and sampler is not None:
            raise UsageError("pass the data position as data= (sampler= is its former name), not both")
        self.sampler = data if data is not None else sampler
        self.user_extra: dict[str, object] = dict(extra or {})
        self._scalars: dict[str, float] = {}  # logged for the step that closes next (log())
        self.compressor = compressor if compressor is not None else (TopK(topk_ratio) if mode == "lowdiff" else None)
        self._compress = compress and mode == "lowdiff"
        host_budget = options.max_host_bytes if options.max_host_bytes is not None else default_max_host_bytes()
        if not self.sharded:  # a sharded model's ranks refuse together, in check() below
            staging_sets(self.path, mode, model, optimizer, self.compressor, host_budget, queue_depth,
                         pieces_ok=True)
        self.process_group = process_group
        self._committer: Committer | None = None
        rank_lock = None
        if self.sharded:  # every rank writes its own chain of local shards (spec §20)
            if store is not None:
                raise UsageError("with a sharded model (DTensor parameters), store= is not supported: give the "
                                 "chain's location (a directory, or an object store URL) as the path")
            compressor_ = self.compressor
            whole_budget = max_bytes
            max_bytes = rank_budget(max_bytes, process_group)  # checked before the copy ranks are known

            def check() -> None:  # each rank's refusals, before any rank writes
                build_schema(model, optimizer, self.kind, compressor_)
                if max_bytes is not None:
                    check_budget(max_bytes, model, optimizer, each_rank=True)
                staging_sets(self.path, mode, model, optimizer, compressor_, host_budget, queue_depth,
                             pieces_ok=False)

            statistics = unsynchronized_statistics(model)
            if copy_ranks is None and statistics:
                log.info("%s: %s keep per-rank running statistics, so no rank is a copy rank (spec §20.2): every "
                         "rank writes its own rank chain", self.path, ", ".join(statistics[:3]))
            sharded = sharded_setup(self.path, model, optimizer, kind=self.kind, group=process_group,
                                    storage_options=storage_options, check=check,
                                    copies_allowed=copy_ranks if copy_ranks is not None else not statistics)
            rank_lock = sharded.lock
            if sharded.copies and isinstance(whole_budget, int):  # split over the rank chains that exist
                max_bytes = whole_budget // len(sharded.chain_ranks)
            if step is not None and sharded.committed is not None and step != sharded.committed:
                if rank_lock is not None:
                    rank_lock.release()
                raise UsageError(f"{path}: the sharded chain's newest committed step is {sharded.committed}; "
                                 f"a sharded chain continues from it, not from step {step}")
            path, truncate = sharded.rank_path, True
            step = sharded.committed if sharded.committed is not None else step
        self.world_size = 1 if self.sharded else world_size(process_group)
        # Data parallel (replicated parameters, DDP): rank 0 records the state, which every rank
        # holds alike, once; every other rank's Checkpointer becomes a ResidualPeer, which sends
        # rank 0 its own RNG states and data position every step (spec §19.1 ``ranks``) and, in
        # 'lowdiff', its top-k residuals at every anchor.
        data_parallel = self.world_size > 1
        copies = sharded.copies if self.sharded else {}
        self._copies = bool(copies)
        self._passive = data_parallel and torch.distributed.get_rank(process_group) != 0
        self._peer: ExtrasPeer | None = None
        self._rank_extras: RankExtras | None = None
        self._exchanges: ExchangeThread | None = None  # rank 0's per-step exchanges with them
        if data_parallel and not self._passive:
            note = per_rank_statistics_note(broadcast_buffers, unsynchronized_statistics(model))
            if note:
                log.warning("%s: %s", self.path, note)
        if data_parallel and mode in ("xor", "lowdiff+"):
            self.world_size = 1  # every rank's state is rank 0's: no per-rank residuals
        if self.world_size > 1 and (anchor_every == "auto" or compressor is None):
            raise UsageError(
                "with several ranks in mode 'lowdiff', give an integer anchor_every (every rank must know the "
                "anchor steps) and compressor=, the TopK of your topk_comm_hook (or use mode 'xor' or 'lowdiff+', "
                "which need neither)"
            )
        self.max_batch_bytes = max_batch_bytes
        self.stats = CaptureStats()
        self.tuning = Tuning(anchor_every, batch_steps, stats=self.stats, max_stall=max_stall,
                             mtbf_s=mtbf_hours * 3600.0, max_batch_bytes=max_batch_bytes, max_lost_s=max_lost_s,
                             max_bytes=max_bytes)
        self._step = 0
        self._closed = False
        if self._passive:
            self._peer = ResidualPeer(optimizer, self.compressor if mode == "lowdiff" else None,
                                      anchor_every=anchor_every if isinstance(anchor_every, int) else None,
                                      model=model, process_group=process_group, scaler=scaler, data=self.sampler)
            return
        initial_ranks = None
        sources = set(copies.values())
        if data_parallel or (copies and (sharded.rank == 0 or sharded.is_copy or sharded.rank in sources)):
            # Rank 0 records the RNG states and data positions of the ranks that write no chain
            # of their own: DDP's other ranks, a sharded job's copy ranks (spec §19.1, §20.2);
            # the copy ranks' sources take part with the digest of their unsharded tensors.
            self._rank_extras = RankExtras(process_group, sorted({0, *copies, *sources}) if copies else None,
                                           copies=copies)
            initial_ranks = self._rank_extras.exchange(capture_rng(), self._data_state(), self._digest())
            if self.sharded and sharded.is_copy:  # its state is its source rank's chain's: it writes nothing
                self._peer = self._copy_rank_peer(sharded, self._rank_extras, storage_options, step)
                self._passive, self._rank_extras = True, None
                return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self._device_type = device.type
        self.stager = Stager(device)
        sets, self._pieces = staging_sets(self.path, mode, model, optimizer, self.compressor, host_budget,
                                          queue_depth, say=True, pieces_ok=not self.sharded)
        self.stats.max_host_bytes, self.stats.staging_sets, self.stats.pieces = host_budget, sets, self._pieces
        self.pool = BufferPool(sets, pin=self._cuda, max_bytes=host_budget, stats=self.stats)
        self._lazy = LazySnapshots(self.stager)
        lazy = options.lazy_snapshot if options.lazy_snapshot is not None else self._cuda  # measured on CPU: a loss
        self._lazy.enabled = mode == "xor" and lazy and not self._pieces  # pieces read the live state themselves
        self._reading: threading.Event | None = None  # set once the writer has read every piece of the last step
        # The last step read in pieces: the live tensors, their versions when it ended, and the
        # training thread's verdict on them, which the writer waits for before the row counts.
        self._judging: tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]], Future[list[str]]] | None = None
        self._pending: _Pending | None = None
        self._last_pre: float | None = None
        self._last_step_bytes = 0

        started = time.perf_counter()
        writer: ChainWriter | None = None
        try:
            try:
                writer = open_writer(
                    str(path), model, optimizer, kind=self.kind, mode=mode, step=step, truncate=truncate,
                    compressor=self.compressor, batch_steps=self.batch_steps, store=store,
                    first_extra=lambda: self._raw_extra(capture_rng(), self._data_state(), initial_ranks),
                    storage_options=storage_options, rank_chain=self.sharded, lock=rank_lock)
                if self.sharded and sharded.rank == 0:
                    self._committer = Committer(self.path, sharded.chain_ranks, storage_options, self.stats)
            except Exception as e:
                if self.sharded:
                    commit_now(None, process_group, failed=e)  # raises e once the other ranks know
                raise
            if self.sharded:
                commit_now(self._committer, process_group)
                writer.retain_at_most = newest_committed(self.path, storage_options)
        except BaseException as e:
            if data_parallel and self._rank_extras is not None:
                self._rank_extras.announce_start(None, None, e)  # the peers stop too, at once
            if self._committer is not None:
                self._committer.stop()
            if writer is not None:
                writer.abort()
            raise
        self.writer = writer
        self.writer.max_batch_bytes = max_batch_bytes  # bounds memory whether batch_steps is stated or auto
        if encode_threads is not None:
            self.writer.encode_threads = encode_threads
        self.writer.max_bytes = max_bytes
        if self._pieces:  # a row coded piece by piece: each tensor against its own base only
            self.writer.predict_state = False
        if self.writer.commits:  # create() wrote the first anchor
            self.tuning.anchor_write_s = time.perf_counter() - started
        self._step = int(self.writer.last_step or 0)
        # Only a state delta may span steps, and only one recording process decides which (docs/capture-runtime.md
        # "Bounded cost"); the others capture every step, and say so when that costs more than the budget.
        self.cadence = Cadence(options, adaptive=mode == "xor" and options.capture_every == "auto" and not (
            self.sharded or data_parallel), last_captured=self._step, max_lost_s=max_lost_s)
        self.tuning.cadence = self.cadence
        self.stats.capture_every = self.cadence.every
        self.stats.durable_at = time.monotonic()
        self._skipping: int | None = None  # the step running now, not captured
        self._uncaptured_end: int | None = None  # the step that ended uncaptured; a scaler.update may follow
        self._after_capture = True  # whether the step of the interval now running was captured
        self._background_mark = (0.0, False)  # the background's busy seconds and activity at the last pre-hook
        self._last_queued_at: float | None = None
        self._skipped_scalars: dict[str, float] = {}  # the last uncaptured step's, if close() captures it
        self._skipped_lrs: list[object] = []
        self._last_anchor = max([a for a in self.writer.anchors if a <= self._step], default=self._step)
        if data_parallel and self._rank_extras is not None:
            self._rank_extras.announce_start(self._step, anchor_every if isinstance(anchor_every, int) else None)
        if self._rank_extras is not None:  # after the last collective of the opening on its group
            self._exchanges = ExchangeThread(self._rank_extras)
        schema = self.writer.root.schema
        self._param_names: list[str] = schema["optimizer"]["params"]
        self._buffer_names = [e["name"] for e in schema["model"] if e["role"] == "buffer" and e["alias_of"] is None]
        self._buffer_keys = {f"model/{n}" for n in self._buffer_names}  # forward may change them: never lazy
        self._params = params
        self._state_keys = self._optimizer_state_keys()
        self._replica = Replica(self.writer, optimizer) if mode == "lowdiff+" else None
        self._staged_versions: dict[str, tuple[int, int]] = {}
        self._hooks = Hooks()
        self._hooks.add(optimizer.register_step_pre_hook(self._pre_hook))
        self._hooks.add(optimizer.register_step_post_hook(self._post_hook))
        if self._lazy.enabled or self._pieces:  # the last step can be judged, and written, as a forward pass starts
            self._hooks.add(model.register_forward_pre_hook(lambda module, args: self._settle()))
        if stage_during_backward is None:
            stage_during_backward = self._cuda
        if mode == "lowdiff+" and stage_during_backward:
            for i, p in enumerate(params):
                self._hooks.add(p.register_post_accumulate_grad_hook(self._stage_hook(i)))
        if scheduler is not None:
            self._hooks.call_after(scheduler, "step", self._after_scheduler_step)
        if scaler is not None:
            self._hooks.call_after(scaler, "update", self._after_scaler_update)
            # GradScaler.unscale_ (also called inside scaler.step) rewrites the gradients in
            # place without bumping their version counters: re-copy every staged gradient.
            self._hooks.call_after(scaler, "unscale_", lambda: self._staged_versions.clear())
        self.mirror_timeout = mirror_timeout
        self.commit_timeout = commit_timeout
        self._mirror: Mirror | None = None
        if mirror is not None and self.sharded:
            if self._committer is not None:  # rank 0 replicates the whole sharded chain (spec §20)
                self._mirror = Mirror(self.path, mirror, stats=self.stats, src_options=storage_options,
                                      dst_options=mirror_options)
                self._committer.on_commit = self._mirror.committed
                self._mirror.committed(self._committer.committed)
        elif mirror is not None:
            self._mirror = Mirror(store if store is not None else self.path, mirror, stats=self.stats,
                                  src_options=None if store is not None else storage_options,
                                  dst_options=mirror_options)
            self._mirror.committed(self.writer.durable_step)  # the chain as opened (or just created)
        self._background = BackgroundWriter(self.writer, self.pool, self.stats, self.tuning, self._replica,
                                            on_commit=self._committer.nudge if self._committer is not None
                                            else self._mirror.committed if self._mirror is not None else None)
        self._queue, self._thread = self._background.queue, self._background.thread
        open_at_exit.add(self)

    def _copy_rank_peer(self, sharded: ShardedSetup, extras: RankExtras, storage_options: dict[str, Any] | None,
                        step: int | None) -> ExtrasPeer:
        """A copy rank's side (spec §20.2 ``copies``): it joins the opening's last collective and
        then only sends rank 0 its RNG states and data position; in ``lowdiff`` it sparsifies
        its gradient as its source does, from the source's residuals at the step the chain
        continues from (which the source's writer loads too)."""
        compress = None
        try:
            if self._compress and self.compressor is not None:
                if sharded.committed is not None:
                    source = ChainReader(rank_location(self.path, sharded.copies[sharded.rank]),
                                         storage_options=storage_options)
                    load_anchor_residuals(source, sharded.committed, self.compressor)
                compress = (self.compressor, self.model)
        except Exception as e:
            commit_now(None, self.process_group, failed=e)  # raises e once the other ranks know
        else:
            commit_now(None, self.process_group)
        return ExtrasPeer(self.optimizer, extras, start=step if step is not None else 0, scaler=self.scaler,
                          data=self.sampler, compress=compress, digest=self._digest)

    def _digest(self) -> str | None:
        """With copy ranks: the crc of this rank's unsharded tensors, which rank 0 compares
        between every copy rank and its source at every step (a copy rank's state must be its
        source's)."""
        return buffer_digest(self.model) if self._copies else None

    @property
    def anchor_every(self) -> int:
        """The anchor interval in force (docs/capture-runtime.md "Anchor interval and batch size")."""
        return self.tuning.anchor_every

    @property
    def batch_steps(self) -> int:
        """Steps per commit in force (docs/capture-runtime.md "Anchor interval and batch size")."""
        return self.tuning.batch_steps

    @property
    def tuner(self) -> AdaptiveTuner:
        return self.tuning.tuner

    def policy_inputs(self) -> PolicyInputs | None:
        """The measurements the policy uses, once enough steps were seen."""
        return self.tuning.inputs(self.writer)

    # -- training-thread capture -------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        error = self._background.error
        if error is not None:
            raise LdformatError(f"{self.path}: the checkpoint writer failed: {error}") from error

    def _stage_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            # Staging only: fires once per micro-batch and before clipping/unscaling; the
            # pre-hook re-copies any gradient whose version changed since.
            if self._closed or p.grad is None:
                return
            started = time.perf_counter()
            buffers = self._stage_buffers()
            name = f"grad/{index}"
            grad = local(p.grad)
            self.stager.copy(buffers.buffer(name, grad), grad)
            self._staged_versions[name] = (grad._version, grad.data_ptr())
            self.stats.stall_s += time.perf_counter() - started

        return hook

    def _stage_copy(self, buffers: BufferSet, *, reuse_staged: bool = True) -> CopyToHost:
        """Copies into ``buffers``; a gradient unchanged since its staging copy is not copied again."""

        def copy(name: str, t: torch.Tensor) -> torch.Tensor:
            buf = buffers.buffer(name, t)
            if not reuse_staged or self._staged_versions.get(name) != (t._version, t.data_ptr()):
                self.stager.copy(buf, t)  # not staged, or changed since (clipping, accumulation, unscale_)
            return buf

        return copy

    def _stage_buffers(self) -> BufferSet:
        if self._pending is not None and not self._pending.post_done:
            return self._pending.buffers
        if self._pending is not None:  # the previous step was never finalized by a wrapper
            self._finalize()
        self._lazy.fence()  # before waiting for a buffer set: the background writer may wait for it ...
        self._hold_for_pieces()  # ... or for the verdict on a step read in pieces
        buffers, waited = self.pool.acquire()
        self.stats.backpressure_s += waited  # part of the stall its caller times
        self._pending = _Pending(step=self._step + 1, buffers=buffers, stepped=True)
        self._staged_versions = {}
        return buffers

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]] | None:
        if nested_step(optimizer):
            return None  # super().step() inside a subclass's step: the outer call is the step
        started = time.perf_counter()
        self._raise_if_failed()
        if self._exchanges is not None:
            # The previous step's exchange ran during this step's forward and backward: a failed
            # one (a rank died, a copy rank drifted) stops this step before it changes the state.
            self._exchanges.settle()
        self._lazy.fence()  # the optimizer is about to change what the last step's snapshot copies
        self._hold_for_pieces()
        if self._last_pre is not None:
            self.stats.step_times.append(started - self._last_pre)
            self._account_interval(started - self._last_pre)
        self._last_pre = started
        if self._skipping is not None:
            return None  # the step already began, uncaptured
        if self._pending is None or self._pending.post_done:
            if self._pending is not None:
                self._finalize()  # the previous step, which no scheduler or scaler call closed
                self._hold_for_pieces()
            if not self._begin_step():
                # Kept by reference (no copy, no GPU sync) in case close() captures this step.
                self._skipped_lrs = [group.get("lr") for group in optimizer.param_groups[:MAX_LR_GROUPS]]
                self.stats.stall_s += time.perf_counter() - started
                return None
            self._stage_buffers()
            # The writer may have failed while this step waited for a buffer set (it keeps
            # handing sets back, unencoded, once it has): stop here, not a step later.
            self._raise_if_failed()
        pending = self._pending
        if pending is None:  # unreachable: _stage_buffers always leaves a pending step
            raise RuntimeError("ldformat capture has no pending step")
        if self.kind != "state.xor":
            def failed() -> None:
                pending.stepped = False  # the optimizer will not step: nothing to replay

            wrapped = around_closure(args, kwargs, lambda: self._capture_gradients(optimizer, pending), failed)
            if wrapped is not None:
                pending.pre_end = time.perf_counter()
                self.stats.stall_s += pending.pre_end - started
                return wrapped
        self._capture_gradients(optimizer, pending)
        pending.pre_end = time.perf_counter()
        self.stats.stall_s += pending.pre_end - started
        return None

    def _begin_step(self) -> bool:
        """Whether the step about to run is captured (:mod:`.cadence`); if not, it runs as ``_skipping``."""
        step = self._step + 1
        self._uncaptured_end = None
        self._skipped_scalars, self._skipped_lrs = {}, []
        self._after_capture = self.cadence.due(step)
        if self._after_capture:
            self.cadence.captured(step)
        else:
            self._skipping = step
        return self._after_capture

    def _end_uncaptured(self) -> None:
        """The uncaptured step ended: the live state moved on, the chain did not."""
        step = self._skipping if self._skipping is not None else self._step + 1
        self._skipping = None
        self._uncaptured_end = self._step = step
        # Logged for a step the chain does not hold, unless close() or flush() captures it.
        self._skipped_scalars, self._scalars = self._scalars, {}
        self.stats.steps += 1

    def _account_interval(self, seconds: float) -> None:
        """One step interval, for the capture cadence (:meth:`Cadence.interval`)."""
        busy, active = self.stats.background_wall_s, self._background.active
        clean = not self._after_capture and not active and self._background_mark == (busy, False)
        # The background's CPU time bounds what it can take from training (its I/O waits take nothing).
        self.cadence.interval(seconds, after_capture=self._after_capture, clean=clean, stall_s=self.stats.stall_s,
                              background_s=self.stats.background_cpu_s)
        self._background_mark = (busy, active)
        self.stats.capture_every, self.stats.overhead = self.cadence.every, self.cadence.overhead

    def _capture_gradients(self, optimizer: torch.optim.Optimizer, pending: _Pending) -> None:
        """The gradients the optimizer is about to consume, and the hyperparameters it uses."""
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            pending.stepped = False  # a fused optimizer skips this step (GradScaler found inf)
            return
        self.writer.check_param_groups()
        pending.hyper = encode_param_groups(optimizer, with_params=False)
        inv_scale = inverse_scale(getattr(optimizer, "grad_scale", None))
        if self._compress and self.compressor is not None:
            self.compressor.compress_(self.model)
        # A scaled gradient is multiplied into a new tensor: never the staged copy.
        copy = self._stage_copy(pending.buffers, reuse_staged=inv_scale is None)
        pending.tensors.update(capture_gradients(self._params, self._param_names, self.kind, self.compressor,
                                                 copy, inv_scale=inv_scale))

    def _capture_after_step(self, pending: _Pending) -> None:
        """Buffers (or the whole state for xor), RNG and data position: final after the step."""
        lazy: dict[str, torch.Tensor] = {}
        if self.mode == "xor":
            live, pending.optimizer = self.writer.live_state()
            pending.nbytes = sum(t.numel() * t.element_size() for t in live.values())
            if self._pieces:  # read by the writer, piece by piece; the buffers forward changes are staged now
                pending.live = {n: t for n, t in live.items() if n not in self._buffer_keys}
                pending.versions = {n: (t._version, t.data_ptr()) for n, t in pending.live.items()}
                self.stager.follow()  # the writer's copies come after the step's kernels, whatever its stream
                lazy = pending.live
            elif self._lazy.enabled:  # parameters and optimizer state: copied while the next step runs
                lazy = {n: t for n, t in live.items() if n not in self._buffer_keys}
        else:
            live = live_buffers(self.model, self._buffer_names)
        eager = capture_tensors({n: t for n, t in live.items() if n not in lazy}, self._stage_copy(pending.buffers))
        # Nothing the training queues from here on may change a tensor before its copy is done
        # (the copies of the pre-hook, if any, ran alongside the optimizer step).
        self.stager.mark(pending.buffers)
        self.stager.fence(pending.buffers)
        if pending.live is not None:
            eager.update({n: CapturedTensor(bits=np.empty(0, np.uint8), dtype=dtype_name(t.dtype),
                                            shape=tuple(t.shape)) for n, t in pending.live.items()})
        elif lazy:
            later, pending.valid = self._lazy.start(pending.step, lazy, pending.buffers)
            eager.update(later)
        pending.tensors.update({n: eager[n] for n in live})  # in the state's order
        pending.rng = capture_rng()
        pending.data = self._data_state()
        pending.post_done = True
        # The other ranks join these as their step ends too (ResidualPeer), in this order. Here,
        # not at _finalize, which a scheduler stepped per epoch delays to the next step's
        # pre-hook, after the next step's collectives: the peers would wait for rank 0 there,
        # and rank 0 for them in those collectives.
        if self.world_size > 1 and self.compressor is not None and (
                pending.step - self._last_anchor >= self.anchor_every):
            pending.peer_residuals = peer_residual_tensors(self.compressor, self._param_names, self.process_group)
        if self._exchanges is not None and self._rank_extras is not None:  # the gather runs on its thread
            ranks = self._exchanges.submit(pending.rng, pending.data, self._digest())
            if self._rank_extras.rank == 0:  # rank 0's writer waits for it and records the others'
                pending.ranks = ranks

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if nested_step(optimizer):
            return
        if self._skipping is not None:
            self._end_uncaptured()
            return
        started = time.perf_counter()
        pending = self._pending
        if pending is None or pending.post_done:
            return
        self.stats.optimizer_times.append(started - pending.pre_end)
        if self._committer is not None:
            self._committer.step_ended(pending.step)
        self._capture_after_step(pending)
        if self.scheduler is None and self.scaler is None:
            self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _after_scaler_update(self) -> None:
        started = time.perf_counter()
        if self._closed:
            return
        self._raise_if_failed()
        if self._uncaptured_end is not None:  # the step ended uncaptured at the optimizer's post-hook
            self._uncaptured_end = None
            return
        if self._pending is None or not self._pending.post_done:
            # GradScaler skipped the step and a non-fused optimizer's hooks never fired.
            if self._pending is None and not self._begin_step():
                self._end_uncaptured()
                self._uncaptured_end = None
                return
            buffers = self._stage_buffers()
            pending = self._pending
            if pending is None or pending.buffers is not buffers:
                raise RuntimeError("ldformat capture has no pending step")
            pending.stepped = False
            self._capture_after_step(pending)
        if self.scheduler is None:
            self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _after_scheduler_step(self) -> None:
        started = time.perf_counter()
        if self._closed or self._pending is None or not self._pending.post_done:
            return
        self._finalize()
        self.stats.stall_s += time.perf_counter() - started

    def _finalize(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if not pending.post_done:
            self._capture_after_step(pending)
        step = pending.step
        anchor = step - self._last_anchor >= self.anchor_every
        # A step the optimizer skipped can still create its state: a fused optimizer
        # initializes it before the kernel sees GradScaler's found_inf. Replay cannot rebuild
        # that, so such a step becomes an anchor of the live state.
        state_keys = self._optimizer_state_keys()
        live_anchor = (self.mode != "xor" and self.world_size == 1 and not pending.stepped
                       and state_keys != self._state_keys)
        self._state_keys = state_keys
        anchor = anchor or live_anchor
        anchor_tensors, structure = None, pending.optimizer
        # lowdiff+ anchors are the CPU replica's state, which equals the live state only when
        # training steps the optimizer on the CPU too (spec §11.8): on another device an
        # anchor is a snapshot of the live state, which re-seeds the replica.
        replica_exact = self._device_type == "cpu"
        if anchor and (self.mode == "lowdiff" or live_anchor or (self.mode == "lowdiff+" and not replica_exact)):
            anchor_tensors, structure = self.writer.snapshot_anchor()
            if pending.peer_residuals is not None:
                anchor_tensors.update(pending.peer_residuals)
        captured = CapturedStep(
            step=step,
            stepped=pending.stepped,
            hyper=pending.hyper if pending.stepped else None,  # xor: for Adam prediction only
            param_groups=encode_param_groups(self.optimizer, with_params=True),
            extra=None,
            tensors=pending.tensors,
            anchor=anchor,
            anchor_tensors=anchor_tensors,
            optimizer=structure,
            scratch=True,  # the staging buffers, refilled only after the writer's encoded()
        )
        self._last_step_bytes = pending.nbytes or sum(ct.bits.nbytes for ct in pending.tensors.values())
        scalars, self._scalars = self._scalars, {}
        if pending.stepped and pending.hyper is not None:  # the lr the step used; a logged lr wins
            scalars = {**step_lrs(pending.hyper, MAX_SCALARS - len(scalars)), **scalars}
        self._last_queued_at = time.monotonic()
        self._hold_for_pieces()  # the step before, if it was read in pieces: judged before its verdict is replaced
        pieces, reading, judging = None, None, None
        if pending.live is not None:
            verdict: Future[list[str]] = Future()
            reading, judging = threading.Event(), (pending.live, pending.versions, verdict)
            pieces = self._piece_reader(pending, reading, verdict)
        self._background.put(Queued(captured, self._raw_extra(pending.rng, pending.data, scalars=scalars),
                                    pending.buffers, pending.ranks, self._last_queued_at, pending.valid,
                                    pieces, reading))
        self._reading, self._judging = reading, judging  # once queued: the writer sets reading
        self._step = step
        self.cadence.captured(step)
        self.stats.captured += 1
        if anchor:
            self._last_anchor = step
        self.stats.steps += 1
        self.tuning.after_step(self.writer, self._last_step_bytes)

    def _hold_for_pieces(self, wait: bool = True, raise_failed: bool = True) -> None:
        """Wait until the writer has read every piece of the last step (the live state is that
        step's until then), then judge whether the state changed meanwhile; raise if the writer
        failed. ``wait=False`` (as a forward pass starts): only if the reading is done already."""
        reading = self._reading
        if reading is None or not (wait or reading.is_set()):
            return
        self._reading = None
        started = time.perf_counter()
        reading.wait()
        self.stats.pieces_wait_s += time.perf_counter() - started  # part of the stall its caller times
        judging, self._judging = self._judging, None
        if judging is not None:
            # Here, on the training thread, every in-place op it began has run and moved its
            # tensor's version counter; the writer's own checks cannot see one still running.
            live, versions, verdict = judging
            verdict.set_result([n for n, t in live.items() if (t._version, t.data_ptr()) != versions[n]])
        if raise_failed:
            self._raise_if_failed()

    def _settle(self) -> None:
        """As a forward pass starts: the last step's lazy snapshot or pieces are judged if their
        copies are done, without waiting, so that the writer can commit the step meanwhile."""
        self._lazy.settle()
        self._hold_for_pieces(wait=False)

    def _piece_reader(self, pending: _Pending, reading: threading.Event, verdict: Future[list[str]]
                      ) -> Callable[[list[str]], Iterator[dict[str, CapturedTensor]]]:
        """What the writer reads a step in pieces with (:meth:`ChainWriter.append_in_pieces`), on
        its own thread: the live tensors copied, piece by piece in the writer's order, into one
        buffer of the step's set that fits the budget beside the buffers staged when it ended."""
        live, versions, buffers, step = pending.live or {}, pending.versions, pending.buffers, pending.step
        staged = {n: ct for n, ct in pending.tensors.items() if n not in live}
        budget = self.pool.max_bytes if self.pool.max_bytes is not None else default_max_host_bytes()

        def read(order: list[str]) -> Iterator[dict[str, CapturedTensor]]:
            sizes = {n: t.numel() * t.element_size() for n, t in live.items()}
            besides = sum(host_bytes(b.numel() * b.element_size(), buffers.pin)
                          for n, b in buffers.tensors.items() if n != PIECES)
            cap = arena_bytes(budget - besides, buffers.pin)
            for name in order:
                if sizes.get(name, 0) > cap:
                    raise UsageError(
                        f"{self.path}: {name} takes {sizes[name]} bytes of host memory, more than fits "
                        f"max_host_bytes={budget} beside the {besides} bytes of buffers staged when the step ended: "
                        "a piece holds at least one whole tensor; give CaptureOptions(max_host_bytes=...) more")
            size = min(cap, sum(_aligned(n) for n in sizes.values()))
            arena = buffers.buffer(PIECES, torch.empty(size, dtype=torch.uint8, device="meta"))
            piece: dict[str, CapturedTensor] = {}
            copied: list[str] = []
            used = 0

            def ready() -> dict[str, CapturedTensor]:
                self.stager.sync()
                for name in copied:  # the copy ran after the check: a change made before it is seen
                    t = live[name]
                    if (t._version, t.data_ptr()) != versions[name]:
                        raise UsageError(
                            f"{self.path}: {name} changed in place after optimizer.step() of step {step}, while "
                            "that step's state (larger than max_host_bytes) was being captured in pieces; make "
                            "such changes before optimizer.step()")
                return piece

            for name in order:
                if name not in live:
                    piece[name] = staged[name]
                    continue
                t, n = live[name], sizes[name]
                at = _aligned(used)
                if at + n > size:
                    yield ready()
                    piece, copied, at = {}, [], 0
                view = arena[at:at + n].view(t.dtype).view(t.shape)
                self.stager.copy(view, t)
                piece[name] = CapturedTensor.of(view)
                copied.append(name)
                used = at + n
            if piece:
                yield ready()
            # Training may go on; the row counts only once the training thread found the state
            # unchanged while it was read (see _hold_for_pieces).
            reading.set()
            changed = verdict.result()
            if changed:
                raise UsageError(
                    f"{self.path}: {', '.join(changed[:3])} changed in place after optimizer.step() of step {step}, "
                    "while that step's state (larger than max_host_bytes) was being captured in pieces; make such "
                    "changes before optimizer.step()")

        return read

    def _optimizer_state_keys(self) -> frozenset[tuple[int, str]]:
        return frozenset((i, k) for i, p in enumerate(self._params) for k in self.optimizer.state.get(p, {}))

    def _raw_extra(self, rng: dict[str, Any] | None, data: dict[str, Any] | None,
                   ranks: dict[str, dict[str, object]] | None = None,
                   scalars: dict[str, float] | None = None) -> dict[str, object]:
        """The extra state of this step as Python values (spec §19.1); copies, not live objects;
        ``ranks``: the other data-parallel ranks' RNG states and data positions."""
        return loop_extra(rng=rng or {}, scheduler=self.scheduler, scaler=self.scaler, data=data,
                          policy=self.tuning.extra(), user=self.user_extra, ranks=ranks, optimizer=self.optimizer,
                          scalars=scalars)

    def _data_state(self) -> dict[str, Any] | None:
        return self.sampler.state_dict() if self.sampler is not None else None

    # -- public control -----------------------------------------------------------------------
    def log(self, **scalars: object) -> None:
        """Record scalars (the loss, the gradient norm, ...) with the step that closes next
        (spec §19.1 ``scalars``; ``ldtools stats`` and ``ldtools plot`` show them).

        A step closes when ``optimizer.step()`` returns, or, with a ``scheduler`` or
        ``scaler``, when its ``step()``/``update()`` returns. So call ``log`` after
        ``loss.backward()`` and before ``optimizer.step()`` (or before ``scheduler.step()``
        when there is one): the loss is known then. Several calls for one step merge, a
        later value replacing an earlier one. At most 64 names per step, of 1-64 letters,
        digits or ``_ . / : -``; a value is anything ``float()`` takes (a one-element tensor
        on a GPU synchronizes). NaN and infinities are recorded as they are (tagged floats,
        spec §6.1): after a spike they are the values that matter. The learning rates the
        step used are recorded without a call, as ``lr`` (param group 0) and ``lr/<g>``.

        Raises:
            UsageError: a bad name, a value that is not a number, or more than 64 scalars.

        Example:
            >>> loss.backward()                                           # doctest: +SKIP
            >>> ck.log(loss=loss, grad_norm=clip_grad_norm_(params, 1.0))  # doctest: +SKIP
            >>> optimizer.step()                                          # doctest: +SKIP
        """
        checked = check_scalars(dict(scalars), len(set(self._scalars) - set(scalars)))
        self._scalars.update(checked)

    @property
    def step(self) -> int:
        """The last captured step (queued; see :attr:`durable_step`)."""
        return self._step

    @property
    def durable_step(self) -> int | None:
        return None if self._passive else self.writer.durable_step

    def flush(self) -> int | None:
        """Wait for every queued step, commit, and return the last durable step."""
        if self._passive:
            return None
        if self._pending is not None and self._pending.post_done:
            self._finalize()
        self._capture_live()
        self._lazy.fence()
        self._hold_for_pieces()  # the writer waits for the training thread's verdict on a step read in pieces
        self._background.join()
        self._raise_if_failed()
        step = self.writer.commit()
        self._committed_all()
        if self._mirror is not None:
            self._mirror.committed(step)
        return step

    def _capture_live(self) -> None:
        """Capture the live state if steps ran since the last capture (``flush`` and ``close``:
        the chain then ends at the state training reached)."""
        self._lazy.fence()
        if (self.mode != "xor" or self._pending is not None or self._skipping is not None
                or (self._step <= self.cadence.last_captured and self._step not in self._lazy.dropped)):
            return
        self._hold_for_pieces()  # the writer may wait for its verdict before it hands the set back
        buffers, waited = self.pool.acquire()
        self.stats.backpressure_s += waited
        self._pending = _Pending(step=self._step, buffers=buffers, stepped=True)
        self.cadence.captured(self._step)
        self._capture_after_step(self._pending)
        lrs = {("lr" if g == 0 else f"lr/{g}"): float(lr) for g, lr in enumerate(self._skipped_lrs)
               if isinstance(lr, (int, float)) and not isinstance(lr, bool)
               or isinstance(lr, torch.Tensor) and lr.numel() == 1}
        self._scalars = {**lrs, **self._skipped_scalars, **self._scalars}  # the step's, as if it had been captured
        self._finalize()

    def _committed_all(self) -> None:
        """Every queued step is durable now: a crash loses only what runs from the last of them."""
        if self._last_queued_at is not None and self.writer.durable_step == self._step:
            self.stats.durable_at = self._last_queued_at

    @property
    def capture_every(self) -> int:
        """The capture interval in force, in steps (docs/capture-runtime.md "Bounded cost")."""
        return self.cadence.every

    def recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """``lowdiff+``: restore the live objects from the in-memory replica (no storage read).

        Returns the step restored. The replica equals the chain's state at that step.
        """
        if self._passive or self._replica is None:
            raise UsageError("recover() needs mode='lowdiff+' (the only mode with an in-memory replica), on the "
                             "rank that records (rank 0 with data parallelism)")
        if self._pending is not None and self._pending.post_done:
            self._finalize()
        self._background.join()
        self._raise_if_failed()
        self._replica.load_into(self._step, model, optimizer)
        return self._step

    def close(self) -> int | None:
        """Flush and commit everything, stop the background thread, remove every hook.

        With a ``mirror``: then one final sync, bounded by ``mirror_timeout`` (a warning
        says how far the mirror stays behind if it does not complete).
        """
        if self._passive:
            if self._peer is not None:
                self._peer.close()
            return None
        if self._closed:
            return self.writer.durable_step
        failed: Exception | None = None
        try:
            try:
                if self._background.error is None and self._pending is not None and (
                    self._pending.post_done or self._pending.hyper is not None
                ):
                    self._finalize()
                if self._background.error is None:
                    self._capture_live()
            except Exception as e:
                # The last step could not be captured (its staging set outgrew max_host_bytes, say):
                # the steps queued before it are still committed and the lock released, then it is raised.
                failed = e
        finally:
            self._closed = True
            self._hold_for_pieces(raise_failed=False)  # the writer waits for it; a failure is raised below
            self._lazy.close()
            self._background.stop()
            self._hooks.remove()
            open_at_exit.discard(self)
            if self._exchanges is not None:  # every queued step's exchange ran for the writer
                self._exchanges.close(0.0 if self._background.error is not None else EXTRAS_TIMEOUT_S)
        if self._background.error is not None:
            self.writer.abort()
            if self._mirror is not None:
                self._mirror.close(0.0)
            if self._committer is not None:
                self._committer.finish(None, 0.0)
            self._raise_if_failed()
        try:
            step = self.writer.commit()
            self._committed_all()
            if self._committer is not None:  # every rank's last step, committed for all (spec §20.3)
                step = self._committer.finish(step, self.commit_timeout)
            if self.sharded and self.writer.max_bytes is not None:
                self._retain_once_committed()
            written = self.writer.close()
        except BaseException:
            if self._mirror is not None:
                self._mirror.close(0.0)
            if self._committer is not None:
                self._committer.finish(None, 0.0)
            self.writer.abort()
            raise
        if self._committer is None:
            step = written
        if self._mirror is not None:
            self._mirror.committed(step)
            self._mirror.close(self.mirror_timeout)
        if failed is not None:
            raise failed
        return step

    def _retain_once_committed(self) -> None:
        """The last retention pass of a rank chain (spec §20.8), once the global commit holds
        this rank's last step: the passes after this rank's own commits had to keep the history
        that the then newest commit still needed, so without this one a rank that finished ahead
        of rank 0's last commit would stay over its share."""
        newest, last = self.writer.retain_at_most, self.writer.durable_step
        if newest is None or last is None:
            return
        deadline = time.monotonic() + self.commit_timeout
        while (committed := newest()) is None or committed < last:
            if time.monotonic() >= deadline:
                log.warning("%s: step %d was not committed for every rank within %g s, so this rank chain keeps "
                            "the history the older commit needs, over its max_bytes share until the next run",
                            self.writer.path, last, self.commit_timeout)
                return
            time.sleep(0.1)
        self.writer.keep_budget()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostPlan(NamedTuple):
    """How the staging buffers fit ``max_host_bytes`` (docs/capture-runtime.md "Host memory")."""

    sets: int  # buffer sets (at most queue_depth + 1)
    pieces: bool  # xor: one set does not fit, so each step is captured in pieces


def staging_sets(path: str, mode: Mode, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compressor: TopK | None, max_host_bytes: int, queue_depth: int, *, say: bool = False,
                 pieces_ok: bool = False) -> HostPlan:
    """How many buffer sets fit ``max_host_bytes`` (at most ``queue_depth + 1``). A state of which
    one set does not fit is captured in pieces in ``xor`` mode where ``pieces_ok`` (one set, read
    through a buffer that fits); refused otherwise, or when one tensor does not fit, with a
    :class:`UsageError` before anything is written."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pin = bool(params) and params[0].device.type == "cuda"
    k = compressor.k_for if compressor is not None and mode == "lowdiff" else None
    one = staging_set_bytes(mode, model, optimizer, pin=pin, topk_k=k)
    if one > max_host_bytes and mode == "xor" and pieces_ok:
        staged = xor_staged_tensors(model, optimizer, pin=pin)
        besides = sum(t.nbytes for t in staged if t.buffer)  # staged when the step ends, whole
        largest = max(staged, key=lambda t: t.nbytes)
        if largest.nbytes > max_host_bytes:
            raise UsageError(
                f"{path}: {largest.what} takes {largest.nbytes} bytes of host memory, more than "
                f"max_host_bytes={max_host_bytes}: a state larger than the budget is captured in pieces, but a piece "
                f"holds at least one whole tensor; give CaptureOptions(max_host_bytes=...) at least {largest.nbytes} "
                "if this machine has the memory to spare, or shard the model (each rank stages its own shards)")
        read = max((t for t in staged if not t.buffer), key=lambda t: t.nbytes, default=None)
        if read is not None and besides + read.nbytes > max_host_bytes:
            raise UsageError(
                f"{path}: the model's buffers ({besides} bytes, staged whole when a step ends) and {read.what} "
                f"({read.nbytes} bytes) take more host memory than max_host_bytes={max_host_bytes}: a state larger "
                "than the budget is captured in pieces, but a piece holds at least one whole tensor; give "
                f"CaptureOptions(max_host_bytes=...) at least {besides + read.nbytes}")
        if say:
            log.info("%s: one staging set of this state takes %d bytes, more than max_host_bytes=%d: each step is "
                     "captured in pieces (training waits at the next optimizer step until the writer has read the "
                     "state; no Adam prediction)", path, one, max_host_bytes)
        return HostPlan(1, True)
    if one > max_host_bytes:
        less = ""
        if mode == "xor":
            grads = staging_set_bytes("lowdiff+", model, optimizer, pin=pin)
            less = f"; mode='lowdiff+' stages only the gradients and buffers ({grads} bytes here)"
        what = ("the whole state, with the optimizer state its first step creates" if mode == "xor"
                else "the gradients and buffers")
        pieces = (" (a sharded state is not captured in pieces)" if mode == "xor"
                  else " (only mode 'xor' captures a state in pieces)")
        raise UsageError(
            f"{path}: one staging set of this state takes {one} bytes of host memory ({mode}: {what}), more "
            f"than max_host_bytes={max_host_bytes}{pieces}; give CaptureOptions(max_host_bytes=...) at least {one} "
            f"if this machine has the memory to spare{less}, or shard the model (each rank stages its own shards)")
    sets = max(1, min(queue_depth + 1, max_host_bytes // max(1, one)))
    if say and sets < queue_depth + 1:
        log.info("%s: %d staging set(s) of %d bytes fit max_host_bytes=%d: %d step(s) may wait for the writer "
                 "instead of queue_depth=%d", path, sets, one, max_host_bytes, sets - 1, queue_depth)
    return HostPlan(sets, False)


def _one_way(given: dict[str, object], name: str, keyword: T, default: T) -> T:
    """A setting given as a Checkpointer keyword or in ``options``, not both."""
    if name not in given:
        return keyword
    if keyword != default:
        raise UsageError(f"{name} is given both as a keyword and in options=; give it one way")
    return given[name]  # type: ignore[return-value]  # CaptureOptions checked its type
