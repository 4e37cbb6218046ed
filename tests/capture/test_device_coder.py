"""The device coder (``ldformat.capture.device_coder``) against the host coder, bit for bit.

The device coder computes a ``state.xor`` row's values with torch ops where the tensors live
(spec §11.3 ``sub`` and ``xor``, §11.3.1 ``adam.v`` and ``adam.w``); the host coder
(``ldformat.format.delta.difference_delta``, ``ldformat.format.predict``, ``ldformat.chain.state_delta.row_values``)
with numpy. Every test compares integer views: the spec's test vectors, random bits full of
NaNs (several payloads), infinities, subnormals and signed zeros for float32, bfloat16,
float16 and int64, the predictions with random and with AdamW coefficients, absent inputs,
a thread that flushes subnormals, whole rows over several steps, and the compaction of
residuals. Each test runs on the CPU and, when there is one, on a CUDA device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping

import numpy as np
import pytest
import torch
from paths import REPO

from ldformat.capture import device_coder as dc
from ldformat.chain.captured import CapturedTensor
from ldformat.chain.state_delta import row_values, wanted_encodings
from ldformat.format.delta import WIDTH_DTYPES, difference_delta
from ldformat.format.manifest import Encoding
from ldformat.format.predict import adam_coefficients, predict_parameter, predict_second_moment
from ldformat.format.state import encode_param_groups

SPEC = REPO / "spec" / "ldformat.md"
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]
WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "uint8": 1}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
         "uint8": torch.uint8}
# Bit patterns every float test meets: NaNs with several payloads and signs, infinities,
# subnormals, signed zeros, the extremes of the finite range.
SPECIALS: dict[str, list[int]] = {
    "float32": [0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0xFF812345, 0x7F800000, 0xFF800000, 0x00000001,
                0x007FFFFF, 0x80400000, 0x00000000, 0x80000000, 0x7F7FFFFF, 0x00800000, 0x3F800000],
    "bfloat16": [0x7FC0, 0x7F81, 0xFFFF, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F7F, 0x3F80],
    "float16": [0x7E00, 0x7C01, 0xFE00, 0xFFFF, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x0000, 0x8000, 0x7BFF, 0x3C00],
    "int64": [0, 1, 2**64 - 1, 2**63, 2**63 - 1, 2**63 + 1],
    "uint8": [0, 1, 127, 128, 255],
}
N = 1 << 15  # elements of a random tensor: two CPU threads' worth of work, a fraction of a second
# Elements of the predictions' inputs: below the size at which torch's CPU square root goes
# parallel, which is slow on a loaded machine; enough to meet every rounding case many times.
PN = 1 << 13


# -- helpers -------------------------------------------------------------------------------------
def on(bits: np.ndarray, device: str) -> torch.Tensor:
    """Host bits (flat unsigned numpy) as a flat signed tensor on ``device``."""
    return dc.base_to_device({"x": bits}, device)["x"]


def live(bits: np.ndarray, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """A tensor of ``dtype`` with the given bits, as training would hold it."""
    return on(bits, device).view(TORCH[dtype]).reshape(shape)


def same(got: np.ndarray, want: np.ndarray, what: str = "values") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} elements differ, first at {i}: {got[i]:#x} != {want[i]:#x}")


def random_bits(rng: np.random.Generator, dtype: str, n: int = N) -> np.ndarray:
    """Uniform random bits with every special pattern of ``dtype`` at random places."""
    width = WIDTH_DTYPES[WIDTH[dtype]]
    out = rng.integers(0, np.iinfo(width).max, n, dtype=width, endpoint=True)
    specials = np.array(SPECIALS[dtype], width)
    places = rng.choice(n, size=n // 8, replace=False)
    out[places] = rng.choice(specials, size=places.size)
    return out


def near(rng: np.random.Generator, bits: np.ndarray, dtype: str) -> np.ndarray:
    """Bits of a next state: mostly a few units in the last place away (either way, with
    wrap-around), some unchanged, some unrelated (specials included)."""
    width = bits.dtype.type
    out: np.ndarray = (bits + rng.integers(-5, 6, bits.size).astype(np.int64).astype(width)).astype(width)
    unrelated = rng.random(bits.size) < 0.05
    out[unrelated] = random_bits(rng, dtype, bits.size)[unrelated]
    keep = rng.random(bits.size) < 0.2
    out[keep] = bits[keep]
    return out


def f32_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def with_specials(rng: np.random.Generator, bits: np.ndarray, share: float = 0.02) -> np.ndarray:
    """float32 bits with a share of them replaced by special patterns."""
    out = bits.copy()
    places = rng.random(out.size) < share
    out[places] = rng.choice(np.array(SPECIALS["float32"], np.uint32), size=int(places.sum()))
    return out


def adamw_coefficients(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                       weight_decay: float = 0.01, step: int = 10) -> np.ndarray:
    """The AdamW coefficients of spec §11.3.1's non-normative note (``a, s, c, e, k, b, d``
    rounded to float32), without building an optimizer (the first one imports torch._dynamo,
    seconds on a loaded machine); the test vectors check them against the spec's."""
    b1, b2 = betas
    values = [1 - lr * weight_decay, lr / (1 - b1**step), math.sqrt(1 - b2**step), eps, 1 / (1 - b1), b2, 1 - b2]
    return np.array(values, np.float64).astype(np.float32).view(np.uint32)


