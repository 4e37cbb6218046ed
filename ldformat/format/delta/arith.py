"""Bit arithmetic of delta values (spec §10 "Deltas", §11.3 "`state.xor`", §11.6 "State replay (`state.xor`)").

A segment's values are the raw bits of tensor elements, as unsigned integers of the element's
width. This module turns tensors into those bits and back, XORs them into a tensor, and codes
the ``sub`` encoding: the zigzag of the difference ``(bits - base) mod 2^W`` (spec §11.3).
"""

from __future__ import annotations

import numpy as np
import torch

from ..manifest import SlotInfo
from ..state import bits_view

WIDTH_DTYPES: dict[int, type[np.uint8 | np.uint16 | np.uint32 | np.uint64]] = {
    1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

SIGNED_NP: dict[int, type[np.uint8 | np.int16 | np.int32 | np.int64]] = {
    1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

Segment = tuple[np.ndarray | None, np.ndarray]  # (sorted int64 indices or None, raw bits)


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a CPU tensor as a flat unsigned numpy array (no copy if contiguous)."""
    flat = bits_view(t.detach().contiguous()).reshape(-1)
    return flat.numpy().view(WIDTH_DTYPES[t.element_size()])



def _torch_dtype(name: str) -> torch.dtype:
    from ..dtypes import parse_dtype

    return parse_dtype(name)


def segment_to_tensor(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """Rebuild a dense tensor from a segment (a new, writable tensor)."""
    dtype = _torch_dtype(slot.dtype)
    idx, vals = seg
    signed = np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize])
    if idx is None:
        bits = torch.from_numpy(signed.copy())
    else:
        bits = torch.zeros(slot.numel, dtype=torch.from_numpy(signed[:0]).dtype)
        bits[torch.from_numpy(idx)] = torch.from_numpy(signed)
    if dtype == torch.bool:
        return bits.view(torch.bool).reshape(slot.shape)
    return bits.view(dtype).reshape(slot.shape)


def dense_view(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """A dense segment as a tensor sharing the decoded values' memory (no copy)."""
    _, vals = seg
    if not (vals.flags.writeable and vals.flags.c_contiguous):
        vals = vals.copy()
    bits = torch.from_numpy(vals.view(SIGNED_NP[vals.dtype.itemsize]))
    return bits.view(_torch_dtype(slot.dtype)).reshape(slot.shape)


def fill_from_segment(out: torch.Tensor, seg: Segment) -> None:
    """Write a segment into an existing tensor of the slot's dtype and shape (no allocation)."""
    idx, vals = seg
    signed = torch.from_numpy(np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize]))
    view = bits_view(out).reshape(-1)
    if idx is None:
        view.copy_(signed)
    else:
        view.zero_()
        view[torch.from_numpy(idx)] = signed


def _flat_bits(target: torch.Tensor) -> tuple[np.ndarray, bool]:
    """The bits of ``target`` as a flat unsigned numpy array, and whether it is ``target``'s own
    memory (a contiguous CPU tensor) rather than a copy to be written back."""
    view = bits_view(target)
    own = view.device.type == "cpu" and view.is_contiguous() and not view.requires_grad
    flat = view.reshape(-1) if own else view.detach().to("cpu").contiguous().reshape(-1)
    return flat.numpy().view(WIDTH_DTYPES[target.element_size()]), own


def xor_into(target: torch.Tensor, seg: Segment) -> None:
    """``target ^= bits`` in place, on the raw bits of ``target``.

    A contiguous CPU target is XORed by numpy: one thread, without the GIL, so that it runs
    beside the decoding of the next step instead of contending with it as torch's
    multi-threaded kernels do.
    """
    _, vals = seg
    signed = np.ascontiguousarray(vals).view(SIGNED_NP[vals.dtype.itemsize])
    view = bits_view(target)
    if view.device.type == "cpu" and view.is_contiguous() and not view.requires_grad:
        flat = view.reshape(-1).numpy()
        if flat.shape != signed.shape:
            raise ValueError(f"xor of {signed.shape[0]} elements into a tensor of {flat.shape[0]}")
        np.bitwise_xor(flat, signed, out=flat)
        return
    view.reshape(-1).bitwise_xor_(torch.from_numpy(signed))


