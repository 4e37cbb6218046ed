"""Checkpoint every optimizer step of a Hugging Face ``Trainer`` run into an ldformat chain.

``LdformatCallback`` is a ``TrainerCallback`` that runs a :class:`~ldformat.Checkpointer` on
the Trainer's model, optimizer and LR scheduler, and records with every step what a Trainer
checkpoint directory holds besides the state: the ``TrainerState`` and the random number
generator states at the point where the Trainer would have saved that step. On a restart,
:meth:`LdformatCallback.resume_checkpoint` writes a Trainer checkpoint directory from the
chain's latest resumable step, and ``Trainer.train(resume_from_checkpoint=...)`` resumes
from it with its own logic, data skipping included (DESIGN §9; spec §19 for the extra state).

Requires ``pip install 'ldformat[hf]'``; ``import ldformat`` never imports transformers.

Where a step ends. The Trainer's step ``k`` goes: optimizer step, scheduler step,
``global_step = k``, ``on_step_end``, then logging, evaluation and saving; the next step
fetches its batches and calls ``on_step_begin``. The callback closes step ``k`` (records its
extra state and hands it to the checkpointer's writer) at the next ``on_step_begin``,
``on_epoch_begin`` or ``on_train_end``, so that the record holds the step's log entries and
evaluation results, and the RNG states that the Trainer restores on resume:

* within an epoch the Trainer restores ``rng_state.pth`` after fetching the next step's
  batches, so the state to restore is the one at the next ``on_step_begin``;
* at the end of an epoch it restores them before the next epoch's data loader starts, the
  state at the next ``on_epoch_begin``.

When those equal the states the checkpointer records after ``optimizer.step()`` (spec §19.2;
the usual case: nothing between draws random numbers), nothing more is stored; otherwise
(an evaluation's data loader draws a seed, for one) the callback stores them as well.

Limits (the Trainer's own checkpoints share the first two):

* Random numbers drawn while the Trainer fetches the first batch after the resume point (a
  collator that masks at random, say) differ from the uninterrupted run's: the Trainer
  restores the RNG states only after that fetch. Later batches are unaffected.
* ``total_flos`` counts up to the step's last logging (the Trainer adds its running count
  when it logs or saves).
* Of the callbacks that export a state (``ExportableState``), only ``TrainerControl`` is
  recorded as it is at the step; the others (``EarlyStoppingCallback``) as at the start of
  training, since a callback does not see the others. They are restored only with
  ``restore_callback_states_from_checkpoint=True``.
* Several processes (DDP) are not covered yet: the checkpointer would run on the main one
  only, which the capture runtime refuses with several ranks except in ``lowdiff`` mode
  with a ``ResidualPeer`` on every other rank, and the other processes' RNG states are not
  recorded.

The callback and :func:`write_trainer_checkpoint` stay one module: they are the two halves of
one round trip, and the record under ``extra.user.hf_trainer`` (``_Recorded``) and the
Trainer's file names they share are private to it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

import numpy as np
import torch

from ..capture.extra import Stateful
from ..capture.options import CaptureOptions
from ..capture.rng import RngState, capture_rng
from ..capture.runtime import Checkpointer, Mode
from ..capture.tuning import Interval
from ..chain.reader import ChainReader
from ..errors import LdformatError, NotAChainError, UsageError
from ..format.jsonvalue import JSON, decode
from ..format.topk import TopK
from ..stores import Store, StoreOrPath

if TYPE_CHECKING:
    from typing import Unpack

    import torch.distributed as dist

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ldformat.integrations.transformers needs Hugging Face transformers and accelerate: "
        "pip install 'ldformat[hf]'"
    ) from e

__all__ = ["EXTRA_KEY", "LdformatCallback", "write_trainer_checkpoint"]

log = logging.getLogger("ldformat.capture")

EXTRA_KEY = "hf_trainer"
"""The key under ``extra.user`` (spec §19.1) where the callback records the Trainer's state."""

RESUME_DIR = "ldformat-resume"
"""The folder under ``TrainingArguments.output_dir`` where resume directories are written."""

# Set by the callback itself: the Trainer's objects, and where the chain continues.
_OWN_ARGUMENTS = ("model", "optimizer", "scheduler", "scaler", "data", "sampler", "step", "truncate")

