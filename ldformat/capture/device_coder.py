"""Coding a ``state.xor`` row with torch ops on the tensors' own device (spec §11.3, §11.3.1).

The host coder (:func:`ldformat.chain.state_delta.row_values`) copies the whole state to the host and
codes it there with numpy. On a CUDA device most of that copy is waste: with Adam prediction
about 99% of a parameter's elements are predicted exactly, so its values are zero. This module
computes the same values where the tensors live, and moves to the host only the residual:

- ``sub``: ``zigzag((N - B) mod 2^W)`` on the signed-integer views of the bits (torch's
  integer arithmetic wraps; the zigzag's ``d >> (W - 1)`` is an arithmetic shift);
- ``adam.v`` / ``adam.w``: the prediction ``P``, one correctly rounded binary32 operation at a
  time, in the order of spec §11.3.1, then a NaN result replaced by +0.0, then the values as
  ``sub`` against ``P``;
- ``xor``: ``N XOR B``;
- the residual of each tensor crosses in its smallest form: dense; the indices of its non-zero
  elements and their values (a predicted ``w``, about 1% non-zero); or a bitmap of its
  non-zero elements and their values (a predicted ``v``, a quarter to a half non-zero); the
  host expands it again.

The results are bit-identical to the host coder's: integer wrap-around is exact by
construction, and every floating-point step is one correctly rounded IEEE 754 binary32
operation: the coefficients are 0-dim tensors on the tensors' device (on CUDA, torch divides
by a *CPU* scalar as a multiplication by its reciprocal, which rounds differently), no kernel
is fused (no ``addcmul``, ``addcdiv``, ``lerp``), the square root is taken in binary64 and
rounded (torch's float32 ``sqrt`` is not correctly rounded on the CPU:
:func:`correctly_rounded_sqrt`), subnormals are kept (:func:`ldformat.format.predict.ieee_subnormals`
around CPU work; CUDA kernels are compiled without flushing) and NaN payloads erased.

The base (the bits of the previous step's state) lives on the device too, as flat signed-integer
tensors, and moves on to each step's bits as :func:`~ldformat.chain.state_delta.row_values` moves
the host base; :func:`base_to_device` and :func:`base_to_host` convert between the two forms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..chain.state_delta import NO_PREDICTION
from ..format.delta import PREDICTED, SIGNED_NP, WIDTH_DTYPES
from ..format.predict import PREDICT, ieee_subnormals, moment_names

SIGNED: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Bytes of the non-zero count that decides, per tensor, in which form its residual crosses.
COUNT_BYTES = 8
_SQRT_CHUNK = 1 << 24  # elements per binary64 square root: 128 MiB of binary64 temporaries at most


# -- bits ------------------------------------------------------------------------------------
def int_bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as a flat signed-integer tensor of its element width, on its device
    (a view of its memory when ``t`` is contiguous, else a copy). The integer view of spec
    §11.3: every dtype takes part by its bits."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    signed = SIGNED[t.element_size()]
    if t.dtype != signed:
        t = t.view(signed)
    return t.reshape(-1)


def base_to_device(base: Mapping[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The host coder's base (flat unsigned numpy bits) as a device base (flat signed tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, bits in base.items():
        flat = np.ascontiguousarray(bits).reshape(-1)
        host = torch.from_numpy(flat.view(SIGNED_NP[flat.dtype.itemsize]))
        if host.dtype == torch.uint8:
            host = host.view(torch.int8)
        out[name] = host.to(device, copy=True)
    return out


def base_to_host(base: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A device base as the host coder's base (flat unsigned numpy bits, copies)."""
    return {name: to_host(bits) for name, bits in base.items()}


def to_host(bits: torch.Tensor) -> np.ndarray:
    """Flat signed-integer bits on any device as a flat unsigned numpy array on the host (a copy)."""
    flat = bits.detach().reshape(-1).to("cpu", copy=True)
    return flat.numpy().view(WIDTH_DTYPES[flat.element_size()])


