"""The chain writer (spec §5 "Commit protocol", §8 "Deltas", §9 "Anchors").

Call order in a training loop::

    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense")
    for step in range(1, n + 1):
        loss.backward(); optimizer.step(); scheduler.step()
        writer.record_step(step, extra={"scheduler": scheduler.state_dict()})
    writer.close()

Gradients and the hyperparameters the optimizer actually used are captured by a step
pre-hook on the optimizer, so that a loop that sets ``lr`` by hand, zeroes gradients early
or runs an optimizer that modifies ``grad`` in place still records what the step consumed.
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from .anchor import encode_anchor
from .delta import Segment, encode_batch, tensor_bits
from .environment import current_environment
from .errors import (
    ChainError,
    ChainExistsError,
    LdformatError,
    UnsupportedStateError,
    UsageError,
    WriterIOError,
)
from .garbage import remove_unreferenced
from .jsonvalue import crc32c_hex, dtype_name, encode
from .lock import WriterLock
from .manifest import (
    FORMAT_VERSION,
    KINDS,
    ROOT_FILE,
    AnchorEntry,
    ChainState,
    DeltaEntry,
    ObjectRef,
    Record,
    RootMetadata,
    SlotInfo,
    StepEntry,
    log_path,
    read_log,
    read_root,
)
from .state import (
    check_schema_matches,
    encode_param_groups,
    live_model_tensors,
    live_optimizer_tensors,
    model_schema,
    optimizer_class_name,
    optimizer_param_names,
    optimizer_params,
    resolve_implementation,
)
from .store import LocalStore, Store
from .topk import TopK


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ChainWriter:
    """Appends steps to a chain. Use :meth:`create` or :meth:`open`, not the constructor."""

    def __init__(
        self,
        *,
        path: str,
        store: Store,
        root: RootMetadata,
        state: ChainState,
        lock: WriterLock,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        compressor: TopK | None,
        batch_steps: int,
        anchor_every: int | None,
    ) -> None:
        if batch_steps < 1:
            raise UsageError(f"batch_steps must be >= 1, got {batch_steps}")
        if anchor_every is not None and anchor_every < 1:
            raise UsageError(f"anchor_every must be >= 1 or None, got {anchor_every}")
        self.path = path
        self.store = store
        self.root = root
        self.kind = root.kind
        self.model = model
        self.optimizer = optimizer
        self.compressor = compressor
        self.batch_steps = batch_steps
        self.anchor_every = anchor_every
        self._state = state
        self._lock: WriterLock | None = lock
        self._params = optimizer_params(optimizer)
        self._param_names: list[str] = root.schema["optimizer"]["params"]
        self._buffers = [e["name"] for e in root.schema["model"] if e["role"] == "buffer" and e["alias_of"] is None]
        self._last_step: int | None = state.latest_step
        self._last_extra: Any = {}
        self._captured: tuple[Any, dict[int, Segment]] | None = None
        self._captures_since_record = 0
        self._seen_generation = -1
        self._rows: list[dict[int, Segment]] = []
        self._row_steps: list[StepEntry] = []
        self._slots: list[SlotInfo] = []
        self._slot_index: dict[str, int] = {}
        self._pending_anchors: list[AnchorEntry] = []
        self._pending_deltas: list[DeltaEntry] = []
        self._written: list[str] = []
        self._xor_base: dict[str, np.ndarray] = {}
        self._failed: LdformatError | None = None
        self._hook = optimizer.register_step_pre_hook(self._pre_hook)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        kind: str,
        batch_steps: int = 8,
        compressor: TopK | None = None,
        anchor_every: int | None = None,
        step: int = 0,
        extra: dict[str, Any] | None = None,
        store: Store | None = None,
    ) -> ChainWriter:
        """Create a chain and write the anchor of the current state as step ``step``.

        Args:
            path: a new or empty directory.
            model, optimizer: the live training objects (the optimizer's parameters must
                belong to the model).
            kind: ``"grad.topk"`` (needs ``compressor``), ``"grad.dense"`` or ``"state.xor"``.
            batch_steps: steps per delta batch; a full batch is committed automatically.
            anchor_every: write an anchor every this many steps (``None``: only when asked).
            step: the step number of the current state (0 before training).
            extra: JSON-able extra state of the first anchor.

        Raises:
            ChainExistsError: ``path`` already holds a chain.
            UnsupportedStateError: the model or optimizer uses something format 1.0 refuses.
        """
        if kind not in KINDS:
            raise UsageError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
        if kind == "grad.topk" and not isinstance(compressor, TopK):
            raise UsageError("kind 'grad.topk' needs compressor=ldformat.TopK(...) (the one that compresses p.grad)")
        if kind != "grad.topk" and compressor is not None:
            raise UsageError(f"kind {kind!r} takes no compressor; use kind='grad.topk' with a TopK compressor")
        where = str(path)
        if store is None:
            p = Path(path)
            if p.exists() and not p.is_dir():
                raise UsageError(f"{where}: exists and is not a directory")
            p.mkdir(parents=True, exist_ok=True)
            store = LocalStore(p)
        if store.exists(ROOT_FILE):
            raise ChainExistsError(f"{where}: already holds a chain; use ChainWriter.open to append")
        if store.list(""):
            raise UsageError(f"{where}: directory is not empty; create a chain in a new or empty directory")
        schema = build_schema(model, optimizer, kind, compressor)
        device = str(next(iter(optimizer_params(optimizer)), torch.empty(0)).device.type)
        environment = {**current_environment(device), "implementation": resolve_implementation(optimizer)}
        root = RootMetadata(
            format_version=FORMAT_VERSION,
            chain_id=secrets.token_hex(16),
            created=_now(),
            kind=kind,
            schema=schema,
            environment=environment,
        )
        try:
            store.create_exclusive(ROOT_FILE, root.to_bytes())
        except FileExistsError:
            raise ChainExistsError(f"{where}: another process created a chain here concurrently") from None
        except OSError as e:
            raise WriterIOError(f"{where}/{ROOT_FILE}: cannot create the chain: {e.strerror or e}") from None
        lock, _ = WriterLock.acquire(store, where)
        writer = cls(path=where, store=store, root=root, state=ChainState(), lock=lock, model=model,
                     optimizer=optimizer, compressor=compressor, batch_steps=batch_steps, anchor_every=anchor_every)
        writer._last_step = step
        writer._last_extra = encode(extra or {}, "extra")
        writer._reset_xor_base_from_live()
        writer.write_anchor(step)
        return writer

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        compressor: TopK | None = None,
        batch_steps: int = 8,
        anchor_every: int | None = None,
        store: Store | None = None,
        break_lock: bool = False,
    ) -> ChainWriter:
        """Re-open a chain to append after its latest committed step.

        The live ``model`` and ``optimizer`` must hold the state of that step (load it with
        :meth:`ChainReader.load_into`). A dead writer's lock is taken over and its
        uncommitted leftovers are removed.
        """
        from .reader import ChainReader, open_store

        where = str(path)
        store = open_store(path, store)
        root = read_root(store, where)
        live_schema = build_schema(model, optimizer, root.kind, compressor)
        check_schema_matches(root.schema["model"], live_schema["model"], where)
        if root.schema["optimizer"]["params"] != live_schema["optimizer"]["params"]:
            raise UsageError(f"{where}: the optimizer's parameters differ from the chain's schema")
        if root.schema["optimizer"]["class"] != live_schema["optimizer"]["class"]:
            raise UsageError(
                f"{where}: the chain was written with {root.schema['optimizer']['class']}, "
                f"not {live_schema['optimizer']['class']}"
            )
        if root.kind == "grad.topk" and not isinstance(compressor, TopK):
            raise UsageError("this grad.topk chain needs compressor=ldformat.TopK(...)")
        lock, _ = WriterLock.acquire(store, where, break_lock=break_lock)
        try:
            _, state = read_log(store, where)
            remove_unreferenced(store, state)
            writer = cls(path=where, store=store, root=root, state=state, lock=lock, model=model,
                         optimizer=optimizer, compressor=compressor, batch_steps=batch_steps,
                         anchor_every=anchor_every)
        except BaseException:
            lock.release()
            raise
        if state.latest_step is None:
            writer._last_step = 0
            writer._reset_xor_base_from_live()
            writer.write_anchor(0)
        elif root.kind == "state.xor":
            # The XOR base is what the chain holds, so deltas stay exact even if the live
            # state was not reloaded.
            latest = ChainReader(path, store=store).materialize(state.latest_step)
            writer._set_xor_base(latest)
        return writer

    # -- capture -------------------------------------------------------------------------
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._failed is not None:
            return
        self._captures_since_record += 1
        hyper = encode_param_groups(optimizer, with_params=False)
        grads: dict[int, Segment] = {}
        if self.kind.startswith("grad."):
            topk = self.compressor if self.kind == "grad.topk" else None
            if topk is not None and any(p.grad is not None for p in self._params):
                if topk.generation == self._seen_generation:
                    self._failed = UsageError(
                        "optimizer.step() ran without TopK.compress_(model) before it; a grad.topk "
                        "chain records the compressed gradient, so compress every step"
                    )
                    return
                self._seen_generation = topk.generation
            for i, p in enumerate(self._params):
                g = p.grad
                if g is None:
                    continue
                if topk is not None:
                    idx = topk.indices.get(self._param_names[i])
                    if idx is None:
                        self._failed = UsageError(
                            f"parameter {self._param_names[i]!r} has a gradient that TopK did not compress"
                        )
                        return
                    values = g.detach().reshape(-1)[idx].cpu()
                    grads[i] = (idx.cpu().numpy(), tensor_bits(values))
                else:
                    grads[i] = (None, tensor_bits(g.detach().to("cpu", copy=True)))
        self._captured = (hyper, grads)

    def record_step(self, step: int, extra: dict[str, Any] | None = None) -> None:
        """Record step ``step``; the live objects must hold the state after it.

        Call it once per optimizer step, after ``optimizer.step()`` and any scheduler step.
        A step in which the optimizer did not run (e.g. GradScaler skipped it) is recorded
        as a step without an optimizer update.
        """
        self._check_usable()
        if self._last_step is None or step != self._last_step + 1:
            raise UsageError(
                f"{self.path}: record_step({step}) out of order; the next step is "
                f"{None if self._last_step is None else self._last_step + 1}"
            )
        if self._captures_since_record > 1:
            raise UsageError(
                f"{self.path}: optimizer.step() ran {self._captures_since_record} times since the "
                "last record_step; call record_step after every optimizer step"
            )
        extra_json = encode(extra or {}, "extra")
        row: dict[int, Segment] = {}
        stepped = self._captured is not None
        hyper = None
        if self.kind.startswith("grad."):
            if self._captured is not None:
                hyper, grads = self._captured
                encoding = "sparse" if self.kind == "grad.topk" else "dense"
                for i, seg in grads.items():
                    p = self._params[i]
                    row[self._slot(f"grad/{i}", p, encoding)] = seg
            sd = self.model.state_dict(keep_vars=True)
            for name in self._buffers:
                t = sd[name].detach()
                row[self._slot(f"model/{name}", t, "dense")] = (None, tensor_bits(t.to("cpu", copy=True)))
        else:
            for name, t in self._live_state_tensors().items():
                bits = tensor_bits(t.to("cpu", copy=t.device.type == "cpu"))
                base = self._xor_base.get(name)
                if base is None or base.shape != bits.shape:
                    delta = bits.copy()
                    self._xor_base[name] = bits
                else:
                    delta = np.bitwise_xor(bits, base)
                    self._xor_base[name] = bits
                row[self._slot(name, t, "xor")] = (None, delta)
        entry = StepEntry(
            step=step,
            base=step - 1,
            row=len(self._rows),
            stepped=stepped,
            hyper=hyper,
            param_groups=encode_param_groups(self.optimizer, with_params=True),
            extra=extra_json,
        )
        self._rows.append(row)
        self._row_steps.append(entry)
        self._captured = None
        self._captures_since_record = 0
        self._last_step = step
        self._last_extra = extra_json
        if self.anchor_every is not None and step % self.anchor_every == 0:
            self.write_anchor(step)
        elif len(self._rows) >= self.batch_steps:
            self.commit()

    def _slot(self, name: str, t: torch.Tensor, encoding: str) -> int:
        j = self._slot_index.get(name)
        if j is None:
            j = self._slot_index[name] = len(self._slots)
            self._slots.append(SlotInfo(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), encoding=encoding))
        elif self._slots[j].shape != tuple(t.shape) or self._slots[j].dtype != dtype_name(t.dtype):
            raise UnsupportedStateError(f"{name} changed shape or dtype during training; format 1.0 refuses that")
        return j

    def _live_state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = live_model_tensors(self.model, self.root.schema["model"])
        tensors.update(live_optimizer_tensors(self.optimizer))
        return tensors

    def _reset_xor_base_from_live(self) -> None:
        if self.kind == "state.xor":
            self._xor_base = {n: tensor_bits(t.to("cpu", copy=True)) for n, t in self._live_state_tensors().items()}

    def _set_xor_base(self, materialized: dict[str, Any]) -> None:
        base = {}
        model_sd = materialized["model"]
        for e in self.root.schema["model"]:
            if e["alias_of"] is None:
                base[f"model/{e['name']}"] = tensor_bits(model_sd[e["name"]].clone())
        for i, st in materialized["optimizer"]["state"].items():
            for key, t in st.items():
                base[f"optimizer/{i}/{key}"] = tensor_bits(t.clone())
        self._xor_base = base

    # -- anchors and commits -------------------------------------------------------------
    def write_anchor(self, step: int) -> int | None:
        """Write a full anchor of the live state at ``step`` (the last recorded step) and commit."""
        self._check_usable()
        if step != self._last_step:
            raise UsageError(
                f"{self.path}: write_anchor({step}): the live state is at step {self._last_step}; "
                "anchors can only be written for the last recorded step"
            )
        tensors = {n: t.to("cpu", copy=True).contiguous() for n, t in self._live_state_tensors().items()}
        if self.compressor is not None:
            for name, r in self.compressor.state_dict().items():
                tensors[f"compressor/{name}"] = r.to("cpu", copy=True).contiguous()
        path = f"anchors/{step}-{secrets.token_hex(4)}.safetensors"
        data = encode_anchor(tensors, step)
        self._io(path, self.store.write, path, data)
        self._written.append(path)
        self._pending_anchors.append(
            AnchorEntry(
                step=step,
                object=ObjectRef(path=path, size=len(data), crc32c=crc32c_hex(data)),
                param_groups=encode_param_groups(self.optimizer, with_params=True),
                extra=self._last_extra,
            )
        )
        return self.commit()

    def _flush_batch(self) -> None:
        if not self._rows:
            return
        first, last = self._row_steps[0].step, self._row_steps[-1].step
        group = f"deltas/{first}-{last}-{secrets.token_hex(4)}"
        objects = encode_batch(self._slots, self._rows, {"kind": self.kind, "first": first, "last": last})
        refs = []
        for key, data in sorted(objects.items()):
            path = f"{group}/{key}"
            self._io(path, self.store.write, path, data)
            self._written.append(path)
            refs.append(ObjectRef(path=key, size=len(data), crc32c=crc32c_hex(data)))
        self._pending_deltas.append(
            DeltaEntry(path=group, objects=tuple(refs), slots=tuple(self._slots), rows=len(self._rows),
                       steps=tuple(self._row_steps))
        )
        self._rows, self._row_steps, self._slots, self._slot_index = [], [], [], {}

    def commit(self) -> int | None:
        """Make everything recorded so far durable; returns the last durable step."""
        self._check_usable()
        self._flush_batch()
        if not self._pending_anchors and not self._pending_deltas:
            return self.durable_step
        self._io("data objects", self.store.sync, self._written)
        record = Record(
            seq=self._state.last_seq + 1,
            type="append",
            prev=self._state.last_checksum,
            time=_now(),
            writer=f"{socket.gethostname()}:{os.getpid()}",
            reason="append",
            anchors=tuple(self._pending_anchors),
            deltas=tuple(self._pending_deltas),
        )
        data = record.to_bytes()
        record = Record.from_bytes(data, "new record")  # carries the checksum
        path = log_path(record.seq)

        def create() -> None:
            try:
                self.store.create_exclusive(path, data)
            except FileExistsError:
                raise ChainError(
                    f"{self.path}/{path}: another writer committed this record; this writer stops "
                    "(re-open the chain to continue)"
                ) from None

        self._io(path, create)
        self._state.apply(record)
        self._pending_anchors, self._pending_deltas, self._written = [], [], []
        return self.durable_step

    @property
    def durable_step(self) -> int | None:
        """The newest step that is committed (None before the first commit)."""
        return self._state.latest_step

    @property
    def last_step(self) -> int | None:
        """The newest recorded step (committed or not)."""
        return self._last_step

    def _io(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Run a storage call; a failure poisons the writer with a clear error."""
        try:
            fn(*args)
        except ChainError as e:
            self._failed = e
            raise
        except OSError as e:
            err = WriterIOError(
                f"{self.path}/{what}: {e.strerror or e} (errno {e.errno}); nothing after step "
                f"{self.durable_step} is durable and the chain is valid there. Fix the cause and "
                "re-open the chain with ChainWriter.open to continue"
            )
            err.errno = e.errno
            self._failed = err
            raise err from None

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._lock is None:
            raise UsageError(f"{self.path}: the writer is closed")

    def close(self) -> int | None:
        """Commit what is pending, release the lock and remove the optimizer hook."""
        try:
            if self._lock is not None and self._failed is None:
                self.commit()
        finally:
            self._hook.remove()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        return self.durable_step

    def abort(self) -> None:
        """Drop what is not committed and release the lock."""
        self._hook.remove()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> ChainWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def build_schema(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, kind: str, compressor: TopK | None
) -> dict[str, Any]:
    class_name, replayable = optimizer_class_name(optimizer)
    if kind.startswith("grad.") and not replayable:
        raise UnsupportedStateError(
            f"kind {kind!r} replays the optimizer, and {class_name} is not a torch.optim class; "
            "use kind='state.xor' for custom optimizers"
        )
    encode_param_groups(optimizer, with_params=False)  # refuses tensor hyperparameters early
    return {
        "model": model_schema(model),
        "optimizer": {
            "class": class_name,
            "params": optimizer_param_names(model, optimizer),
            "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        },
        "compressor": None
        if compressor is None
        else {"name": "topk", "ratio": compressor.ratio, "error_feedback": compressor.error_feedback},
    }