# -- difference coding (slot encoding ``sub``, spec §11.3) -----------------------------------
# Elements per pass: chunks of 128 Ki elements stay in the L2 cache, so the subtraction, the
# base update and the zigzag cost about the memory traffic of the two XORs they replace.
SUB_CHUNK = 1 << 17
_SIGNED_WIDTH: dict[int, type[np.int8 | np.int16 | np.int32 | np.int64]] = {
    1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _zigzag_chunk(d: np.ndarray, tmp: np.ndarray) -> None:
    """``d = (d << 1) XOR (d >>arith (W - 1))`` in place: small differences of either sign
    become small unsigned numbers (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...)."""
    signed = _SIGNED_WIDTH[d.dtype.itemsize]
    np.right_shift(d.view(signed), d.dtype.itemsize * 8 - 1, out=tmp.view(signed))
    np.left_shift(d, 1, out=d)
    np.bitwise_xor(d, tmp, out=d)


def _unzigzag_chunk(z: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out = (z >> 1) XOR -(z AND 1)``, the inverse of :func:`_zigzag_chunk` (``out`` may be ``z``)."""
    np.bitwise_and(z, 1, out=tmp)
    np.negative(tmp, out=tmp)  # 0 or all ones (unsigned arithmetic wraps)
    np.right_shift(z, 1, out=out)
    np.bitwise_xor(out, tmp, out=out)


def difference_delta(bits: np.ndarray, base: np.ndarray | None, out: np.ndarray) -> None:
    """A ``sub`` slot's values: ``out = zigzag((bits - base) mod 2^W)``, and ``base`` moves on to
    ``bits``. Flat unsigned arrays of one width; ``out`` may be ``bits`` (then ``bits`` is
    overwritten). ``base`` None: the tensor appears, and is coded against all-zero bits."""
    n = bits.shape[0]
    tmp = np.empty(min(n, SUB_CHUNK), bits.dtype)
    copy = out is not bits
    for i in range(0, n, SUB_CHUNK):
        b, o = bits[i:i + SUB_CHUNK], out[i:i + SUB_CHUNK]
        if base is None:
            if copy:
                np.copyto(o, b)
        else:
            a = base[i:i + SUB_CHUNK]
            np.subtract(b, a, out=o)  # o = d (wraps mod 2^W)
            np.add(a, o, out=a)  # a + d = the new bits, whether or not o is b
        _zigzag_chunk(o, tmp[: o.shape[0]])


def undifference(values: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
    """``out (+)= unzigzag(values)`` mod 2^W: apply a ``sub`` slot's values to ``out`` (its
    base's bits), or with ``accumulate`` False decode them into ``out`` (a merge's start)."""
    n = values.shape[0]
    if out.shape[0] != n:
        raise ValueError(f"difference of {n} elements applied to a tensor of {out.shape[0]}")
    width = WIDTH_DTYPES[values.dtype.itemsize]
    values, out = values.view(width), out.view(width)
    tmp = np.empty(min(n, SUB_CHUNK), width)
    dec = np.empty(min(n, SUB_CHUNK), width) if accumulate else None
    for i in range(0, n, SUB_CHUNK):
        z, o = values[i:i + SUB_CHUNK], out[i:i + SUB_CHUNK]
        if dec is None:
            _unzigzag_chunk(z, o, tmp[: z.shape[0]])
        else:
            d = dec[: z.shape[0]]
            _unzigzag_chunk(z, d, tmp[: z.shape[0]])
            np.add(o, d, out=o)


def sub_into(target: torch.Tensor, seg: Segment) -> None:
    """``bits(target) += unzigzag(values)`` mod 2^W in place: replay of a ``sub`` slot (spec §11.6)."""
    _, vals = seg
    flat, own = _flat_bits(target)
    undifference(np.ascontiguousarray(vals), flat, accumulate=True)
    if not own:
        bits_view(target).reshape(-1).copy_(torch.from_numpy(flat.view(SIGNED_NP[flat.dtype.itemsize])))


def apply_state_delta(target: torch.Tensor, seg: Segment, encoding: str) -> None:
    """Apply one ``state.xor`` slot to the tensor it changes: XOR (``xor``) or addition (``sub``)."""
    if encoding == "sub":
        sub_into(target, seg)
    else:
        xor_into(target, seg)


def state_delta_tensor(seg: Segment, slot: SlotInfo) -> torch.Tensor:
    """The tensor a ``state.xor`` slot creates where its base has none (spec §11.3: the base is
    all-zero bits, so an ``xor`` slot holds the bits and a ``sub`` slot their zigzag)."""
    t = segment_to_tensor(seg, slot)
    if slot.encoding == "sub":
        flat, _ = _flat_bits(t)
        undifference(flat, flat, accumulate=False)
    return t
