"""Adam prediction for ``state.xor`` rows (slot encodings ``adam.v`` and ``adam.w``, spec §11.3).

An Adam step changes the second moment ``v`` and the parameter ``w`` almost entirely as a
function of things a reader already has: the new first moment ``m`` (stored as a difference),
the previous ``m``, ``v`` and ``w``, and a few scalars. The writer stores those scalars, seven
float32 **coefficients** per parameter (slot ``predict/<i>``), and for ``v`` and ``w`` only the
difference between the true bits and a **prediction**; the reader computes the same prediction
and adds the difference back. The prediction is a fixed sequence of IEEE 754 binary32
operations (each correctly rounded, subnormals kept even in a thread that flushes them,
a NaN result replaced by +0.0), so every platform computes the same bits and replay stays
exact wherever it runs, whichever kernel the optimizer used: a prediction that misses only
costs bytes. On the benchmark workload (AdamW) it hits ``w`` exactly for 99% of the elements.

Coefficients ``[a, s, c, e, k, b, d]``, for parameter ``i`` at the recorded step:

    v_hat = v0 * b + ((m0 + (m - m0) * k) ** 2) * d     # m0, v0: before the step
    w_hat = w0 * a - (m / (sqrt(v) / c + e)) * s        # m, v: after it

which for ``torch.optim.AdamW`` (and ``Adam``) at step ``t`` with ``lr``, ``betas = (b1,
b2)``, ``eps`` and ``weight_decay`` are ``a = 1 - lr * weight_decay`` (1 for ``Adam``'s L2
decay), ``s = lr / (1 - b1**t)``, ``c = sqrt(1 - b2**t)``, ``e = eps``, ``k = 1 / (1 - b1)``,
``b = b2``, ``d = 1 - b2``, each rounded to float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CorruptChainError, UnsupportedStateError
from .jsonvalue import JSON, decode

COEFFICIENTS = 7  # a, s, c, e, k, b, d: the float32 values of slot predict/<i>
PREDICT = "predict/"  # slot namespace of the coefficients (not a state tensor)
FIRST_MOMENT, SECOND_MOMENT = "exp_avg", "exp_avg_sq"
_CHUNK = 1 << 16  # elements per pass: the temporaries stay in the L1/L2 caches
_F32 = np.float32


def _flushes_subnormals() -> bool:
    """Whether this thread's floating-point unit flushes subnormal inputs or results to zero
    (``torch.set_flush_denormal(True)``, a library built with fast-math): the prediction
    would then differ between a writer and a reader in different modes."""
    tiny = np.array([1e-39, 1e-20], _F32)
    product = tiny * np.array([1.0, 1e-20], _F32)
    return bool(product[0] == 0 or product[1] == 0)


@contextlib.contextmanager
def ieee_subnormals() -> Iterator[None]:
    """Run the block with subnormals kept, as spec §11.3.1 requires, and put the thread's mode
    back afterwards; raise if the mode cannot be changed."""
    if not _flushes_subnormals():
        yield
        return
    torch.set_flush_denormal(False)
    try:
        if _flushes_subnormals():
            raise UnsupportedStateError(
                "this thread flushes subnormal floats to zero and it cannot be turned off, so Adam prediction "
                "(spec §11.3.1) would not give the bits every other reader computes")
        yield
    finally:
        torch.set_flush_denormal(True)


def _canonical(out: np.ndarray, scratch: np.ndarray) -> None:
    """Replace every NaN by +0.0 (NaN payloads differ between CPUs; spec §11.3)."""
    np.isnan(out, out=scratch)
    if scratch.any():  # rare: skip the masked copy, half of this function's cost
        np.copyto(out, _F32(0.0), where=scratch)


def _f32(a: np.ndarray | None, n: int) -> np.ndarray:
    """Flat float32 view of an array of 32-bit bits; all-zero bits for an absent input."""
    return np.zeros(n, _F32) if a is None else a.view(_F32)


def predict_second_moment(m0: np.ndarray | None, m: np.ndarray | None, v0: np.ndarray | None,
                          coef: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the ``adam.v`` prediction (bits, flat uint32); ``out`` may be ``v0``."""
    n = out.shape[0]
    k, b, d = (_F32(x) for x in coef.view(_F32)[4:7])
    m0f, mf, v0f, o = _f32(m0, n), _f32(m, n), _f32(v0, n), out.view(_F32)
    t = np.empty(min(n, _CHUNK), _F32)
    nan = np.empty(min(n, _CHUNK), bool)
    with ieee_subnormals(), np.errstate(all="ignore"):  # inf - inf and the like: NaN, replaced below
        for i in range(0, n, _CHUNK):
            j = min(n, i + _CHUNK)
            tc, oc, bad = t[: j - i], o[i:j], nan[: j - i]
            np.subtract(mf[i:j], m0f[i:j], out=tc)
            np.multiply(tc, k, out=tc)
            np.add(m0f[i:j], tc, out=tc)  # the gradient, as m's update implies it
            np.multiply(tc, tc, out=tc)
            np.multiply(tc, d, out=tc)
            np.multiply(v0f[i:j], b, out=oc)
            np.add(oc, tc, out=oc)
            _canonical(oc, bad)


