"""Capture and restore of random number generator states (spec §19.2): the process's global
generators, and those an optimizer holds outside its ``state_dict()``."""

from __future__ import annotations

import logging
import random
import warnings
import weakref
from typing import Any, TypedDict

import torch

from ..errors import CorruptChainError

log = logging.getLogger("ldformat.capture")


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


# -- generators an optimizer holds outside its state_dict() (spec §19.2, `optimizer_rng`) ----------
# timm's Adahessian draws its Hutchinson probes from a torch.Generator of its own, which neither
# optimizer.state_dict() nor the global states hold: without it a resumed run draws other probes.
_NOT_SEARCHED = frozenset({"state", "param_groups", "defaults"})  # in state_dict(), or configuration
_warned: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _numpy_random() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for users of the runtime
        return None
    return np.random


def _state_kind(value: object) -> str | None:
    """``torch``, ``python`` or ``numpy``: the §19.2 member whose form holds ``value``'s state;
    ``opaque`` for a generator whose state cannot be captured; None for anything else."""
    if isinstance(value, torch.Generator):
        return "torch"
    if isinstance(value, random.SystemRandom):  # the OS's entropy: no state to capture
        return "opaque"
    if isinstance(value, random.Random):
        return "python"
    np_random = _numpy_random()
    if np_random is not None:
        if isinstance(value, np_random.RandomState):
            return "numpy"
        if isinstance(value, (np_random.Generator, np_random.BitGenerator)):  # 128-bit state words
            return "opaque"
    return None


def optimizer_generators(optimizer: torch.optim.Optimizer) -> tuple[dict[str, object], list[str]]:
    """The random number generators ``optimizer`` holds as attributes, by attribute path (``a.b``
    for an optimizer it wraps under ``a``), and the paths of those whose state cannot be
    captured (a ``numpy.random.Generator``, ``random.SystemRandom``). Each generator once."""
    found: dict[str, object] = {}
    opaque: list[str] = []
    seen: set[int] = set()

    def walk(obj: torch.optim.Optimizer, prefix: str) -> None:
        seen.add(id(obj))
        for name, value in list(vars(obj).items()):
            if name in _NOT_SEARCHED or id(value) in seen:
                continue
            kind = _state_kind(value)
            if kind == "opaque":
                opaque.append(prefix + name)
            elif kind is not None:
                found[prefix + name] = value
                seen.add(id(value))
            elif isinstance(value, torch.optim.Optimizer):  # a wrapped optimizer (Lookahead's base)
                walk(value, f"{prefix}{name}.")

    walk(optimizer, "")
    return found, opaque


def capture_optimizer_rng(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """The states of the generators of :func:`optimizer_generators` (spec §19.2): ``{path:
    {"torch": state, "device": str} | {"python": state} | {"numpy": state}}``, copies.

    Warns once per optimizer (a :class:`RuntimeWarning`) when it holds a generator whose state
    cannot be captured: a run resumed from the chain then draws other numbers from it.
    """
    found, opaque = optimizer_generators(optimizer)
    if opaque and optimizer not in _warned:
        _warned.add(optimizer)
        warnings.warn(
            f"{type(optimizer).__name__} holds random number generators whose state ldformat cannot record "
            f"({', '.join(opaque)}): a run resumed from this chain will not continue them exactly (keep a "
            "torch.Generator, random.Random or numpy.random.RandomState instead)", RuntimeWarning, stacklevel=2)
    out: dict[str, object] = {}
    for path, rng in found.items():
        if isinstance(rng, torch.Generator):
            out[path] = {"torch": rng.get_state(), "device": str(rng.device)}
        elif isinstance(rng, random.Random):
            out[path] = {"python": rng.getstate()}
        else:
            name, keys, pos, has_gauss, gauss = rng.get_state(legacy=True)  # type: ignore[attr-defined]
            keys_bits = torch.from_numpy(keys.astype("uint32").view("int32").copy())
            out[path] = {"numpy": {"name": name, "keys": keys_bits, "pos": int(pos), "has_gauss": int(has_gauss),
                                   "gauss": float(gauss)}}
    return out


def restore_optimizer_rng(optimizer: torch.optim.Optimizer, state: object, where: str) -> None:
    """Set the generators of ``optimizer`` to the states :func:`capture_optimizer_rng` recorded
    (spec §19.5), after ``optimizer.load_state_dict``.

    A ``torch.Generator`` recorded on another device than the live one's (timm's Adahessian
    moves its generator to the parameters' device at its first step) is replaced by one on the
    recorded device. A recorded generator the live optimizer lacks is skipped with a warning.

    Raises:
        CorruptChainError: ``state`` is not a dict of the recorded form, naming ``where``.
    """
    if not isinstance(state, dict):
        raise CorruptChainError(f"{where}: extra.optimizer_rng is {type(state).__name__}, not an object (spec §19.2)")
    for path, saved in state.items():
        what = f"{where}: extra.optimizer_rng[{path!r}]"
        owner: object = optimizer
        *outer, name = str(path).split(".")
        for part in outer:  # through wrapped optimizers only, as capture_optimizer_rng walks
            owner = vars(owner).get(part) if isinstance(owner, torch.optim.Optimizer) else None
        live = vars(owner).get(name) if isinstance(owner, torch.optim.Optimizer) else None
        if not isinstance(saved, dict) or len(saved) > 2 or not {"torch", "python", "numpy"} & set(saved):
            raise CorruptChainError(f"{what} is not a recorded generator state (spec §19.2)")
        try:
            if "torch" in saved:
                device = torch.device(str(saved.get("device", "cpu")))
                if isinstance(live, torch.Generator) and live.device != device:
                    try:
                        live = torch.Generator(device)
                    except RuntimeError:  # recorded on a device this process does not have
                        log.warning("%s: the optimizer's generator %s was recorded on %s, which this process does "
                                    "not have: it is not restored, and the resumed run draws other random numbers "
                                    "from it", where, path, device)
                        continue
                    setattr(owner, name, live)
                if isinstance(live, torch.Generator):
                    live.set_state(saved["torch"])
                    continue
            elif "python" in saved and isinstance(live, random.Random) and _state_kind(live) == "python":
                version, internal, gauss = saved["python"]
                live.setstate((version, tuple(internal), gauss))
                continue
            elif "numpy" in saved and _state_kind(live) == "numpy":
                n = saved["numpy"]
                live.set_state((n["name"], n["keys"].numpy().view("uint32"), n["pos"], n["has_gauss"],  # type: ignore[union-attr]
                                n["gauss"]))
                continue
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError) as e:
            raise CorruptChainError(f"{what} cannot be restored ({type(e).__name__}: {e}); spec §19.2") from None
        log.warning("%s: the optimizer has no generator %s like the recorded one (%s): it is not restored, and "
                    "the resumed run draws other random numbers from it", where, path, type(live).__name__)
