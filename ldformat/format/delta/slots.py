"""A batch's slots against the chain's schema (spec §10.3 "Slots").

Which slot names, encodings, dtypes and shapes a batch of each delta kind may hold, checked
before anything of the batch is decoded (the writer checks what it commits the same way).
"""

from __future__ import annotations

import numpy as np

from ...errors import CorruptChainError
from ..jsonvalue import JSON
from ..manifest import Encoding, SlotInfo
from ..predict import COEFFICIENTS as PREDICT_COEFFICIENTS
from .profile import is_count, shape_numel

# -- slot bounds (spec §10.3) ---------------------------------------------------------------
NP_DTYPES: dict[str, type[np.generic]] = {
    "bool": np.uint8, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64,
    # format 1.2: their bits, by width
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8, "complex64": np.uint64}
# An optimizer slot may hold 2^20 elements whatever the model: state whose size does not scale
# with the parameters (a generator's state, a histogram), which a tiny model's P^2 could not hold.
OPTIMIZER_SLOT_FLOOR = 1 << 20
_KIND_SLOTS: dict[str, dict[str, tuple[Encoding, ...]]] = {
    "grad.topk": {"grad": ("sparse",), "model": ("dense",)},
    "grad.dense": {"grad": ("dense",), "model": ("dense",)},
    "state.xor": {"model": ("xor", "sub", "adam.w"), "optimizer": ("xor", "sub", "adam.v"), "predict": ("dense",)},
}
PREDICTED: tuple[Encoding, ...] = ("adam.v", "adam.w")  # computed from a prediction (spec §11.3)


def _index(text: str) -> int | None:
    """A parameter index written in decimal without leading zeros, else None."""
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0") or len(text) > 19:
        return None
    return int(text)


def _schema_tables(schema: JSON) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[str], int]:
    """(stored model entries by name: (dtype, shape), optimizer params, total parameter numel) of a root schema."""
    where = "the chain's schema (ldformat.json)"
    model = schema.get("model") if isinstance(schema, dict) else None
    optimizer = schema.get("optimizer") if isinstance(schema, dict) else None
    listed = optimizer.get("params") if isinstance(optimizer, dict) else None
    params = [p for p in listed if isinstance(p, str)] if isinstance(listed, list) else []
    if not isinstance(model, list) or not isinstance(listed, list) or len(params) != len(listed):
        raise CorruptChainError(f"{where}: schema.model or schema.optimizer.params is malformed (spec §5.6)")
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    total = 0
    for e in model:
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(e, dict) or not isinstance(name, str):
            raise CorruptChainError(f"{where}: a schema.model entry is malformed (spec §5.6.1)")
        if e.get("alias_of") is not None:
            continue
        shape, dtype = e.get("shape"), e.get("dtype")
        dims = tuple(d for d in shape if is_count(d)) if isinstance(shape, list) else ()
        if not isinstance(shape, list) or len(dims) != len(shape) or not _shape_ok(dims):
            raise CorruptChainError(f"{where}: schema.model entry {name!r} has a malformed shape {shape!r}")
        if dtype not in NP_DTYPES or not isinstance(dtype, str):
            raise CorruptChainError(f"{where}: schema.model entry {name!r} has dtype {dtype!r}, "
                                    "not one of spec §5.6.4")
        entries[name] = (dtype, dims)
        if e.get("role") == "parameter":
            total += shape_numel(dims)
    for p in params:
        if p not in entries:
            raise CorruptChainError(f"{where}: schema.optimizer.params names {p!r}, which is not a stored "
                                    "schema.model entry (spec §5.6.2)")
    return entries, params, total


def optimizer_slot_bound(parameter_elements: int) -> int:
    """The most elements an ``optimizer/…`` slot may hold in a chain whose schema's parameters
    have ``parameter_elements`` elements together (P): ``max(2^20, P^2)`` (spec §10.3).

    Every second-order statistic of the gradients (a full-matrix preconditioner, Kronecker
    factors, blocks of them, stacked) is indexed by pairs of parameter elements, so it holds at
    most P^2; P alone, the bound up to 1.6's reference reader, refused preconditioner matrices
    that the writer recorded (e.g. pytorch-optimizer's DASH).
    """
    return max(OPTIMIZER_SLOT_FLOOR, parameter_elements * parameter_elements)