def host_v(m0: np.ndarray | None, m: np.ndarray | None, v0: np.ndarray | None, coef: np.ndarray,
           n: int) -> np.ndarray:
    out = np.empty(n, np.uint32)
    predict_second_moment(m0, m, v0, coef, out)
    return out


def host_w(w0: np.ndarray | None, m: np.ndarray | None, v: np.ndarray | None, coef: np.ndarray,
           n: int) -> np.ndarray:
    out = np.empty(n, np.uint32)
    predict_parameter(w0, m, v, coef, out)
    return out


def device_v(m0: np.ndarray | None, m: np.ndarray | None, v0: np.ndarray | None, coef: np.ndarray, n: int,
             device: str) -> np.ndarray:
    a0, a1, a2 = (None if a is None else on(a, device) for a in (m0, m, v0))
    return dc.to_host(dc.second_moment_prediction(a0, a1, a2, dc.coefficient_tensor(coef, device), n))


def device_w(w0: np.ndarray | None, m: np.ndarray | None, v: np.ndarray | None, coef: np.ndarray, n: int,
             device: str) -> np.ndarray:
    a0, a1, a2 = (None if a is None else on(a, device) for a in (w0, m, v))
    return dc.to_host(dc.parameter_prediction(a0, a1, a2, dc.coefficient_tensor(coef, device), n))


