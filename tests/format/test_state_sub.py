"""Difference-coded state deltas (slot encoding ``sub``, format 1.6, spec §11.3): the spec's test
vectors, the codec's round trip at every width and across its chunks, chains of 1.5 (XOR) and
1.6 (differences) replayed bit for bit against live training, merges and the runs compaction
must fold instead, and slots that a chain's kind does not allow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from models import TinyNet, assert_state_bits_equal, snapshot, train_step
from paths import REPO

import ldformat
from ldformat.errors import CorruptChainError
from ldformat.format import delta
from ldformat.format.delta import check_slots, difference_delta, undifference
from ldformat.format.manifest import SlotInfo, state_delta_encoding
from ldformat.format.predict import predict_parameter, predict_second_moment
from ldtools.cli import cli

SPEC = REPO / "spec" / "ldformat.md"
WIDTHS = {"float32": np.uint32, "bfloat16": np.uint16, "int64": np.uint64, "uint8": np.uint8}


def spec_vectors() -> list[tuple[str, str | None, str, str, str]]:
    """(dtype, base or None, new, xor values, sub values) from the table in spec §11.3."""
    text = SPEC.read_text()
    section = text[text.index("### 11.3 `state.xor`"): text.index("### 11.4 Replay path")]
    table = section[section.index("*Test vectors*"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] not in WIDTHS:
            continue
        hexes = [re.match(r"`([0-9A-F]+)`", c) for c in cells[1:]]
        base = hexes[0].group(1) if hexes[0] else None
        assert base is not None or cells[1].startswith("none"), line
        rows.append((cells[0], base, *(h.group(1) for h in hexes[1:] if h)))  # type: ignore[arg-type]
    return rows  # type: ignore[return-value]


VECTORS = spec_vectors()


def prediction_vectors() -> tuple[np.ndarray, list[list[int]]]:
    """(coefficients, rows of m0, m, v0, adam.v P, w0, v, adam.w P) from spec §11.3.1."""
    text = SPEC.read_text()
    section = text[text.index("#### 11.3.1 Adam prediction"): text.index("### 11.4 Replay path")]
    table = section[section.index("*Prediction test vectors*"):]
    coef = re.search(r"`a, s, c, e, k, b, d` = `([0-9A-F ]+)`", table)
    assert coef is not None
    rows = []
    for line in table.splitlines():
        cells = re.findall(r"`([0-9A-F]{8})`", line)
        if line.startswith("| `") and len(cells) == 7:
            rows.append([int(c, 16) for c in cells])
    return np.array([int(x, 16) for x in coef.group(1).split()], np.uint32), rows


def test_the_spec_has_test_vectors() -> None:
    assert len(VECTORS) >= 8
    assert {v[0] for v in VECTORS} >= {"float32", "bfloat16", "int64"}


@pytest.mark.parametrize(("dtype", "base", "new", "want_xor", "want_sub"), VECTORS)
def test_spec_vectors(dtype: str, base: str | None, new: str, want_xor: str, want_sub: str) -> None:
    width = WIDTHS[dtype]
    b = None if base is None else np.array([int(base, 16)], width)
    n = np.array([int(new, 16)], width)
    xor = n.copy() if b is None else np.bitwise_xor(n, b)
    assert int(xor[0]) == int(want_xor, 16)
    out = np.empty_like(n)
    moved = None if b is None else b.copy()
    difference_delta(n.copy(), moved, out)
    assert int(out[0]) == int(want_sub, 16)
    if moved is not None:
        assert int(moved[0]) == int(new, 16)  # the base moved on to the new bits
    # replay: the base (all-zero bits where there is none) plus unzigzag(values)
    target = np.zeros(1, width) if b is None else b.copy()
    undifference(out, target, accumulate=True)
    assert int(target[0]) == int(new, 16)


def test_spec_prediction_vectors() -> None:
    """Spec §11.3.1: the binary32 predictions, including an all-zero row, and NaN -> +0.0."""
    coef, rows = prediction_vectors()
    assert len(coef) == 7 and len(rows) >= 3
    col = [np.array([r[k] for r in rows], np.uint32) for k in range(7)]
    m0, m, v0, want_v, w0, v, want_w = col
    got = np.empty_like(m)
    predict_second_moment(m0, m, v0, coef, got)
    assert got.tolist() == want_v.tolist()
    predict_parameter(w0, m, v, coef, got)
    assert got.tolist() == want_w.tolist()
    one = np.array([0x3F800000], np.uint32)
    predict_parameter(one, None, None, np.zeros(7, np.uint32), got[:1])  # sqrt(0) / 0 is NaN
    assert got[0] == 0


@pytest.mark.parametrize("width", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("in_place", [False, True])
def test_round_trip_at_every_width_across_chunks(monkeypatch: pytest.MonkeyPatch, width: type[np.generic],
                                                  in_place: bool) -> None:
    monkeypatch.setattr(delta, "SUB_CHUNK", 7)  # many chunks, and a partial last one
    rng = np.random.default_rng(int(np.dtype(width).itemsize))
    top = 2 ** (8 * np.dtype(width).itemsize)
    base = rng.integers(0, top, size=100, dtype=width)
    # extremes: no change, +-1, wrap-around both ways, the largest differences
    new = (base + rng.integers(-3, 4, size=100).astype(np.int64).astype(width)).astype(width)
    new[:4] = [0, top - 1, 0, top - 1]
    base[:4] = [top - 1, 0, top // 2, top // 2 - 1]
    keep_base, keep_new = base.copy(), new.copy()
    out = new if in_place else np.empty_like(new)
    difference_delta(new, base, out)
    assert np.array_equal(base, keep_new), "the base moves on to the new bits"
    if not in_place:
        assert np.array_equal(new, keep_new), "the new bits are left alone"
    small = out[4:] < 8
    assert small.all(), "small differences of either sign are small numbers"
    replayed = keep_base.copy()
    undifference(out, replayed, accumulate=True)
    assert np.array_equal(replayed, keep_new)
    decoded = np.empty_like(out)
    undifference(out, decoded, accumulate=False)
    again = decoded.copy()
    difference_delta(again, None, again)  # against all-zero bits: the zigzag alone
    assert np.array_equal(again, out)
    assert np.array_equal((keep_base + decoded).astype(width), keep_new)


def test_a_mismatched_length_is_refused() -> None:
    with pytest.raises(ValueError, match="3 elements applied to a tensor of 4"):
        undifference(np.zeros(3, np.uint32), np.zeros(4, np.uint32), accumulate=True)


def _train_chain(path: Path, version: str, steps: int = 7, batch_steps: int = 3,
                 optimizer: str = "adamw") -> tuple[ldformat.ChainWriter, dict[int, dict]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    writer = ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=batch_steps,
                                         format_version=version)
    refs = {0: snapshot(model, opt)}
    for step in range(1, steps + 1):
        train_step(model, opt, step)
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
    return writer, refs


def _encodings(path: Path) -> set[str]:
    return {s.encoding for e in ldformat.ChainReader(path).state.delta_entries() for s in e.slots}


@pytest.mark.parametrize(("version", "encoding"), [("1.5", "xor"), ("1.6", "sub")])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_chains_of_both_versions_replay_every_step_exactly(tmp_path: Path, version: str, encoding: str,
                                                           optimizer: str) -> None:
    """AdamW (state appears at step 1) and SGD momentum; BatchNorm's int64 step counter, tied weights."""
    path = tmp_path / "chain"
    writer, refs = _train_chain(path, version, optimizer=optimizer)
    writer.close()
    assert state_delta_encoding(version) == encoding
    predicted = version == "1.6" and optimizer == "adamw"  # Adam prediction (spec §11.3)
    assert _encodings(path) == ({encoding, "adam.v", "adam.w", "dense"} if predicted else {encoding})
    reader = ldformat.ChainReader(path)
    assert reader.root.format_version == version
    for step, ref in refs.items():
        assert_state_bits_equal(reader.materialize(step), ref, f"{version} step {step}")
    assert ldformat.validate(path, deep=True).ok
    # Batches of predicted rows compress their values with lz4, every other batch with zstd.
    for entry in reader.state.delta_entries():
        meta = json.loads(reader.store.read(f"{entry.path}/values_u32/zarr.json"))
        blosc = next(c for c in meta["codecs"] if c["name"] == "blosc")
        assert blosc["configuration"]["cname"] == ("lz4" if predicted else "zstd"), entry.path
    # ldtools info says which encodings the batches hold, so a user sees whether prediction applies
    out = CliRunner().invoke(cli, ["info", str(path), "--json"])
    assert out.exit_code == 0, out.output
    encodings = json.loads(out.output)["slot_encodings"]
    assert set(encodings) == _encodings(path) and all(n > 0 for n in encodings.values())
    text = CliRunner().invoke(cli, ["info", str(path)]).output
    assert ("Adam prediction" in text) == predicted and "encodings    " in text


