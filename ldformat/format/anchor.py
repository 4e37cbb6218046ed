"""Anchors: full states as safetensors objects (spec §9, "Anchors").

An anchor object holds every tensor of the state under its stored name (see
:mod:`ldformat.format.state`), each storage once. Its safetensors ``__metadata__`` carries
``ldformat.format`` = ``anchor`` and ``ldformat.step``; the JSON-able parts (param groups,
extra state) live in the commit record that references the anchor.

Writing (docs/implementation-notes.md "Anchor objects"): :func:`anchor_parts` returns the
header and zero-copy views of the tensors' memory, so that the object is streamed to storage
and checksummed without ever being joined in memory. The header is the canonical JSON (§6.2) of the
safetensors header, padded with spaces to a multiple of 8 bytes, and the data is ordered by
decreasing element size, then name: the bytes depend only on the state (not on the process,
unlike ``safetensors.torch.save``, whose ``__metadata__`` order varies), and every tensor
starts at a multiple of its element size.

Reading: :func:`decode_anchor` validates the header itself (spec §9.1) and builds every tensor with
``torch.frombuffer`` on the one buffer the object was read into: no second copy, and the
tensors are writable (replay updates them in place) and do not overlap.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import torch

from ..errors import CorruptChainError, FormatError, UnsupportedStateError
from ..stores.base import Store
from .checksum import object_checksum_parts
from .jsonvalue import JSON, JSONObject, canonical, parse_json

# safetensors dtype codes of the format's dtypes (spec §5.6.4).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    # format 1.2
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in SAFETENSORS_DTYPES.items()}

# safetensors refuses headers above 100 MB (MAX_HEADER_SIZE); so do we.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

#: Anchors from this size on are checksummed on a second thread while they are written
#: (below it, starting a thread costs more than the overlap saves).
_OVERLAP_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class AnchorParts:
    """An anchor object as the pieces written back to back: ``header`` then ``payloads``.

    ``payloads`` are uint8 numpy views of the tensors' memory (no copy; empty tensors have
    none). They stay valid while the tensors are not modified.
    """

    header: bytes
    payloads: tuple[np.ndarray, ...]
    size: int

    @property
    def parts(self) -> list[bytes | np.ndarray]:
        return [self.header, *self.payloads]


def anchor_metadata(step: int) -> dict[str, str]:
    return {"ldformat.format": "anchor", "ldformat.step": str(step)}


def anchor_parts(tensors: dict[str, torch.Tensor], step: int) -> AnchorParts:
    """Split the anchor of CPU ``tensors`` (not sharing memory) into header and payloads."""
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name == METADATA_KEY:
            raise UnsupportedStateError(f"{name!r} cannot be a tensor name in an anchor")
        if t.device.type != "cpu":
            raise UnsupportedStateError(f"{name}: anchor tensors must be on the CPU, not {t.device}")
        if t.dtype not in _CODES:
            raise UnsupportedStateError(f"{name}: dtype {t.dtype} is not supported by format 1.x")
        flat[name] = t.detach().contiguous()
    _refuse_shared_memory(flat)
    # Decreasing element size, then name: every tensor is aligned to its element size
    # (the data starts at a multiple of 8), and the order does not depend on dict order.
    order = sorted(flat, key=lambda n: (-flat[n].element_size(), n))
    header: JSONObject = {METADATA_KEY: dict(anchor_metadata(step))}
    payloads: list[np.ndarray] = []
    offset = 0
    for name in order:
        t = flat[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            payloads.append(t.reshape(-1).view(torch.uint8).numpy())
    body = canonical(header)
    body += b" " * (-len(body) % 8)  # like safetensors: the data starts at a multiple of 8
    head = struct.pack("<Q", len(body)) + body
    return AnchorParts(header=head, payloads=tuple(payloads), size=len(head) + offset)


def write_anchor_parts(store: Store, path: str, anchor: AnchorParts) -> str:
    """Write ``anchor`` as the object ``path`` of ``store`` (not yet durable); its checksum.

    Returns :func:`~ldformat.format.jsonvalue.object_checksum` of the object. For a large anchor the
    checksum is computed on a second thread while the object is written: crc32c and the
    store's writes both release the GIL, so the checksum costs no time of its own (the
    pass over memory overlaps the wait for the disk). The object's bytes are those of
    :func:`anchor_parts`; the thread only reads them.
    """
    parts = anchor.parts
    if anchor.size < _OVERLAP_MIN_BYTES:
        store.write_parts(path, parts)
        return object_checksum_parts(path, parts)
    crc: list[str] = []
    failed: list[BaseException] = []

    def checksum() -> None:
        try:
            crc.append(object_checksum_parts(path, parts))
        except BaseException as exc:  # noqa: BLE001 (re-raised on the calling thread)
            failed.append(exc)

    worker = threading.Thread(target=checksum, name="ldformat-anchor-crc32c", daemon=True)
    worker.start()
    try:
        store.write_parts(path, parts)
    finally:
        worker.join()
    if failed:
        raise failed[0]
    return crc[0]


def _refuse_shared_memory(tensors: dict[str, torch.Tensor]) -> None:
    """Each storage is stored once (spec §9.1): overlapping tensors are a caller's bug."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in tensors.items()
                   if t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise UnsupportedStateError(f"{a} and {b} share memory; an anchor stores each storage once")


