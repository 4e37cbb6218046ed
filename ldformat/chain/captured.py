"""One captured step, apart from appending it (spec §10.4 "Step entries", docs/capture-runtime.md "Capture points").

A :class:`CapturedStep` is everything a :class:`~ldformat.ChainWriter` needs to append one
step: the raw bits of its tensors and the JSON parts of its step entry. Capturing it is
the training loop's side; appending it (XOR, encoding, commits) may run elsewhere.

:func:`capture_gradients` is the one way gradients are captured, shared by
``ChainWriter.record_step`` and the capture runtime; they differ only in where the bits go
(``copy``): a fresh CPU copy, or a reused staging buffer.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TypeAlias

import numpy as np
import torch

from ..errors import UnsupportedStateError, UsageError
from ..format.delta import SIGNED_NP, tensor_bits
from ..format.dtensors import local
from ..format.dtypes import dtype_name, parse_dtype
from ..format.jsonvalue import JSON
from ..format.manifest import Kind
from ..format.topk import TopK

CopyToHost: TypeAlias = Callable[[str, torch.Tensor], torch.Tensor]
"""``copy(name, tensor)``: a CPU tensor that holds (or will hold) the bits of ``tensor``.

``name`` is the stored name the bits are for (``index/<i>`` for top-k indices), so that an
implementation can reuse one buffer per name.
"""


@dataclass(frozen=True, kw_only=True)
class CapturedTensor:
    """The raw bits of one captured tensor (flat, unsigned) and what they are."""

    bits: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None = None  # sorted flat indices of a sparse gradient

    @classmethod
    def of(cls, t: torch.Tensor, *, shape: tuple[int, ...] | None = None,
           indices: np.ndarray | None = None) -> CapturedTensor:
        """Wrap a CPU tensor (shares its memory: pass a copy the caller will not modify)."""
        return cls(bits=tensor_bits(t), dtype=dtype_name(t.dtype), shape=tuple(t.shape) if shape is None else shape,
                   indices=indices)

    def to_tensor(self) -> torch.Tensor:
        dtype = parse_dtype(self.dtype)
        signed = self.bits.view(SIGNED_NP[self.bits.dtype.itemsize])
        return torch.from_numpy(signed).view(dtype).reshape(self.shape)


@dataclass(frozen=True, kw_only=True)
class CapturedStep:
    """Everything the writer needs to append one step, captured from the training loop."""

    step: int
    stepped: bool
    hyper: JSON  # encoded param groups the optimizer used (None if it did not step; xor: for prediction)
    param_groups: JSON  # encoded live param groups after the step and its scheduler step
    extra: JSON  # encoded extra state
    tensors: dict[str, CapturedTensor]  # grad kinds: grad/<i> + model/<buffer>; xor: whole state
    anchor: bool = False
    anchor_tensors: dict[str, torch.Tensor] | None = None  # full state for an anchor (grad kinds)
    optimizer: JSON = None  # the optimizer structure (spec §8.2) after the step: xor steps, anchors
    # True: the tensors are the caller's staging buffers, whose contents ChainWriter.append may
    # overwrite (an XOR delta is computed in place); False: it only reads them.
    scratch: bool = False


def copy_to_host(name: str, t: torch.Tensor) -> torch.Tensor:
    """A fresh CPU copy of ``t`` (the default ``copy`` of the capture functions)."""
    return t.detach().to("cpu", copy=True)


def capture_gradients(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    kind: Kind,
    compressor: TopK | None,
    copy: CopyToHost = copy_to_host,
    *,
    inv_scale: float | None = None,
) -> dict[str, CapturedTensor]:
    """The gradients the optimizer is about to consume, as ``grad/<index>`` tensors.

    Args:
        params: the optimizer's parameters, in optimizer order (``<index>`` is the position).
        names: their names (``schema.optimizer.params``), for the compressor's indices.
        kind: the chain's kind; ``state.xor`` captures no gradients.
        compressor: for ``grad.topk``, the :class:`TopK` whose indices select the entries.
        copy: where the bits go; the default makes a fresh CPU copy.
        inv_scale: multiply every captured value by this (GradScaler's ``1/grad_scale``,
            a power of two, so that the product is exact).

    Returns:
        ``grad/<index>`` for every parameter with a gradient: for ``grad.topk`` only the
        values at the compressor's (sorted) indices, otherwise the dense gradient.

    Raises:
        UsageError: a ``grad.topk`` gradient that the compressor did not compress.
    """
    grads: dict[str, CapturedTensor] = {}
    if kind == "state.xor":
        return grads
    if kind == "grad.topk" and compressor is None:
        raise UsageError("kind 'grad.topk' needs compressor=ldformat.TopK(...) (the one that compresses p.grad)")
    topk = compressor if kind == "grad.topk" else None
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        g = local(p.grad)  # the shard this rank's optimizer consumes (spec §20)
        if topk is not None:
            idx = topk.indices.get(names[i])
            if idx is None:
                raise UsageError(f"parameter {names[i]!r} has a gradient that the TopK compressor did not "
                                 "compress this step")
            values = g.detach().reshape(-1)[idx]
            if inv_scale is not None:
                values = values * inv_scale
            grads[f"grad/{i}"] = CapturedTensor.of(copy(f"grad/{i}", values), shape=tuple(g.shape),
                                                   indices=copy(f"index/{i}", idx).numpy())
        else:
            grads[f"grad/{i}"] = CapturedTensor.of(copy(f"grad/{i}", g.detach() if inv_scale is None
                                                        else g.detach() * inv_scale))
    return grads


def inverse_scale(grad_scale: torch.Tensor | None) -> float | None:
    """``1/grad_scale``: what unscales the gradients a fused optimizer gets from GradScaler.

    Multiplying by it is exact only for a power-of-two scale, so any other is refused
    (docs/capture-runtime.md "Capture points").
    """
    if grad_scale is None:
        return None
    scale = float(grad_scale)
    mantissa, _ = math.frexp(scale)
    if mantissa != 0.5:
        raise UnsupportedStateError(
            f"GradScaler scale {scale} is not a power of two; exact capture needs power-of-two scales "
            "(the default init_scale, growth_factor and backoff_factor are)"
        )
    return 1.0 / scale


def capture_tensors(tensors: Mapping[str, torch.Tensor], copy: CopyToHost = copy_to_host) -> dict[str, CapturedTensor]:
    """Every tensor of ``tensors`` under its stored name (buffers; the whole state for ``state.xor``)."""
    return {name: CapturedTensor.of(copy(name, t)) for name, t in tensors.items()}


def live_buffers(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The live buffers ``names`` of ``model`` as ``model/<name>``: the optimizer never touches them."""
    sd = model.state_dict(keep_vars=True)
    return {f"model/{n}": sd[n] for n in names}