def test_appending_to_a_15_chain_keeps_xor(tmp_path: Path) -> None:
    """Spec §3.1: a writer writes no ``sub`` slot into a chain whose root says 1.5."""
    path = tmp_path / "chain"
    writer, refs = _train_chain(path, "1.5", steps=3)
    model, opt = writer.model, writer.optimizer
    writer.close()
    writer = ldformat.ChainWriter.open(path, model, opt)
    for step in range(4, 7):
        train_step(model, opt, step)
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
    writer.close()
    assert _encodings(path) == {"xor"}
    reader = ldformat.ChainReader(path)
    assert reader.root.format_version == "1.5"
    for step, ref in refs.items():
        assert_state_bits_equal(reader.materialize(step), ref, f"step {step}")


def test_merged_differences_are_exact(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    writer, refs = _train_chain(path, "1.6", steps=9)
    writer.close()
    plan = ldformat.compact(path, keep_last=2, keep_every=4)
    assert plan.merged_deltas == [(0, 4), (4, 8)] and not plan.new_anchors
    reader = ldformat.ChainReader(path)
    merged = [e for e in reader.state.delta_entries() if any(s.base != s.step - 1 for s in e.steps)]
    assert merged and {s.encoding for e in merged for s in e.slots} == {"sub"}
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
    assert ldformat.validate(path, deep=True).ok


@pytest.mark.parametrize("version", ["1.5", "1.6"])
def test_runs_of_any_encoding_merge_exactly(tmp_path: Path, version: str) -> None:
    """Spec §17.2: a 1.6 chain's merged delta is the difference of the two states, whatever the
    deltas between them hold (here batches coded by XOR, difference and Adam prediction, as
    another implementation may write them); a 1.5 chain's deltas merge by XOR."""
    path = tmp_path / "chain"
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    writer = ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=2, format_version=version)
    refs = {0: snapshot(model, opt)}
    for step in range(1, 9):
        if version == "1.6":
            writer._state_encoding = "xor" if step in (3, 4) else "sub"  # sub: with Adam prediction
        train_step(model, opt, step)
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
    writer.close()
    assert _encodings(path) == ({"xor", "sub", "adam.v", "adam.w", "dense"} if version == "1.6" else {"xor"})
    plan = ldformat.compact(path, keep_every=4)
    assert plan.merged_deltas == [(0, 4), (4, 8)] and not plan.new_anchors
    reader = ldformat.ChainReader(path)
    merged = [e for e in reader.state.delta_entries() if any(s.base != s.step - 1 for s in e.steps)]
    assert [s.step for e in merged for s in e.steps] == [4, 8]
    assert {s.encoding for e in merged for s in e.slots} == ({"sub"} if version == "1.6" else {"xor"})
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")
    assert ldformat.validate(path, deep=True).ok


