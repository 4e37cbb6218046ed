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
"Pipeline"). Training blocks only when every buffer set is in flight.

``Checkpointer`` is the front: its public API over role objects, each in its own module.
:mod:`.settings` checks the keywords and ``options`` in one place; :mod:`.setup` puts the
roles together in named steps (the ranks of a data-parallel or sharded job, the staging plan,
the chain, the hooks, the threads) into the shared :mod:`.parts`; :mod:`.lifecycle` captures
each step from hook to hand-off, with :mod:`.snapshot` (lazy) and :mod:`.pieces` (a state
over the host budget); :mod:`.closing` flushes and closes. Next door: the ``lowdiff+``
replica in :mod:`.replica`, data-parallel residuals in :mod:`.ddp`, the anchor interval and
batch size in :mod:`.tuning`, the extra state in :mod:`.extra`, opening and resuming in
:mod:`.resume`, hook bookkeeping in :mod:`.hooks`, the host budget in :mod:`.host_memory`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from queue import Queue
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

from ..errors import UsageError
from ..format.manifest import Kind
from ..format.topk import TopK
from ..stores import Store, StoreOrPath
from .background import BackgroundWriter, Queued
from .cadence import Cadence
from .closing import Closing
from .ddp import ExtrasPeer
from .extra import Stateful, check_scalars, loop_extra
from .hooks import open_at_exit
from .host_memory import HostPlan, staging_sets
from .lifecycle import OpenStep, StepLifecycle
from .mirror import DEFAULT_MIRROR_TIMEOUT_S
from .options import CaptureOptions
from .parts import Parts
from .pieces import PIECE_ALIGN, PIECES, PieceReader
from .policy import AdaptiveTuner, PolicyInputs
from .replica import Replica
from .rng import capture_rng
from .settings import DEFAULT_MODE, DEFAULT_QUEUE_DEPTH, MODES, Mode, Settings
from .setup import CheckpointerSetup, per_rank_statistics_note
from .sharded import DEFAULT_COMMIT_TIMEOUT_S, Committer, buffer_digest
from .snapshot import LazySnapshots
from .staging import BufferPool, Stager
from .stats import CaptureStats
from .tuning import DEFAULT_MAX_LOST_S, Interval, Tuning

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..chain.writer import ChainWriter

T = TypeVar("T")

__all__ = [  # the names this module has always offered, wherever they live now
    "DEFAULT_MODE", "DEFAULT_QUEUE_DEPTH", "MODES", "PIECES", "PIECE_ALIGN", "Checkpointer", "HostPlan", "Mode",
    "per_rank_statistics_note", "staging_sets",
]


