"""Prototypes of improvements proposed to ldformat, measured next to the current code.

Nothing here is used by ldformat; the benchmark measures these so that a proposed change
(a codec setting) comes with its measured effect, and a limit with the measurement behind it.
"""

from __future__ import annotations

from typing import Any


def codec_variants(values: Any, typesize: int = 4) -> dict[str, dict[str, float]]:
    """Re-encode one step's delta values (a flat numpy array) with ldformat's value codec
    (blosc zstd level 1, byte shuffle, 1 MiB blocks, 8 MiB chunks) and with variants.

    Returns ``{variant: {"ratio", "encode_core_s", "decode_core_s"}}`` (single thread).
    """
    import time

    from numcodecs import Blosc

    chunk = (8 << 20) // typesize
    variants = {
        "current: zstd1 shuffle, blocksize 1 MiB": Blosc("zstd", 1, Blosc.SHUFFLE, 1 << 20),
        "zstd1 shuffle, blocksize auto": Blosc("zstd", 1, Blosc.SHUFFLE, 0),
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
