"""Capture and restore of random number generator states (spec §19.2)."""

from __future__ import annotations

import random
from typing import TypedDict

import torch


class NumpyRngState(TypedDict):
    """NumPy's legacy global state (``np.random.get_state(legacy=True)``), ``keys`` as int32 bits."""

    name: str
    keys: torch.Tensor
    pos: int
    has_gauss: int
    gauss: float


class _TorchRngState(TypedDict):
    torch: torch.Tensor


class RngState(_TorchRngState, total=False):
    """The ``rng`` member of the extra state (spec §19.2), decoded."""

    python: tuple[int, tuple[int, ...], float | None]  # random.getstate()
    cuda: list[torch.Tensor]
    numpy: NumpyRngState


def capture_rng() -> dict[str, object]:
    """CPU and CUDA torch generators, Python's ``random``, and NumPy's legacy global state."""
    state: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        keys_bits = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
        state["numpy"] = {"name": name, "keys": keys_bits, "pos": int(pos), "has_gauss": int(has_gauss),
                          "gauss": float(gauss)}
    except ImportError:  # numpy is optional for users of the runtime
        pass
    return state


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = n["keys"].numpy().view("uint32")
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["gauss"]))
