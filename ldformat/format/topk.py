"""Top-k gradient compression with error feedback (LowDiff; spec §11.1 ``grad.topk``, §14).

``TopK.compress_(model)`` runs after ``backward()`` and before ``optimizer.step()``. For each
parameter it adds the residual carried from earlier steps, keeps the ``k`` entries of largest
magnitude, writes them back into ``p.grad`` (zeros elsewhere) and keeps the rest as the new
residual. The sorted indices it chose are handed to the chain writer, so recording a
``grad.topk`` delta needs no second scan for non-zeros.
"""

from __future__ import annotations

import math

import torch

from .dtensors import local


class TopK:
    """Top-k compressor with per-parameter error feedback.

    Args:
        ratio: fraction of each gradient's entries to keep, in (0, 1].
        error_feedback: carry the dropped part of each gradient into the next step.

    Example:
        >>> topk = TopK(0.01)
        >>> loss.backward(); topk.compress_(model); optimizer.step()   # doctest: +SKIP
    """

    def __init__(self, ratio: float, error_feedback: bool = True) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopK ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[str, torch.Tensor] = {}
        self.indices: dict[str, torch.Tensor] = {}
        self.generation = 0
        self._scratch: dict[str, torch.Tensor] = {}

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))  # 0 for an empty tensor

    @torch.no_grad()
    def select(self, name: str, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback and selection for one flat gradient: (sorted indices, values).

        Updates the residual of ``name``; leaves ``flat`` unchanged unless error feedback
        adds the residual into it.
        """
        if self.error_feedback:
            if name not in self.residuals:
                self.residuals[name] = torch.zeros_like(flat)
            flat.add_(self.residuals[name])
        scratch = self._scratch.get(name)
        if scratch is None or scratch.shape != flat.shape or scratch.dtype != flat.dtype:
            scratch = self._scratch[name] = torch.empty_like(flat)
        torch.abs(flat, out=scratch)  # reused: a fresh |g| per step costs more than the top-k itself
        _, idx = torch.topk(scratch, self.k_for(flat.numel()), sorted=False)
        idx, _ = torch.sort(idx)
        values = flat[idx]
        if self.error_feedback:
            self.residuals[name].copy_(flat)
            self.residuals[name][idx] = 0
        return idx, values

    @torch.no_grad()
    def compress_(self, model: torch.nn.Module) -> None:
        """Compress every ``p.grad`` of ``model`` in place."""
        self.indices = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            grad = local(p.grad)  # a DTensor's shard: top-k is per shard (spec §20)
            if not grad.is_contiguous():
                raise ValueError(f"TopK: gradient of {name!r} is not contiguous")
            flat = grad.view(-1)
            idx, values = self.select(name, flat)
            flat.zero_()
            flat[idx] = values
            self.indices[name] = idx
        self.generation += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals by parameter name (what anchors store)."""
        return dict(self.residuals)

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        """Restore residuals (missing ones restart from zero)."""
        self.residuals = {k: v.clone() for k, v in residuals.items()}
        self.indices = {}