# -- the optimizer's step, as its hooks see it ----------------------------------------------
_TORCH_OPTIMIZER_FILE = os.path.join("torch", "optim", "optimizer.py")
StepArgs: TypeAlias = "tuple[tuple[object, ...], dict[str, object]]"


def nested_step(optimizer: object) -> bool:
    """Whether the step hooks of ``optimizer`` run for a ``step()`` called inside its own
    ``step()`` (a subclass whose ``step`` calls ``super().step()``: torch wraps both with the
    hooks). Only the outermost call is a training step. Read from the stack rather than
    counted, so that a step that raised (its post-hooks never run) leaves nothing behind."""
    frame: FrameType | None = sys._getframe(1)
    calls = 0
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_TORCH_OPTIMIZER_FILE):
            if frame.f_locals.get("self") is optimizer:
                calls += 1
                if calls > 1:
                    return True
        frame = frame.f_back
    return False


def around_closure(args: tuple[object, ...], kwargs: dict[str, object],
                   after: Callable[[], None], failed: Callable[[], None]) -> StepArgs | None:
    """For ``optimizer.step(closure)`` (Lightning, LBFGS-style loops), whose gradients exist only
    once the closure ran inside ``step()``: the step's arguments with the closure replaced by
    one that calls ``after()`` when it returns (``failed()`` when it raises); None without a
    closure. ``args`` are what torch gives step pre-hooks: the optimizer, then step's own."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None

    def closure_then_capture() -> object:
        try:
            loss = closure()
        except BaseException:
            failed()
            raise
        after()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_capture}
    return (args[0], closure_then_capture, *args[2:]), kwargs
