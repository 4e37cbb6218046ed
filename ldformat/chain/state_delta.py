"""The writer's side of a ``state.xor`` row (spec §11.3): each tensor's values against the base.

The base is the bits of the state the writer last recorded, which is what replay of the chain
produces at the previous step. A row codes every tensor against it: by XOR (format 1.5 and
older chains), by difference (``sub``), or, for the second moment and the parameter of an Adam
parameter, by difference from a prediction (``adam.v``, ``adam.w``; :mod:`ldformat.format.predict`),
with the prediction's coefficients in a ``predict/<i>`` slot. The values of a predicted
tensor depend on other tensors of the row, so they are computed in dependency order (per
parameter: ``v`` from ``m`` before and after the step, then ``m``, then ``w`` from the new
``m`` and ``v``) whatever the order in which the batch encoder takes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from ..format.delta import PREDICTED, difference_delta
from ..format.jsonvalue import JSON
from ..format.manifest import Encoding
from ..format.predict import (
    COEFFICIENTS,
    PREDICT,
    adam_coefficients,
    by_parameter,
    moment_names,
    predict_parameter,
    predict_second_moment,
)
from .captured import CapturedTensor

#: Coefficients of a predicted slot whose parameter has none at this step (its optimizer state
#: changed within a batch): the prediction is then +0.0 and the values the bits' zigzag.
NO_PREDICTION = np.zeros(COEFFICIENTS, np.uint32)


def step_counts(tensors: Mapping[str, CapturedTensor]) -> dict[int, float]:
    """The new step count of each parameter with an ``optimizer/<i>/step`` scalar."""
    out: dict[int, float] = {}
    for name, ct in tensors.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "optimizer" and parts[2] == "step" and parts[1].isdigit():
            if ct.indices is None and ct.bits.size == 1 and ct.dtype in ("float32", "float64", "int64"):
                out[int(parts[1])] = float(ct.to_tensor().reshape(-1)[0])
    return out


def coefficients(optimizer: torch.optim.Optimizer, tensors: Mapping[str, CapturedTensor],
                 groups: JSON) -> dict[int, np.ndarray]:
    """Coefficients per parameter that Adam prediction fits, with the param groups ``groups``."""
    return adam_coefficients(optimizer, groups, step_counts(tensors))


def wanted_encodings(tensors: Mapping[str, CapturedTensor], params: list[str], plain: Encoding,
                     coefs: Mapping[int, np.ndarray]) -> dict[str, Encoding]:
    """The encoding each tensor would get in a new batch: ``adam.v``/``adam.w`` where the
    parameter has coefficients and its ``m`` and ``v`` are float32 like it, else ``plain``."""
    out: dict[str, Encoding] = {name: plain for name in tensors}
    for i in coefs:
        m_name, v_name = moment_names(i)
        m, v = tensors.get(m_name), tensors.get(v_name)
        if m is None or v is None or m.dtype != "float32" or v.dtype != "float32" or m.shape != v.shape:
            continue
        out[v_name] = "adam.v"
        w = tensors.get(f"model/{params[i]}") if i < len(params) else None
        if w is not None and w.dtype == "float32" and w.shape == m.shape:
            out[f"model/{params[i]}"] = "adam.w"
    return out


def row_values(tensors: Mapping[str, CapturedTensor], encodings: Mapping[str, str], params: list[str],
               coefs: Mapping[int, np.ndarray], base: dict[str, np.ndarray],
               prior: Mapping[str, np.ndarray], in_place: bool,
               pool: ThreadPoolExecutor | None = None) -> dict[str, np.ndarray]:
    """The values of every tensor of a row, and the base moved on to this step's bits.

    ``encodings``: the slot encoding of each tensor in its batch; ``base``: the bits of the
    previous step's state, of the tensors present at this step (updated in place); ``prior``:
    the base before the tensors absent at this step were forgotten (``m`` before the step of a
    parameter whose ``m`` is gone now). ``in_place``: the captured bits may be overwritten
    with the values (a staging buffer); otherwise each value gets its own array. ``pool``:
    code the tensors of different parameters on its threads (numpy releases the GIL); a
    parameter's tensors depend on each other and stay on one thread.
    """
    values: dict[str, np.ndarray] = {}

    def out_for(name: str) -> np.ndarray:
        bits = tensors[name].bits
        return bits if in_place else bits.copy()

    def plain(name: str) -> None:
        if name in values:
            return
        bits, enc = tensors[name].bits, encodings[name]
        old = base.get(name)
        if old is not None and (old.shape != bits.shape or old.dtype != bits.dtype):
            old = None
        out = out_for(name)
        if old is None:
            base[name] = bits.copy()
            if enc != "xor":
                difference_delta(out, None, out)  # coded against all-zero bits
        elif enc == "xor":
            np.bitwise_xor(out, old, out=out)
            np.bitwise_xor(old, out, out=old)  # b ^ (b ^ x) == x: the base moves on
        else:
            difference_delta(out, old, out)
        values[name] = out

    def predicted(name: str, i: int) -> None:
        if name in values:
            return
        m_name, v_name = moment_names(i)
        coef = coefs.get(i, NO_PREDICTION)
        bits = tensors[name].bits
        target = base.get(name)
        if target is None or target.shape != bits.shape or target.dtype != bits.dtype:
            target = base[name] = np.zeros_like(bits)  # absent: all-zero bits (spec §11.3)
        if encodings[name] == "adam.v":
            m_new = tensors[m_name].bits if m_name in tensors else None  # before m's values replace it
            predict_second_moment(prior.get(m_name), m_new, target, coef, target)
        else:
            for dep in (m_name, v_name):
                if dep in tensors:
                    compute(dep)  # the base then holds the new m and v
            predict_parameter(target, base.get(m_name) if m_name in tensors else None,
                              base.get(v_name) if v_name in tensors else None, coef, target)
        out = out_for(name)
        difference_delta(out, target, out)  # the prediction moves on to the true bits
        values[name] = out

    def compute(name: str) -> None:
        enc = encodings[name]
        if enc in PREDICTED:
            predicted(name, index_of[name])
            return
        # A first moment whose parameter predicts v: v first, while m still has both states.
        for v_name in dependents.get(name, ()):
            predicted(v_name, index_of[v_name])
        plain(name)

    index_of: dict[str, int] = {}
    dependents: dict[str, list[str]] = {}
    for name, enc in encodings.items():
        if enc == "adam.v":
            i = int(name.split("/")[1])
            index_of[name] = i
            dependents.setdefault(moment_names(i)[0], []).append(name)
        elif enc == "adam.w":
            index_of[name] = params.index(name[len("model/"):])
    if pool is None:
        for name in tensors:
            compute(name)
    else:
        # Each task writes only its own names' entries of ``values`` and ``base``. Largest
        # first, so that the last task to start is a short one.
        ordered = sorted(by_parameter(tensors, params), key=lambda names: -sum(tensors[n].bits.nbytes for n in names))

        def code(names: list[str]) -> None:
            for name in names:
                compute(name)

        futures = [pool.submit(code, names) for names in ordered]
        wait(futures)  # all of them, even after a failure: none may still write into the buffers
        for future in futures:
            future.result()
    for name in [n for n in encodings if encodings[n] in PREDICTED]:
        i = index_of[name]
        values.setdefault(f"{PREDICT}{i}", coefs.get(i, NO_PREDICTION))
    return values
