"""Lightning: checkpoint every optimizer step into an ldformat chain, resume in one line.

:class:`LdformatCheckpoint` is a Lightning ``Callback``. At ``on_train_start`` it opens a
:class:`~ldformat.Checkpointer` (mode ``xor``: lossless, exact in any environment) on the
``LightningModule`` and the trainer's optimizer, so that every optimizer step lands in the
chain. With each step it records what a Lightning checkpoint holds besides the weights (loop
progress with the state of resumable data loaders, callback, datamodule, precision-plugin and
LR-scheduler states) and the RNG states at the points a resumed run needs them, as the
``lightning`` member of ``extra.user`` (spec §19.1 "The `extra` object"; the scheduler
member holds ``{"lr_schedulers": [...]}``, one state per Lightning scheduler).
:meth:`LdformatCheckpoint.resume_checkpoint` materializes the chain's latest step into a
``.ckpt`` file that ``trainer.fit(ckpt_path=...)`` accepts::

    cb = LdformatCheckpoint("runs/chain")
    trainer = L.Trainer(max_steps=1000, callbacks=[cb])
    trainer.fit(model, loader, ckpt_path=cb.resume_checkpoint())   # None on a fresh chain

Where a step ends. The Checkpointer captures the model and optimizer when
``optimizer.step()`` returns; the step is queued for writing only when the callback ends it at
the start of the next batch (or when training stops), because only then are two of its parts
known: the callbacks' states after everything that followed the step (validation included) and
the RNG state at which the next batch starts. The loop progress and the data position are taken
at ``on_train_batch_end``, where Lightning's own ``ModelCheckpoint`` takes them, so Lightning's
restart logic applies to them unchanged. A crash between a step and the next batch loses that
step; the rerun redoes it.

RNG. A resumed run sets two recorded states (CPU, CUDA, Python, NumPy): before Lightning
creates the data iterator, the state from which the original run created the iterator of the
epoch the next batch belongs to (so that a shuffling loader draws the same permutation, also
when the resumed run starts a new epoch); and at the first ``on_train_batch_start``, the state
at which the original run started that batch (so that dropout draws the same masks: creating
the iterator on resume consumes random numbers that the original run did not). Lightning's own
checkpoints hold no RNG state.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - exercised in a subprocess without lightning
    raise ImportError(
        "ldformat.integrations.lightning needs Lightning (lightning.pytorch): pip install 'ldformat[lightning]'"
    ) from e

from ..api import sync
from ..capture.options import CaptureOptions
from ..capture.rng import RngState, capture_rng, restore_rng
from ..capture.runtime import Checkpointer
from ..capture.tuning import Interval
from ..chain.reader import ChainReader
from ..errors import LdformatError, NotAChainError, UsageError
from ..export.files import write_atomically
from ..format.jsonvalue import JSON, encode

__all__ = ["LdformatCheckpoint"]

log = logging.getLogger("ldformat.capture")

_KEY = "lightning"
"""The member of ``extra.user`` that holds the Lightning state of a step."""

_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


class _Recorded(TypedDict):
    """The ``extra.user.lightning`` of a step."""

    checkpoint: dict[str, object]  # a Lightning checkpoint, less weights, optimizer and LR schedulers
    rng_data: dict[str, object] | None  # the RNG from which the data iterator of the step's epoch was made
    rng_batch: dict[str, object] | None  # the RNG at which the next batch starts


class _Resumed(TypedDict):
    """This callback's state in a checkpoint :meth:`LdformatCheckpoint.resume_checkpoint` wrote."""

    chain: str
    step: int
    rng_data: dict[str, object] | None
    rng_batch: dict[str, object] | None


