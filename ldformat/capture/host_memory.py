"""How the staging buffers fit the host memory budget (docs/capture-runtime.md "Host memory").

A captured step is copied into a staging set of host buffers (:mod:`.staging`) that the
background writer encodes from. :func:`staging_sets` decides, before anything is written, how
many sets fit ``max_host_bytes``, and whether an ``xor`` state too large for one set is
captured in pieces (:mod:`.pieces`); a state that fits neither way is refused.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ..errors import UsageError
from ..format.topk import TopK
from .settings import Mode
from .tuning import staging_set_bytes, xor_staged_tensors

log = logging.getLogger("ldformat.capture")


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
