"""Delta batches as Zarr v3 groups (spec §10, "Deltas").

A batch holds the deltas of consecutive steps, one *row* per step, over a list of *slots*
(tensors). Everything is flat and concatenated so that a batch costs a handful of arrays,
not one array per tensor per step:

    counts     int64[rows, slots]   elements stored for (row, slot); -1 = absent
    indices    uint32[...]          sparse slots: sorted flat indices, gap-coded per segment
    values_u8 / values_u16 / values_u32 / values_u64
                                    the raw bits of the values, grouped by element width

Segments are laid out row-major (row 0 slot 0, row 0 slot 1, ...). Every array ends its
codec chain with ``crc32c``.

The modules, by job: :mod:`.profile` (the Zarr v3 profile of spec §10.2 "Zarr profile": the
metadata written and accepted, codecs, limits), :mod:`.slots` (spec §10.3 "Slots"),
:mod:`.encode` (spec §10.1 "Batch layout"), :mod:`.decode` (spec §10.5 "Decoding a batch")
and :mod:`.arith` (the bits of the values, spec §11.3 "`state.xor`"). Every name is imported
from here, as before the split.
"""

from __future__ import annotations

import sys
import types

from . import arith, decode, encode, profile, slots
from .arith import (
    SIGNED_NP,
    WIDTH_DTYPES,
    Segment,
    apply_state_delta,
    dense_view,
    difference_delta,
    fill_from_segment,
    segment_to_tensor,
    state_delta_tensor,
    sub_into,
    tensor_bits,
    undifference,
    xor_into,
)
from .arith import SUB_CHUNK as SUB_CHUNK
from .decode import DecodedBatch, RowDecoder, decode_batch, decode_batch_checks
from .encode import (
    ArrayEncoder,
    BatchEncoder,
    EncodePool,
    check_encode_threads,
    default_encode_pool,
    default_encode_threads,
    encode_batch,
    encode_pool,
    gap_code,
)
from .profile import (
    CHUNK_BYTES,
    COUNT_CODECS,
    DIFFERENCE_VALUE_CODECS,
    INDEX_CODECS,
    MAX_COUNTS,
    MAX_SPARSE_INDEX,
    VALUE_CODECS,
    BloscOptions,
)
from .profile import ProfileArray as ProfileArray
from .profile import profile_arrays as profile_arrays
from .slots import OPTIMIZER_SLOT_FLOOR, PREDICTED, check_slots, optimizer_slot_bound

__all__ = [
    "CHUNK_BYTES", "COUNT_CODECS", "DIFFERENCE_VALUE_CODECS", "INDEX_CODECS", "MAX_COUNTS", "MAX_SPARSE_INDEX",
    "OPTIMIZER_SLOT_FLOOR", "PREDICTED", "SIGNED_NP", "VALUE_CODECS", "WIDTH_DTYPES",
    "ArrayEncoder", "BatchEncoder", "BloscOptions", "DecodedBatch", "EncodePool", "RowDecoder", "Segment",
    "apply_state_delta", "check_encode_threads", "check_slots", "decode_batch", "decode_batch_checks",
    "default_encode_pool", "default_encode_threads", "dense_view", "difference_delta", "encode_batch", "encode_pool",
    "fill_from_segment", "gap_code", "optimizer_slot_bound", "segment_to_tensor", "state_delta_tensor", "sub_into",
    "tensor_bits", "undifference", "xor_into",
]

_MODULES = (arith, profile, slots, encode, decode)


class _Package(types.ModuleType):
    """Setting a name here sets it in every module of the package that holds it.

    The tunables (``CHUNK_BYTES``, ``SUB_CHUNK``) are read by the modules that use them, as
    they were by the one module this package was: ``monkeypatch.setattr(delta, "CHUNK_BYTES",
    64)`` must still change the chunks the encoder writes.
    """

    def __setattr__(self, name: str, value: object) -> None:
        for module in _MODULES:
            if name in vars(module):
                setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
