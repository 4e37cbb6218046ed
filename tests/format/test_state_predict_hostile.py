"""Hostile input for Adam prediction in ``state.xor`` chains (format 1.6, spec §10.3, §11.3.1,
§11.6, §17.2, §18).

Three kinds of checks:

- crafted batches (re-encoded with valid checksums) whose predicted slots break a rule of spec
  §10.3 or §11.3.1 — coefficients missing from the row or the batch, coefficients of the wrong
  dtype, shape, index or encoding, ``adam.*`` on tensors it is not for, inputs of another
  shape or dtype — are refused with a ``CorruptChainError`` (an unknown encoding: also
  ``UnsupportedVersionError``) naming the batch and the step, reported by ``validate`` and by
  ``ldtools validate`` / ``ldtools materialize`` with exit code 1 and one line, no traceback;
- hostile but valid chains replay bit for bit: coefficients that are zero, NaN, infinite,
  huge or subnormal; NaN payloads, infinities and signed zeros in the live state; training
  that diverges to NaN; zero-size and 0-dimensional parameters; optimizer state that vanishes
  and reappears, in whole or in part; an ``amsgrad`` group beside a plain one; coefficient
  slots without a predicted slot; predicted slots whose inputs are absent; a 1.6 chain relabelled
  1.5 or 1.7 — and compaction keeps every kept step exact with merged ``sub`` deltas;
- the prediction itself matches an independent binary32 reference of spec §11.3.1 on special
  values (NaN payloads, infinities, signed zeros, subnormals) under hostile coefficients;
- ``Adam`` with weight decay and ``maximize`` use the prediction and save bytes like ``AdamW``.

"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from clirun import invoke
from models import TinyNet, assert_state_bits_equal, snapshot, train_step
from record_edit import edit_records, record_paths
from torch import nn

import ldformat
import ldformat.chain.writer
from ldformat import ChainReader, ChainWriter
from ldformat.errors import CorruptChainError, UnsupportedStateError, UnsupportedVersionError
from ldformat.format.checksum import object_checksum, with_checksum
from ldformat.format.delta import Segment, decode_batch, difference_delta, encode_batch
from ldformat.format.manifest import SlotInfo
from ldformat.format.predict import predict_parameter, predict_second_moment

Hook = Callable[[int, nn.Module, torch.optim.Optimizer], Callable[[], None] | None]
OptFactory = Callable[[nn.Module], torch.optim.Optimizer]
Rows = list[dict[int, Segment]]

STEPS = 6
BATCH_STEPS = 3  # batches 1-3 and 4-6
# schema.optimizer.params of TinyNet: the root module's own parameter first, then the children's
PARAMS = ["unused", "embed.weight", "hidden.weight", "hidden.bias", "norm.weight", "norm.bias"]
# the coefficients of spec §11.3.1's test vectors (AdamW, lr 1e-3, step 10)
SPEC_COEFFICIENTS = [0x3F7FFF58, 0x3AC93D76, 0x3DCC5704, 0x322BCC77, 0x41200000, 0x3F7FBE77, 0x3A83126F]


# -- models and training -------------------------------------------------------------------------
class HostileNet(TinyNet):
    """TinyNet plus an extra parameter ``q`` that feeds four logits, a 0-dimensional parameter
    and a parameter with no elements: all three get gradients, so AdamW predicts them."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.scalar = nn.Parameter(torch.tensor(0.25))
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens) * (1.0 + self.scalar)
        return out + nn.functional.pad(self.q, (0, out.shape[-1] - 4)) + self.empty.sum()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def write_chain(path: Path, make_opt: OptFactory = adamw, *, steps: int = STEPS, batch_steps: int = BATCH_STEPS,
                model: nn.Module | None = None, hook: Hook | None = None, anchor_every: int | None = None,
                version: str = "1.6", predict: bool = True,
                ) -> tuple[dict[int, dict[str, Any]], nn.Module, torch.optim.Optimizer]:
    """Train ``steps`` steps and record each; {step: live state}. ``hook(step, model, opt)`` runs
    after the optimizer step and before the record, and may return what undoes its change after
    the record (so the next step trains on the real state)."""
    torch.manual_seed(0)
    model = TinyNet() if model is None else model
    opt = make_opt(model)
    writer = ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=batch_steps,
                                anchor_every=anchor_every, format_version=version)
    writer.predict_state = predict
    refs = {0: snapshot(model, opt)}
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        undo = hook(step, model, opt) if hook is not None else None
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
        if undo is not None:
            undo()
    writer.close()
    return refs, model, opt


def encodings_of(path: Path) -> set[str]:
    return {s.encoding for e in ChainReader(path).state.delta_entries() for s in e.slots}


def slot_encodings(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in ChainReader(path).state.delta_entries():
        for s in e.slots:
            out.setdefault(s.name, set()).add(s.encoding)
    return out


def assert_exact(path: Path, refs: dict[int, dict[str, Any]], steps: list[int] | None = None) -> None:
    """Every step (of ``steps``, default all committed) materializes bit for bit, and the chain
    validates deeply."""
    reader = ChainReader(path)
    wanted = reader.steps if steps is None else steps
    for step in wanted:
        got = reader.materialize(step)
        assert not any(k.startswith("predict") for k in got["model"]), "coefficients are not state"
        assert_state_bits_equal(got, refs[step], f"step {step}")
    for step in (wanted[-1], wanted[0]):  # replay changes no tensor that a later replay starts from
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step} again")
    report = ldformat.validate(path, deep=True)
    assert report.ok, [str(p) for p in report.problems]