@pytest.fixture
def flushing() -> Iterator[None]:
    """The calling thread flushes subnormals to zero, as after ``torch.set_flush_denormal(True)``."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# -- the spec's test vectors ------------------------------------------------------------------------
def sub_vectors() -> list[tuple[str, int | None, int, int, int]]:
    """(dtype, base or None, new, xor values, sub values) from the table of spec §11.3."""
    text = SPEC.read_text(encoding="utf-8")
    section = text[text.index("### 11.3 `state.xor`"): text.index("#### 11.3.1 Adam prediction")]
    rows = []
    for line in section[section.index("*Test vectors*"):].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in WIDTH:
            hexes = [re.fullmatch(r"`([0-9A-F]+)`.*", c) for c in cells[1:]]
            base, new, xor, sub = (int(h.group(1), 16) if h else None for h in hexes)
            assert new is not None and xor is not None and sub is not None, line
            rows.append((cells[0], base, new, xor, sub))
    return rows


def prediction_vectors() -> tuple[np.ndarray, list[list[int]]]:
    """(coefficients, rows of m0, m, v0, adam.v P, w0, v, adam.w P) from spec §11.3.1."""
    text = SPEC.read_text(encoding="utf-8")
    section = text[text.index("#### 11.3.1 Adam prediction"): text.index("### 11.4 Replay path")]
    table = section[section.index("*Prediction test vectors*"):]
    coef = re.search(r"`a, s, c, e, k, b, d` = `([0-9A-F ]+)`", table)
    assert coef is not None
    rows = [[int(c, 16) for c in re.findall(r"`([0-9A-F]{8})`", line)] for line in table.splitlines()
            if line.startswith("| `")]
    return np.array([int(x, 16) for x in coef.group(1).split()], np.uint32), [r for r in rows if len(r) == 7]


SUB_VECTORS = sub_vectors()


def test_the_spec_has_the_vectors() -> None:
    assert len(SUB_VECTORS) >= 8 and {v[0] for v in SUB_VECTORS} >= {"float32", "bfloat16", "int64"}
    coef, rows = prediction_vectors()
    assert coef.shape == (7,) and len(rows) >= 3


@pytest.mark.parametrize("device", DEVICES)
def test_spec_sub_and_xor_vectors(device: str) -> None:
    """Spec §11.3's table: ``sub`` and ``xor`` values, the base moving on, and the way back."""
    for dtype, base, new, want_xor, want_sub in SUB_VECTORS:
        width = WIDTH_DTYPES[WIDTH[dtype]]
        n = np.array([new], width)
        b = None if base is None else np.array([base], width)
        t = live(n, dtype, (1,), device)
        got = dc.to_host(dc.difference(dc.int_bits(t), None if b is None else on(b, device)))
        assert int(got[0]) == want_sub, (dtype, base, new)
        host = np.empty_like(n)
        difference_delta(n.copy(), None if b is None else b.copy(), host)
        same(got, host)
        back = dc.undifference(on(got, device), None if b is None else on(b, device))
        assert int(dc.to_host(back)[0]) == new
        # through a whole row: xor and sub, with and without a base
        for enc, want in (("xor", want_xor), ("sub", want_sub)):
            dev_base = {} if b is None else dc.base_to_device({"model/x": b}, device)
            row = dc.code_row({"model/x": t}, {"model/x": enc}, [], {}, dev_base, dict(dev_base))
            assert int(row.values["model/x"][0]) == want, (dtype, enc, base, new)
            same(dc.to_host(dev_base["model/x"]), n, "base moved on")


@pytest.mark.parametrize("device", DEVICES)
def test_spec_prediction_vectors(device: str) -> None:
    """Spec §11.3.1's table, and all-zero coefficients: ``sqrt(0) / 0`` is NaN, so ``P`` = +0.0."""
    coef, rows = prediction_vectors()
    assert adamw_coefficients().tolist() == coef.tolist()  # the helper the other tests use
    m0, m, v0, want_v, w0, v, want_w = (np.array([r[k] for r in rows], np.uint32) for k in range(7))
    same(device_v(m0, m, v0, coef, len(rows), device), want_v, "adam.v")
    same(device_w(w0, m, v, coef, len(rows), device), want_w, "adam.w")
    one = np.array([0x3F800000], np.uint32)
    assert device_w(one, None, None, np.zeros(7, np.uint32), 1, device).tolist() == [0]


