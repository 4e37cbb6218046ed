"""How a :class:`~ldformat.Checkpointer` is put together, step by step (docs/capture-runtime.md
"Modes and life cycle", "Data parallel and sharded jobs", "Host memory", "Pipeline").

:class:`CheckpointerSetup` runs the constructor's steps in their fixed order: take the live
objects (unwrapped) and refuse what cannot be captured, before anything is written; open the
rank chain of a sharded model (spec §20) or join the ranks of a data-parallel job, where a rank
other than 0 becomes a peer and records nothing; plan the staging buffers; open (or create) the
chain; then start the cadence, the hooks, the mirror and the background writer. Each step fills
the shared :class:`~.parts.Parts`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..chain.reader import ChainReader
from ..chain.sharded_probe import rank_location
from ..chain.writer import ChainWriter, build_schema
from ..errors import UsageError
from ..format.dtensors import has_dtensors
from ..format.topk import TopK
from ..stores import Store, StoreOrPath
from .background import BackgroundWriter
from .cadence import Cadence
from .ddp import ExchangeThread, ExtrasPeer, RankExtras, ResidualPeer, world_size
from .extra import Stateful
from .hooks import Hooks
from .host_memory import staging_sets
from .lifecycle import StepLifecycle
from .mirror import Mirror
from .parts import Parts
from .pieces import PieceReading
from .replica import Replica
from .resume import load_anchor_residuals, open_writer
from .rng import capture_rng
from .settings import Settings
from .sharded import (
    Committer,
    ShardedSetup,
    commit_now,
    newest_committed,
    rank_budget,
    unsynchronized_statistics,
)
from .sharded import setup as sharded_setup
from .snapshot import LazySnapshots
from .staging import BufferPool, Stager
from .stats import CaptureStats
from .tuning import Tuning, check_budget
from .unwrap import unwrap_model, unwrap_optimizer, unwrap_scheduler

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("ldformat.capture")


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


class CheckpointerSetup:
    """The constructor's steps, in order; each fills :attr:`parts` (or leaves this rank a peer)."""

    def __init__(self, parts: Parts, settings: Settings, path: str, *, step: int | None, truncate: bool,
                 max_bytes: int | None, store: Store | None, storage_options: dict[str, Any] | None,
                 process_group: dist.ProcessGroup | None) -> None:
        self.parts = parts
        self.settings = settings
        self.chain_path = path  # the chain this rank writes: a sharded model's rank chain under path
        self.step = step
        self.truncate = truncate
        self.max_bytes = max_bytes
        self.store = store
        self.storage_options = storage_options
        self.sharded_setup: ShardedSetup | None = None
        self.rank_lock: Any = None
        self.data_parallel = False
        self.passive = False  # this rank records nothing: a data-parallel peer or a copy rank
        parts.path, parts.mode, parts.kind = path, settings.mode, settings.kind
        parts.process_group = process_group
        parts.committer, parts.rank_extras, parts.exchanges, parts.mirror = None, None, None, None
        parts.copies = False

    # -- before anything is written ------------------------------------------------------------
    def take_objects(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: Stateful | None, scaler: torch.amp.GradScaler | None) -> None:
        """The live objects, unwrapped, and the refusals that need them but no other rank."""
        parts, settings = self.parts, self.settings
        self.broadcast_buffers = getattr(model, "broadcast_buffers", None)  # DDP's; None for another wrapper
        model = unwrap_model(model)
        optimizer = unwrap_optimizer(optimizer)
        scheduler = unwrap_scheduler(scheduler)
        parts.sharded = has_dtensors(model)
        every = settings.options.capture_every
        if isinstance(every, int) and every > 1 and (settings.mode != "xor" or parts.sharded
                                                     or world_size(parts.process_group) > 1):
            raise UsageError(f"capture_every={every}: only mode 'xor' with one recording process can skip steps (a "
                             "gradient delta needs every step; data-parallel and sharded ranks would have to agree "
                             "on the steps); give capture_every=1 or 'auto'")
        if self.max_bytes is not None and not parts.sharded:
            check_budget(self.max_bytes, model, optimizer)
        parts.model, parts.optimizer, parts.scheduler, parts.scaler = model, optimizer, scheduler, scaler

    def take_compressor(self) -> None:
        settings, parts = self.settings, self.parts
        compressor = settings.compressor
        parts.compressor = compressor if compressor is not None else (
            TopK(settings.topk_ratio) if settings.mode == "lowdiff" else None)
        parts.compress = settings.compress and settings.mode == "lowdiff"

    def check_host_budget(self) -> None:
        """Refuse a state whose staging does not fit ``max_host_bytes`` (a sharded model's ranks
        refuse together, in :meth:`open_sharded`)."""
        if not self.parts.sharded:
            self._staging_sets(pieces_ok=True)

    def _staging_sets(self, *, pieces_ok: bool, say: bool = False) -> tuple[int, bool]:
        parts, pipeline = self.parts, self.settings.pipeline
        return staging_sets(parts.path, parts.mode, parts.model, parts.optimizer, parts.compressor,
                            pipeline.max_host_bytes, pipeline.queue_depth, say=say, pieces_ok=pieces_ok)

    # -- the ranks -------------------------------------------------------------------------------
    def open_sharded(self, copy_ranks: bool | None) -> None:
        """A sharded model: every rank writes its own chain of local shards (spec §20); a collective."""
        parts = self.parts
        if not parts.sharded:
            return
        if self.store is not None:
            raise UsageError("with a sharded model (DTensor parameters), store= is not supported: give the "
                             "chain's location (a directory, or an object store URL) as the path")
        whole_budget = self.max_bytes
        self.max_bytes = rank_budget(self.max_bytes, parts.process_group)  # checked before the copy ranks are known
        max_bytes = self.max_bytes

        def check() -> None:  # each rank's refusals, before any rank writes
            build_schema(parts.model, parts.optimizer, parts.kind, parts.compressor)
            if max_bytes is not None:
                check_budget(max_bytes, parts.model, parts.optimizer, each_rank=True)
            self._staging_sets(pieces_ok=False)

        statistics = unsynchronized_statistics(parts.model)
        if copy_ranks is None and statistics:
            log.info("%s: %s keep per-rank running statistics, so no rank is a copy rank (spec §20.2): every "
                     "rank writes its own rank chain", parts.path, ", ".join(statistics[:3]))
        sharded = self.sharded_setup = sharded_setup(
            parts.path, parts.model, parts.optimizer, kind=parts.kind, group=parts.process_group,
            storage_options=self.storage_options, check=check,
            copies_allowed=copy_ranks if copy_ranks is not None else not statistics)
        self.rank_lock = sharded.lock
        if sharded.copies and isinstance(whole_budget, int):  # split over the rank chains that exist
            self.max_bytes = whole_budget // len(sharded.chain_ranks)
        if self.step is not None and sharded.committed is not None and self.step != sharded.committed:
            if self.rank_lock is not None:
                self.rank_lock.release()
            raise UsageError(f"{parts.path}: the sharded chain's newest committed step is {sharded.committed}; "
                             f"a sharded chain continues from it, not from step {self.step}")
        self.chain_path, self.truncate = sharded.rank_path, True
        self.step = sharded.committed if sharded.committed is not None else self.step

    def join_ranks(self) -> None:
        """Data parallel (replicated parameters, DDP): rank 0 records the state, which every rank
        holds alike, once; every other rank becomes a peer, which sends rank 0 its own RNG states
        and data position every step (spec §19.1 ``ranks``) and, in 'lowdiff', its top-k
        residuals at every anchor."""
        parts, settings = self.parts, self.settings
        parts.world_size = 1 if parts.sharded else world_size(parts.process_group)
        self.data_parallel = parts.world_size > 1
        parts.copies = bool(self.sharded_setup.copies) if self.sharded_setup is not None else False
        self.passive = self.data_parallel and torch.distributed.get_rank(parts.process_group) != 0
        if self.data_parallel and not self.passive:
            note = per_rank_statistics_note(self.broadcast_buffers, unsynchronized_statistics(parts.model))
            if note:
                log.warning("%s: %s", parts.path, note)
        if self.data_parallel and settings.mode in ("xor", "lowdiff+"):
            parts.world_size = 1  # every rank's state is rank 0's: no per-rank residuals
        if parts.world_size > 1 and (settings.policy.anchor_every == "auto" or settings.compressor is None):
            raise UsageError(
                "with several ranks in mode 'lowdiff', give an integer anchor_every (every rank must know the "
                "anchor steps) and compressor=, the TopK of your topk_comm_hook (or use mode 'xor' or 'lowdiff+', "
                "which need neither)"
            )

    def start_policy(self) -> None:
        """The stats and the anchor/batch policy (docs/capture-runtime.md "Anchor interval and batch size")."""
        parts, policy = self.parts, self.settings.policy
        parts.max_batch_bytes = self.settings.pipeline.max_batch_bytes
        parts.stats = CaptureStats()
        parts.tuning = Tuning(policy.anchor_every, policy.batch_steps, stats=parts.stats, max_stall=policy.max_stall,
                              mtbf_s=policy.mtbf_hours * 3600.0,
                              max_batch_bytes=self.settings.pipeline.max_batch_bytes,
                              max_lost_s=policy.max_lost_s, max_bytes=self.max_bytes)

    def residual_peer(self, data: Stateful | None) -> ResidualPeer:
        """A data-parallel rank other than 0: it records nothing (docs/capture-runtime.md "Data-parallel `lowdiff`")."""
        parts, anchor_every = self.parts, self.settings.policy.anchor_every
        return ResidualPeer(parts.optimizer, parts.compressor if parts.mode == "lowdiff" else None,
                            anchor_every=anchor_every if isinstance(anchor_every, int) else None,
                            model=parts.model, process_group=parts.process_group, scaler=parts.scaler, data=data)

    def exchange_first_extras(self) -> dict[str, dict[str, object]] | None:
        """Rank 0 records the RNG states and data positions of the ranks that write no chain of
        their own: DDP's other ranks, a sharded job's copy ranks (spec §19.1, §20.2); the copy
        ranks' sources take part with the digest of their unsharded tensors. Returns the others'
        at the opening, for the first anchor."""
        parts, sharded = self.parts, self.sharded_setup
        copies = sharded.copies if sharded is not None else {}
        sources = set(copies.values())
        if not (self.data_parallel or (copies and sharded is not None and (
                sharded.rank == 0 or sharded.is_copy or sharded.rank in sources))):
            return None
        parts.rank_extras = RankExtras(parts.process_group, sorted({0, *copies, *sources}) if copies else None,
                                       copies=copies)
        return parts.rank_extras.exchange(capture_rng(), parts.data_state(), parts.digest())

    @property
    def is_copy_rank(self) -> bool:
        return self.sharded_setup is not None and self.parts.rank_extras is not None and self.sharded_setup.is_copy

    def copy_rank_peer(self, data: Stateful | None) -> ExtrasPeer:
        """A copy rank's side (spec §20.2 ``copies``): it joins the opening's last collective and
        then only sends rank 0 its RNG states and data position; in ``lowdiff`` it sparsifies
        its gradient as its source does, from the source's residuals at the step the chain
        continues from (which the source's writer loads too)."""
        parts, sharded, extras = self.parts, self.sharded_setup, self.parts.rank_extras
        if sharded is None or extras is None:  # unreachable: only a copy rank of a sharded job
            raise RuntimeError("ldformat capture: not a copy rank")
        compress = None
        try:
            if parts.compress and parts.compressor is not None:
                if sharded.committed is not None:
                    source = ChainReader(rank_location(parts.path, sharded.copies[sharded.rank]),
                                         storage_options=self.storage_options)
                    load_anchor_residuals(source, sharded.committed, parts.compressor)
                compress = (parts.compressor, parts.model)
        except Exception as e:
            commit_now(None, parts.process_group, failed=e)  # raises e once the other ranks know
        else:
            commit_now(None, parts.process_group)
        parts.rank_extras = None
        return ExtrasPeer(parts.optimizer, extras, start=self.step if self.step is not None else 0,
                          scaler=parts.scaler, data=data, compress=compress, digest=parts.digest)

    # -- the recording rank ----------------------------------------------------------------------
    def plan_staging(self) -> None:
        """The staging buffers within ``max_host_bytes``, and how a step's state is copied into
        them: whole, lazily (docs/capture-runtime.md "Lazy snapshot") or in pieces."""
        parts, settings = self.parts, self.settings
        params = [p for g in parts.optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        parts.params, parts.cuda, parts.device_type = params, device.type == "cuda", device.type
        parts.stager = Stager(device)
        sets, parts.in_pieces = self._staging_sets(say=True, pieces_ok=not parts.sharded)
        host_budget = settings.pipeline.max_host_bytes
        parts.stats.max_host_bytes, parts.stats.staging_sets, parts.stats.pieces = host_budget, sets, parts.in_pieces
        parts.pool = BufferPool(sets, pin=parts.cuda, max_bytes=host_budget, stats=parts.stats)
        parts.lazy = LazySnapshots(parts.stager)
        lazy = settings.options.lazy_snapshot
        lazy = lazy if lazy is not None else parts.cuda  # measured on CPU: a loss
        parts.lazy.enabled = parts.mode == "xor" and lazy and not parts.in_pieces  # pieces read the live state
        parts.pieces = PieceReading(parts.path, parts.stager, parts.pool, parts.stats, parts.raise_if_failed)

    def open_chain(self, first_extra: Callable[[], dict[str, object]]) -> None:
        """Create the chain (its first anchor: the state now) or re-open it at ``step``; a sharded
        model's ranks then agree that every rank chain is open (a collective)."""
        parts = self.parts
        started = time.perf_counter()
        self.opened: ChainWriter | None = None
        try:
            writer = self._open_writer(first_extra)
            if parts.sharded:
                commit_now(parts.committer, parts.process_group)
                writer.retain_at_most = newest_committed(parts.path, self.storage_options)
        except BaseException as e:
            if self.data_parallel and parts.rank_extras is not None:
                parts.rank_extras.announce_start(None, None, e)  # the peers stop too, at once
            if parts.committer is not None:
                parts.committer.stop()
            if self.opened is not None:
                self.opened.abort()
            raise
        parts.writer = writer
        self._configure_writer(started)

    def _open_writer(self, first_extra: Callable[[], dict[str, object]]) -> ChainWriter:
        parts = self.parts
        try:
            writer = open_writer(
                self.chain_path, parts.model, parts.optimizer, kind=parts.kind, mode=parts.mode, step=self.step,
                truncate=self.truncate, compressor=parts.compressor, batch_steps=parts.tuning.batch_steps,
                store=self.store, first_extra=first_extra, storage_options=self.storage_options,
                rank_chain=parts.sharded, lock=self.rank_lock)
            self.opened = writer  # aborted if what follows fails
            if self.sharded_setup is not None and self.sharded_setup.rank == 0:
                parts.committer = Committer(parts.path, self.sharded_setup.chain_ranks, self.storage_options,
                                            parts.stats)
        except Exception as e:
            if parts.sharded:
                commit_now(None, parts.process_group, failed=e)  # raises e once the other ranks know
            raise
        return writer

    def _configure_writer(self, started: float) -> None:
        parts, pipeline = self.parts, self.settings.pipeline
        writer = parts.writer
        writer.max_batch_bytes = pipeline.max_batch_bytes  # bounds memory whether batch_steps is stated or auto
        if pipeline.encode_threads is not None:
            writer.encode_threads = pipeline.encode_threads
        writer.max_bytes = self.max_bytes
        if parts.in_pieces:  # a row coded piece by piece: each tensor against its own base only
            writer.predict_state = False
        if writer.commits:  # create() wrote the first anchor
            parts.tuning.anchor_write_s = time.perf_counter() - started

    def start_cadence(self) -> StepLifecycle:
        """Which steps are captured (docs/capture-runtime.md "Bounded cost"), and the step life
        cycle from the chain's last step. Only a state delta may span steps, and only one
        recording process decides which; the others capture every step, and say so when that
        costs more than the budget."""
        parts, settings = self.parts, self.settings
        options = settings.options
        last = int(parts.writer.last_step or 0)
        parts.cadence = Cadence(options, adaptive=settings.mode == "xor" and options.capture_every == "auto" and not (
            parts.sharded or self.data_parallel), last_captured=last, max_lost_s=settings.policy.max_lost_s)
        parts.tuning.cadence = parts.cadence
        parts.stats.capture_every = parts.cadence.every
        parts.stats.durable_at = time.monotonic()
        if parts.rank_extras is not None and self.data_parallel:
            anchor_every = settings.policy.anchor_every
            parts.rank_extras.announce_start(last, anchor_every if isinstance(anchor_every, int) else None)
        if parts.rank_extras is not None:  # after the last collective of the opening on its group
            parts.exchanges = ExchangeThread(parts.rank_extras)
        schema = parts.writer.root.schema
        parts.param_names = schema["optimizer"]["params"]
        parts.buffer_names = [e["name"] for e in schema["model"] if e["role"] == "buffer" and e["alias_of"] is None]
        parts.buffer_keys = {f"model/{n}" for n in parts.buffer_names}
        life = StepLifecycle(parts, step=last)
        parts.replica = Replica(parts.writer, parts.optimizer) if parts.mode == "lowdiff+" else None
        return life

    def install_hooks(self, life: StepLifecycle) -> None:
        """The optimizer's step hooks, and the wrappers that close a step (docs/capture-runtime.md "Capture points")."""
        parts, settings = self.parts, self.settings
        hooks = parts.hooks = Hooks()
        hooks.add(parts.optimizer.register_step_pre_hook(life.pre_hook))
        hooks.add(parts.optimizer.register_step_post_hook(life.post_hook))
        if parts.lazy.enabled or parts.in_pieces:  # the last step can be judged, and written, as a forward starts
            hooks.add(parts.model.register_forward_pre_hook(lambda module, args: life.settle()))
        stage = settings.pipeline.stage_during_backward
        if stage is None:
            stage = parts.cuda
        if parts.mode == "lowdiff+" and stage:
            for i, p in enumerate(parts.params):
                hooks.add(p.register_post_accumulate_grad_hook(life.stage_hook(i)))  # type: ignore[no-untyped-call]
        if parts.scheduler is not None:
            hooks.call_after(parts.scheduler, "step", life.after_scheduler_step)
        if parts.scaler is not None:
            hooks.call_after(parts.scaler, "update", life.after_scaler_update)
            # GradScaler.unscale_ (also called inside scaler.step) rewrites the gradients in
            # place without bumping their version counters: re-copy every staged gradient.
            hooks.call_after(parts.scaler, "unscale_", life.forget_staged)

    def start_mirror(self, mirror: StoreOrPath | None, mirror_options: dict[str, Any] | None) -> None:
        """Replicate the chain in the background (the Checkpointer's ``mirror``): after each local commit."""
        parts = self.parts
        if mirror is not None and parts.sharded:
            if parts.committer is not None:  # rank 0 replicates the whole sharded chain (spec §20)
                parts.mirror = Mirror(parts.path, mirror, stats=parts.stats, src_options=self.storage_options,
                                      dst_options=mirror_options)
                parts.committer.on_commit = parts.mirror.committed
                parts.mirror.committed(parts.committer.committed)
        elif mirror is not None:
            parts.mirror = Mirror(self.store if self.store is not None else parts.path, mirror, stats=parts.stats,
                                  src_options=None if self.store is not None else self.storage_options,
                                  dst_options=mirror_options)
            parts.mirror.committed(parts.writer.durable_step)  # the chain as opened (or just created)

    def start_background(self) -> None:
        """The background writer thread (docs/capture-runtime.md "Pipeline")."""
        parts = self.parts
        on_commit = (parts.committer.nudge if parts.committer is not None
                     else parts.mirror.committed if parts.mirror is not None else None)
        parts.background = BackgroundWriter(parts.writer, parts.pool, parts.stats, parts.tuning, parts.replica,
                                            on_commit=on_commit)