class _Part(Generic[T]):
    """An attribute of the Checkpointer read from its :class:`~.parts.Parts` (one source of truth)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Part[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object, owner: type) -> T | _Part[T]:
        if obj is None:
            return self
        return getattr(obj._parts, self.name)  # type: ignore[attr-defined,no-any-return]


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
        mirror: StoreOrPath | None = None,
        mirror_options: dict[str, Any] | None = None,
        mirror_timeout: float = DEFAULT_MIRROR_TIMEOUT_S,
        commit_timeout: float = DEFAULT_COMMIT_TIMEOUT_S,
        copy_ranks: bool | None = None,
        options: CaptureOptions | None = None,
    ) -> None:
        settings = Settings.from_arguments(
            mode=mode, options=options, compressor=compressor, topk_ratio=topk_ratio, compress=compress,
            anchor_every=anchor_every, batch_steps=batch_steps, max_stall=max_stall, mtbf_hours=mtbf_hours,
            max_lost_s=max_lost_s, queue_depth=queue_depth, max_batch_bytes=max_batch_bytes,
            encode_threads=encode_threads, stage_during_backward=stage_during_backward)
        self.options = settings.options
        self._parts = parts = Parts()
        self._passive = False  # this rank records nothing (a data-parallel peer or a copy rank)
        self._peer: ExtrasPeer | None = None
        self._life: StepLifecycle | None = None
        self._closing: Closing | None = None
        self._peer_scalars: dict[str, float] = {}  # a peer's log(), checked but not recorded
        parts.raw_extra, parts.data_state, parts.digest = self._raw_extra, self._data_state, self._digest
        parts.mirror_timeout, parts.commit_timeout = mirror_timeout, commit_timeout
        setup = CheckpointerSetup(parts, settings, str(path), step=step, truncate=truncate, max_bytes=max_bytes,
                                  store=store, storage_options=storage_options, process_group=process_group)
        setup.take_objects(model, optimizer, scheduler, scaler)
        self.sampler = self._data_position(data, sampler)
        self.user_extra: dict[str, object] = dict(extra or {})
        setup.take_compressor()
        setup.check_host_budget()
        setup.open_sharded(copy_ranks)
        setup.join_ranks()
        setup.start_policy()
        if setup.passive:
            self._passive, self._peer = True, setup.residual_peer(self.sampler)
            return
        initial_ranks = setup.exchange_first_extras()
        if setup.is_copy_rank:  # its state is its source rank's chain's: it writes nothing
            self._passive, self._peer = True, setup.copy_rank_peer(self.sampler)
            return
        setup.plan_staging()
        setup.open_chain(first_extra=lambda: self._raw_extra(capture_rng(), self._data_state(), initial_ranks))
        self._life = life = setup.start_cadence()
        setup.install_hooks(life)
        setup.start_mirror(mirror, mirror_options)
        setup.start_background()
        self._closing = Closing(parts, life)
        open_at_exit.add(self)

    # -- what callers read: the recording rank's parts ----------------------------------------
    path: _Part[str] = _Part()
    mode: _Part[Mode] = _Part()
    kind: _Part[Kind] = _Part()
    model: _Part[torch.nn.Module] = _Part()
    optimizer: _Part[torch.optim.Optimizer] = _Part()
    scheduler: _Part[Stateful | None] = _Part()
    scaler: _Part[torch.amp.GradScaler | None] = _Part()
    compressor: _Part[TopK | None] = _Part()
    process_group: _Part[dist.ProcessGroup | None] = _Part()
    sharded: _Part[bool] = _Part()
    world_size: _Part[int] = _Part()
    max_batch_bytes: _Part[int] = _Part()
    stats: _Part[CaptureStats] = _Part()
    tuning: _Part[Tuning] = _Part()
    cadence: _Part[Cadence] = _Part()
    stager: _Part[Stager] = _Part()
    pool: _Part[BufferPool] = _Part()
    writer: _Part[ChainWriter] = _Part()
    mirror_timeout: _Part[float] = _Part()
    commit_timeout: _Part[float] = _Part()

    @staticmethod
    def _data_position(data: Stateful | None, sampler: Stateful | None) -> Stateful | None:
        if data is not None and sampler is not None:
            raise UsageError("pass the data position as data= (sampler= is its former name), not both")
        return data if data is not None else sampler

    def _digest(self) -> str | None:
        """With copy ranks: the crc of this rank's unsharded tensors, which rank 0 compares
        between every copy rank and its source at every step (a copy rank's state must be its
        source's)."""
        return buffer_digest(self.model) if self._parts.copies else None

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

    @property
    def capture_every(self) -> int:
        """The capture interval in force, in steps (docs/capture-runtime.md "Bounded cost")."""
        return self.cadence.every

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
        if self._life is not None:
            self._life.log(scalars)
        else:  # a peer records nothing; the names are still checked, as for the rank that records
            self._peer_scalars.update(check_scalars(dict(scalars), len(set(self._peer_scalars) - set(scalars))))

    @property
    def step(self) -> int:
        """The last captured step (queued; see :attr:`durable_step`)."""
        return self._life.step if self._life is not None else 0

    @property
    def durable_step(self) -> int | None:
        return None if self._passive else self.writer.durable_step

    def flush(self) -> int | None:
        """Wait for every queued step, commit, and return the last durable step."""
        if self._closing is None:
            return None
        return self._closing.flush()

    def recover(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """``lowdiff+``: restore the live objects from the in-memory replica (no storage read).

        Returns the step restored. The replica equals the chain's state at that step.
        """
        life = self._life
        if life is None or self._parts.replica is None:
            raise UsageError("recover() needs mode='lowdiff+' (the only mode with an in-memory replica), on the "
                             "rank that records (rank 0 with data parallelism)")
        life.finalize_ended()
        self._parts.background.join()
        self._parts.raise_if_failed()
        self._parts.replica.load_into(life.step, model, optimizer)
        return life.step

    def close(self) -> int | None:
        """Flush and commit everything, stop the background thread, remove every hook.

        With a ``mirror``: then one final sync, bounded by ``mirror_timeout`` (a warning
        says how far the mirror stays behind if it does not complete).
        """
        if self._closing is None:
            if self._peer is not None:
                self._peer.close()
            return None
        return self._closing.close(lambda: open_at_exit.discard(self))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- private names that tests and benchmarks reach for, delegated to the roles ------------
    @property
    def _lazy(self) -> LazySnapshots:
        return self._parts.lazy

    @property
    def _background(self) -> BackgroundWriter:
        return self._parts.background

    @property
    def _thread(self) -> threading.Thread:
        return self._parts.background.thread

    @property
    def _queue(self) -> Queue[Queued | None]:
        return self._parts.background.queue

    @property
    def _committer(self) -> Committer | None:
        return self._parts.committer

    @property
    def _replica(self) -> Replica | None:
        return self._parts.replica

    @property
    def _pieces(self) -> bool:
        return self._parts.in_pieces

    @property
    def _reading(self) -> threading.Event | None:
        return self._parts.pieces.reading

    @property
    def _piece_reader(self) -> Callable[..., PieceReader]:
        return self._parts.pieces.reader

    @_piece_reader.setter
    def _piece_reader(self, reader: Callable[..., PieceReader]) -> None:
        self._parts.pieces.reader = reader  # type: ignore[method-assign]

    @property
    def _pending(self) -> OpenStep | None:
        return self._life.open if self._life is not None else None

    @property
    def _step(self) -> int:
        return self.step

    @property
    def _closed(self) -> bool:
        return self._life is not None and self._life.closed

    @property
    def _last_pre(self) -> float | None:
        return self._life.last_pre if self._life is not None else None

    @_last_pre.setter
    def _last_pre(self, value: float | None) -> None:
        if self._life is not None:
            self._life.last_pre = value

    @property
    def _last_step_bytes(self) -> int:
        return self._life.last_step_bytes if self._life is not None else 0

    def _raise_if_failed(self) -> None:
        self._parts.raise_if_failed()