SCHEMA = {"model": [{"name": "w", "dtype": "float32", "shape": [4], "role": "parameter", "alias_of": None}],
          "optimizer": {"params": ["w"]}}


@pytest.mark.parametrize("encoding", ["xor", "sub"])
def test_state_slots_take_either_encoding(encoding: str) -> None:
    check_slots((SlotInfo(name="model/w", dtype="float32", shape=(4,), encoding=encoding),
                 SlotInfo(name="optimizer/0/exp_avg", dtype="float32", shape=(4,), encoding="sub")),
                SCHEMA, "state.xor", "batch")


@pytest.mark.parametrize(("kind", "name"), [("grad.dense", "grad/0"), ("grad.topk", "model/w"),
                                            ("grad.dense", "model/w")])
def test_gradient_kinds_refuse_sub_slots(kind: str, name: str) -> None:
    slot = SlotInfo(name=name, dtype="float32", shape=(4,), encoding="sub")
    with pytest.raises(CorruptChainError, match=r"has encoding 'sub'; a grad\.\w+ chain stores it as"):
        check_slots((slot,), SCHEMA, kind, "batch")


def test_writer_refuses_an_unknown_format_version(tmp_path: Path) -> None:
    with pytest.raises(ldformat.UsageError, match="1.6"):
        ldformat.ChainWriter.create(tmp_path / "c", TinyNet(), torch.optim.SGD(TinyNet().parameters(), lr=0.1),
                                    kind="state.xor", format_version="1.7")