# -- differences ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "uint8"])
def test_difference_matches_the_host(device: str, dtype: str) -> None:
    rng = np.random.default_rng(WIDTH[dtype] * 7 + len(dtype))
    base = random_bits(rng, dtype)
    for new in (near(rng, base, dtype), random_bits(rng, dtype), base.copy()):
        t = live(new, dtype, (N // 64, 64), device)
        for b in (base, None):  # against the base, and appearing (all-zero bits)
            got = dc.to_host(dc.difference(dc.int_bits(t), None if b is None else on(b, device)))
            want = np.empty_like(new)
            difference_delta(new.copy(), None if b is None else b.copy(), want)
            same(got, want)
            back = dc.to_host(dc.undifference(on(got, device), None if b is None else on(b, device)))
            same(back, new, "round trip")
        same(dc.to_host(dc.int_bits(t)), new, "the live tensor is left alone")


@pytest.mark.parametrize("device", DEVICES)
def test_zigzag_extremes(device: str) -> None:
    """Wrap-around both ways at every width: ``MIN - 1``, ``MAX + 1``, ``0 - MIN``."""
    for width in (1, 2, 4, 8):
        top = 1 << (8 * width)
        u = WIDTH_DTYPES[width]
        new = np.array([0, top - 1, 0, top - 1, top // 2, top // 2 - 1, 0, top // 2], u)
        base = np.array([top - 1, 0, top // 2, top // 2 - 1, top // 2 - 1, top // 2, top // 2, 0], u)
        got = dc.to_host(dc.difference(on(new, device), on(base, device)))
        want = np.empty_like(new)
        difference_delta(new.copy(), base.copy(), want)
        same(got, want)
        same(dc.to_host(dc.undifference(on(got, device), on(base, device))), new)


# -- predictions ----------------------------------------------------------------------------------------
def realistic(rng: np.random.Generator, n: int = N) -> tuple[np.ndarray, ...]:
    """(m0, m, v0, w0, v) as float32 bits of a state AdamW would hold: ``m`` near ``m0``,
    ``v`` positive and about ``m**2``, weights of order 1, some elements exactly zero."""
    w0 = rng.normal(0, 0.5, n).astype(np.float32)
    g = rng.normal(0, 1e-2, n).astype(np.float32)
    m0 = (rng.normal(0, 1e-2, n)).astype(np.float32)
    v0 = (rng.random(n) * 1e-4).astype(np.float32)
    m = (np.float32(0.9) * m0 + np.float32(0.1) * g).astype(np.float32)
    v = (np.float32(0.999) * v0 + np.float32(0.001) * g * g).astype(np.float32)
    for a in (m0, m, v0, v, w0):
        a[rng.random(n) < 0.01] = 0.0
    return tuple(f32_bits(a) for a in (m0, m, v0, w0, v))


def coefficient_cases(rng: np.random.Generator) -> list[np.ndarray]:
    """AdamW's at several steps and settings, random floats of every magnitude, random bits,
    all zeros, and some with a special value among them."""
    cases = [adamw_coefficients(), adamw_coefficients(step=1), adamw_coefficients(lr=3e-4, step=100_000),
             adamw_coefficients(lr=1.0, betas=(0.5, 0.5), eps=1e-30, weight_decay=0.0, step=3)]
    cases += [f32_bits(rng.uniform(-2, 2, 7) * 10.0 ** rng.integers(-40, 38, 7)) for _ in range(3)]
    cases += [rng.integers(0, 2**32, 7, dtype=np.uint32) for _ in range(2)]
    cases.append(np.zeros(7, np.uint32))
    for special in (0x7FC00000, 0x7F800000, 0x00000001, 0x80000000):
        c = adamw_coefficients().copy()
        c[rng.integers(0, 7)] = special
        cases.append(c)
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_predictions_match_the_host(device: str) -> None:
    rng = np.random.default_rng(11)
    m0, m, v0, w0, v = realistic(rng, PN)
    states = {
        "adamw": (m0, m, v0, w0, v),
        "adamw with specials": tuple(with_specials(rng, a) for a in (m0, m, v0, w0, v)),
        "random bits": tuple(random_bits(rng, "float32", PN) for _ in range(5)),
    }
    for coef in coefficient_cases(rng):
        for what, (a0, a, b0, c0, b) in states.items():
            same(device_v(a0, a, b0, coef, PN, device), host_v(a0, a, b0, coef, PN), f"adam.v, {what}, {coef}")
            same(device_w(c0, a, b, coef, PN, device), host_w(c0, a, b, coef, PN), f"adam.w, {what}, {coef}")


@pytest.mark.parametrize("device", DEVICES)
def test_absent_inputs_are_all_zero_bits(device: str) -> None:
    """An absent input is +0.0 (spec §11.3.1): None gives the bits zeros give, in any place."""
    rng = np.random.default_rng(5)
    m0, m, v0, w0, v = realistic(rng, 4096)
    zero = np.zeros(4096, np.uint32)
    for coef in (adamw_coefficients(), np.zeros(7, np.uint32)):
        for absent in range(3):
            a0, a1, a2 = (None if k == absent else a for k, a in enumerate((m0, m, v0)))
            z0, z1, z2 = (zero if a is None else a for a in (a0, a1, a2))
            got = device_v(a0, a1, a2, coef, 4096, device)
            same(got, host_v(a0, a1, a2, coef, 4096))
            same(got, device_v(z0, z1, z2, coef, 4096, device))
            a0, a1, a2 = (None if k == absent else a for k, a in enumerate((w0, m, v)))
            z0, z1, z2 = (zero if a is None else a for a in (a0, a1, a2))
            got = device_w(a0, a1, a2, coef, 4096, device)
            same(got, host_w(a0, a1, a2, coef, 4096))
            same(got, device_w(z0, z1, z2, coef, 4096, device))
        same(device_v(None, None, None, coef, 4096, device), host_v(None, None, None, coef, 4096))
        same(device_w(None, None, None, coef, 4096, device), host_w(None, None, None, coef, 4096))


def tiny_state(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """A state whose predictions are full of subnormals: moments of about 1e-20 (their squares
    are below 1.2e-38), subnormal second moments and weights."""
    m0 = f32_bits(rng.normal(0, 1e-20, N))
    m = f32_bits(rng.normal(0, 1e-20, N))
    sub = rng.integers(1, 1 << 23, N, dtype=np.uint32)
    v0, w0, v = sub.copy(), (sub ^ (rng.integers(0, 2, N, dtype=np.uint32) << 31)), np.roll(sub, 1)
    return m0, m, v0, w0, v


def test_a_flushing_thread_keeps_subnormals(flushing: None) -> None:
    """After ``torch.set_flush_denormal(True)`` the CPU predictions still keep subnormals, as the
    host coder does (spec §11.3.1), and the caller's mode is back afterwards."""
    rng = np.random.default_rng(3)
    m0, m, v0, w0, v = tiny_state(rng)
    coef = adamw_coefficients(eps=1e-38).copy()
    coef[1] = 0x00000800  # s: a subnormal step size, so that w's update is subnormal too
    want_v, want_w = host_v(m0, m, v0, coef, N), host_w(w0, m, v, coef, N)
    for want in (want_v, want_w):  # the test must meet subnormal results
        assert int(((want & 0x7F800000) == 0).sum() - ((want & 0x7FFFFFFF) == 0).sum()) > N // 2
    same(device_v(m0, m, v0, coef, N, "cpu"), want_v, "adam.v")
    same(device_w(w0, m, v, coef, N, "cpu"), want_w, "adam.w")
    for enc, want in (("adam.v", want_v), ("adam.w", want_w)):  # through a row, too
        names = {"adam.v": "optimizer/0/exp_avg_sq", "adam.w": "model/w"}
        tensors = {"optimizer/0/exp_avg": live(m, "float32", (N,), "cpu"),
                   "optimizer/0/exp_avg_sq": live(v, "float32", (N,), "cpu"),
                   "model/w": live(v, "float32", (N,), "cpu")}
        base = dc.base_to_device({"optimizer/0/exp_avg": m0, "optimizer/0/exp_avg_sq": v0, "model/w": w0}, "cpu")
        encodings = {n: "sub" for n in tensors} | {names[enc]: enc}
        row = dc.code_row(tensors, encodings, ["w"], {0: coef}, base, dict(base))
        residual = np.empty(N, np.uint32)
        target = dc.to_host(dc.int_bits(tensors[names[enc]]))
        difference_delta(target, want.copy(), residual)
        same(row.values[names[enc]], residual, f"{enc} row")
    tiny = torch.tensor([0x00400000], dtype=torch.int32).view(torch.float32)
    assert float((tiny * 1.0).item()) == 0.0, "the thread flushes again afterwards"


# -- compaction ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_compaction_round_trips(device: str) -> None:
    """Both compacted forms, and what fetching a residual moves in its smallest form."""
    rng = np.random.default_rng(9)
    for width in (1, 2, 4, 8):
        u = WIDTH_DTYPES[width]
        for size in (4096, 4093):  # the bitmap's last byte full or partial
            for share in (0.0, 0.01, 0.2, 0.5, 1.0):
                dense = rng.integers(1, np.iinfo(u).max, size, dtype=u, endpoint=True)
                dense[rng.random(size) >= share] = 0
                nnz = int(np.count_nonzero(dense))
                t = on(dense, device)
                idx, nz = dc.compact_residual(t)
                assert idx.dtype == torch.int32 and idx.device == t.device and nz.device == t.device
                assert idx.numel() == nnz
                same(dc.expand_residual(idx.cpu().numpy(), dc.to_host(nz), size), dense, f"indices {width} {share}")
                bitmap, nz = dc.mask_residual(t)
                assert bitmap.dtype == torch.uint8 and bitmap.device == t.device
                assert bitmap.numel() == -(-size // 8) and nz.numel() == nnz
                same(bitmap.cpu().numpy(), np.packbits(dense != 0, bitorder="little"), "bitmap")
                back = dc.expand_mask_residual(bitmap.cpu().numpy(), dc.to_host(nz), size)
                same(back, dense, f"mask {width} {share}")
                smallest = min(size * width, nnz * (4 + width), -(-size // 8) + nnz * width)
                for compact in (True, False):
                    values, d2h, raw = dc.fetch_row({"x": t}, compact)
                    same(values["x"], dense, "fetched")
                    assert raw == size * width
                    assert d2h == dc.COUNT_BYTES + (smallest if compact else size * width)
                assert dc.row_transfer_bytes({"x": t}) == (dc.COUNT_BYTES + smallest, size * width)
    assert dc.residual_bytes(1000, 4, 10)[1] == "indices" and dc.residual_bytes(1000, 4, 300)[1] == "mask"
    assert dc.residual_bytes(1000, 4, 1000)[1] == "dense"
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    idx, nz = dc.compact_residual(empty)
    assert idx.numel() == nz.numel() == 0
    assert dc.mask_residual(empty)[0].numel() == 0
    assert dc.fetch_row({"x": empty})[0]["x"].shape == (0,)


# -- whole rows -----------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    count: torch.Tensor
    h16: torch.Tensor
    flag: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 48))
        self.b = torch.nn.Parameter(torch.zeros(48))
        self.h = torch.nn.Parameter(torch.randn(32, 8).to(torch.bfloat16))  # not predicted: bfloat16
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("h16", torch.randn(16).to(torch.float16))
        self.register_buffer("flag", torch.zeros(4, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w + self.b).tanh().sum() + self.h.float().square().sum() * 1e-3


def state_of(net: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Stored names of every state tensor (spec §11.3): ``model/<key>``, ``optimizer/<i>/<key>``."""
    out = {f"model/{k}": v for k, v in net.state_dict(keep_vars=True).items()}
    for i, p in enumerate(net.parameters()):
        for key, value in opt.state.get(p, {}).items():
            out[f"optimizer/{i}/{key}"] = value
    return out


def host_row(state: dict[str, torch.Tensor], encodings: Mapping[str, str], params: list[str],
             coefs: dict[int, np.ndarray], base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host coder's row, as the writer calls it (``prior``: the base before forgetting)."""
    tensors = {n: CapturedTensor.of(t.detach().to("cpu", copy=True)) for n, t in state.items()}
    prior = dict(base)
    for name in [n for n in base if n not in tensors]:
        del base[name]
    return row_values(tensors, encodings, params, coefs, base, prior, in_place=False)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_match_the_host(device: str) -> None:
    """Several steps of AdamW training coded by both coders, against bases kept by each: every
    value and the moved base equal, with state appearing at the first step, a tensor absent
    at one step and back at the next, a row without coefficients, ``xor`` rows, specials in
    the state and a flushing thread on the CPU."""
    torch.manual_seed(0)
    net = Net().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    params = [k for k, _ in net.named_parameters()]
    host_base: dict[str, np.ndarray] = {}
    dev_base: dict[str, torch.Tensor] = {}
    x = torch.randn(8, 64, device=device)
    for step in range(1, 7):
        opt.zero_grad()
        net(x * step).backward()
        opt.step()
        with torch.no_grad():
            net.count.add_(step)
            net.h16.mul_(1.5)
            net.flag.logical_not_()
            if step == 4:  # specials in the live state: NaN payloads, inf, subnormals, -0.0
                for t in (net.w, opt.state[net.w]["exp_avg"], opt.state[net.w]["exp_avg_sq"]):
                    flat = t.view(torch.int32).view(-1)
                    flat[:15] = torch.tensor(np.array(SPECIALS["float32"], np.uint32).view(np.int32), device=device)
        state = state_of(net, opt)
        if step == 3:
            state = {n: t for n, t in state.items() if n != "optimizer/1/exp_avg"}  # absent for one step
        groups = encode_param_groups(opt, with_params=False)
        coefs = adam_coefficients(opt, groups, {0: float(step), 1: float(step)})
        if step == 5:
            coefs = {0: coefs[0]}  # parameter 1 keeps its predicted slots without coefficients
        captured = {n: CapturedTensor.of(t.detach().to("cpu", copy=True)) for n, t in state.items()}
        plain: Encoding = "xor" if step == 6 else "sub"
        encodings = wanted_encodings(captured, params, plain, coefs if step != 6 else {})
        if step == 5:
            encodings |= {"optimizer/1/exp_avg_sq": "adam.v", "model/b": "adam.w"}
        assert step in (3, 6) or {"adam.v", "adam.w"} <= set(encodings.values())
        want = host_row(state, encodings, params, coefs, host_base)
        prior = dict(dev_base)  # before forgetting, sharing the base's tensors as the writer's does
        for name in [n for n in dev_base if n not in state]:
            del dev_base[name]  # the writer forgets the base of an absent tensor
        before = {n: dc.to_host(dc.int_bits(t)) for n, t in state.items()}
        if device == "cpu" and step == 4:
            torch.set_flush_denormal(True)
        try:
            got = dc.code_row(state, encodings, params, coefs, dev_base, prior)
        finally:
            torch.set_flush_denormal(False)
        assert sorted(got.values) == sorted(want), f"step {step}: names"
        for name in want:
            same(got.values[name], want[name], f"step {step}: {name}")
        for name, bits in before.items():
            same(dc.to_host(dc.int_bits(state[name])), bits, f"step {step}: live {name} left alone")
        assert sorted(dev_base) == sorted(host_base), f"step {step}: base names"
        for name, bits in dc.base_to_host(dev_base).items():
            same(bits, host_base[name], f"step {step}: base {name}")
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        assert got.raw_bytes == state_bytes
        if step == 2:  # m and v predicted from a state of one step: mostly exact
            assert got.d2h_bytes < got.raw_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_a_predicted_row_crosses_a_fraction_of_the_state(device: str) -> None:
    """AdamW ``w`` is predicted almost exactly from the new ``m`` and ``v``: its residual crosses
    as a few non-zeros, and the row as a fraction of the raw state."""
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(128, 64, device=device))
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.01, foreach=False)
    base: dict[str, torch.Tensor] = {}
    for step in range(1, 4):
        w.grad = torch.randn_like(w) * 1e-2
        opt.step()
        state = {"model/w": w, **{f"optimizer/0/{k}": v for k, v in opt.state[w].items()}}
        captured = {n: CapturedTensor.of(t.detach().to("cpu", copy=True)) for n, t in state.items()}
        coefs = adam_coefficients(opt, encode_param_groups(opt, with_params=False), {0: float(step)})
        encodings = wanted_encodings(captured, ["w"], "sub", coefs)
        assert encodings["model/w"] == "adam.w"
        on_device = dc.code_row_on_device(state, encodings, ["w"], coefs, base, dict(base))
        if step > 1:
            # CPU kernels round AdamW's update as the prediction does; a CUDA kernel may fuse
            # some of its operations and miss more often (a cost in bytes, never in exactness).
            strict = device == "cpu"
            exact = float((on_device["model/w"] == 0).float().mean())
            assert exact > (0.99 if strict else 0.5), exact
            d2h, raw = dc.row_transfer_bytes(on_device)
            assert d2h < (0.6 if strict else 0.9) * raw, (d2h, raw)
            values, fetched, _ = dc.fetch_row(on_device)
            assert fetched == d2h
            for name, v in on_device.items():
                same(values[name], dc.to_host(v), name)
