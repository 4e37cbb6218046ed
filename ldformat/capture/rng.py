"""Capture and restore of random number generator states (spec §19.2)."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """CPU and CUDA torch generators, Python's ``random``, and NumPy's legacy global state."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
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


def restore_rng(state: dict[str, Any]) -> None:
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
