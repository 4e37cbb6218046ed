"""Golden chains (spec "Versioning and compatibility"): every reader must read them bit for bit.

``tests/golden/<format version>/`` holds chains written by ``tests/golden/make_golden.py`` and,
beside each, the live training state of every committed step. These tests never write into
the golden directories: a test that needs to change a chain works on a copy in ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from paths import REPO, TESTS

import ldformat
from ldformat.format.checksum import with_checksum
from ldformat.format.jsonvalue import canonical, decode, encode
from ldformat.format.manifest import Record

GOLDEN = TESTS / "golden"
SPEC_SCHEMAS = REPO / "spec" / "schema"
VERSIONS = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.json").is_file())
CHAINS = [
    (version, name)
    for version in VERSIONS
    for name in json.loads((GOLDEN / version / "golden.json").read_text())["chains"]
]
IDS = [f"{v}/{n}" for v, n in CHAINS]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes: unlike torch.equal, tells -0.0 from +0.0 and NaN payloads."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_structure(got: Any, want: Any, where: str) -> None:
    """Structural equality of decoded values: the same types (a tuple is not a list, an int not a
    float or a bool), dict keys in any order, floats and tensors bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert same_bits(got, want), f"{where}: tensors differ"
    elif isinstance(want, dict):
        assert len(got) == len(want) and set(map(repr, got)) == set(map(repr, want)), f"{where}: keys differ"
        for k, v in want.items():
            same_structure(got[k], v, f"{where}.{k!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: lengths differ"
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            same_structure(g, w, f"{where}[{j}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want) or got != got and want != want, where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def load_expected(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def json_text(value: Any) -> str:
    return canonical(encode(value)).decode()


def expected_steps(version: str, name: str) -> list[int]:
    return sorted(int(p.stem) for p in (GOLDEN / version / name / "expected").glob("*.safetensors"))


def test_golden_versions_present() -> None:
    assert ldformat.FORMAT_VERSION in VERSIONS, "the current format version has no golden chains"
    index = json.loads((GOLDEN / ldformat.FORMAT_VERSION / "golden.json").read_text())
    kinds = {c["kind"] for c in index["chains"].values()}
    assert kinds == set(ldformat.KINDS), "every delta kind needs a golden chain"


@pytest.mark.parametrize(("version", "name"), CHAINS, ids=IDS)
@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_materialize_every_step_bitwise(version: str, name: str) -> None:
    chain = GOLDEN / version / name / "chain"
    before = tree_digest(GOLDEN / version / name)
    info = json.loads((GOLDEN / version / "golden.json").read_text())["chains"][name]
    reader = ldformat.ChainReader(chain)
    assert reader.kind == info["kind"]
    assert reader.steps == info["steps"] == expected_steps(version, name)
    assert reader.anchors == info["anchors"]
    for step in reader.steps:
        tensors, meta = load_expected(GOLDEN / version / name / "expected" / f"{step}.safetensors")
        got = reader.materialize(step)
        where = f"{version}/{name} step {step}"
        assert got["step"] == step == int(meta["step"])
        # Model: state_dict order and every key, tied keys included.
        assert list(got["model"]) == json.loads(meta["model_keys"]), where
        for key, value in got["model"].items():
            assert same_bits(value, tensors[f"model.{key}"]), f"{where}: model {key} differs in bits"
        # Optimizer: exactly the stored per-parameter tensors.
        got_opt = {f"optimizer.{i}.{k}": v for i, s in got["optimizer"]["state"].items() if isinstance(s, dict)
                   for k, v in s.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        want_opt = {k for k in tensors if k.startswith("optimizer.")}
        assert set(got_opt) == want_opt, where
        for key, value in got_opt.items():
            assert same_bits(value, tensors[key]), f"{where}: {key} differs in bits"
        # From 1.2: the whole optimizer state_dict but param_groups, structurally (spec §3.4, §8.2).
        if "optimizer" in meta:
            want = decode(json.loads(meta["optimizer"]), where)
            same_structure({k: v for k, v in got["optimizer"].items() if k != "param_groups"}, want, where)
        assert json_text(got["optimizer"]["param_groups"]) == meta["param_groups"], where
        assert json_text(got["extra"]) == meta["extra"], where
        # Top-k residuals: only at anchors, and only those the writer stored.
        assert ("compressor" in got) == (meta["compressor"] == "present"), where
        want_res = {k[len("compressor."):]: v for k, v in tensors.items() if k.startswith("compressor.")}
        if "compressor" in got:
            assert sorted(got["compressor"]) == sorted(want_res), where
            for key, value in got["compressor"].items():
                assert same_bits(value, want_res[key]), f"{where}: residual {key} differs in bits"
        # Tied weights come back sharing one storage.
        if "head.weight" in got["model"]:
            assert got["model"]["head.weight"].data_ptr() == got["model"]["embed.weight"].data_ptr(), where
    assert tree_digest(GOLDEN / version / name) == before, "reading must never modify a chain"


@pytest.mark.parametrize(("version", "name"), CHAINS, ids=IDS)
@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_validate_deep(version: str, name: str) -> None:
    chain = GOLDEN / version / name / "chain"
    before = tree_digest(chain)
    report = ldformat.validate(chain, deep=True)
    assert report.ok, [str(p) for p in report.problems]
    assert all(d["max_ulps"] == 0 for d in report.drift)
    assert tree_digest(chain) == before


def _validators(names: tuple[str, ...] = ("root.schema.json", "record.schema.json")) -> list[Any]:
    jsonschema = pytest.importorskip("jsonschema")
    out = []
    for name in names:
        schema = json.loads((SPEC_SCHEMAS / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        out.append(jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()))
    return out


@pytest.mark.parametrize(("version", "name"), CHAINS, ids=IDS)
def test_json_schemas(version: str, name: str) -> None:
    root_validator, record_validator, segment_validator = _validators(
        ("root.schema.json", "record.schema.json", "segment.schema.json"))
    chain = GOLDEN / version / name / "chain"
    root = json.loads((chain / "ldformat.json").read_text())
    errors = [e.message for e in root_validator.iter_errors(root)]
    assert not errors, errors
    records = sorted((chain / "log").glob("*.json"))
    assert records
    for path in records:
        record = json.loads(path.read_text())
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in record_validator.iter_errors(record)]
        assert not errors, (path.name, errors)
    # Segments (1.5, spec §7.9): every one the records reference validates against its schema.
    referenced = {g["path"] for p in records for g in json.loads(p.read_text()).get("segments", [])}
    assert referenced <= {p.relative_to(chain).as_posix() for p in (chain / "segments").glob("*.json")}
    for segment in sorted(referenced):
        doc = json.loads((chain / segment).read_text())
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in segment_validator.iter_errors(doc)]
        assert not errors, (segment, errors)
    if tuple(map(int, version.split("."))) >= (1, 5):
        assert referenced, "from 1.5 on, golden chains hold segmented snapshots"


def _mutations(record: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool, bool]]:
    """(what, mutated record, whether format 1.0 accepts it, whether a JSON schema can tell)."""
    out: list[tuple[str, dict[str, Any], bool, bool]] = []

    def mutate(what: str, accepted: bool, change: Any, schema_can_tell: bool = True) -> None:
        doc = json.loads(json.dumps(record))
        change(doc)
        out.append((what, with_checksum(doc), accepted, schema_can_tell))

    mutate("ignorable unknown field", True, lambda d: d.update(future={"must_understand": False, "x": 1}))
    mutate("unknown field", False, lambda d: d.update(future=1))
    mutate("must-understand unknown field", False, lambda d: d.update(future={"must_understand": True}))
    mutate("unknown record type", False, lambda d: d.update(type="rewrite"))
    mutate("missing seq", False, lambda d: d.pop("seq"))
    mutate("string size", False, lambda d: d["deltas"][0]["objects"][0].update(size="12"))
    mutate("unsafe path", False, lambda d: d["deltas"][0].update(path="deltas/../../etc"))
    mutate("unknown slot encoding", False, lambda d: d["deltas"][0]["slots"][0].update(encoding="rle"))
    mutate("ignorable field in a slot", True,
           lambda d: d["deltas"][0]["slots"][0].update(codec={"must_understand": False}))
    mutate("stepped as int", False, lambda d: d["deltas"][0]["steps"][0].update(stepped=1))
    mutate("optimizer structure not an object", False, lambda d: d["deltas"][0]["steps"][0].update(optimizer=[]))
    # Relations between fields: the spec states them, only the reader checks them.
    mutate("base not before step", False, lambda d: d["deltas"][0]["steps"][0].update(base=9), False)
    mutate("row past rows", False, lambda d: d["deltas"][0]["steps"][0].update(row=d["deltas"][0]["rows"]), False)
    return out


def test_schema_agrees_with_reader() -> None:
    """The record schema accepts and rejects what the reader accepts and rejects."""
    _, record_validator = _validators()
    chain = GOLDEN / ldformat.FORMAT_VERSION / "grad.dense" / "chain"
    record_path = next(p for p in sorted((chain / "log").glob("*.json")) if json.loads(p.read_text())["deltas"])
    record = json.loads(record_path.read_text())
    for what, doc, accepted, schema_can_tell in _mutations(record):
        schema_ok = record_validator.is_valid(doc) if schema_can_tell else accepted
        try:
            Record.from_bytes(canonical(doc) + b"\n", what)
            reader_ok = True
        except ldformat.ChainError:
            reader_ok = False
        assert schema_ok == accepted, f"schema on {what}"
        assert reader_ok == accepted, f"reader on {what}"


@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_garbage_collection_removes_only_leftovers(tmp_path: Path) -> None:
    source = GOLDEN / ldformat.FORMAT_VERSION / "state.xor-leftovers"
    chain = tmp_path / "chain"
    shutil.copytree(source / "chain", chain)
    before = ldformat.ChainReader(chain)
    referenced = before.state.referenced_objects()
    plan = ldformat.compact(chain)
    assert plan.removed_objects, "the golden chain has an uncommitted delta group"
    # Besides that group: the records a snapshot superseded (from 1.5 on, spec §7.8).
    superseded = {f"log/{seq:012d}.json" for seq in range(1, before.state.first_seq)}
    assert all(p.startswith("deltas/5-6-") or p in superseded for p in plan.removed_objects), plan.removed_objects
    assert any(p.startswith("deltas/5-6-") for p in plan.removed_objects)
    assert not referenced & set(plan.removed_objects)
    reader = ldformat.ChainReader(chain)
    assert reader.steps == expected_steps(ldformat.FORMAT_VERSION, "state.xor-leftovers")
    for step in reader.steps:
        tensors, _ = load_expected(source / "expected" / f"{step}.safetensors")
        got = reader.materialize(step)
        for key, value in got["model"].items():
            assert same_bits(value, tensors[f"model.{key}"])


@pytest.mark.procs
def test_make_golden_still_runs(tmp_path: Path) -> None:
    """The generator works with the current writer (it checks its own chains bit for bit)."""
    out = tmp_path / "golden"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = subprocess.run(
            [sys.executable, str(GOLDEN / "make_golden.py"), str(out)], capture_output=True, text=True, timeout=600
        )
    assert result.returncode == 0, result.stderr[-2000:]
    index = json.loads((out / "golden.json").read_text())
    committed = json.loads((GOLDEN / ldformat.FORMAT_VERSION / "golden.json").read_text())
    assert index["format_version"] == ldformat.FORMAT_VERSION
    assert {n: c["steps"] for n, c in index["chains"].items()} == {
        n: c["steps"] for n, c in committed["chains"].items()
    }
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert total < 1_000_000