@pytest.mark.parametrize("flushing", ["writer", "reader"])
def test_prediction_keeps_subnormals_in_a_thread_that_flushes_them(tmp_path: Path, flushing: str) -> None:
    """Spec §11.3.1: subnormals are kept whatever the thread's mode, or a writer and a reader in
    different modes would predict different bits; the thread's mode is put back afterwards."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e-37)  # weights and Adam state among the subnormals
    opt = torch.optim.AdamW(model.parameters(), lr=1e-38, eps=1e-40)
    path = tmp_path / "chain"
    refs: dict[int, dict] = {}
    try:
        torch.set_flush_denormal(flushing == "writer")
        writer = ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=2)
        for step in range(1, 5):
            opt.zero_grad()
            model(torch.full((2, 4), 1e-3)).sum().backward()
            opt.step()
            writer.record_step(step)
            refs[step] = snapshot(model, opt)
        writer.close()
        assert "adam.w" in _encodings(path)
        torch.set_flush_denormal(flushing == "reader")
        reader = ldformat.ChainReader(path)
        for step, ref in refs.items():
            assert_state_bits_equal(reader.materialize(step), ref, f"step {step}")
        still = np.array([1e-39], np.float32) * np.array([1.0], np.float32)
        assert (still[0] == 0) == (flushing == "reader"), "the thread's mode is restored"
    finally:
        torch.set_flush_denormal(False)


def test_a_failure_while_coding_a_row_stops_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base may have moved on for part of the row: a retry of the step would code the rest
    against the wrong base, so the writer refuses every later call until the chain is reopened."""
    import ldformat.chain.state_delta

    path = tmp_path / "chain"
    writer, refs = _train_chain(path, "1.6", steps=2, batch_steps=1)
    model, opt = writer.model, writer.optimizer
    calls = {"n": 0}
    real = ldformat.chain.state_delta.predict_parameter

    def fail_on_second(*args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("simulated allocation failure")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ldformat.chain.state_delta, "predict_parameter", fail_on_second)
    train_step(model, opt, 3)
    with pytest.raises(ldformat.ChainError, match="coding step 3 failed.*MemoryError"):
        writer.record_step(3)
    with pytest.raises(ldformat.ChainError, match="coding step 3 failed"):
        writer.record_step(3)  # the retry is refused, never coded against a half-moved base
    writer.abort()
    monkeypatch.undo()
    reader = ldformat.ChainReader(path)
    assert reader.latest_step == 2
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), refs[step], f"step {step}")


def test_adam_v_on_the_first_moment_is_refused() -> None:
    slot = SlotInfo(name="optimizer/0/exp_avg", dtype="float32", shape=(4,), encoding="adam.v")
    with pytest.raises(CorruptChainError, match="other than the first moment exp_avg"):
        check_slots((slot,), SCHEMA, "state.xor", "batch")


def test_by_parameter_groups_a_parameters_tensors_and_leaves_the_others_alone() -> None:
    """What the row coder parallelizes over (ldformat.format.predict.by_parameter): a parameter's
    weight and optimizer tensors in one group, the first index of a repeated name."""
    from ldformat.format.predict import by_parameter

    names = ["model/a", "model/bn.running_mean", "optimizer/0/exp_avg", "optimizer/1/exp_avg_sq", "model/b",
             "optimizer/0/step", "optimizer/1/exp_avg", "predict/1", "optimizer/ref/x"]
    assert by_parameter(names, ["a", "b", "a"]) == [
        ["model/a", "optimizer/0/exp_avg", "optimizer/0/step"], ["model/bn.running_mean"],
        ["optimizer/1/exp_avg_sq", "model/b", "optimizer/1/exp_avg"], ["predict/1"], ["optimizer/ref/x"]]