def set_bits(t: torch.Tensor, index: int, bits: int) -> None:
    """Set element ``index`` (flat) of a float32 tensor to the given bit pattern."""
    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] = int(np.array([bits], np.uint32).view(np.int32)[0])


def state_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    return opt.state[p]  # type: ignore[index, no-any-return]


# -- crafting batches ----------------------------------------------------------------------------
def delta_entry(docs: list[dict[str, Any]], step: int) -> dict[str, Any]:
    for doc in reversed(docs):
        for d in doc.get("deltas", []):
            if any(s["step"] == step for s in d["steps"]):
                return d  # type: ignore[no-any-return]
    raise KeyError(step)


def edit_batch(chain: Path, step: int, change: Callable[[list[SlotInfo], Rows], None]) -> str:
    """Decode the batch holding ``step``, let ``change`` edit its slots and rows (segments by
    slot index) in place, re-encode it as a writer would and make every record reference the
    new objects with valid sizes and checksums. Returns the batch's path."""
    docs = [json.loads(p.read_bytes()) for p in record_paths(chain)]
    entry = delta_entry(docs, step)
    group: str = entry["path"]
    objects = {o["path"]: (chain / group / o["path"]).read_bytes() for o in entry["objects"]}
    slots = [SlotInfo(name=s["name"], dtype=s["dtype"], shape=tuple(s["shape"]), encoding=s["encoding"])
             for s in entry["slots"]]
    decoded = decode_batch(objects, tuple(slots), entry["rows"], group)
    rows: Rows = [{j: (None if idx is None else idx.copy(), np.array(vals, copy=True))
                   for j, (idx, vals) in decoded.segments[r].items()} for r in range(entry["rows"])]
    change(slots, rows)
    steps = [s["step"] for s in entry["steps"]]
    new = encode_batch(slots, rows, {"kind": "state.xor", "first": min(steps), "last": max(steps)})
    shutil.rmtree(chain / group)
    refs = []
    for key, data in sorted(new.items()):
        (chain / group / key).parent.mkdir(parents=True, exist_ok=True)
        (chain / group / key).write_bytes(data)
        refs.append({"path": key, "size": len(data), "crc32c": object_checksum(f"{group}/{key}", data)})

    def rewrite(docs: list[dict[str, Any]]) -> None:
        for doc in docs:
            for d in doc.get("deltas", []):
                if d["path"] == group:
                    d["objects"], d["rows"] = refs, len(rows)
                    d["slots"] = [s.to_dict() for s in slots]

    edit_records(chain, rewrite)
    return group


def index_of(slots: list[SlotInfo], name: str) -> int:
    return next(j for j, s in enumerate(slots) if s.name == name)


def change_slot(slot_name: str, /, **fields: Any) -> Callable[[list[SlotInfo], Rows], None]:
    def change(slots: list[SlotInfo], rows: Rows) -> None:
        j = index_of(slots, slot_name)
        slots[j] = dataclasses.replace(slots[j], **fields)

    return change


def drop_slot(slots: list[SlotInfo], rows: Rows, name: str) -> None:
    """Remove a slot from the batch (its column and its segments)."""
    j = index_of(slots, name)
    del slots[j]
    for r, row in enumerate(rows):
        rows[r] = {k - (k > j): seg for k, seg in row.items() if k != j}


def map_values(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[list[SlotInfo], Rows], None]:
    def change(slots: list[SlotInfo], rows: Rows) -> None:
        j = index_of(slots, name)
        for row in rows:
            if j in row:
                row[j] = (None, fn(row[j][1]))

    return change


def chained(*changes: Callable[[list[SlotInfo], Rows], None]) -> Callable[[list[SlotInfo], Rows], None]:
    def change(slots: list[SlotInfo], rows: Rows) -> None:
        for c in changes:
            c(slots, rows)

    return change


def absent_in_row(name: str, row: int) -> Callable[[list[SlotInfo], Rows], None]:
    def change(slots: list[SlotInfo], rows: Rows) -> None:
        del rows[row][index_of(slots, name)]  # counts -1 in that row

    return change


def dropped(name: str) -> Callable[[list[SlotInfo], Rows], None]:
    return lambda slots, rows: drop_slot(slots, rows, name)


# -- the CLI ---------------------------------------------------------------------------------------
def assert_cli_refuses(chain: Path, step: int, fragment: str, tmp_path: Path) -> None:
    """``ldtools validate`` exits 1 listing the problem; ``ldtools materialize --step`` exits 1
    with one error line naming the step (spec §18, §18.1)."""
    result = invoke("validate", chain, code=None)
    assert result.exit_code == 1, result.output
    assert fragment in result.stdout, (fragment, result.stdout)
    out = tmp_path / "out" / "state.pt"
    result = invoke("materialize", chain, "--step", step, "-o", out, code=None)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldtools: error: "), result.stderr
    assert f"step {step}" in lines[0] and fragment in lines[0], lines[0]
    assert not out.exists()


