"""The commit log module (spec §7): records name themselves in errors, sizes are bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_lock import make_chain

import ldformat
from ldformat import ChainReader, CorruptChainError
from ldformat.chain.commit import commit_record
from ldformat.chain.records import log_path, read_log
from ldformat.errors import FormatError
from ldformat.format.checksum import with_checksum
from ldformat.format.jsonvalue import MAX_RECORD_BYTES, canonical
from ldformat.stores import LocalStore


def rewrite_record(path: Path, seq: int, change) -> Path:  # type: ignore[no-untyped-def]
    rel = path / log_path(seq)
    doc = json.loads(rel.read_text())
    doc.pop("checksum")
    change(doc)
    rel.write_bytes(canonical(with_checksum(doc)) + b"\n")
    return rel


def test_unsafe_path_error_names_the_record(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    seqs = sorted(int(p.stem) for p in (path / "log").glob("*.json"))
    rel = rewrite_record(path, seqs[-1], lambda d: d["deltas"][0].update(path="deltas/../../etc"))
    with pytest.raises(CorruptChainError) as info:
        ChainReader(path)
    assert rel.name in str(info.value) and "unsafe object path" in str(info.value)
    report = ldformat.validate(path)
    assert not report.ok and rel.name in str(report.problems[0])


def test_oversized_record_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    seqs = sorted(int(p.stem) for p in (path / "log").glob("*.json"))
    rel = path / log_path(seqs[-1])
    with rel.open("ab") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # sparse: no disk used
    store = LocalStore(path)
    reads: list[str] = []
    original = store.read
    monkeypatch.setattr(store, "read", lambda p: reads.append(p) or original(p))
    with pytest.raises(FormatError) as info:
        read_log(store, str(path))
    assert rel.name in str(info.value) and str(MAX_RECORD_BYTES) in str(info.value)
    assert log_path(seqs[-1]) not in reads, "the oversized record was read into memory"


def test_writer_refuses_a_record_readers_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "chain"
    make_chain(path)
    store = LocalStore(path)
    _, state = read_log(store, str(path))
    monkeypatch.setattr("ldformat.chain.commit.MAX_RECORD_BYTES", 100)
    with pytest.raises(ldformat.ChainError, match="more than the 100 readers accept"):
        commit_record(store, str(path), state, None, type="append", reason="append")
    monkeypatch.undo()
    assert ChainReader(path).records[-1].seq == state.last_seq


def test_non_canonical_record_is_refused_even_with_a_valid_checksum(tmp_path: Path) -> None:
    """Spec §7.1: a reader that re-serializes and one that compares bytes must agree."""
    path = tmp_path / "chain"
    make_chain(path)
    rel = path / log_path(1)
    doc = json.loads(rel.read_text())
    rel.write_text(json.dumps(doc, indent=1) + "\n")  # same members, same checksum, other bytes
    with pytest.raises(FormatError, match="not in canonical form"):
        read_log(LocalStore(path), str(path))
    assert not ldformat.validate(path).ok


def test_validate_checks_optimizer_state_shapes_in_anchors(tmp_path: Path) -> None:
    """An anchor of a gradient chain whose Adam moment has the wrong shape: validate says so
    (it used to pass plain validate and fail only in materialize)."""
    import safetensors.torch
    from test_lock import make_training, train

    from ldformat import ChainWriter
    from ldformat.format.checksum import object_checksum

    path = tmp_path / "chain"
    model, optimizer = make_training()
    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense")
    for s in (1, 2):
        train(model, optimizer, s)
        writer.record_step(s)
    writer.write_anchor(2)
    writer.close()
    assert ldformat.validate(path).ok
    seq = max(int(p.stem) for p in (path / "log").glob("*.json"))
    doc = json.loads((path / log_path(seq)).read_text())
    entry = next(a for a in doc["anchors"] if a["step"] == 2)
    obj = path / entry["object"]["path"]
    with safetensors.safe_open(str(obj), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = next(k for k in tensors if k.endswith("/exp_avg") and tensors[k].dim() == 2)
    tensors[name] = tensors[name].reshape(-1)[:-1].clone()  # one element short, 1-D
    safetensors.torch.save_file(tensors, str(obj), metadata=meta)
    data = obj.read_bytes()
    entry["object"].update(size=len(data), crc32c=object_checksum(entry["object"]["path"], data))
    rewrite_record(path, seq, lambda d: d.update(anchors=doc["anchors"]))
    report = ldformat.validate(path)
    assert not report.ok, "validate passed an anchor that replay cannot use"
    assert name in str(report.problems[0]) and "shape" in str(report.problems[0])
    with pytest.raises(CorruptChainError):
        ChainReader(path).materialize(2)