def encode_anchor(tensors: dict[str, torch.Tensor], step: int) -> bytes:
    """The anchor object of CPU ``tensors`` as one ``bytes`` (same bytes as :func:`anchor_parts`)."""
    p = anchor_parts(tensors, step)
    return b"".join([p.header, *(a.data for a in p.payloads)])


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(data: bytes | bytearray | memoryview | np.ndarray,
                  where: str) -> tuple[dict[str, str], dict[str, _Entry], int]:
    """Validate a safetensors header like safetensors does; returns (metadata, entries, data start)."""

    def bad(why: str) -> CorruptChainError:
        return CorruptChainError(f"{where}: not a valid safetensors anchor ({why})")

    if len(data) < 8:
        raise bad("truncated safetensors header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES:
        raise bad(f"header length {n} exceeds {MAX_HEADER_BYTES}")
    if n > len(data) - 8:
        raise bad("truncated safetensors header")
    raw = bytes(data[8 : 8 + n])
    if not raw.startswith(b"{"):
        raise bad("the header does not start with '{'")

    try:  # the JSON rules of records (spec §6.4): no duplicate names, no NaN, bounded numbers and depth
        header: JSON = parse_json(raw, "header", max_bytes=MAX_HEADER_BYTES, tagged=False)
    except FormatError as exc:
        raise bad(str(exc)) from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    stored = header.pop(METADATA_KEY, {})
    meta = {k: v for k, v in stored.items() if isinstance(v, str)} if isinstance(stored, dict) else {}
    if not isinstance(stored, dict) or len(meta) != len(stored):
        raise bad("__metadata__ is not an object of strings")

    def is_uint(x: object) -> TypeGuard[int]:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63

    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"{name}: not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise bad(f"{name}: dtype {dtype!r} is not one of format 1.x")
        dims = tuple(d for d in shape if is_uint(d)) if isinstance(shape, list) else ()
        if not isinstance(shape, list) or len(dims) != len(shape):
            raise bad(f"{name}: shape {shape!r} is not a list of non-negative integers")
        span = 1
        for d in dims:
            span *= max(1, d)
        if span >= 1 << 63:  # torch cannot hold it, even with no element
            raise bad(f"{name}: shape {shape!r} is too large (the product of its non-zero dimensions is 2^63 "
                      "or more)")
        bounds = [o for o in offsets if is_uint(o)] if isinstance(offsets, list) else []
        if not isinstance(offsets, list) or len(offsets) != 2 or len(bounds) != 2:
            raise bad(f"{name}: data_offsets {offsets!r} is not two non-negative integers")
        entries[name] = _Entry(dtype, dims, bounds[0], bounds[1])
    # The tensors tile the data exactly, in some order (any order is valid, spec §9.1).
    cursor = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end, kv[0])):
        if e.begin != cursor or e.end < e.begin:
            raise bad(f"{name}: data_offsets [{e.begin}, {e.end}] do not follow the previous tensor "
                      f"(ending at {cursor})")
        numel = 1
        for d in e.shape:
            numel *= d
        if numel * _ITEMSIZE[e.dtype] != e.end - e.begin:
            raise bad(f"{name}: {e.end - e.begin} bytes for shape {list(e.shape)} of {e.dtype}")
        cursor = e.end
    if cursor != len(data) - 8 - n:
        raise bad(f"the tensors cover {cursor} bytes of data, the object holds {len(data) - 8 - n}")
    return meta, entries, 8 + n


def decode_anchor(data: bytes | bytearray | memoryview | np.ndarray, step: int, where: str) -> dict[str, torch.Tensor]:
    """Parse a verified anchor object; checks the metadata names the expected step.

    The tensors share ``data`` when it is a ``bytearray`` or a writable ``uint8`` array (as
    :meth:`Store.read_buffer` returns; one copy is made otherwise):
    each is a writable view of its own byte range, except a tensor whose offset is not
    aligned to its element size (other writers), which is copied. Sorted by name.
    """
    meta, entries, start = _parse_header(data, where)
    if meta.get("ldformat.format") != "anchor" or meta.get("ldformat.step") != str(step):
        raise CorruptChainError(f"{where}: anchor metadata does not name step {step}")
    owned = isinstance(data, bytearray) or (
        isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 and data.flags.writeable
        and data.flags.c_contiguous)
    buf = data if owned else bytearray(data)
    base = np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(entries):
        e = entries[name]
        dtype = SAFETENSORS_DTYPES[e.dtype]
        nbytes, offset = e.end - e.begin, start + e.begin
        if nbytes == 0:
            tensors[name] = torch.empty(e.shape, dtype=dtype)
            continue
        if dtype == torch.bool and int(np.frombuffer(buf, np.uint8, nbytes, offset).max()) > 1:
            raise CorruptChainError(f"{where}: not a valid safetensors anchor ({name}: a bool byte is not 0 or 1)")
        itemsize = _ITEMSIZE[e.dtype]
        if (base + offset) % itemsize == 0:
            flat = torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset)
        else:  # unaligned (not written by ldformat): copy into aligned memory
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).clone().view(dtype)
        tensors[name] = flat.reshape(e.shape)
    return tensors


def tensor_bytes(data: bytes | bytearray | memoryview | np.ndarray, prefix: str) -> int:
    """Bytes of the tensors whose name starts with ``prefix``, from the header alone."""
    _, entries, _ = _parse_header(data, "anchor")
    return sum(e.end - e.begin for k, e in entries.items() if k.startswith(prefix))