# -- the pristine chain ---------------------------------------------------------------------------
_PRISTINE: dict[str, tuple[Path, dict[int, dict[str, Any]]]] = {}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """An AdamW chain of TinyNet as the writer makes it (batches 1-3 and 4-6); never modified."""
    if "adamw" not in _PRISTINE:
        path = tmp_path_factory.mktemp("pristine") / "chain"
        refs, _, _ = write_chain(path)
        _PRISTINE["adamw"] = (path, refs)
    return _PRISTINE["adamw"]


@pytest.fixture
def adamw_chain(pristine: tuple[Path, dict[int, dict[str, Any]]],
                tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    src, refs = pristine
    dst = tmp_path / "chain"
    shutil.copytree(src, dst)
    return dst, refs


def test_the_pristine_chain_predicts_and_replays(adamw_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    path, refs = adamw_chain
    encodings = slot_encodings(path)
    assert encodings["model/embed.weight"] == {"adam.w"}
    assert encodings["optimizer/1/exp_avg_sq"] == {"adam.v"}
    assert encodings["predict/1"] == {"dense"}
    assert encodings["model/unused"] == {"sub"}  # no gradient, no optimizer state: nothing to predict
    assert encodings["model/norm.running_mean"] == {"sub"}
    assert_exact(path, refs)


# -- 1. crafted chains that must be refused ---------------------------------------------------------
M1, V1, P1 = "optimizer/1/exp_avg", "optimizer/1/exp_avg_sq", "predict/1"


def _seven_u64(vals: np.ndarray) -> np.ndarray:
    return vals.astype(np.uint64)


# (id, step whose batch is edited, first step that fails, the change, what the error names)
REFUSED: list[tuple[str, int, int, Callable[[list[SlotInfo], Rows], None], str]] = [
    ("coefficients-absent-in-the-row", 5, 5, absent_in_row(P1, 1), P1),
    ("coefficients-absent-in-the-first-row", 1, 1, absent_in_row(P1, 0), P1),
    ("coefficients-removed-from-the-batch", 4, 4, dropped(P1), P1),
    ("coefficients-of-another-parameter", 4, 4, change_slot(P1, name="predict/0"), P1),
    ("coefficients-int32", 4, 4, change_slot(P1, dtype="int32"), P1),
    ("coefficients-float64", 4, 4, chained(change_slot(P1, dtype="float64"), map_values(P1, _seven_u64)), P1),
    ("coefficients-shape-6", 4, 4, chained(change_slot(P1, shape=(6,)), map_values(P1, lambda v: v[:6])), P1),
    ("coefficients-shape-7x1", 4, 4, change_slot(P1, shape=(7, 1)), P1),
    ("coefficients-index-out-of-range", 4, 4, change_slot(P1, name="predict/6"), "predict/6"),
    ("coefficients-index-leading-zero", 4, 4, change_slot(P1, name="predict/01"), "predict/01"),
    ("coefficients-index-not-decimal", 4, 4, change_slot(P1, name="predict/x"), "predict/x"),
    ("coefficients-without-index", 4, 4, change_slot(P1, name="predict/"), "'predict/' is not a slot name"),
    ("coefficients-twice", 4, 4, change_slot("predict/2", name=P1), "appears twice"),
    ("coefficients-encoded-sub", 4, 4, change_slot(P1, encoding="sub"), P1),
    ("coefficients-encoded-adam.w", 4, 4, change_slot(P1, encoding="adam.w"), P1),
    ("adam.w-on-an-int64-buffer", 4, 4, change_slot("model/norm.num_batches_tracked", encoding="adam.w"),
     "model/norm.num_batches_tracked"),
    ("adam.v-on-an-int32-moment", 4, 4, change_slot(V1, dtype="int32"), V1),
    ("adam.w-on-a-float32-buffer", 4, 4, change_slot("model/norm.running_mean", encoding="adam.w"),
     "model/norm.running_mean"),
    ("adam.v-on-optimizer-ref", 4, 4, change_slot(V1, name="optimizer/ref/exp_avg_sq"), "optimizer/ref/exp_avg_sq"),
    ("adam.w-on-optimizer-state", 4, 4, change_slot(M1, encoding="adam.w"), M1),
    ("adam.v-on-a-model-tensor", 4, 4, change_slot("model/embed.weight", encoding="adam.v"), "model/embed.weight"),
    ("adam.w-on-an-alias", 4, 4, change_slot("model/embed.weight", name="model/head.weight"), "model/head.weight"),
    ("first-moment-of-another-shape-for-adam.w", 1, 1, change_slot(M1, shape=(512,)),
     f"model/embed.weight is predicted from {M1}, which is float32 [512]"),
    ("first-moment-of-another-shape-for-adam.v", 1, 1,
     chained(change_slot(M1, shape=(512,)), change_slot("model/embed.weight", encoding="sub")),
     f"{V1} is predicted from {M1}, which is float32 [512]"),
    ("first-moment-of-another-dtype", 1, 1, change_slot(M1, dtype="int32"), f"predicted from {M1}, which is int32"),
    ("second-moment-of-another-shape-for-adam.w", 1, 1, change_slot(V1, encoding="sub", shape=(512,)),
     f"model/embed.weight is predicted from {V1}, which is float32 [512]"),
    # m0, an input of adam.v, exists (from batch 1-3) with another shape while the row drops m
    ("previous-first-moment-of-another-shape", 4, 4,
     chained(dropped(M1), change_slot("model/embed.weight", encoding="sub")),
     f"{V1} is predicted from {M1}, which is float32 [512]"),
]


@pytest.mark.parametrize(("case", "step", "failing", "change", "fragment"), REFUSED, ids=[c[0] for c in REFUSED])
def test_crafted_predicted_slots_are_refused(adamw_chain: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path,
                                             case: str, step: int, failing: int,
                                             change: Callable[[list[SlotInfo], Rows], None], fragment: str) -> None:
    path, refs = adamw_chain
    if case == "previous-first-moment-of-another-shape":  # batch 1-3 holds m flat, and nothing predicted
        edit_batch(path, 1, chained(change_slot(M1, shape=(512,)), change_slot(V1, encoding="sub"),
                                    change_slot("model/embed.weight", encoding="sub")))
    group = edit_batch(path, step, change)
    reader = ChainReader(path)
    for s in reader.steps:
        if s < failing:
            reader.materialize(s)  # steps before the damage are not affected (values may differ)
            continue
        with pytest.raises(CorruptChainError) as info:
            reader.materialize(s)
        message = str(info.value)
        assert group in message and fragment in message, message
        named = [int(n) for n in re.findall(r"step (\d+)", message)]
        assert failing in named, message
    report = ldformat.validate(path)  # check 5 or check 8, without replaying the tensors
    assert not report.ok
    text = "\n".join(str(p) for p in report.problems)
    assert fragment in text and group in text, text
    assert_cli_refuses(path, failing, fragment, tmp_path)


def test_an_unknown_encoding_is_refused(adamw_chain: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    """Spec §10.3: a reader MUST reject a slot with an unknown encoding (the reference reader:
    UnsupportedVersionError, spec §3.3); ldtools exits 1 (spec §18.1)."""
    path, _ = adamw_chain
    edit_batch(path, 4, change_slot(V1, encoding="adam.m"))
    with pytest.raises((CorruptChainError, UnsupportedVersionError)) as info:
        ChainReader(path).materialize(4)
    assert "adam.m" in str(info.value)
    report = ldformat.validate(path)
    assert not report.ok and "adam.m" in "\n".join(map(str, report.problems))
    result = invoke("validate", path, code=None)
    assert result.exit_code == 1, result.output
    result = invoke("materialize", path, "--step", 4, "-o", tmp_path / "o.pt", code=None)
    assert result.exit_code == 1 and result.stderr.startswith("ldtools: error: "), result.output


def test_adam_w_ignores_the_previous_first_moment(adamw_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    path, _ = adamw_chain
    # batch 1-3: m flat (512 elements), v and w not predicted; batch 4-6: m dropped, v plain, w predicted
    edit_batch(path, 1, chained(change_slot(M1, shape=(512,)), change_slot(V1, encoding="sub"),
                                change_slot("model/embed.weight", encoding="sub")))
    edit_batch(path, 4, chained(dropped(M1), change_slot(V1, encoding="sub")))
    report = ldformat.validate(path)
    assert report.ok, [str(p) for p in report.problems]
    reader = ChainReader(path)
    for s in reader.steps:
        reader.materialize(s)


# -- 2. hostile but valid: coefficients and state --------------------------------------------------
def _u32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32)


HOSTILE_COEFFICIENTS: dict[str, np.ndarray] = {
    "zero": _u32(*[0] * 7),
    "negative-zero": _u32(*[0x80000000] * 7),
    "quiet-nan": _u32(*[0x7FC00000] * 7),
    "nan-payloads": _u32(0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0xFF800001, 0x7FC00001, 0xFFFFFFFF, 0x7FFFFFFF),
    "infinities": _u32(0x7F800000, 0xFF800000, 0x7F800000, 0xFF800000, 0x7F800000, 0xFF800000, 0x7F800000),
    "huge": _u32(*[0x7F7FFFFF] * 7),
    "subnormal": _u32(*[0x00000001] * 7),
    "mixed": _u32(0x7F800000, 0x00000000, 0x7FC00000, 0x7F7FFFFF, 0x00000001, 0xFF800000, 0x80000000),
    "c-zero": _u32(*SPEC_COEFFICIENTS[:2], 0, *SPEC_COEFFICIENTS[3:]),  # sqrt(v) / 0: inf or NaN
    "random": np.random.default_rng(7).integers(0, 1 << 32, size=7, dtype=np.uint64).astype(np.uint32),
}


# An independent binary32 reference of spec §11.3.1: each operation in double precision, then
# rounded to float32 (correctly rounded: double has more than 2 * 24 + 2 bits, so the double
# rounding of +, -, *, / and sqrt is innocuous), with IEEE 754 special cases written out.
def _f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _float(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def _div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _sqrt(a: float) -> float:
    return math.nan if math.isnan(a) or a < 0.0 else math.sqrt(a)  # sqrt(-0.0) is -0.0


def _result(p: float) -> int:
    return 0 if math.isnan(p) else int(np.array([p], np.float32).view(np.uint32)[0])


def reference_v(m0: int, m: int, v0: int, coef: np.ndarray) -> int:
    k, b, d = (_float(int(x)) for x in coef[4:7])
    fm0, fm, fv0 = _float(m0), _float(m), _float(v0)
    t = _f32(fm - fm0)
    t = _f32(t * k)
    t = _f32(fm0 + t)
    t = _f32(t * t)
    t = _f32(t * d)
    p = _f32(fv0 * b)
    return _result(_f32(p + t))


def reference_w(w0: int, m: int, v: int, coef: np.ndarray) -> int:
    a, s, c, e = (_float(int(x)) for x in coef[0:4])
    q = _f32(_sqrt(_float(v)))
    q = _f32(_div(q, c))
    q = _f32(q + e)
    q = _f32(_div(_float(m), q))
    q = _f32(q * s)
    p = _f32(_float(w0) * a)
    return _result(_f32(p - q))


SPECIAL_BITS = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0xBF800000,
                0x3A83126F, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0xFFC12345]


@pytest.mark.parametrize("name", ["spec", *sorted(HOSTILE_COEFFICIENTS)])
def test_the_prediction_is_binary32_with_nan_as_positive_zero(name: str) -> None:
    """predict_second_moment / predict_parameter against the reference above, on every
    combination of special values (NaN payloads, infinities, signed zeros, subnormals, the
    largest float) and random bits: no flush to zero, no fused operation, NaN -> +0.0."""
    coef = _u32(*SPEC_COEFFICIENTS) if name == "spec" else HOSTILE_COEFFICIENTS[name]
    rng = np.random.default_rng(11)
    triples = [*itertools.product(SPECIAL_BITS, repeat=3),
               *(tuple(int(x) for x in rng.integers(0, 1 << 32, size=3, dtype=np.uint64)) for _ in range(300))]
    # near-Adam values, where the prediction is mostly right and its last bits matter
    near = rng.normal(0.0, 1e-3, size=(300, 3)).astype(np.float32)
    near[:, 2] = np.abs(near[:, 2]) ** 2
    triples += [tuple(int(b) for b in row.view(np.uint32)) for row in near]
    x, y, z = (np.array(col, np.uint32) for col in zip(*triples, strict=True))
    got = np.empty_like(x)
    predict_second_moment(x, y, z, coef, got)
    want = [reference_v(int(a), int(b), int(c), coef) for a, b, c in zip(x, y, z, strict=True)]
    assert got.tolist() == want
    in_place = z.copy()  # out may be v0 (replay predicts into the tensor itself)
    predict_second_moment(x, y, in_place, coef, in_place)
    assert in_place.tolist() == want
    predict_parameter(x, y, z, coef, got)
    want = [reference_w(int(a), int(b), int(c), coef) for a, b, c in zip(x, y, z, strict=True)]
    assert got.tolist() == want
    in_place = x.copy()
    predict_parameter(in_place, y, z, coef, in_place)
    assert in_place.tolist() == want


def _predict_values(path: Path) -> list[np.ndarray]:
    """The values of every present predict/<i> segment of the chain."""
    out = []
    for e in ChainReader(path).state.delta_entries():
        objects = {o.path: (path / e.path / o.path).read_bytes() for o in e.objects}
        decoded = decode_batch(objects, e.slots, e.rows, e.path)
        for row in decoded.segments.values():
            for j, (_, vals) in row.items():
                if e.slots[j].name.startswith("predict/"):
                    out.append(np.asarray(vals).view(np.uint32).copy())
    return out


@pytest.mark.parametrize("name", sorted(HOSTILE_COEFFICIENTS))
def test_hostile_coefficients_replay_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Spec §11.3.1: whether the prediction is right only changes the size of the values, so a
    writer may store any coefficients; replay stays exact (NaN results become +0.0)."""
    hostile = HOSTILE_COEFFICIENTS[name]
    real = ldformat.chain.writer.state_coefficients

    def coefficients(*args: Any, **kwargs: Any) -> dict[int, np.ndarray]:
        return {i: hostile.copy() for i in real(*args, **kwargs)}

    monkeypatch.setattr(ldformat.chain.writer, "state_coefficients", coefficients)
    path = tmp_path / "chain"
    refs, _, _ = write_chain(path, steps=5, batch_steps=2, model=HostileNet(), anchor_every=3)
    assert {"adam.v", "adam.w"} <= encodings_of(path)
    stored = _predict_values(path)
    assert stored and all(v.tolist() == hostile.tolist() for v in stored)
    assert_exact(path, refs)


NAN_BITS = [0x7FA00001, 0xFFC12345, 0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x7F7FFFFF]


def _poke(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None] | None:
    """Step 2: NaN payloads, infinities, -0.0, a subnormal and the largest float in w, m and v of
    predicted parameters and a negative v (sqrt: NaN), undone after the record; step 4: a NaN
    in q that stays, so training diverges to NaN from step 5 on."""
    assert isinstance(model, HostileNet)
    if step == 2:
        targets = [model.embed.weight, state_of(opt, model.embed.weight)["exp_avg"],
                   state_of(opt, model.embed.weight)["exp_avg_sq"], model.hidden.weight,
                   state_of(opt, model.hidden.weight)["exp_avg_sq"]]
        saved = [t.detach().clone() for t in targets]
        for n, t in enumerate(targets):
            for k, bits in enumerate(NAN_BITS):
                set_bits(t, (7 * n + 3 * k) % t.numel(), bits)
        with torch.no_grad():
            state_of(opt, model.hidden.weight)["exp_avg_sq"].view(-1)[-1] = -1.0

        def undo() -> None:
            with torch.no_grad():
                for t, s in zip(targets, saved, strict=True):
                    t.copy_(s)

        return undo
    if step == 4:
        set_bits(model.q, 1, 0x7FA5A5A5)
    return None


def test_nan_inf_and_signed_zeros_in_the_live_state_replay_exactly(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    refs, model, _ = write_chain(path, steps=7, batch_steps=3, model=HostileNet(), hook=_poke, anchor_every=5)
    assert isinstance(model, HostileNet)
    assert torch.isnan(model.embed.weight).all(), "training diverged to NaN, as intended"
    assert {"adam.v", "adam.w"} <= encodings_of(path)
    enc = slot_encodings(path)
    assert enc["model/scalar"] == {"adam.w"} and enc["model/empty"] == {"adam.w"}  # 0-d and 0 elements
    assert_exact(path, refs)
    result = invoke("validate", "--deep", path, code=None)
    assert result.exit_code == 0, result.output


# -- 3. optimizer state that vanishes and reappears; amsgrad; compaction ---------------------------
def _vanish(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None] | None:
    """3: all optimizer state gone (AdamW starts over at step 4); 5: one parameter's state gone;
    6: m of one parameter gone, 7: its step count, 8: v of another (each put back after the
    record, so training goes on)."""
    assert isinstance(model, TinyNet)
    if step == 3:
        opt.state.clear()
    elif step == 5:
        del opt.state[model.hidden.weight]
    elif step in (6, 7, 8):
        p = {6: model.embed.weight, 7: model.hidden.bias, 8: model.norm.weight}[step]
        key = {6: "exp_avg", 7: "step", 8: "exp_avg_sq"}[step]
        value = state_of(opt, p).pop(key)

        def undo() -> None:
            state_of(opt, p)[key] = value

        return undo
    return None


def assert_compacts_exactly(path: Path, refs: dict[int, dict[str, Any]], keep_every: int = 3) -> None:
    plan = ldformat.compact(path, keep_every=keep_every)
    assert plan.merged_deltas, "state.xor runs merge"
    assert not plan.new_anchors
    reader = ChainReader(path)
    merged = [e for e in reader.state.delta_entries() if any(s.base != s.step - 1 for s in e.steps)]
    assert merged and {s.encoding for e in merged for s in e.slots} == {"sub"}  # spec §17.2, 1.6
    assert reader.steps == plan.kept_steps
    assert_exact(path, refs)


@pytest.mark.parametrize("batch_steps", [1, 3, 9])
def test_state_that_vanishes_and_reappears(tmp_path: Path, batch_steps: int) -> None:
    path = tmp_path / "chain"
    refs, _, _ = write_chain(path, steps=9, batch_steps=batch_steps, hook=_vanish)
    assert refs[3]["optimizer"]["state"] == {}  # nothing left at step 3
    assert 2 not in refs[5]["optimizer"]["state"] and "exp_avg" not in refs[6]["optimizer"]["state"][1]
    assert {"adam.v", "adam.w"} <= encodings_of(path)
    assert_exact(path, refs)
    assert_compacts_exactly(path, refs)


def test_an_amsgrad_group_next_to_a_plain_one(tmp_path: Path) -> None:
    """Prediction is for groups without amsgrad (spec §11.3.1): the other group is coded as sub."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        assert isinstance(model, TinyNet)
        plain: list[torch.Tensor] = [model.unused, model.embed.weight, model.hidden.weight]
        ams: list[torch.Tensor] = [model.hidden.bias, model.norm.weight, model.norm.bias]
        groups: list[dict[str, Any]] = [{"params": plain}, {"params": ams, "amsgrad": True, "lr": 0.02}]
        return torch.optim.AdamW(groups, lr=0.01)

    path = tmp_path / "chain"
    refs, _, _ = write_chain(path, make, steps=7, batch_steps=3, hook=_vanish)
    enc = slot_encodings(path)
    assert enc["model/embed.weight"] == {"adam.w"} and enc["optimizer/1/exp_avg_sq"] == {"adam.v"}
    assert enc["model/hidden.bias"] == {"sub"} and enc["optimizer/3/exp_avg_sq"] == {"sub"}
    assert enc["optimizer/3/max_exp_avg_sq"] == {"sub"}
    assert_exact(path, refs)
    assert_compacts_exactly(path, refs)


def _reshape_extra(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None] | None:
    """An extra state tensor of one parameter: 1 element at steps 1-3, gone at step 4, 4 elements
    from step 5 (it vanishes, then reappears with another shape: spec §11.3, §11.6)."""
    assert isinstance(model, TinyNet)
    state = state_of(opt, model.hidden.bias)
    if step <= 3:
        state["extra_buf"] = torch.full((1,), float(step))
    elif step == 4:
        state.pop("extra_buf")
    else:
        state["extra_buf"] = torch.arange(4, dtype=torch.float32) + step
    return None


def test_compaction_of_state_that_reappears_with_another_shape(tmp_path: Path) -> None:
    """Spec §17.2: no delta turns the 1-element tensor of step 3 into the 4-element one of step 6
    (a slot applies only to a tensor like it), so step 6 is folded into an anchor; 0 -> 3 merges."""
    path = tmp_path / "chain"
    refs, _, _ = write_chain(path, steps=7, batch_steps=1, hook=_reshape_extra)
    assert_exact(path, refs)  # the chain itself is valid and exact
    plan = ldformat.compact(path, keep_every=3)
    assert plan.merged_deltas == [(0, 3)] and plan.new_anchors == [6]
    reader = ChainReader(path)
    assert 6 in reader.anchors
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
    assert ldformat.validate(path, deep=True).ok


def _grow_extra(step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None] | None:
    """An extra state tensor that changes shape from one step to the next without vanishing."""
    assert isinstance(model, TinyNet)
    state_of(opt, model.hidden.bias)["extra_buf"] = torch.arange(step, dtype=torch.float32)
    return None


def test_the_writer_refuses_state_that_changes_shape_between_batches(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    try:
        refs, _, _ = write_chain(path, steps=4, batch_steps=1, hook=_grow_extra)
    except UnsupportedStateError:
        return  # refused, as spec §12 requires
    assert_exact(path, refs)


# -- hand-made predicted slots that are valid --------------------------------------------------------
def test_coefficients_without_a_predicted_slot_are_not_state(
        adamw_chain: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    """A predict/<i> slot of a parameter with no predicted slot in the row changes nothing."""
    path, refs = adamw_chain

    def add(slots: list[SlotInfo], rows: Rows) -> None:
        slots.append(SlotInfo(name="predict/0", dtype="float32", shape=(7,), encoding="dense"))
        for row in rows:
            row[len(slots) - 1] = (None, _u32(*SPEC_COEFFICIENTS))

    edit_batch(path, 1, add)
    edit_batch(path, 4, add)
    assert_exact(path, refs)


@pytest.mark.parametrize("coefficients", ["spec", "zero", "nan"])
def test_a_predicted_slot_whose_inputs_are_absent(adamw_chain: tuple[Path, dict[int, dict[str, Any]]],
                                                  coefficients: str) -> None:
    """adam.w on ``model/unused``, a parameter without optimizer state: m and v are all-zero bits
    (spec §11.3.1), so P = w0 * a - (0 / (sqrt(0) / c + e)) * s, or +0.0 where that is NaN
    (zero coefficients: 0 / 0). The values are computed here by the spec's formula."""
    path, refs = adamw_chain
    coef = {"spec": _u32(*SPEC_COEFFICIENTS), "zero": _u32(*[0] * 7), "nan": _u32(*[0x7FC00000] * 7)}[coefficients]

    def predicted(first: int) -> Callable[[list[SlotInfo], Rows], None]:
        def change(slots: list[SlotInfo], rows: Rows) -> None:
            j = index_of(slots, "model/unused")
            slots[j] = dataclasses.replace(slots[j], encoding="adam.w")
            slots.append(SlotInfo(name="predict/0", dtype="float32", shape=(7,), encoding="dense"))
            for r, row in enumerate(rows):
                w0 = refs[first + r - 1]["model"]["unused"].numpy().view(np.uint32).copy()
                w = refs[first + r]["model"]["unused"].numpy().view(np.uint32).copy()
                prediction = w0.copy()
                predict_parameter(w0, None, None, coef, prediction)
                values = np.empty_like(w)
                difference_delta(w, prediction, values)
                row[j] = (None, values)
                row[len(slots) - 1] = (None, coef.copy())

        return change

    edit_batch(path, 1, predicted(1))
    edit_batch(path, 4, predicted(4))
    assert slot_encodings(path)["model/unused"] == {"adam.w"}
    assert_exact(path, refs)


# -- versions ------------------------------------------------------------------------------------------
def relabel(path: Path, version: str) -> None:
    root = path / "ldformat.json"
    doc = json.loads(root.read_bytes())
    doc["format_version"] = version
    root.write_bytes(json.dumps(with_checksum(doc), sort_keys=True, indent=1).encode() + b"\n")


def test_predicted_slots_in_a_chain_labelled_15(tmp_path: Path) -> None:
    """Spec §11.3: a reader accepts every encoding in a chain of any version. A 1.5 chain's
    compaction merges by XOR only (spec §17.2), so runs holding predicted slots are folded into
    anchors, and a writer appending to it writes xor slots (spec §3.1)."""
    path = tmp_path / "chain"
    refs, model, opt = write_chain(path)
    relabel(path, "1.5")
    assert ChainReader(path).root.format_version == "1.5"
    assert_exact(path, refs)
    with ChainWriter.open(path, model, opt) as writer:
        for step in (7, 8):
            train_step(model, opt, step)
            writer.record_step(step)
            refs[step] = snapshot(model, opt)
    reader = ChainReader(path)
    new = [e for e in reader.state.delta_entries() if min(s.step for s in e.steps) >= 7]
    assert new and {s.encoding for e in new for s in e.slots} == {"xor"}
    assert_exact(path, refs)
    plan = ldformat.compact(path, keep_every=4)
    assert plan.new_anchors == [4, 8] and plan.merged_deltas == []  # both runs hold predicted slots: folded
    assert_exact(path, refs)


def test_a_newer_minor_is_read_but_not_written(tmp_path: Path) -> None:
    """Spec §3.1: a reader of MAJOR 1 accepts any MINOR; a writer MUST NOT write to a newer one."""
    path = tmp_path / "chain"
    refs, model, opt = write_chain(path, steps=4)
    relabel(path, "1.7")
    assert_exact(path, refs)
    with pytest.raises(UnsupportedVersionError, match="1.7"):
        ChainWriter.open(path, model, opt)


@pytest.mark.parametrize("operation", ["compact", "truncate"])
def test_a_newer_minor_is_not_compacted_or_truncated(tmp_path: Path, operation: str) -> None:
    path = tmp_path / "chain"
    write_chain(path, steps=4)
    relabel(path, "1.7")
    before = sorted(p.name for p in (path / "log").iterdir())
    with pytest.raises(UnsupportedVersionError, match="1.7"):
        if operation == "compact":
            ldformat.compact(path, keep_every=2)
        else:
            ldformat.truncate(path, 2)
    assert sorted(p.name for p in (path / "log").iterdir()) == before


# -- 4. Adam with weight decay, maximize -------------------------------------------------------------
ADAM_VARIANTS: dict[str, OptFactory] = {
    "adam-weight-decay": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1),
    "adam-maximize": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1, maximize=True),
    "adamw-maximize": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, maximize=True),
    "adam-decoupled": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
}


@pytest.mark.parametrize("name", sorted(ADAM_VARIANTS))
def test_adam_variants_are_predicted_and_exact(tmp_path: Path, name: str) -> None:
    path = tmp_path / "chain"
    refs, _, _ = write_chain(path, ADAM_VARIANTS[name], steps=5, batch_steps=2)
    enc = slot_encodings(path)
    for i, p in enumerate(PARAMS[1:], 1):
        assert enc[f"model/{p}"] == {"adam.w"}, (p, enc[f"model/{p}"])
        assert enc[f"optimizer/{i}/exp_avg_sq"] == {"adam.v"}
    assert_exact(path, refs)


def _mlp_chain(path: Path, make_opt: OptFactory, predict: bool, steps: int = 6) -> tuple[float, float, float, int]:
    """(delta bytes per step / raw state bytes, share of adam.v and of adam.w elements predicted
    exactly, raw state bytes) for an MLP of about 99k parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = make_opt(model)
    writer = ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=steps)
    writer.predict_state = predict
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        writer.record_step(step)
    writer.close()
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    raw += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    reader = ChainReader(path)
    entries = reader.state.delta_entries()
    size = sum(o.size for e in entries for o in e.objects)
    hits: dict[str, list[int]] = {"adam.v": [0, 0], "adam.w": [0, 0]}
    for e in entries:
        objects = {o.path: (path / e.path / o.path).read_bytes() for o in e.objects}
        for row in decode_batch(objects, e.slots, e.rows, e.path).segments.values():
            for j, (_, vals) in row.items():
                if e.slots[j].encoding in hits:
                    hits[e.slots[j].encoding][0] += int((np.asarray(vals) == 0).sum())
                    hits[e.slots[j].encoding][1] += int(np.asarray(vals).size)
    (v_hits, v_n), (w_hits, w_n) = hits.values()
    return size / steps / raw, v_hits / max(1, v_n), w_hits / max(1, w_n), raw


def test_prediction_saves_bytes_for_adamw_and_adam_with_weight_decay(tmp_path: Path) -> None:
    results = {}
    for name, make in [("adamw", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)),
                       ("adam-wd", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.1))]:
        predicted = _mlp_chain(tmp_path / name, make, True)
        plain = _mlp_chain(tmp_path / f"{name}-sub", make, False)
        results[name] = (predicted, plain)
        raw = predicted[3]
        print(f"{name}: raw state {raw} B/step; predicted {predicted[0] * raw:.0f} B/step = {predicted[0]:.3f} "
              f"(adam.v exact {predicted[1]:.2f}, adam.w exact {predicted[2]:.2f}); sub {plain[0] * raw:.0f} B/step "
              f"= {plain[0]:.3f}")
        assert predicted[0] < 0.6 * plain[0], results
        assert predicted[2] > 0.5, results  # most of w is predicted exactly
