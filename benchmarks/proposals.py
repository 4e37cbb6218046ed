"""Prototypes of improvements proposed to ldformat, measured next to the current code.

Nothing here is used by ldformat; the benchmark times these so that a proposal comes with
its measured effect.

* :func:`stream_anchor` writes an anchor object *byte-identical* to
  ``ldformat.anchor.encode_anchor`` (``safetensors.torch.save``) without building the whole
  object in memory: the safetensors header, then each tensor's memory straight to the file,
  computing the seeded crc32c (``object_checksum``) on the way.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _crc(data: Any, value: int) -> int:
    try:
        import crc32c

        return int(crc32c.crc32c(data, value))
    except ImportError:  # google_crc32c wants read-only bytes: one copy per tensor
        import google_crc32c

        return int(google_crc32c.extend(value, bytes(data)))


def anchor_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[str]]:
    """The safetensors header ``safetensors.torch.save`` would write, and the data order."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))  # safetensors' order
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for n in order:
        t = tensors[n]
        nbytes = t.numel() * t.element_size()
        header[n] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body, order


def stream_anchor(path: str | os.PathLike[str], rel_path: str, tensors: dict[str, torch.Tensor],
                  step: int) -> tuple[int, str]:
    """Write an anchor object to ``path`` and fsync it; returns (size, object_checksum)."""
    head, order = anchor_header(tensors, {"ldformat.format": "anchor", "ldformat.step": str(step)})
    crc = _crc(head, _crc(rel_path.encode(), 0))
    size = len(head)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, head)
        for n in order:
            t = tensors[n].detach().contiguous()
            if t.numel() == 0:
                continue
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            crc = _crc(view, crc)
            size += len(view)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, f"{crc:08x}"


def codec_variants(values: Any, typesize: int = 4) -> dict[str, dict[str, float]]:
    """Re-encode one step's delta values (a flat numpy array) with ldformat's value codec
    (blosc zstd level 1, byte shuffle, automatic block size, 8 MiB chunks) and with variants.

    Returns ``{variant: {"ratio", "encode_core_s", "decode_core_s"}}`` (single thread).
    """
    import time

    from numcodecs import Blosc

    chunk = (8 << 20) // typesize
    variants = {
        "current: zstd1 shuffle, blocksize auto": Blosc("zstd", 1, Blosc.SHUFFLE, 0),
        "zstd1 shuffle, blocksize 1 MiB": Blosc("zstd", 1, Blosc.SHUFFLE, 1 << 20),
        "zstd3 shuffle, blocksize 1 MiB": Blosc("zstd", 3, Blosc.SHUFFLE, 1 << 20),
        "zstd1 bitshuffle, blocksize 1 MiB": Blosc("zstd", 1, Blosc.BITSHUFFLE, 1 << 20),
        "lz4 shuffle, blocksize 1 MiB": Blosc("lz4", 5, Blosc.SHUFFLE, 1 << 20),
    }
    out = {}
    for name, codec in variants.items():
        t0 = time.thread_time()
        chunks = [codec.encode(values[i:i + chunk]) for i in range(0, values.shape[0], chunk)]
        enc = time.thread_time() - t0
        t0 = time.thread_time()
        for c in chunks:
            codec.decode(c)
        dec = time.thread_time() - t0
        out[name] = {"ratio": sum(len(c) for c in chunks) / values.nbytes, "encode_core_s": enc, "decode_core_s": dec}
    return out


def byte_plane_entropy(values: Any) -> dict[str, Any]:
    """Order-0 entropy (bits) of each byte plane of 32-bit values, and the ratio it bounds.

    Byte shuffle followed by an entropy coder codes each byte plane separately, so the sum of
    the planes' order-0 entropies / 32 is about the best ratio such a coder reaches (a coder
    with context can beat it only where neighbouring bytes are correlated).
    """
    import numpy as np

    planes = np.ascontiguousarray(values).view(np.uint8).reshape(-1, values.dtype.itemsize)
    bits = []
    for i in range(planes.shape[1]):
        p = np.bincount(planes[:, i], minlength=256) / planes.shape[0]
        p = p[p > 0]
        bits.append(float(-(p * np.log2(p)).sum()))
    return {"plane_bits": bits, "bound_ratio": sum(bits) / (8 * planes.shape[1])}
