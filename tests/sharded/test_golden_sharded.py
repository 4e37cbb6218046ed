"""Golden sharded chains of formats 1.3 and 1.4 (spec §20, §3.4): every reader must read them bit for bit.

``tests/golden/<version>/`` holds sharded chains written by ``tests/golden/make_golden_sharded.py``
(two ranks, one chain per kind: FSDP2 in 1.3; HSDP with a copy rank in 1.4) and, beside each,
the full live state of every step, gathered from the shards while the chain was written. The
tests never write into them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from paths import REPO, TESTS

import ldformat

GOLDEN_ROOT = TESTS / "golden"
VERSIONS = ("1.3", "1.4")
SPEC_SCHEMAS = REPO / "spec" / "schema"
INDEXES = {v: json.loads((GOLDEN_ROOT / v / "sharded.json").read_text()) for v in VERSIONS}
NAMES = [f"{v}/{name}" for v in VERSIONS for name in sorted(INDEXES[v]["chains"])]
GOLDEN = GOLDEN_ROOT  # chains by "<version>/<name>"


def info_of(name: str) -> dict[str, Any]:
    version, chain = name.split("/")
    return dict(INDEXES[version]["chains"][chain])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def load_expected(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


@pytest.mark.parametrize("version", VERSIONS)
def test_every_kind_has_a_sharded_golden_chain(version: str) -> None:
    index = INDEXES[version]
    assert {c["kind"] for c in index["chains"].values()} == set(ldformat.KINDS)
    assert index["format_version"] == version
    for name in index["chains"]:
        root = json.loads((GOLDEN_ROOT / version / name / "chain" / "sharded.json").read_text())
        assert root["format_version"] == version
        assert ("copies" in root) == (version == "1.4")  # 1.4: rank 1 is a copy of rank 0, and has no chain
        assert sorted(p.name for p in (GOLDEN_ROOT / version / name / "chain" / "ranks").iterdir()) == (
            ["00000"] if version == "1.4" else ["00000", "00001"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_materialize_every_step_bitwise(name: str) -> None:
    before = tree_digest(GOLDEN / name)
    info = info_of(name)
    reader = ldformat.open_reader(GOLDEN / name / "chain")
    assert isinstance(reader, ldformat.ShardedReader)
    assert (reader.kind, reader.world_size, reader.steps, reader.anchors) == (
        info["kind"], info["world_size"], info["steps"], info["anchors"])
    expected_steps = sorted(int(p.stem) for p in (GOLDEN / name / "expected").glob("*.safetensors"))
    assert expected_steps == [s for s in info["steps"] if s > 0]
    for step in expected_steps:
        tensors, meta = load_expected(GOLDEN / name / "expected" / f"{step}.safetensors")
        got = reader.materialize(step)
        where = f"{name} step {step}"
        assert got["step"] == step == int(meta["step"])
        assert list(got["model"]) == json.loads(meta["model_keys"]), where
        for key, value in got["model"].items():
            want = tensors[f"model.{key}"]
            assert value.dtype == want.dtype and value.shape == want.shape, f"{where}: model {key}"
            assert torch.equal(bits(value), bits(want)), f"{where}: model {key} differs in bits"
        got_opt = {f"optimizer.{i}.{k}": v for i, s in got["optimizer"]["state"].items()
                   for k, v in s.items() if isinstance(v, torch.Tensor)}
        want_opt = {k: v for k, v in tensors.items() if k.startswith("optimizer.")}
        assert sorted(got_opt) == sorted(want_opt), where
        for key, want in want_opt.items():
            assert torch.equal(bits(got_opt[key]), bits(want)), f"{where}: {key} differs in bits"
        tied = [k for k in got["model"] if got["model"][k] is got["model"].get("embed.weight")]
        assert tied == ["embed.weight", "head.weight"], f"{where}: tied weights are one tensor"
    assert tree_digest(GOLDEN / name) == before, "reading changed a golden file"


@pytest.mark.parametrize("name", NAMES)
def test_validate_deep(name: str) -> None:
    report = ldformat.validate(GOLDEN / name / "chain", deep=True)
    assert report.ok, [str(p) for p in report.problems]
    assert report.steps == len(info_of(name)["steps"])


def _validator(schema_name: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SPEC_SCHEMAS / schema_name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", NAMES)
def test_json_schemas(name: str) -> None:
    chain = GOLDEN / name / "chain"
    sharded, commit, root = _validator("sharded.schema.json"), _validator("commit.schema.json"), _validator(
        "root.schema.json")
    errors = [e.message for e in sharded.iter_errors(json.loads((chain / "sharded.json").read_text()))]
    assert not errors, errors
    records = sorted((chain / "commits").glob("*.json"))
    assert records
    for path in records:
        errors = [e.message for e in commit.iter_errors(json.loads(path.read_text()))]
        assert not errors, (path.name, errors)
    for rank_root in sorted(chain.glob("ranks/*/ldformat.json")):
        doc = json.loads(rank_root.read_text())
        assert doc["format_version"] == "1.3", "rank chains are written as 1.3 (spec §20.1)"
        errors = [e.message for e in root.iter_errors(doc)]
        assert not errors, (str(rank_root.relative_to(chain)), errors)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("1.4/")])
def test_copy_rank_state_and_extra(name: str) -> None:
    """A copy rank (spec §20.2 ``copies``) has rank 0's local state and its own RNG states,
    which rank chain 0 records under ``extra.ranks``."""
    reader = ldformat.open_reader(GOLDEN / name / "chain")
    assert isinstance(reader, ldformat.ShardedReader)
    assert dict(reader.root.copies) == {1: 0} and list(reader.ranks) == [0]
    step = reader.latest_step
    got = reader.materialize(step)
    assert same(got["rank_extra"][0], got["extra"])
    mine = got["extra"]["ranks"]["1"]
    assert same(got["rank_extra"][1]["rng"], mine["rng"]) and got["rank_extra"][1]["data"] == mine["data"]
    assert same(reader.extra_of(1, step), got["rank_extra"][1])


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(bits(a), bits(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("1.4/")])
@pytest.mark.filterwarnings("ignore::ldformat.ReplayEnvironmentWarning")
def test_a_replica_of_a_chain_with_copy_ranks(name: str, tmp_path: Path) -> None:
    """``sync`` copies ``sharded.json`` (its ``copies``), the rank chains that exist and the
    commit records (spec §20.12); a second sync copies nothing."""
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / name / "chain", src)
    report = ldformat.sync(src, tmp_path / "dst")
    assert report.sharded and len(report.ranks) == 1
    assert sorted(p.name for p in (tmp_path / "dst" / "ranks").iterdir()) == ["00000"]
    assert (tmp_path / "dst" / "sharded.json").read_bytes() == (src / "sharded.json").read_bytes()
    assert ldformat.validate(tmp_path / "dst", deep=True).ok
    a, b = ldformat.open_reader(src), ldformat.open_reader(tmp_path / "dst")
    assert a.steps == b.steps
    for step in a.steps:
        x, y = a.materialize(step), b.materialize(step)
        for key, value in x["model"].items():
            assert torch.equal(bits(value), bits(y["model"][key])), (step, key)
    assert ldformat.sync(src, tmp_path / "dst").objects_copied == 0
