"""Anchors: full states as safetensors objects (spec §9, "Anchors").

An anchor object holds every tensor of the state under its stored name (see
:mod:`ldformat.state`), each storage once. Its safetensors ``__metadata__`` carries
``ldformat.format`` = ``anchor`` and ``ldformat.step``; the JSON-able parts (param groups,
extra state) live in the commit record that references the anchor.
"""

from __future__ import annotations

import json
import struct

import safetensors.torch
import torch

from .errors import CorruptChainError


def encode_anchor(tensors: dict[str, torch.Tensor], step: int) -> bytes:
    """Serialize CPU tensors (contiguous, not sharing memory) to safetensors bytes."""
    return safetensors.torch.save(
        tensors, metadata={"ldformat.format": "anchor", "ldformat.step": str(step)}
    )


def decode_anchor(data: bytes, step: int, where: str) -> dict[str, torch.Tensor]:
    """Parse a verified anchor object; checks the metadata names the expected step."""
    try:
        # safetensors returns tensors in no fixed order: sort for deterministic output.
        tensors = dict(sorted(safetensors.torch.load(data).items()))
        meta = _metadata(data)
    except CorruptChainError:
        raise
    except Exception as e:
        raise CorruptChainError(f"{where}: not a valid safetensors anchor ({e})") from None
    if meta.get("ldformat.format") != "anchor" or meta.get("ldformat.step") != str(step):
        raise CorruptChainError(f"{where}: anchor metadata does not name step {step}")
    return tensors


def tensor_bytes(data: bytes, prefix: str) -> int:
    """Bytes of the tensors whose name starts with ``prefix``, from the header alone."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return sum(
        int(v["data_offsets"][1]) - int(v["data_offsets"][0])
        for k, v in header.items()
        if k != "__metadata__" and k.startswith(prefix)
    )


def _metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise CorruptChainError("truncated safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CorruptChainError("truncated safetensors header")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__", {})
    return meta if isinstance(meta, dict) else {}