def predict_parameter(w0: np.ndarray | None, m: np.ndarray | None, v: np.ndarray | None,
                      coef: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the ``adam.w`` prediction (bits, flat uint32); ``out`` may be ``w0``."""
    n = out.shape[0]
    a, s, c, e = (_F32(x) for x in coef.view(_F32)[0:4])
    w0f, mf, vf, o = _f32(w0, n), _f32(m, n), _f32(v, n), out.view(_F32)
    t = np.empty(min(n, _CHUNK), _F32)
    nan = np.empty(min(n, _CHUNK), bool)
    with ieee_subnormals(), np.errstate(all="ignore"):  # sqrt of a negative, 0/0: NaN, replaced below
        for i in range(0, n, _CHUNK):
            j = min(n, i + _CHUNK)
            tc, oc, bad = t[: j - i], o[i:j], nan[: j - i]
            np.sqrt(vf[i:j], out=tc)
            np.divide(tc, c, out=tc)
            np.add(tc, e, out=tc)
            np.divide(mf[i:j], tc, out=tc)
            np.multiply(tc, s, out=tc)
            np.multiply(w0f[i:j], a, out=oc)
            np.subtract(oc, tc, out=oc)
            _canonical(oc, bad)


def adam_coefficients(optimizer: torch.optim.Optimizer, groups: JSON,
                      steps: Mapping[int, float]) -> dict[int, np.ndarray]:
    """Coefficients (float32 bits, uint32[7]) per parameter index for which Adam prediction
    fits: ``optimizer`` is ``torch.optim.Adam`` or ``AdamW`` without ``amsgrad``, ``groups``
    are the encoded param groups the step used (``hyper``, else those after it), ``steps``
    the new step count of each parameter that has one. Empty for any other optimizer."""
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW) or not isinstance(groups, list):
        return {}
    out: dict[int, np.ndarray] = {}
    first = 0
    for g_json, group in zip(groups, optimizer.param_groups, strict=False):
        n = len(group["params"])
        try:
            g = decode(g_json)
            if not isinstance(g, dict):
                raise TypeError("a param group is not a dict")
            coef = _coefficients(g, cls is torch.optim.AdamW or bool(g.get("decoupled_weight_decay")))
        except (TypeError, ValueError, KeyError, OverflowError, ZeroDivisionError, AttributeError):
            coef = None
        for i in range(first, first + n):
            step = steps.get(i)
            if coef is not None and step is not None and step >= 1:
                try:
                    c = coef(step)
                except (ValueError, OverflowError, ZeroDivisionError, FloatingPointError):
                    c = None
                if c is not None:
                    out[i] = c
        first += n
    return out


def _coefficients(g: dict[str, Any], decoupled: bool) -> Any:
    if g.get("amsgrad"):
        return None  # the update divides by max(v): not this prediction
    lr, eps, wd = float(g["lr"]), float(g["eps"]), float(g["weight_decay"])
    b1, b2 = (float(x) for x in g["betas"])
    if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
        return None

    def at(step: float) -> np.ndarray | None:
        values = [1.0 - lr * wd if decoupled else 1.0, lr / (1.0 - b1**step), math.sqrt(1.0 - b2**step), eps,
                  1.0 / (1.0 - b1), b2, 1.0 - b2]
        with np.errstate(all="ignore"):  # an absurd lr or eps: inf or 0 in float32, refused below
            arr = np.array(values, np.float64).astype(_F32)
        if not np.isfinite(arr).all():
            return None
        return arr.view(np.uint32)

    return at


def predicted_param(name: str, encoding: str, params: Sequence[str]) -> int:
    """The optimizer parameter index of a predicted slot: ``optimizer/<i>/...`` for ``adam.v``,
    the first ``i`` with ``params[i] == <key>`` for ``adam.w`` on ``model/<key>`` (slots are
    checked against the schema first, spec §10.3)."""
    if encoding == "adam.v":
        return int(name.split("/")[1])
    key = name[len("model/"):]
    for i, p in enumerate(params):
        if p == key:
            return i
    raise CorruptChainError(f"slot {name} has encoding 'adam.w' but is not an optimizer parameter (spec §11.3)")


def by_parameter(names: Iterable[str], params: Sequence[str]) -> list[list[str]]:
    """``names`` grouped by the optimizer parameter they belong to (``optimizer/<i>/...`` and
    ``model/<params[i]>``), every other name alone, groups in first-seen order. A prediction
    reads only its own parameter's tensors (spec §11.3.1), so different groups may be coded or
    applied on different threads."""
    param_of: dict[str, int] = {}
    for i, p in enumerate(params):
        param_of.setdefault(f"model/{p}", i)  # the first i, as predicted_param takes
    groups: dict[object, list[str]] = {}
    for name in names:
        parts = name.split("/")
        key: object = (int(parts[1]) if parts[0] == "optimizer" and len(parts) == 3 and parts[1].isdigit()
                       else param_of.get(name, name))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def moment_names(i: int) -> tuple[str, str]:
    """The stored names of parameter ``i``'s first and second moments (spec §11.3)."""
    return f"optimizer/{i}/{FIRST_MOMENT}", f"optimizer/{i}/{SECOND_MOMENT}"