# File names of a Trainer checkpoint directory (transformers' trainer.py and utils).
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
SAFE_WEIGHTS_NAME = "model.safetensors"
TRAINING_ARGS_NAME = "training_args.bin"


class _CheckpointerOptions(TypedDict, total=False):
    """The :class:`~ldformat.Checkpointer` arguments that :class:`LdformatCallback` passes on
    (all but those in ``_OWN_ARGUMENTS``); keep in step with ``Checkpointer.__init__``."""

    mode: Mode
    anchor_every: Interval
    batch_steps: Interval
    topk_ratio: float
    compressor: TopK | None
    compress: bool
    max_stall: float
    mtbf_hours: float
    max_lost_s: float
    max_bytes: int | None
    queue_depth: int | None
    max_batch_bytes: int
    stage_during_backward: bool | None
    extra: dict[str, object] | None
    store: Store | None
    process_group: dist.ProcessGroup | None
    storage_options: dict[str, Any] | None  # Any: as Checkpointer and ChainReader take them
    mirror: StoreOrPath | None
    mirror_options: dict[str, Any] | None
    mirror_timeout: float
    commit_timeout: float
    options: CaptureOptions | None


class _SavesPretrained(Protocol):
    """A tokenizer, processor or feature extractor: what the Trainer passes as ``processing_class``."""

    def save_pretrained(self, save_directory: str, /) -> object: ...


class _TrainerObjects(TypedDict, total=False):
    """The keyword arguments the Trainer passes to every callback event (``CallbackHandler.call_event``,
    which types none of them), besides the event's own (``logs``, ``metrics``)."""

    model: torch.nn.Module
    processing_class: _SavesPretrained | None
    optimizer: torch.optim.Optimizer
    lr_scheduler: Stateful | None
    train_dataloader: object
    eval_dataloader: object


def _trainer_objects(kwargs: Mapping[str, object]) -> _TrainerObjects:
    return cast(_TrainerObjects, kwargs)


class _ControlArgs(TypedDict):
    """What ``TrainerControl.state()`` returns: its flags under ``args``."""

    args: dict[str, bool]
    attributes: dict[str, object]


class _RecordedState(TypedDict):
    state: dict[str, object]  # the TrainerState's fields, log history aside, as JSON values


class _Recorded(_RecordedState, total=False):
    """The ``extra.user.hf_trainer`` of a step (spec §19.1)."""

    log: object  # the log entries added since the previous step: list[dict[str, float]], encoded in the log
    rng: object  # RNG states to restore, when they differ from the step's own (capture_rng's shape)
    cuda_device: int


class _StepEnd:
    """What the checkpointer is given as the scheduler: the Trainer's LR scheduler, whose
    state it records, with a ``step()`` that only the callback calls.

    The checkpointer completes a step when the scheduler's ``step()`` returns
    (docs/capture-runtime.md "Capture points"). The Trainer steps its scheduler before it
    counts the step and before it logs, evaluates or saves, so the callback completes the
    step itself, once the Trainer is done with it.
    """

    def __init__(self, scheduler: Stateful | None) -> None:
        self.scheduler = scheduler

    # Any: a torch-style state dict, as the Stateful protocol has it.
    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict)

    def step(self) -> None:
        """Marks the end of the step (the checkpointer runs its own code after this returns)."""


@dataclasses.dataclass
class _Resume:
    """The step :meth:`LdformatCallback.resume_checkpoint` wrote a directory for."""

    step: int
    global_step: int
    directory: Path
    remove: Path