def _shape_ok(shape: tuple[int, ...]) -> bool:
    """A shape torch can hold: the product of max(1, d) over the dimensions is below 2^63."""
    span = 1
    for d in shape:
        span *= max(1, d)
    return span < 1 << 63


def check_slots(slots: tuple[SlotInfo, ...], schema: JSON, kind: str, where: str) -> None:
    """Check a batch's slots against the chain's schema before anything of the batch is decoded (spec §10.3).

    Names are unique and in the namespaces of ``kind``, with its encoding; dtypes are those of
    spec §5.6.4; ``grad/<i>`` has exactly the dtype and shape of parameter ``i``, ``model/<key>``
    those of its schema entry, and an ``optimizer/…`` slot holds at most
    :func:`optimizer_slot_bound` elements. Raises CorruptChainError naming the slot.
    """
    model, params, total = _schema_tables(schema)
    allowed = _KIND_SLOTS.get(kind)
    if allowed is None:
        raise CorruptChainError(f"{where}: unknown delta kind {kind!r}")
    seen: set[str] = set()
    for slot in slots:
        name = slot.name
        bad = f"{where}: slot {name!r}"
        if name in seen:
            raise CorruptChainError(f"{bad} appears twice in the batch (spec §10.3)")
        seen.add(name)
        if slot.dtype not in NP_DTYPES:
            raise CorruptChainError(f"{bad} has dtype {slot.dtype!r}, not one of spec §5.6.4")
        space, _, rest = name.partition("/")
        encodings = allowed.get(space)
        if encodings is None or not rest:
            raise CorruptChainError(f"{bad} is not a slot name a {kind} chain uses (spec §10.3, §11)")
        if slot.encoding not in encodings:
            raise CorruptChainError(f"{bad} has encoding {slot.encoding!r}; a {kind} chain stores it as "
                                    f"{' or '.join(map(repr, encodings))} (spec §11)")
        if slot.encoding in PREDICTED and slot.dtype != "float32":
            raise CorruptChainError(f"{bad} is {slot.dtype}; encoding {slot.encoding!r} is for float32 tensors "
                                    "(spec §11.3)")
        if space in ("grad", "predict"):
            i = _index(rest)
            if i is None or i >= len(params):
                raise CorruptChainError(f"{bad} names no optimizer parameter (the chain has {len(params)})")
            expected: tuple[str, tuple[int, ...]] | None = (
                model[params[i]] if space == "grad" else ("float32", (PREDICT_COEFFICIENTS,)))
        elif space == "model":
            expected = model.get(rest)
            if expected is None:
                raise CorruptChainError(f"{bad} names no stored schema.model entry (spec §8)")
            if slot.encoding == "adam.w" and rest not in params:
                raise CorruptChainError(f"{bad} has encoding 'adam.w' but is not an optimizer parameter (spec §11.3)")
        else:
            i_text, _, key = rest.partition("/")
            i = _index(i_text)
            structure = i_text == "ref"  # optimizer/ref/...: a tensor of the optimizer structure (§8.2)
            if not key or not structure and (i is None or i >= len(params)):
                raise CorruptChainError(f"{bad} names no optimizer parameter (the chain has {len(params)})")
            if slot.encoding == "adam.v" and (structure or key == "exp_avg"):
                raise CorruptChainError(f"{bad} has encoding 'adam.v', which is for optimizer/<i>/<key> other than "
                                        "the first moment exp_avg it is predicted from (spec §10.3, §11.3.1)")
            expected = None
            bound = optimizer_slot_bound(total)
            if not _shape_ok(slot.shape) or slot.numel > bound:
                raise CorruptChainError(f"{bad} has shape {list(slot.shape)}: more elements than the {bound} an "
                                        f"optimizer tensor may hold in a chain of {total} parameter elements "
                                        "(max(2^20, P^2); spec §10.3)")
        if expected is not None and (slot.dtype, slot.shape) != expected:
            raise CorruptChainError(f"{bad} is {slot.dtype} {list(slot.shape)}; the schema says {expected[0]} "
                                    f"{list(expected[1])} (spec §10.3)")
