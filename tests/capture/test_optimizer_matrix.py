"""Every optimizer, every step: the ``optimizer.state_dict()`` round trip is structurally exact.

The contract under test: ``Checkpointer(mode="xor")`` works with any ``torch.optim.Optimizer``,
whatever its state and hyperparameters hold (tensors of any dtype, Python int/float/bool/
None/str, dtypes, tuples, nested lists, top-level non-parameter state, extra top-level
``state_dict`` entries). What cannot be supported is refused by the constructor with an
``ldformat.LdformatError``, leaving no chain directory (and so no lock) behind. Materializing
any step gives back the live ``state_dict`` exactly: tensor bits (integer views), keys and
key types, ``None`` values, Python types (int stays int, tuple stays tuple), empty
per-parameter state. The other modes keep that promise through their anchors (``lowdiff+``:
every step; ``lowdiff``: the anchor steps).

Each optimizer gets one outcome per mode:

* ``exact``: every checked step materializes to the live state;
* ``refused``: the constructor raised an ``LdformatError`` and left nothing on disk;
* ``refused unclean``: the constructor failed with another exception, left files behind, or
  changed the live model or optimizer;
* ``error after start``: training, ``close()`` or ``materialize`` raised;
* ``silent difference``: a step materializes to something else without an error (the worst).

The optimizers (tests/support/optimizer_zoo.py): every ``torch.optim`` class in several configurations,
every optimizer ``pytorch_optimizer`` lists (those that fail without ldformat are skipped with
the reason), and probes whose state holds one kind of value each. The runs are computed once
per module (:class:`Matrix`) and shared by the per-optimizer tests and the summary tests, which
print the table and bound the share of non-exact optimizers. ``-m slow`` repeats everything
with longer runs and several steps per delta batch.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import shutil
import struct
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from optimizer_zoo import (
    PROBES,
    TORCH_OPTIM,
    UNSUPPORTABLE,
    UNSUPPORTABLE_LATER,
    Entry,
    plain_failure,
    preconditioner_entries,
    pytorch_optimizer_entries,
    timm_entries,
    train_step,
)

import ldformat

EXACT, REFUSED, UNCLEAN, ERROR, SILENT, EXCLUDED = (
    "exact", "refused", "refused unclean", "error after start", "silent difference", "excluded")
FAILURES = {UNCLEAN, ERROR, SILENT}


# -- structural comparison --------------------------------------------------------------------
class StateMismatch(AssertionError):
    """The first difference between two states, with its path."""


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor of the same bytes: bool as uint8, complex as its (real, imag) pairs."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if t.is_quantized:
        t = t.int_repr()
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    view = _INT_VIEW[t.element_size()]
    return t if t.dtype == view else t.view(view)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _fail(path: str, what: str) -> None:
    raise StateMismatch(f"{path}: {what}")


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor({v.dtype}, {tuple(v.shape)})"
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _compare_tensors(live: torch.Tensor, stored: torch.Tensor, path: str) -> None:
    if live.layout != stored.layout:
        _fail(path, f"layout {live.layout} != {stored.layout}")
    if live.dtype != stored.dtype:
        _fail(path, f"dtype {live.dtype} != {stored.dtype}")
    if live.shape != stored.shape:
        _fail(path, f"shape {tuple(live.shape)} != {tuple(stored.shape)}")
    if live.layout == torch.sparse_coo:
        a, b = live.coalesce(), stored.coalesce()
        _compare_tensors(a.indices(), b.indices(), f"{path}.indices()")
        _compare_tensors(a.values(), b.values(), f"{path}.values()")
        return
    if live.layout != torch.strided:
        _compare_tensors(live.to_dense(), stored.to_dense(), f"{path}.to_dense()")
        return
    a, b = tensor_bits(live), tensor_bits(stored)
    if not torch.equal(a, b):
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        i = int((flat_a != flat_b).nonzero()[0, 0]) // max(1, flat_a.numel() // max(1, live.numel()))
        la = live.detach().cpu().reshape(-1)[i].item()
        sb = stored.detach().cpu().reshape(-1)[i].item()
        _fail(path, f"bits differ at flat index {i} (live {la}, stored {sb})")


def _compare(live: Any, stored: Any, path: str) -> None:
    if isinstance(live, torch.Tensor) or isinstance(stored, torch.Tensor):
        if not (isinstance(live, torch.Tensor) and isinstance(stored, torch.Tensor)):
            _fail(path, f"{_describe(live)} != {_describe(stored)}")
        _compare_tensors(live, stored, path)
        return
    if isinstance(live, Mapping) or isinstance(stored, Mapping):
        if not (isinstance(live, Mapping) and isinstance(stored, Mapping)):
            _fail(path, f"{_describe(live)} != {_describe(stored)}")
        stored_keys = {k: k for k in stored}  # the stored key object (0, 0.0 and False hash alike)
        for k in live:
            if k not in stored_keys:
                _fail(f"{path}[{k!r}]", f"key missing from the stored state (live: {_describe(live[k])})")
            if type(stored_keys[k]) is not type(k):
                _fail(f"{path}[{k!r}]", f"key type {type(k).__name__} != {type(stored_keys[k]).__name__}")
        for k in stored:
            if k not in live:
                _fail(f"{path}[{k!r}]", f"extra key in the stored state ({_describe(stored[k])})")
        for k in live:
            _compare(live[k], stored[stored_keys[k]], f"{path}[{k!r}]")
        return
    if type(live) is not type(stored):
        _fail(path, f"type {type(live).__name__} != {type(stored).__name__} (live {live!r}, stored {stored!r})")
    if isinstance(live, (list, tuple)):
        assert isinstance(stored, (list, tuple))
        if len(live) != len(stored):
            _fail(path, f"length {len(live)} != {len(stored)}")
        for i, (a, b) in enumerate(zip(live, stored, strict=True)):
            _compare(a, b, f"{path}[{i}]")
        return
    if isinstance(live, float):
        assert isinstance(stored, float)
        if _float_bits(live) != _float_bits(stored):
            _fail(path, f"float {live!r} != {stored!r} (bits)")
        return
    if live != stored:
        _fail(path, f"{live!r} != {stored!r}")


def assert_same_state(live: dict[Any, Any], stored: dict[Any, Any], where: str = "state") -> None:
    """Raise :class:`StateMismatch` naming the path of the first difference between two states.

    Mappings: the same keys, each of the same type (any mapping class); sequences: the same
    class (tuple is not list) and length; other values: the same class (``1``, ``1.0`` and
    ``True`` differ) and value, floats by their bits (``-0.0`` is not ``0.0``, NaN equals a
    NaN of the same bits); tensors: layout, dtype, shape and bits of an integer view.
    """
    _compare(live, stored, where)


# -- runs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    steps: int
    anchor_every: int
    batch_steps: int

    def anchors(self) -> list[int]:
        return list(range(0, self.steps + 1, self.anchor_every))


DEFAULT = Config(steps=6, anchor_every=4, batch_steps=1)  # anchors 0 and 4; deltas 1-3 and 5-6
LONG = Config(steps=24, anchor_every=7, batch_steps=3)  # several rows per batch, batches across anchors


@dataclass
class Outcome:
    name: str
    mode: str
    category: str
    reason: str = ""
    seconds: float = 0.0
    anchors: list[int] = field(default_factory=list)
    checked_steps: list[int] = field(default_factory=list)
    ldformat_error: bool = False  # the exception (if any) is an LdformatError
    largest_optimizer_slot: int = 0  # elements of the largest optimizer/… slot of the chain's batches
    parameter_elements: int = 0  # P of spec §10.3: the schema's parameters, together

    def row(self) -> str:
        return f"{self.mode:9s} {self.name:28s} {self.category:18s} {self.reason}"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _leftovers(path: Path) -> list[str]:
    if not path.exists():
        return []
    if not path.is_dir():
        return [path.name]
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) or ["(an empty directory)"]


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def run_case(entry: Entry, mode: str, root: Path, config: Config) -> Outcome:
    """Train ``entry`` under a Checkpointer in ``mode``, then materialize and compare the steps
    (every step; in ``lowdiff`` mode, whose deltas are compressed gradients, the anchors)."""
    started = time.perf_counter()
    out = Outcome(entry.name, mode, EXACT)
    path = root / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{mode}-{entry.name}")
    model = entry.model()
    opt = entry.make(model)
    refs = {0: snapshot(model, opt)}
    try:
        ck = ldformat.Checkpointer(str(path), model, opt, mode=mode,  # type: ignore[arg-type]
                                   anchor_every=config.anchor_every, batch_steps=config.batch_steps,
                                   topk_ratio=0.25,
                                   options=ldformat.CaptureOptions(capture_every=1))  # every step is compared
    except Exception as e:
        out.ldformat_error = isinstance(e, ldformat.LdformatError)
        left = _leftovers(path)
        if not out.ldformat_error:
            out.category, out.reason = UNCLEAN, f"constructor raised a non-ldformat error: {_one_line(e)}"
            if left:
                out.reason += f"; left behind: {', '.join(left[:8])}"
        elif left:
            out.category, out.reason = UNCLEAN, f"refused ({_one_line(e)}) but left behind: {', '.join(left[:8])}"
        else:
            out.category, out.reason = REFUSED, _one_line(e)
        try:  # a refusal happens before training: it leaves the live objects as they were
            assert_same_state(refs[0], snapshot(model, opt), "live state after the refusal")
        except StateMismatch as changed:
            out.category, out.reason = UNCLEAN, f"{out.reason}; but it changed {changed}"
        out.seconds = time.perf_counter() - started
        shutil.rmtree(path, ignore_errors=True)
        return out
    phase = "training"
    try:
        for step in range(1, config.steps + 1):
            phase = f"training step {step}"
            train_step(model, opt, step, entry)
            refs[step] = snapshot(model, opt)
        phase = "close()"
        ck.close()
        phase = "reading the chain"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ldformat.ReplayEnvironmentWarning)
            reader = ldformat.ChainReader(str(path))
            out.anchors = list(reader.anchors)
            out.parameter_elements = sum(p.numel() for p in model.parameters())
            out.largest_optimizer_slot = max((s.numel for e in reader.state.delta_entries() for s in e.slots
                                              if s.name.startswith("optimizer/")), default=0)
            if reader.steps != list(range(config.steps + 1)):
                out.category = SILENT
                out.reason = f"close() succeeded but the chain holds steps {reader.steps}, not 0-{config.steps}"
                return out
            checked = out.anchors if mode == "lowdiff" else list(range(config.steps + 1))
            for step in checked:
                phase = f"materialize({step})"
                got = reader.materialize(step)
                phase = f"comparing step {step}"
                out.checked_steps.append(step)
                try:
                    if got["step"] != step:
                        _fail("step", f"{step} != {got['step']}")
                    assert_same_state(refs[step]["model"], got["model"], f"step {step} model")
                    assert_same_state(refs[step]["optimizer"], got["optimizer"], f"step {step} optimizer")
                except StateMismatch as e:
                    out.category, out.reason = SILENT, str(e)
                    return out
    except Exception as e:
        out.ldformat_error = isinstance(e, ldformat.LdformatError)
        out.category, out.reason = ERROR, f"{phase}: {_one_line(e)}"
        with contextlib.suppress(Exception):
            ck.close()  # a no-op once closed
    finally:
        out.seconds = time.perf_counter() - started
        shutil.rmtree(path, ignore_errors=True)
    return out


class Matrix:
    """The outcome of every (mode, optimizer) under ``config``, computed on first use."""

    def __init__(self, root: Path, config: Config) -> None:
        self.root, self.config = root, config
        self.outcomes: dict[tuple[str, str], Outcome] = {}
        self._plain: dict[str, str | None] = {}

    def plain(self, entry: Entry) -> str | None:
        if entry.name not in self._plain:
            self._plain[entry.name] = plain_failure(entry, steps=self.config.steps)
        return self._plain[entry.name]

    def get(self, mode: str, entry: Entry) -> Outcome:
        key = (mode, entry.name)
        if key not in self.outcomes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the optimizers' own deprecation and usage notes
                reason = self.plain(entry)
                if reason is not None:
                    self.outcomes[key] = Outcome(entry.name, mode, EXCLUDED, reason)
                else:
                    self.outcomes[key] = run_case(entry, mode, self.root, self.config)
        return self.outcomes[key]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread pools only cost time here
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    with _one_thread():
        yield Matrix(tmp_path_factory.mktemp("optimizer_matrix"), DEFAULT)


@pytest.fixture(scope="module")
def long_matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    with _one_thread():
        yield Matrix(tmp_path_factory.mktemp("optimizer_matrix_long"), LONG)


TORCH_ENTRIES = {e.name: e for e in TORCH_OPTIM}
PO_ENTRIES = pytorch_optimizer_entries()
TIMM_ENTRIES = timm_entries()
PROBE_ENTRIES = {e.name: e for e in PROBES}
UNSUPPORTABLE_ENTRIES = {e.name: e for e in UNSUPPORTABLE}
LATER_ENTRIES = {e.name: e for e in UNSUPPORTABLE_LATER}
WIDE_ENTRIES = preconditioner_entries()  # on MatrixNet(16): preconditioners larger than the model
OPTIMIZERS = {**TORCH_ENTRIES, **PO_ENTRIES, **TIMM_ENTRIES}  # the matrix proper: real optimizers
THIRD_PARTY = {**PO_ENTRIES, **TIMM_ENTRIES}
EVERYTHING = {**OPTIMIZERS, **PROBE_ENTRIES, **UNSUPPORTABLE_ENTRIES}
MODES = ["xor", "lowdiff+", "lowdiff"]


def _check(out: Outcome, *, refusal_allowed: bool = True) -> None:
    if out.category == EXCLUDED:
        pytest.skip(out.reason)
    if out.category in FAILURES or (out.category == REFUSED and not refusal_allowed):
        pytest.fail(f"{out.mode} {out.name}: {out.category}: {out.reason}", pytrace=False)


# -- the structural comparison catches each kind of difference ---------------------------------
_T = torch.tensor


@pytest.mark.parametrize(("live", "stored", "path"), [
    ({"a": 1}, {"a": 1.0}, "s['a']"),
    ({"a": 1}, {"a": True}, "s['a']"),
    ({"a": 1.0}, {"a": 1}, "s['a']"),
    ({"a": True}, {"a": 1}, "s['a']"),
    ({"a": (1, 2)}, {"a": [1, 2]}, "s['a']"),
    ({"a": [1, 2]}, {"a": (1, 2)}, "s['a']"),
    ({"a": None}, {}, "s['a']"),
    ({"a": None}, {"a": 0}, "s['a']"),
    ({}, {"a": None}, "s['a']"),
    ({0: {}}, {}, "s[0]"),
    ({0: 1}, {"0": 1}, "s[0]"),
    ({0: 1}, {0.0: 1}, "s[0]"),
    ({"a": "x"}, {"a": "y"}, "s['a']"),
    ({"a": torch.float16}, {"a": torch.bfloat16}, "s['a']"),
    ({"a": torch.float16}, {"a": "float16"}, "s['a']"),
    ({"a": -0.0}, {"a": 0.0}, "s['a']"),
    ({"a": 0.1}, {"a": 0.1 + 2**-56}, "s['a']"),
    ({"a": [[1, (2, 3.0)]]}, {"a": [[1, (2, 3)]]}, "s['a'][0][1][1]"),
    ({"a": [[1, (2, 3.0)]]}, {"a": [[1, (2, 3.0, None)]]}, "s['a'][0][1]"),
    ({"a": _T([1.0])}, {"a": 1.0}, "s['a']"),
    ({"a": _T([1.0])}, {"a": _T([1.0], dtype=torch.float64)}, "s['a']"),
    ({"a": _T([1.0])}, {"a": _T([[1.0]])}, "s['a']"),
    ({"a": _T(1.0)}, {"a": _T([1.0])}, "s['a']"),
    ({"a": _T([0.0])}, {"a": _T([-0.0])}, "s['a']"),
    ({"a": _T([1.0, 2.0])}, {"a": _T([1.0, 2.0 + 2**-22])}, "s['a']"),
    ({"a": _T([True, False])}, {"a": _T([True, True])}, "s['a']"),
    ({"a": _T([1 + 2j])}, {"a": _T([1 - 2j])}, "s['a']"),
    ({"a": _T([1.0], dtype=torch.bfloat16)}, {"a": _T([1.0078125], dtype=torch.bfloat16)}, "s['a']"),
    ({"a": _T([3], dtype=torch.int8)}, {"a": _T([3], dtype=torch.uint8)}, "s['a']"),
    ({"state": {0: {"step": _T(3.0)}}}, {"state": {0: {"step": 3.0}}}, "s['state'][0]['step']"),
    ({"state": {0: {"m": None}}}, {"state": {0: {}}}, "s['state'][0]['m']"),
])
def test_assert_same_state_reports_the_first_difference(live: Any, stored: Any, path: str) -> None:
    with pytest.raises(StateMismatch) as info:
        assert_same_state(live, stored, "s")
    assert str(info.value).startswith(f"{path}:"), str(info.value)
    with pytest.raises(StateMismatch):
        assert_same_state(stored, live, "s")  # whichever side is live


def test_assert_same_state_accepts_identical_bits() -> None:
    nan = float("nan")
    live: dict[str, Any] = {
        "state": {0: {"m": _T([nan, -0.0, float("inf")]), "c": _T([1 + 2j]), "b": _T([True]), "x": None},
                  1: {}, "top": (1, 2.5, None, "s", torch.int8, [[_T([1], dtype=torch.int16)]])},
        "param_groups": [{"betas": (0.9, 0.999), "lr": nan, "params": [0, 1]}],
    }
    stored = copy.deepcopy(live)
    stored["state"][0]["m"] = torch.arange(6.0).reshape(3, 2).t()[0].clone()  # a new tensor...
    stored["state"][0]["m"].copy_(live["state"][0]["m"])  # ...with the same bits
    assert_same_state(live, stored)
    strided = torch.arange(6.0).reshape(2, 3).t()
    assert_same_state({"t": strided}, {"t": strided.contiguous()})
    # NaN payloads and signs are bits like any other
    other_nan = _T([nan]).view(torch.int32).add(1).view(torch.float32)
    with pytest.raises(StateMismatch, match=r"\['m'\]: bits differ"):
        assert_same_state({"m": _T([nan])}, {"m": other_nan})
    assert math.isnan(float(other_nan))


# -- xor: every step, every optimizer -----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TORCH_ENTRIES))
def test_xor_torch_optim(matrix: Matrix, name: str) -> None:
    _check(matrix.get("xor", TORCH_ENTRIES[name]))


@pytest.mark.parametrize("name", sorted(PO_ENTRIES))
def test_xor_pytorch_optimizer(matrix: Matrix, name: str) -> None:
    _check(matrix.get("xor", PO_ENTRIES[name]))


@pytest.mark.parametrize("name", sorted(TIMM_ENTRIES))
def test_xor_timm(matrix: Matrix, name: str) -> None:
    _check(matrix.get("xor", TIMM_ENTRIES[name]))


@pytest.mark.parametrize("name", sorted(PROBE_ENTRIES))
def test_xor_state_values_the_contract_names(matrix: Matrix, name: str) -> None:
    """Every kind of value the contract lists must round-trip; refusing them is a failure."""
    _check(matrix.get("xor", PROBE_ENTRIES[name]), refusal_allowed=False)


@pytest.mark.parametrize("name", sorted(UNSUPPORTABLE_ENTRIES))
def test_xor_unsupportable_state_is_refused_cleanly(matrix: Matrix, name: str) -> None:
    """An arbitrary object (or a sparse tensor) already present at construction: exact, or
    refused by the constructor with nothing left on disk; never an error later, never silent."""
    _check(matrix.get("xor", UNSUPPORTABLE_ENTRIES[name]))


@pytest.mark.parametrize("name", sorted(LATER_ENTRIES))
def test_xor_unsupportable_state_appearing_later_is_loud(matrix: Matrix, name: str) -> None:
    """State the constructor cannot have seen may fail once training runs, but as an
    LdformatError from step() or close(), never from reading, never silently."""
    out = matrix.get("xor", LATER_ENTRIES[name])
    assert out.category not in (SILENT, UNCLEAN), out.reason
    if out.category == ERROR:
        assert out.ldformat_error, f"not an LdformatError: {out.reason}"
        assert out.reason.startswith(("training", "close()")), \
            f"the error must come from training or close(), not from reading: {out.reason}"


@pytest.mark.parametrize("name", sorted(WIDE_ENTRIES))
def test_xor_preconditioners_larger_than_the_model(matrix: Matrix, name: str) -> None:
    """Kronecker factors and blocks of them (DASH, Shampoo, SOAP, Kron, ...) hold more elements
    than all parameters together; the reader reads the slots the writer records (spec §10.3)."""
    out = matrix.get("xor", WIDE_ENTRIES[name])
    _check(out, refusal_allowed=False)
    assert out.largest_optimizer_slot > out.parameter_elements, (
        f"{name}: no optimizer slot above P = {out.parameter_elements} (largest {out.largest_optimizer_slot}): "
        "the case no longer tests what it is for")


# -- the other modes, through their anchors ----------------------------------------------------
@pytest.mark.parametrize("name", sorted(TORCH_ENTRIES))
def test_lowdiff_plus_torch_optim(matrix: Matrix, name: str) -> None:
    _check(matrix.get("lowdiff+", TORCH_ENTRIES[name]))


@pytest.mark.parametrize("name", sorted({**THIRD_PARTY, **PROBE_ENTRIES}))
def test_lowdiff_plus_other_optimizers_exact_or_refused_cleanly(matrix: Matrix, name: str) -> None:
    """lowdiff+ replays the optimizer: a class it cannot rebuild must be refused up front."""
    _check(matrix.get("lowdiff+", {**THIRD_PARTY, **PROBE_ENTRIES}[name]))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lowdiff_anchors(matrix: Matrix, name: str) -> None:
    _check(matrix.get("lowdiff", OPTIMIZERS[name]))


# -- summary ----------------------------------------------------------------------------------
_ORDER = [SILENT, ERROR, UNCLEAN, REFUSED, EXCLUDED, EXACT]


def _print_table(title: str, outcomes: list[Outcome], capsys: pytest.CaptureFixture[str]) -> None:
    counts = {c: sum(o.category == c for o in outcomes) for c in _ORDER}
    with capsys.disabled():
        print(f"\n== {title}: " + ", ".join(f"{c} {n}" for c, n in counts.items() if n))
        for o in sorted(outcomes, key=lambda o: (_ORDER.index(o.category), o.name)):
            print(f"  {o.row()}  [{o.seconds:.2f}s]")


def _summarize(matrix: Matrix, mode: str, entries: dict[str, Entry], title: str,
               capsys: pytest.CaptureFixture[str]) -> list[Outcome]:
    outcomes = [matrix.get(mode, e) for e in entries.values()]
    _print_table(title, outcomes, capsys)
    return outcomes


def _assert_xor_matrix(outcomes: list[Outcome], config: Config) -> None:
    runnable = [o for o in outcomes if o.category != EXCLUDED]
    exact = [o for o in runnable if o.category == EXACT]
    assert len(runnable) >= 40, f"only {len(runnable)} runnable optimizers: is pytorch_optimizer installed?"
    families = {OPTIMIZERS[o.name].family for o in runnable if o.name in OPTIMIZERS}
    assert {"torch.optim", "pytorch_optimizer", "timm"} <= families, (
        f"the matrix ran only {sorted(families)}: install the test extra and timm "
        "(pip install --no-deps timm, which keeps the CPU torch)")
    for o in exact:
        assert o.anchors == config.anchors() and o.checked_steps == list(range(config.steps + 1)), \
            f"{o.name}: anchors {o.anchors}, checked {o.checked_steps}: the run missed anchors or deltas"
    silent = [o.name for o in runnable if o.category == SILENT]
    assert not silent, f"silent differences: {silent}"
    assert len(exact) >= 0.95 * len(runnable), (
        f"{len(exact)}/{len(runnable)} optimizers are exact in xor mode; not exact: "
        + "; ".join(f"{o.name} ({o.category})" for o in runnable if o.category != EXACT))


def test_summary_xor(matrix: Matrix, capsys: pytest.CaptureFixture[str]) -> None:
    outcomes = _summarize(matrix, "xor", OPTIMIZERS, "xor: torch.optim, pytorch_optimizer and timm", capsys)
    probes = _summarize(matrix, "xor", {**PROBE_ENTRIES, **UNSUPPORTABLE_ENTRIES, **LATER_ENTRIES},
                        "xor: probes", capsys)
    assert not [o.name for o in probes if o.category == SILENT], "silent differences in the probes"
    _assert_xor_matrix(outcomes, matrix.config)


def test_summary_other_modes(matrix: Matrix, capsys: pytest.CaptureFixture[str]) -> None:
    plus = _summarize(matrix, "lowdiff+", {**OPTIMIZERS, **PROBE_ENTRIES}, "lowdiff+ (every step)", capsys)
    topk = _summarize(matrix, "lowdiff", OPTIMIZERS, "lowdiff (anchor steps)", capsys)
    silent = [f"{o.mode} {o.name}" for o in plus + topk if o.category == SILENT]
    assert not silent, f"silent differences: {silent}"
    for o in topk:
        if o.category == EXACT:
            assert o.checked_steps == matrix.config.anchors(), f"{o.name}: checked {o.checked_steps}"
    torch_plus = [o for o in plus if o.name in TORCH_ENTRIES and o.category != EXCLUDED]
    assert sum(o.category == EXACT for o in torch_plus) >= 0.8 * len(torch_plus), \
        "lowdiff+ should replay most torch.optim optimizers exactly"


# -- slow: longer runs, several steps per batch -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_long_runs(long_matrix: Matrix, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    entries = EVERYTHING if mode != "lowdiff" else OPTIMIZERS
    outcomes = _summarize(long_matrix, mode, entries, f"{mode}, {long_matrix.config}", capsys)
    failures = [o.row() for o in outcomes if o.category in FAILURES
                or (o.category == REFUSED and o.name in PROBE_ENTRIES and mode == "xor")]
    assert not failures, "\n".join(failures)
    if mode == "xor":
        _assert_xor_matrix([o for o in outcomes if o.name in OPTIMIZERS], long_matrix.config)