class _Schedulers:
    """The trainer's LR schedulers as the one scheduler a :class:`Checkpointer` captures.

    The Checkpointer queues a step when its scheduler's ``step()`` returns; Lightning steps the
    real schedulers, and the callback calls this ``step()`` to end a step once its Lightning
    state is recorded. ``state_dict()`` is ``{"lr_schedulers": [...]}``, the member of that
    name of a Lightning checkpoint.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    # Any: a torch-style state dict, as the Stateful protocol has it.
    def state_dict(self) -> dict[str, Any]:
        return {"lr_schedulers": [c.scheduler.state_dict() for c in self._trainer.lr_scheduler_configs]}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        for config, state in zip(self._trainer.lr_scheduler_configs, state_dict["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(state)

    def step(self) -> None:
        """Ends the step being captured (the Checkpointer runs its code after this returns)."""


class LdformatCheckpoint(Callback):
    """Record every optimizer step of ``trainer.fit`` into an ldformat chain; resume from it in one line.

    Args:
        path: the chain: a directory (created on the first fit) or a URL (``s3://...``,
            see :func:`ldformat.stores.open_store`).
        anchor_every, batch_steps: the Checkpointer's anchor interval and steps per commit
            (``"auto"``: derived from measured costs).
        max_stall, mtbf_hours, queue_depth: passed to :class:`~ldformat.Checkpointer`.
        storage_options: settings of the object store at the URL ``path``.
        mirror, mirror_options: replicate the chain in the background to this location (see
            :class:`~ldformat.Checkpointer`); :meth:`resume_checkpoint` first copies the
            mirror's steps to ``path`` when the mirror is ahead (a lost local disk).
        extra: your own JSON-able dict, recorded as ``extra.user`` with every step; ``cb.extra``
            is that dict, so changing it changes what the next steps record.
        options: a :class:`~ldformat.CaptureOptions` (the overhead budget, the capture interval,
            ...), passed to the Checkpointer.

    Example:
        >>> cb = LdformatCheckpoint("runs/chain")                                 # doctest: +SKIP
        >>> trainer = L.Trainer(max_steps=1000, callbacks=[cb])                   # doctest: +SKIP
        >>> trainer.fit(model, datamodule, ckpt_path=cb.resume_checkpoint())      # doctest: +SKIP

    The same three lines start a run and, after a crash (even ``kill -9``), continue it from
    the chain's latest committed step: with a resumable data loader (torchdata's
    ``StatefulDataLoader``, or any loader with ``state_dict``/``load_state_dict``) and one
    process, the continuation is bit-identical to an uninterrupted run, dropout included.
    A plain ``DataLoader`` resumed inside an epoch restarts that epoch's data, as it does with
    Lightning's own checkpoints (Lightning warns).

    Limits: one process (``devices=1``), one optimizer, at most one optimizer step per batch.
    What ``on_save_checkpoint`` hooks add to a checkpoint is not recorded; keep training state
    in the module's parameters and buffers, or in a callback's ``state_dict()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        anchor_every: Interval = "auto",
        batch_steps: Interval = "auto",
        max_stall: float = 0.035,
        mtbf_hours: float = 24.0,
        queue_depth: int | None = None,
        storage_options: dict[str, Any] | None = None,  # Any: as Checkpointer and ChainReader take them
        mirror: str | os.PathLike[str] | None = None,
        mirror_options: dict[str, Any] | None = None,
        extra: dict[str, object] | None = None,
        options: CaptureOptions | None = None,
    ) -> None:
        if extra is not None and _KEY in extra:
            raise UsageError(f"extra must not have the key {_KEY!r}: LdformatCheckpoint records its state there")
        self.path = str(path)
        self.anchor_every = anchor_every
        self.batch_steps = batch_steps
        self.max_stall = max_stall
        self.mtbf_hours = mtbf_hours
        self.queue_depth = queue_depth
        self.storage_options = storage_options
        self.mirror = mirror
        self.mirror_options = mirror_options
        self.extra: dict[str, object] = dict(extra or {})
        self.options = options
        self.checkpointer: Checkpointer | None = None
        """The Checkpointer of the running fit (None outside ``trainer.fit``)."""
        self._schedulers: _Schedulers | None = None
        self._resumed: _Resumed | None = None  # our state in the .ckpt that fit() loaded
        self._temporary: Path | None = None  # a directory resume_checkpoint() made, removed once loaded
        self._global_step = 0
        self._pending: dict[str, object] | None = None  # Lightning state of the step not yet ended
        self._pending_rng: dict[str, object] | None = None  # RNG right after that step
        self._rng_data: dict[str, object] | None = None  # RNG from which this epoch's data iterator was made
        self._batch_rng: dict[str, object] | None = None  # to set at the first batch after a resume
        self._batches_this_fit = 0
        self._checked_encoding = False
        self._hparams: dict[str, object] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(path=self.path)

    # -- resuming -------------------------------------------------------------------------------
    def resume_checkpoint(self, path: str | os.PathLike[str] | None = None) -> str | None:
        """Write a Lightning checkpoint of the chain's latest step; None when there is nothing to resume.

        Args:
            path: where to write the ``.ckpt`` (atomically). Default: a temporary file, removed
                once ``trainer.fit`` has loaded it.

        Returns:
            The path to pass as ``trainer.fit(..., ckpt_path=...)``, or None when the chain does
            not exist yet or holds no step recorded by this callback (a fresh run).

        Raises:
            UsageError: the chain has steps, none of them recorded by ``LdformatCheckpoint``.
        """
        reader = self._reader()
        if reader is None or reader.latest_step is None:
            return None
        step = _latest_lightning_step(reader)
        if step is None:
            if reader.latest_step == 0:
                return None  # only the first anchor: a run that died before its first step
            raise UsageError(
                f"{self.path}: no step of this chain was recorded by LdformatCheckpoint; resume it with "
                "ldformat.resume(), or checkpoint this run to a new path"
            )
        if step != reader.latest_step:
            log.warning("%s: steps %d..%d hold no Lightning state; resuming from step %d", self.path,
                        step + 1, reader.latest_step, step)
        state = reader.materialize(step)
        checkpoint = self._lightning_checkpoint(state, step)
        if path is None:
            self._remove_temporary()
            self._temporary = Path(tempfile.mkdtemp(prefix="ldformat-lightning-"))
            out = self._temporary / f"step-{step}.ckpt"
        else:
            out = Path(path)
        _save_atomically(checkpoint, out)
        return str(out)

    def _reader(self) -> ChainReader | None:
        """The chain at ``path``, first brought up to the mirror's if the mirror is ahead."""
        local = _open_chain(self.path, self.storage_options)
        if self.mirror is None:
            return local
        try:
            remote = _open_chain(self.mirror, self.mirror_options)
        except (LdformatError, OSError) as e:
            log.warning("%s: the mirror %s is not readable (%s); resuming from %s", self.path, self.mirror, e,
                        self.path)
            return local
        ahead = remote is not None and remote.latest_step is not None and (
            local is None or local.latest_step is None or remote.latest_step > local.latest_step)
        if not ahead or remote is None:
            return local
        try:
            report = sync(self.mirror, self.path, src_options=self.mirror_options, dst_options=self.storage_options)
        except LdformatError as e:
            raise UsageError(
                f"{self.path}: the mirror {self.mirror} is ahead (step {remote.latest_step}) but cannot be copied "
                f"here ({e}); move {self.path} away to resume from the mirror"
            ) from e
        log.warning("%s: the mirror %s is ahead (step %s): copied %d records from it", self.path, self.mirror,
                    remote.latest_step, report.records_copied)
        return _open_chain(self.path, self.storage_options)

    # Any: what ChainReader.materialize returns.
    def _lightning_checkpoint(self, state: dict[str, Any], step: int) -> dict[str, object]:
        extra = state["extra"]
        recorded = cast(_Recorded, extra["user"][_KEY])
        checkpoint = dict(recorded["checkpoint"])
        if checkpoint.get("global_step") != step:
            raise UsageError(f"{self.path}: step {step} records Lightning's global_step "
                             f"{checkpoint.get('global_step')!r}; the chain was not written by one fit")
        checkpoint["state_dict"] = state["model"]
        checkpoint["optimizer_states"] = [state["optimizer"]]
        checkpoint["lr_schedulers"] = extra["scheduler"]["lr_schedulers"]
        callbacks = cast(dict[str, object], checkpoint.setdefault("callbacks", {}))
        callbacks[self.state_key] = _Resumed(chain=self.path, step=step, rng_data=recorded["rng_data"],
                                             rng_batch=recorded["rng_batch"])
        return checkpoint

    # Any: Lightning's signatures.
    def state_dict(self) -> dict[str, Any]:
        return {}  # only the checkpoints resume_checkpoint() writes carry this callback's state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._resumed = cast(_Resumed, state_dict)
        # Lightning may call this after on_fit_start (strategies that restore after setup):
        # set the RNG here too, then again at on_fit_start where that comes later.
        _set_rng(state_dict["rng_data"])

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.world_size > 1:
            raise UsageError("LdformatCheckpoint records one process (devices=1); for data-parallel training, "
                             "construct ldformat.Checkpointer with the same arguments on every rank")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = None
        self._batches_this_fit = 0
        self._batch_rng = None
        if self._resumed is not None:
            _set_rng(self._resumed["rng_data"])
            self._batch_rng = self._resumed["rng_batch"]
        # Lightning creates the first epoch's data iterator after this hook (the sanity check in
        # between runs with the RNG state isolated).
        self._rng_data = _rng()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise UsageError(f"LdformatCheckpoint records one optimizer; configure_optimizers returned "
                             f"{len(trainer.optimizers)}")
        step, truncate = self._opening_step(trainer)
        self._schedulers = _Schedulers(trainer)
        self.checkpointer = Checkpointer(
            self.path, pl_module, trainer.optimizers[0], mode="xor", scheduler=self._schedulers,
            scaler=getattr(trainer.precision_plugin, "scaler", None), step=step, truncate=truncate,
            anchor_every=self.anchor_every, batch_steps=self.batch_steps, max_stall=self.max_stall,
            mtbf_hours=self.mtbf_hours, queue_depth=self.queue_depth, storage_options=self.storage_options,
            mirror=self.mirror, mirror_options=self.mirror_options, extra=self.extra, options=self.options,
        )
        self.checkpointer.user_extra = self.extra  # live: changes reach the next steps
        self._hparams = _hyper_parameters(pl_module)
        self._global_step = trainer.global_step
        self._resumed = None
        self._remove_temporary()  # Lightning has loaded it

    def _opening_step(self, trainer: pl.Trainer) -> tuple[int | None, bool]:
        """The step to open the chain at, and whether to truncate the steps after it."""
        step = trainer.global_step
        if self._resumed is not None:
            if self._resumed["step"] != step:
                raise UsageError(f"{self.path}: the checkpoint is of step {self._resumed['step']}, but the "
                                 f"trainer is at global_step {step}")
            return step, True  # steps after it (if any) are redone by this run
        reader = _open_chain(self.path, self.storage_options)
        latest = reader.latest_step if reader is not None else None
        if latest is None or latest == step:
            return None, False
        if step == 0:
            raise UsageError(
                f"{self.path}: the chain holds steps up to {latest}; pass "
                "trainer.fit(..., ckpt_path=cb.resume_checkpoint()) to continue it, or use a new path"
            )
        if reader is not None and step in reader.steps:
            log.warning("%s: resuming from another checkpoint at step %d: the chain's steps after it are "
                        "truncated", self.path, step)
            return step, True
        raise UsageError(f"{self.path}: the trainer is at global_step {step}, which the chain (steps up to "
                         f"{latest}) does not hold; resume with ckpt_path=cb.resume_checkpoint()")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The iterator of a later epoch is created right after this hook; the first epoch's of
        # a fit was created before it (see on_fit_start).
        if self._batches_this_fit:
            self._rng_data = _rng()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self._end_step(trainer, rng_batch=_rng())
        self._batches_this_fit += 1
        if self._batch_rng is not None:
            _set_rng(self._batch_rng)
            self._batch_rng = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if self.checkpointer is None or trainer.global_step == self._global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        if trainer.global_step != self._global_step + 1:
            raise UsageError(f"LdformatCheckpoint records one optimizer step per batch; batch {batch_idx} made "
                             f"{trainer.global_step - self._global_step}")
        self._global_step = trainer.global_step
        self._pending = _progress_state(trainer)
        self._pending_rng = _rng()
        # The step closes at the next batch's start: its loss goes with it.
        self.checkpointer.log(**_step_scalars(outputs))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.checkpointer is not None:
            self._close(trainer)
        self._resumed = None  # a fit that had nothing left to train never reached on_train_start
        self._remove_temporary()

    # -- ending steps ---------------------------------------------------------------------------
    def _end_step(self, trainer: pl.Trainer, rng_batch: dict[str, object] | None) -> None:
        """Record the Lightning state of the captured step and queue the step for writing."""
        ck, schedulers, pending = self.checkpointer, self._schedulers, self._pending
        if ck is None or schedulers is None or pending is None:
            return
        self._pending = None
        checkpoint = dict(pending)
        if self._hparams is not None:
            checkpoint["hyper_parameters"] = self._hparams
        checkpoint["callbacks"] = copy.deepcopy({
            cb.state_key: state for cb in _callbacks(trainer) if cb is not self and (state := cb.state_dict())
        })
        recorded: _Recorded = {
            "checkpoint": checkpoint,
            "rng_data": self._rng_data,
            # Training stopped before a next batch: the state right after the step is the best guess.
            "rng_batch": rng_batch if rng_batch is not None else self._pending_rng,
        }
        if not self._checked_encoding:
            try:
                encode(recorded, f"extra.user.{_KEY}")
            except LdformatError as e:
                raise UsageError(f"LdformatCheckpoint cannot record the trainer's state: {e}") from e
            self._checked_encoding = True
        ck.user_extra[_KEY] = recorded
        try:
            schedulers.step()  # the Checkpointer queues the step, with a copy of user_extra
        finally:
            del ck.user_extra[_KEY]
        if ck.step != checkpoint["global_step"]:
            raise UsageError(f"{self.path}: the chain is at step {ck.step} but Lightning at global_step "
                             f"{checkpoint['global_step']}: an optimizer step ran outside Lightning's loop")

    def _close(self, trainer: pl.Trainer) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        try:
            self._end_step(trainer, rng_batch=None)
        finally:
            self.checkpointer = None
            self._schedulers = None
            ck.close()

    def _remove_temporary(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


def _step_scalars(outputs: object) -> dict[str, object]:
    """The flight recorder's scalars of a step (spec §19.1 ``scalars``): the loss
    ``training_step`` returned (a tensor, or a dict's ``"loss"``). The Checkpointer records the
    learning rate the step used itself: Lightning steps per-step schedulers before
    ``on_train_batch_end``, so the lr read here would be the next step's."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return {"loss": loss.detach()}
    return {}


def _progress_state(trainer: pl.Trainer) -> dict[str, object]:
    """What ``ModelCheckpoint`` saves at ``on_train_batch_end`` besides weights, optimizer,
    schedulers and callbacks: loop progress (with resumable loaders' positions), the
    datamodule's and the precision plugin's state (copies)."""
    state: dict[str, object] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,  # type: ignore[attr-defined]  # not re-exported
        "loops": {name: getattr(trainer, name).state_dict() for name in _LOOPS},
    }
    precision = trainer.precision_plugin
    if precision_state := precision.state_dict():
        state[type(precision).__qualname__] = precision_state
    datamodule: pl.LightningDataModule | None = trainer.datamodule  # type: ignore[attr-defined]  # set by a connector
    if datamodule is not None and (datamodule_state := datamodule.state_dict()):
        state[type(datamodule).__qualname__] = datamodule_state
    return copy.deepcopy(state)


def _rng() -> dict[str, object]:
    """:func:`capture_rng`, with Python's 625-int state as a tensor: copied once per step
    twice (here and by the Checkpointer), a tuple of ints costs a deepcopy call per int."""
    state = capture_rng()
    python = state.get("python")
    if isinstance(python, tuple):
        version, internal, gauss = python
        state["python"] = (version, torch.tensor(internal, dtype=torch.int64), gauss)
    return state


def _set_rng(state: object) -> None:
    """Restore a state recorded by :func:`_rng`."""
    rng = dict(cast(Mapping[str, object], state))
    python = rng.get("python")
    if python is not None:
        version, internal, gauss = cast(tuple[int, torch.Tensor, float | None], python)  # as _rng() makes it
        rng["python"] = (version, tuple(int(i) for i in internal.tolist()), gauss)
    restore_rng(cast(RngState, rng))


def _open_chain(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> ChainReader | None:
    try:
        return ChainReader(path, storage_options=storage_options)
    except NotAChainError:
        return None


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    return callbacks


def _hyper_parameters(pl_module: pl.LightningModule) -> dict[str, object] | None:
    """The module's ``hparams`` (what ``load_from_checkpoint`` needs), if they can be recorded."""
    hparams = dict(pl_module.hparams)
    if not hparams:
        return None
    try:
        encode(hparams, "hyper_parameters")
    except LdformatError as e:
        log.info("LdformatCheckpoint: the module's hparams are not recorded (%s)", e)
        return None
    return copy.deepcopy(hparams)


def _latest_lightning_step(reader: ChainReader) -> int | None:
    """The latest step whose extra state holds this callback's record (read from the log alone)."""
    for step in reversed(reader.steps):
        anchor = reader.state.anchors.get(step)
        extra: JSON = anchor.extra if anchor is not None else reader.state.deltas[step][1].extra
        user = extra.get("user") if isinstance(extra, dict) else None
        if isinstance(user, dict) and _KEY in user:
            return step
    return None


def _save_atomically(checkpoint: dict[str, object], path: Path) -> None:
    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)

    write_atomically(path, save)