class LdformatCallback(TrainerCallback):
    """A ``TrainerCallback`` that checkpoints every optimizer step into the chain at ``path``.

    Args:
        path: the chain directory (or URL, see :class:`~ldformat.Checkpointer`).
        resume_dir: where :meth:`resume_checkpoint` writes the Trainer checkpoint directory
            (it is removed once the Trainer has loaded it). Default: ``ldformat-resume``
            under the Trainer's ``output_dir``, or a temporary directory when no Trainer is
            attached yet.
        **checkpointer_kwargs: passed to :class:`~ldformat.Checkpointer` (``mode``,
            ``anchor_every``, ``batch_steps``, ``extra``, ``store``, ``mirror``, ...). The
            callback sets ``model``, ``optimizer``, ``scheduler``, ``scaler`` and ``step``
            itself. Without ``mode`` the checkpointer's default applies, which never changes
            training.

    Example:
        >>> cb = LdformatCallback("runs/chain")                                       # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
        >>> trainer.train(resume_from_checkpoint=cb.resume_checkpoint())             # doctest: +SKIP

    The checkpointer runs on the main process only (``state.is_world_process_zero``); it is
    at :attr:`checkpointer` between ``on_train_begin`` and ``on_train_end``.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume_dir: str | os.PathLike[str] | None = None,
                 **checkpointer_kwargs: Unpack[_CheckpointerOptions]) -> None:
        own = sorted(k for k in checkpointer_kwargs if k in _OWN_ARGUMENTS)
        if own:
            raise UsageError(f"LdformatCallback sets {', '.join(own)} itself; pass only the other Checkpointer "
                             "arguments (mode=, anchor_every=, batch_steps=, extra=, store=, ...)")
        try:
            inspect.signature(Checkpointer).bind(path, None, None, **checkpointer_kwargs)
        except TypeError as e:
            raise UsageError(f"LdformatCallback: {e} (the keyword arguments go to ldformat.Checkpointer)") from None
        user = checkpointer_kwargs.get("extra") or {}
        if EXTRA_KEY in user:
            raise UsageError(f"extra[{EXTRA_KEY!r}] is where LdformatCallback records the Trainer state; "
                             "use another key")
        self.path = str(path)
        self.resume_dir = Path(resume_dir) if resume_dir is not None else None
        self.checkpointer_kwargs = checkpointer_kwargs
        self.checkpointer: Checkpointer | None = None
        self._store: Store | None = checkpointer_kwargs.get("store")
        self._storage_options = checkpointer_kwargs.get("storage_options")
        self._model: torch.nn.Module | None = None
        self._args: TrainingArguments | None = None
        self._processing_class: _SavesPretrained | None = None
        self._resume: _Resume | None = None
        self._step_end = _StepEnd(None)
        self._open = False  # a step was taken and is not closed yet
        self._step_rng: RngState | None = None
        self._control: _ControlArgs | None = None
        self._logged = 0

    # -- resuming ---------------------------------------------------------------------------
    def resume_checkpoint(self) -> str | None:
        """Write a Trainer checkpoint directory of the chain's latest resumable step.

        Returns:
            The directory, for ``Trainer.train(resume_from_checkpoint=...)``, or ``None`` when
            ``path`` holds no chain yet (a new run).

        The step is the latest one (in ``lowdiff`` mode: the latest anchor that holds the
        top-k residuals, spec §14.2). The directory holds what the Trainer saves at that
        step: the model (``save_pretrained``), ``optimizer.pt``, ``scheduler.pt``,
        ``scaler.pt`` with a GradScaler, ``rng_state.pth`` and ``trainer_state.json``.
        """
        reader = self._reader()
        if reader is None or reader.latest_step is None:
            return None
        step = _resumable_step(reader)
        if self._resume is not None:
            shutil.rmtree(self._resume.remove, ignore_errors=True)
        base, remove = self._resume_base()
        shutil.rmtree(remove, ignore_errors=True)
        directory, global_step = _write_checkpoint(reader, step, base, model=self._model, args=self._args,
                                                   processing_class=self._processing_class)
        self._resume = _Resume(step=step, global_step=global_step, directory=directory, remove=remove)
        log.info("%s: resuming from step %d (Trainer global step %d) via %s", self.path, step, global_step, directory)
        return str(directory)

    def _reader(self) -> ChainReader | None:
        try:
            return ChainReader(self.path, store=self._store, storage_options=self._storage_options)
        except NotAChainError:
            return None

    def _resume_base(self) -> tuple[Path, Path]:
        """The folder to write ``checkpoint-<step>`` into, and the folder to remove afterwards."""
        if self.resume_dir is not None:
            return self.resume_dir, self.resume_dir
        if self._args is not None and self._args.output_dir is not None:  # None only before __post_init__
            base = Path(self._args.output_dir) / RESUME_DIR
            if int(self._args.world_size) > 1:
                base = base / f"process-{int(self._args.process_index)}"
            return base, base
        base = Path(tempfile.mkdtemp(prefix="ldformat-resume-"))
        return base, base

    def _cleanup(self) -> None:
        if self._resume is not None:
            shutil.rmtree(self._resume.remove, ignore_errors=True)
            self._resume = None

    # -- Trainer events ----------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> None:
        objects = _trainer_objects(kwargs)
        self._args = args
        self._model = objects.get("model")
        self._processing_class = objects.get("processing_class")

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: object) -> None:
        objects = _trainer_objects(kwargs)
        self._args = args
        if objects.get("model") is not None:
            self._model = objects["model"]
        if self.checkpointer is not None:  # left open by a train() call that raised
            self.checkpointer.close()
            self.checkpointer = None
        if not state.is_world_process_zero:
            return
        model, optimizer, scheduler = objects.get("model"), objects.get("optimizer"), objects.get("lr_scheduler")
        if model is None or optimizer is None:
            raise UsageError("LdformatCallback: the Trainer passed no model or optimizer to on_train_begin")
        step, truncate = self._start_step(state)
        self._step_end = _StepEnd(scheduler)
        self._logged = len(state.log_history)
        self._control = _control_state(control)
        options = self.checkpointer_kwargs.copy()
        user = dict(options.pop("extra", None) or {})
        user[EXTRA_KEY] = self._trainer_extra(state, rng=None)
        options["extra"] = user
        self.checkpointer = Checkpointer(self.path, model, optimizer, scheduler=self._step_end,
                                         scaler=getattr(optimizer, "scaler", None), step=step, truncate=truncate,
                                         **options)
        self._open = False

    def _start_step(self, state: TrainerState) -> tuple[int | None, bool]:
        """The chain step the live state is at, and whether to truncate steps after it."""
        resume = self._resume
        if resume is not None and resume.global_step == state.global_step:
            return resume.step, True
        reader = self._reader()
        if reader is None or reader.latest_step is None:
            # A new chain starts at the Trainer's step (which is not 0 when it resumed from
            # one of its own checkpoints): chain steps then count as the Trainer's do.
            return state.global_step, False
        self._cleanup()
        raise UsageError(
            f"{self.path} already holds a chain (up to step {reader.latest_step}) and this training does not "
            "resume from it; pass resume_from_checkpoint=cb.resume_checkpoint() to Trainer.train, or use a new "
            "path"
        )

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: object) -> None:
        self._close(state)  # only when no step boundary came since the last optimizer step

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: object) -> None:
        ck = self.checkpointer
        if ck is None:
            return
        self._step_rng = cast(RngState, capture_rng())
        # What a close() or an exit records with the step if it ends before the callback
        # closes it: the Trainer's step number is already right, the rest is as before the step.
        provisional = self._trainer_extra(state, rng=None, advance=False)
        provisional["state"]["global_step"] = int(state.global_step) + 1
        ck.user_extra[EXTRA_KEY] = provisional
        self._open = True

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> None:
        self._remember_control(control)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               **kwargs: object) -> None:
        self._remember_control(control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> None:
        self._remember_control(control)

    def _remember_control(self, control: TrainerControl) -> None:
        """The ``TrainerControl`` state as the Trainer saves it at this point: logging and
        evaluation done, ``should_save`` set (a Trainer checkpoint is saved only then)."""
        self._control = _control_state(control)
        self._control["args"]["should_save"] = True

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: object) -> None:
        self._close(state)
        self._cleanup()  # the Trainer has loaded everything from a resume directory by now

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: object) -> None:
        self._close(state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object) -> None:
        try:
            self._close(state)
        finally:
            ck, self.checkpointer = self.checkpointer, None
            self._cleanup()
            if ck is not None:
                ck.close()

    # -- recording ---------------------------------------------------------------------------
    def _close(self, state: TrainerState) -> None:
        """Record the Trainer's state with the step taken last and hand the step to the writer."""
        ck = self.checkpointer
        if ck is None or not self._open:
            return
        self._open = False
        rng = cast(RngState, capture_rng())
        entry = self._trainer_extra(
            state, rng=None if self._step_rng is not None and _same_rng(rng, self._step_rng) else rng)
        ck.user_extra[EXTRA_KEY] = entry
        ck.log(**_step_scalars(entry["log"]))
        self._step_end.step()

    def _trainer_extra(self, state: TrainerState, rng: RngState | None, *, advance: bool = True) -> _Recorded:
        """The ``extra.user.hf_trainer`` of a step: the ``TrainerState`` without its log
        history, the log entries added since the previous step, and the RNG states to restore
        when they differ from the step's own."""
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"}
        plain: dict[str, object] = json.loads(json.dumps(fields))  # what save_to_json writes, as plain values
        callbacks = plain.get("stateful_callbacks")
        if isinstance(callbacks, dict) and self._control is not None:
            callbacks["TrainerControl"] = self._control
        entry: _Recorded = {"state": plain, "log": list(state.log_history[self._logged:])}
        if advance:
            self._logged = len(state.log_history)
        if rng is not None:
            entry["rng"] = rng
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            entry["cuda_device"] = torch.cuda.current_device()
        return entry