# -- ``sub`` (spec §11.3) ----------------------------------------------------------------------
def zigzag_(d: torch.Tensor) -> torch.Tensor:
    """``d = (d << 1) XOR (d >>arith (W - 1))`` in place on a signed-integer tensor and return it:
    a difference read as two's complement ``D`` becomes ``2D`` (``D >= 0``) or ``-2D - 1``, the
    zigzag of spec §11.3. Both shifts are defined for every value in torch (the left shift works
    on the unsigned value, the right shift of a signed integer is arithmetic)."""
    sign = torch.bitwise_right_shift(d, d.element_size() * 8 - 1)  # 0 or all ones
    d.bitwise_left_shift_(1)
    d.bitwise_xor_(sign)
    return d


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    """``(z >>logical 1) XOR -(z AND 1)``: the inverse of :func:`zigzag_` (spec §11.3), a new tensor."""
    half = torch.bitwise_right_shift(z, 1)
    half.bitwise_and_((1 << (z.element_size() * 8 - 1)) - 1)  # the arithmetic shift's sign bit cleared
    low = torch.bitwise_and(z, 1)
    low.neg_()  # 0 or all ones
    return half.bitwise_xor_(low)


def difference(bits: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """The values of a ``sub`` slot (spec §11.3): ``zigzag((bits - base) mod 2^W)`` as a new flat
    signed tensor; ``base`` None is all-zero bits (a tensor that appears). Integer subtraction
    wraps in torch, on the CPU and on CUDA. Neither argument is modified."""
    d = bits.clone() if base is None else torch.sub(bits, base)
    return zigzag_(d)


def undifference(values: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """The bits a ``sub`` slot's values rebuild from ``base`` (spec §11.6): ``base + unzigzag(values)``."""
    d = unzigzag(values)
    return d if base is None else d.add_(base)


# -- Adam prediction (spec §11.3.1) -------------------------------------------------------------
def coefficient_tensor(coef: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """The seven coefficients ``a, s, c, e, k, b, d`` (float32 bits, ``uint32[7]``, or those of
    several parameters one after the other) as a flat float32 tensor on ``device``. Each
    prediction step takes them as 0-dim tensors of the device: on CUDA, torch divides by a
    CPU scalar as a multiplication by its reciprocal (not the correctly rounded quotient), and
    a device tensor is never such a scalar."""
    bits = np.ascontiguousarray(coef, np.uint32).reshape(-1).view(np.int32)
    if bits.shape[0] % 7:
        raise ValueError(f"{bits.shape[0]} prediction coefficients, spec §11.3.1 has 7 per parameter")
    return torch.from_numpy(bits.copy()).to(device).view(torch.float32)


@contextlib.contextmanager
def _ieee(device: torch.device) -> Iterator[None]:
    """Subnormals kept while a prediction runs: on the CPU the calling thread may flush them
    (``torch.set_flush_denormal(True)``); CUDA kernels are compiled without flushing."""
    if device.type == "cpu":
        with ieee_subnormals():
            yield
    else:
        yield


def _input(bits: torch.Tensor | None, size: int, device: torch.device, what: str) -> torch.Tensor:
    """A prediction input as flat float32 on ``device``: all-zero bits (+0.0) when absent."""
    if bits is None:
        return torch.zeros(size, dtype=torch.float32, device=device)
    if bits.element_size() != 4 or bits.numel() != size:
        raise ValueError(f"prediction input {what} has {bits.numel()} elements of {bits.element_size()} bytes, "
                         f"not {size} float32 (spec §11.3.1)")
    flat = int_bits(bits).to(device)
    return flat.view(torch.float32)


def _canonical_(p: torch.Tensor) -> torch.Tensor:
    """Every NaN replaced by +0.0, whatever its payload (spec §11.3.1); returns the int32 bits."""
    p.masked_fill_(torch.isnan(p), 0.0)
    return p.view(torch.int32)


def second_moment_prediction(m0: torch.Tensor | None, m: torch.Tensor | None, v0: torch.Tensor | None,
                             coef: torch.Tensor, size: int) -> torch.Tensor:
    """The ``adam.v`` prediction ``P`` (spec §11.3.1) as flat int32 bits on ``coef``'s device::

        t = m - m0;  t = t * k;  t = m0 + t;  t = t * t;  t = t * d;  P = v0 * b;  P = P + t

    ``m0``, ``m``, ``v0``: 32-bit bits (any integer or float32 view) or None for all-zero bits;
    ``coef``: :func:`coefficient_tensor`. Bit-identical to
    :func:`ldformat.format.predict.predict_second_moment`: each op is one correctly rounded binary32
    operation (an addition's operands commute exactly), a NaN result becomes +0.0."""
    dev = coef.device
    k, b, d = coef[4], coef[5], coef[6]
    m0f, mf, v0f = _input(m0, size, dev, "m0"), _input(m, size, dev, "m"), _input(v0, size, dev, "v0")
    with _ieee(dev):
        t = torch.sub(mf, m0f)
        t.mul_(k)
        t.add_(m0f)  # m0 + t
        t.mul_(t)
        t.mul_(d)
        p = torch.mul(v0f, b)
        p.add_(t)
        return _canonical_(p)


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded binary32 square root of a float32 tensor, as a new tensor.

    ``torch.sqrt`` on float32 is not always correctly rounded: on the CPU it runs through a
    vector math library that is off by one unit in the last place for some inputs (about 1 in 6
    on AdamW second moments), while spec §11.3.1 requires one correctly rounded operation. The
    square root is therefore taken in binary64 and rounded to binary32: the square root of a
    binary32 value lies at least 4 binary64 units in the last place away from any midpoint of
    two binary32 values (it cannot be one: a midpoint's square has more significant bits than
    a binary32 value), so a binary64 result within that error rounds to the correctly rounded
    binary32 one. Chunked, so that the binary64 temporaries stay small."""
    out = torch.empty_like(x)
    flat, dst = x.reshape(-1), out.view(-1)
    for i in range(0, flat.numel(), _SQRT_CHUNK):
        dst[i:i + _SQRT_CHUNK] = torch.sqrt(flat[i:i + _SQRT_CHUNK].double())  # rounded to nearest, ties even
    return out


def parameter_prediction(w0: torch.Tensor | None, m: torch.Tensor | None, v: torch.Tensor | None,
                         coef: torch.Tensor, size: int) -> torch.Tensor:
    """The ``adam.w`` prediction ``P`` (spec §11.3.1) as flat int32 bits on ``coef``'s device::

        q = sqrt(v); q = q / c;  q = q + e;  q = m / q;   q = q * s;  P = w0 * a;  P = P - q

    Arguments as :func:`second_moment_prediction`; bit-identical to
    :func:`ldformat.format.predict.predict_parameter`."""
    dev = coef.device
    a, s, c, e = coef[0], coef[1], coef[2], coef[3]
    w0f, mf, vf = _input(w0, size, dev, "w0"), _input(m, size, dev, "m"), _input(v, size, dev, "v")
    with _ieee(dev):
        q = correctly_rounded_sqrt(vf)
        q.div_(c)  # c is a device tensor: a true division, also on CUDA
        q.add_(e)
        torch.div(mf, q, out=q)
        q.mul_(s)
        p = torch.mul(w0f, a)
        p.sub_(q)
        return _canonical_(p)


# -- residual compaction ----------------------------------------------------------------------
Form = Literal["dense", "indices", "mask"]
"""How a tensor's residual crosses to the host: all its values; the flat indices of its
non-zero elements and those elements (:func:`compact_residual`); or a bitmap of its non-zero
elements and those elements (:func:`mask_residual`)."""


def index_dtype(size: int) -> torch.dtype:
    """The dtype of the indices of a compacted residual of ``size`` elements: int32 when they fit."""
    return torch.int32 if size <= torch.iinfo(torch.int32).max else torch.int64


def compact_residual(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, nonzero)`` of a tensor's values, computed on its device: the sorted flat
    indices of its non-zero elements (:func:`index_dtype`) and those elements. For a
    predicted ``w`` (about 99% zero) these are what needs to cross to the host."""
    flat = values.reshape(-1)
    idx = torch.nonzero(flat).reshape(-1)
    return idx.to(index_dtype(flat.numel())), flat[idx]


def expand_residual(indices: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """The dense values of :func:`compact_residual`'s output on the host: zeros except at ``indices``."""
    out = np.zeros(size, values.dtype)
    out[indices] = values
    return out


_BIT_WEIGHTS = [1 << b for b in range(8)]


def mask_residual(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bitmap, nonzero)`` of a tensor's values, computed on its device: one bit per element,
    set where it is non-zero (``uint8``, little-endian bit order, as ``np.packbits(...,
    bitorder="little")``), and the non-zero elements in order. Smaller than
    :func:`compact_residual` when more than about 1 element in 32 is non-zero (a predicted
    ``v``: a third to a half of the elements)."""
    flat = values.reshape(-1)
    nonzero = flat != 0
    pad = -flat.numel() % 8
    bits = torch.cat([nonzero, nonzero.new_zeros(pad)]) if pad else nonzero
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=flat.device)
    bitmap = (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    return bitmap, flat[nonzero]


def expand_mask_residual(bitmap: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """The dense values of :func:`mask_residual`'s output on the host."""
    out = np.zeros(size, values.dtype)
    out[np.unpackbits(bitmap, count=size, bitorder="little").astype(bool)] = values
    return out


def residual_bytes(size: int, width: int, nonzero: int) -> tuple[int, Form]:
    """Bytes a residual of ``size`` elements of ``width`` bytes with ``nonzero`` non-zero elements
    takes to cross to the host in its smallest :data:`Form`, the non-zero count included."""
    forms: list[tuple[int, Form]] = [
        (size * width, "dense"),
        (nonzero * (index_dtype(size).itemsize + width), "indices"),
        (-(-size // 8) + nonzero * width, "mask"),
    ]
    nbytes, form = min(forms, key=lambda f: f[0])  # the first of equals: dense before compacted
    return COUNT_BYTES + nbytes, form


@dataclass(frozen=True)
class CodedRow:
    """A row coded on the device and fetched: ``values`` equal :func:`~ldformat.chain.state_delta.row_values`'s;
    ``d2h_bytes`` crossed from the device (non-zero counts, residuals in their smallest form),
    ``raw_bytes`` is the size of the state tensors, what the host coder copies."""

    values: dict[str, np.ndarray]
    d2h_bytes: int
    raw_bytes: int


def row_transfer_bytes(values: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """``(d2h, raw)``: the bytes :func:`fetch_row` moves from the device for these device values,
    and the bytes of the state tensors themselves (what copying the state costs). Synchronizes
    with the device (one count per tensor); counts the same on the CPU."""
    d2h = raw = 0
    for v in values.values():
        n, w = v.numel(), v.element_size()
        d2h += residual_bytes(n, w, int(torch.count_nonzero(v)) if n else 0)[0]
        raw += n * w
    return d2h, raw


def fetch_row(values: Mapping[str, torch.Tensor], compact: bool = True) -> tuple[dict[str, np.ndarray], int, int]:
    """Device values (flat signed tensors) as host values (flat unsigned numpy arrays), each
    tensor's residual compacted on its device when that moves fewer bytes (``compact``; else
    every tensor crosses dense). Returns ``(values, d2h_bytes, raw_bytes)`` as
    :class:`CodedRow` counts them."""
    out: dict[str, np.ndarray] = {}
    d2h = raw = 0
    for name, v in values.items():
        n, w = v.numel(), v.element_size()
        raw += n * w
        if not compact or n == 0:
            d2h += COUNT_BYTES + n * w
            out[name] = to_host(v)
            continue
        nbytes, form = residual_bytes(n, w, int(torch.count_nonzero(v)))
        d2h += nbytes
        if form == "indices":
            idx, nz = compact_residual(v)
            out[name] = expand_residual(idx.cpu().numpy(), to_host(nz), n)
        elif form == "mask":
            bitmap, nz = mask_residual(v)
            out[name] = expand_mask_residual(bitmap.cpu().numpy(), to_host(nz), n)
        else:
            out[name] = to_host(v)
    return out, d2h, raw


# -- a whole row (the device form of state_delta.row_values) -----------------------------------
def _param_index(name: str, encoding: str, params: Sequence[str]) -> int:
    """The parameter of a predicted slot, as the host coder finds it: ``optimizer/<i>/...`` for
    ``adam.v``, the first ``i`` with ``params[i] == <key>`` for ``adam.w`` on ``model/<key>``."""
    if encoding == "adam.v":
        return int(name.split("/")[1])
    return list(params).index(name[len("model/"):])


def code_row_on_device(tensors: Mapping[str, torch.Tensor], encodings: Mapping[str, str], params: Sequence[str],
                       coefs: Mapping[int, np.ndarray], base: dict[str, torch.Tensor],
                       prior: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The values of every state tensor of a row (spec §11.3, §11.3.1), as flat signed tensors on
    each tensor's device, and the base moved on to this step's bits; what
    :func:`~ldformat.chain.state_delta.row_values` computes on the host, with the same arguments in
    device form: ``tensors`` the live tensors (read, never written), ``base`` the previous
    step's bits of the tensors present now (updated in place; an entry on another device is
    moved to its tensor's), ``prior`` the base before the absent tensors were forgotten (may
    share its tensors with ``base``). The ``predict/<i>`` slots are :func:`prediction_slots`.

    Order, as the host's dependency order gives it: every ``adam.v`` first (it reads ``m``
    before the step from ``prior``, which the first moment's own coding moves on), then the
    plain slots, then every ``adam.w`` (from the new ``m`` and ``v``, the live tensors).
    """
    bits = {name: int_bits(t) for name, t in tensors.items()}
    values: dict[str, torch.Tensor] = {}
    index_of = {name: _param_index(name, enc, params) for name, enc in encodings.items() if enc in PREDICTED}
    used = sorted(set(index_of.values()))
    row_of = {i: r for r, i in enumerate(used)}
    table = np.stack([coefs.get(i, NO_PREDICTION) for i in used]) if used else np.zeros((0, 7), np.uint32)
    coef_on: dict[torch.device, torch.Tensor] = {}

    def coefficients(i: int, device: torch.device) -> torch.Tensor:
        """Parameter ``i``'s coefficients on ``device``: one copy of the row's whole table per device."""
        if device not in coef_on:
            coef_on[device] = coefficient_tensor(table, device).view(-1, 7)
        return coef_on[device][row_of[i]]

    def base_of(name: str, like: torch.Tensor) -> torch.Tensor | None:
        old = base.get(name)
        if old is None or old.numel() != like.numel() or old.element_size() != like.element_size():
            return None  # absent, or unlike the tensor: coded against all-zero bits
        if old.device != like.device or old.dtype != like.dtype:
            old = base[name] = old.to(like.device).view(like.dtype)
        return old

    def plain(name: str) -> None:
        n, old = bits[name], base_of(name, bits[name])
        if encodings[name] == "xor":
            values[name] = n.clone() if old is None else torch.bitwise_xor(n, old)
        else:
            values[name] = difference(n, old)
        if old is None:
            base[name] = n.clone()
        else:
            old.copy_(n)

    def predicted(name: str, i: int, encoding: str) -> None:
        n = bits[name]
        if n.element_size() != 4:
            raise ValueError(f"{name}: encoding {encoding!r} needs float32 bits (spec §11.3.1)")
        target = base_of(name, n)
        coef = coefficients(i, n.device)
        m_name, v_name = moment_names(i)
        if encoding == "adam.v":
            p = second_moment_prediction(prior.get(m_name), bits.get(m_name), target, coef, n.numel())
        else:
            p = parameter_prediction(target, bits.get(m_name), bits.get(v_name), coef, n.numel())
        values[name] = zigzag_(torch.sub(n, p, out=p))  # sub against the prediction, in its memory
        if target is None:
            base[name] = n.clone()
        else:
            target.copy_(n)

    for name in tensors:
        if encodings[name] == "adam.v":
            predicted(name, index_of[name], "adam.v")
    for name in tensors:
        if encodings[name] not in PREDICTED:
            plain(name)
    for name in tensors:
        if encodings[name] == "adam.w":
            predicted(name, index_of[name], "adam.w")
    return {name: values[name] for name in tensors}


def prediction_slots(encodings: Mapping[str, str], params: Sequence[str],
                     coefs: Mapping[int, np.ndarray]) -> dict[str, np.ndarray]:
    """The ``predict/<i>`` slots of a row (spec §11.3.1): the coefficients of every parameter
    with a predicted slot (``NO_PREDICTION`` where it has none), as the host coder adds them."""
    out: dict[str, np.ndarray] = {}
    for name, enc in encodings.items():
        if enc in PREDICTED:
            i = _param_index(name, enc, params)
            out.setdefault(f"{PREDICT}{i}", coefs.get(i, NO_PREDICTION))
    return out


def code_row(tensors: Mapping[str, torch.Tensor], encodings: Mapping[str, str], params: Sequence[str],
             coefs: Mapping[int, np.ndarray], base: dict[str, torch.Tensor],
             prior: Mapping[str, torch.Tensor], compact: bool = True) -> CodedRow:
    """A whole row coded on the tensors' devices and fetched: :class:`CodedRow` whose ``values``
    equal those of :func:`~ldformat.chain.state_delta.row_values` with the same state, bit for bit
    (arguments as :func:`code_row_on_device`; ``compact``: residuals cross as non-zeros when smaller)."""
    on_device = code_row_on_device(tensors, encodings, params, coefs, base, prior)
    values, d2h, raw = fetch_row(on_device, compact)
    for name, coef in prediction_slots(encodings, params, coefs).items():
        values.setdefault(name, coef)
    return CodedRow(values=values, d2h_bytes=d2h, raw_bytes=raw)
