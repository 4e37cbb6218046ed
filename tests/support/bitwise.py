"""Bit-for-bit comparison of states for the tests: integer views of every tensor, so that
-0.0 and 0.0, and NaN payloads, count as different (``torch.equal`` does not)."""

from __future__ import annotations

import math
from typing import Any

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (so that -0.0 and NaN payloads count)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point() or t.is_complex():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[
            t.element_size()])
    return t


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Deep equality, tensors bit for bit (dtype, shape, bytes); dict order is not compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{tuple(got.shape)}"
        assert torch.equal(bits(got), bits(want)), f"{where}: bits differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__} is not a dict"
        assert sorted(got, key=repr) == sorted(want, key=repr), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{where}: {got!r} is not nan"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"