# -- writing a Trainer checkpoint directory ------------------------------------------------------
def write_trainer_checkpoint(
    path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    args: TrainingArguments | None = None,
    processing_class: _SavesPretrained | None = None,
    store: Store | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write a Trainer checkpoint directory (``checkpoint-<global step>``) of a chain's step.

    Args:
        path: a chain written by :class:`LdformatCallback`.
        output_dir: the folder to create the checkpoint directory in.
        step: the chain step (default: the latest resumable one, as :meth:`LdformatCallback.resume_checkpoint`).
        model: a ``PreTrainedModel`` of the trained architecture: the weights are written with
            its ``save_pretrained`` (config included), as the Trainer does; without one only
            ``model.safetensors`` is written.
        args, processing_class: the Trainer's ``TrainingArguments`` and tokenizer/processor,
            written like the Trainer writes them when given.

    Returns:
        The directory, which ``Trainer.train(resume_from_checkpoint=...)`` accepts.
    """
    reader = ChainReader(path, store=store, storage_options=storage_options)
    if step is None:
        step = _resumable_step(reader)
    directory, _ = _write_checkpoint(reader, step, Path(output_dir), model=model, args=args,
                                     processing_class=processing_class)
    return str(directory)


def _resumable_step(reader: ChainReader) -> int:
    """The latest step; for ``grad.topk`` the latest anchor holding top-k residuals (spec §14.2)."""
    latest = reader.latest_step
    if latest is None:
        raise UsageError(f"{reader.path}: the chain has no step to resume from")
    if reader.kind != "grad.topk":
        return latest
    for s in reversed(reader.anchors):
        if any(name.startswith("compressor") for name in reader.load_anchor_tensors(s)):
            return s
    log.warning("%s: no anchor holds top-k residuals; resuming from step %d restarts them at zero", reader.path,
                latest)
    return latest


def _step_extra(reader: ChainReader, step: int) -> JSON:
    """The encoded ``extra`` of a step, from the log (no tensor is read)."""
    anchor = reader.state.anchors.get(step)
    if anchor is not None:
        return anchor.extra
    return reader.state.deltas[step][1].extra


def _recorded(extra: object, where: str) -> _Recorded | None:
    user = extra.get("user") if isinstance(extra, dict) else None
    entry = user.get(EXTRA_KEY) if isinstance(user, dict) else None
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
        raise LdformatError(f"{where}: extra.user.{EXTRA_KEY} is not a Trainer record")
    return cast(_Recorded, entry)


def _log_history(reader: ChainReader, step: int) -> list[dict[str, float]]:
    """The log entries recorded with the chain's steps up to ``step``, in order."""
    history: list[dict[str, float]] = []
    for s in reader.steps:
        if s > step:
            break
        entry = _recorded(_step_extra(reader, s), f"{reader.path} (step {s})")
        if entry is not None and entry.get("log"):
            logs = decode(cast(JSON, entry["log"]), f"{reader.path} (step {s}) extra.user.{EXTRA_KEY}.log")
            if isinstance(logs, list):
                history.extend(logs)
    return history


def _write_checkpoint(reader: ChainReader, step: int, base: Path, *, model: torch.nn.Module | None,
                      args: TrainingArguments | None, processing_class: _SavesPretrained | None) -> tuple[Path, int]:
    where = f"{reader.path} (step {step})"
    state = reader.materialize(step)
    extra = state["extra"]
    entry = _recorded(extra, where)
    if entry is None:
        raise UsageError(f"{where}: the step holds no Trainer state (extra.user.{EXTRA_KEY}); only chains written "
                         "by LdformatCallback resume a Trainer")
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    # Any: JSON values of the types TrainerState declares, as save_to_json wrote them.
    recorded: dict[str, Any] = {k: v for k, v in entry["state"].items() if k in fields}
    trainer_state = TrainerState(**recorded)
    trainer_state.log_history = _log_history(reader, step)
    global_step = int(trainer_state.global_step)

    directory = base / f"checkpoint-{global_step}"
    directory.mkdir(parents=True, exist_ok=True)
    _save_model(state["model"], directory, model)
    torch.save(state["optimizer"], directory / OPTIMIZER_NAME)
    if extra.get("scheduler"):
        torch.save(extra["scheduler"], directory / SCHEDULER_NAME)
    if "scaler" in extra:
        torch.save(extra["scaler"], directory / SCALER_NAME)
    world_size = int(args.world_size) if args is not None else 1
    rng_name = "rng_state.pth" if args is None or world_size <= 1 else f"rng_state_{int(args.process_index)}.pth"
    rng = entry.get("rng", extra.get("rng"))
    torch.save(_trainer_rng(rng, distributed=world_size > 1, device=int(entry.get("cuda_device", 0))),
               directory / rng_name)
    trainer_state.save_to_json(str(directory / TRAINER_STATE_NAME))
    if processing_class is not None:
        processing_class.save_pretrained(str(directory))
    if args is not None:
        torch.save(args, directory / TRAINING_ARGS_NAME)
    return directory, global_step


def _save_model(state_dict: dict[str, torch.Tensor], directory: Path, model: torch.nn.Module | None) -> None:
    """As ``Trainer._save``: ``save_pretrained`` for a ``PreTrainedModel``, else the state dict."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        model.save_pretrained(str(directory), state_dict=state_dict)
        return
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory (tied weights): keep the first name of each.
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset())) if t.numel() else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.contiguous()
    save_file(tensors, str(directory / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})


def _trainer_rng(rng: object, *, distributed: bool, device: int) -> dict[str, object]:
    """The RNG states recorded by ldformat (spec §19.2) as the Trainer's ``rng_state.pth`` holds them."""
    if not isinstance(rng, dict) or "torch" not in rng:
        raise LdformatError("the step holds no RNG states (extra.rng)")
    out: dict[str, object] = {}
    # The Trainer reads "python", "numpy" and "cpu" unconditionally. The capture runtime
    # always records Python's, and NumPy's whenever NumPy is installed (the Trainer needs it).
    if "python" in rng:
        version, internal, gauss = rng["python"]
        out["python"] = (version, tuple(internal), gauss)
    else:
        out["python"] = random.getstate()
    if "numpy" in rng:
        n = rng["numpy"]
        keys = np.asarray(n["keys"].numpy()).view(np.uint32).copy()
        out["numpy"] = (str(n["name"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"]))
    else:
        out["numpy"] = np.random.get_state()
    out["cpu"] = rng["torch"]
    if "cuda" in rng:
        states = list(rng["cuda"])
        out["cuda"] = states if distributed else states[device]
    return out


def _step_scalars(entries: object) -> dict[str, float]:
    """The flight recorder's scalars of a step (spec §19.1 ``scalars``): the ``loss`` and
    ``grad_norm`` of the Trainer's log entries of the step (the Checkpointer records the
    learning rate the step used itself). The Trainer logs every ``logging_steps`` steps (a
    mean over them): ``logging_steps=1`` records every step's own loss."""
    out: dict[str, float] = {}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict):
            out.update({k: float(v) for k, v in entry.items() if k in ("loss", "grad_norm")
                        and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _same_rng(a: RngState, b: RngState) -> bool:
    """Whether two :func:`~ldformat.capture.rng.capture_rng` results are the same states."""
    if a.keys() != b.keys() or a.get("python") != b.get("python"):
        return False
    if not torch.equal(a["torch"], b["torch"]):
        return False
    if len(a.get("cuda", [])) != len(b.get("cuda", [])) or not all(
            torch.equal(x, y) for x, y in zip(a.get("cuda", []), b.get("cuda", []), strict=True)):
        return False
    na, nb = a.get("numpy"), b.get("numpy")
    if na is None or nb is None:
        return na is nb
    return bool({k: v for k, v in na.items() if k != "keys"} == {k: v for k, v in nb.items() if k != "keys"}
                and torch.equal(na["keys"], nb["keys"]))


def _control_state(control: TrainerControl) -> _ControlArgs:
    return cast(_ControlArgs, control.state())  # transformers types it a plain dict
