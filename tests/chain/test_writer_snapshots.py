"""Snapshot records written by the writer itself (spec §7.8): opening a chain reads the newest
snapshot plus a bounded tail, and a snapshot never changes what the chain holds."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

from ldformat import ChainReader, ChainWriter, TopK, compact, truncate, validate
from ldformat.chain.records import log_sequence_numbers, read_log
from ldformat.chain.writer import SnapshotPolicy
from ldformat.errors import WriterIOError
from ldformat.stores import Fault, FaultyStore, LocalStore

# Small enough that a few steps make a snapshot due.
EAGER = SnapshotPolicy(ratio=0.5, min_bytes=0, min_records=3)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Torch on one thread here (tests/conftest.py)."""


def _writer(path: Path, kind: str, **kw: Any) -> tuple[ChainWriter, TinyNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    topk = TopK(ratio=0.25) if kind == "grad.topk" else None
    writer = ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk, batch_steps=2, **kw)
    writer.snapshot_policy = EAGER
    return writer, model, optimizer


def _train(writer: ChainWriter, model: TinyNet, optimizer: torch.optim.Optimizer, first: int, last: int,
           states: dict[int, dict[str, Any]]) -> None:
    topk = writer.compressor
    for step in range(first, last + 1):
        train_step(model, optimizer, step, compress=None if topk is None else topk.compress_)
        writer.record_step(step, extra={"step": step, "tag": [step, "x"]})
        states[step] = snapshot(model, optimizer)


def _record_types(path: Path) -> list[str]:
    records, _ = read_log(LocalStore(path), str(path))
    return [r.type for r in records]


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor", "grad.topk"])
def test_every_step_materializes_bit_exactly_with_writer_snapshots(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "chain"
    writer, model, optimizer = _writer(path, kind, anchor_every=7)
    states: dict[int, dict[str, Any]] = {0: snapshot(model, optimizer)}
    _train(writer, model, optimizer, 1, 24, states)
    writer.close()
    assert writer.snapshots >= 2
    reader = ChainReader(path)
    types = [r.type for r in reader.records]
    assert types[0] == "snapshot" and reader.records[0].reason == "snapshot"
    assert len(reader.records) <= 1 + 2 * EAGER.min_records + 2  # the tail is bounded
    assert reader.steps == list(range(25)) and reader.anchors == [0, 7, 14, 21]
    # Records below the previous snapshot were removed; the newest superseded ones are left.
    assert log_sequence_numbers(reader.store)[0] > 1
    for step, want in states.items():
        got = reader.materialize(step)
        assert_state_bits_equal(got, want, f"{kind} step {step}")
        assert got["extra"] == ({} if step == 0 else {"step": step, "tag": [step, "x"]})
    assert validate(path).ok


def test_reopened_writer_continues_and_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    writer, model, optimizer = _writer(path, "grad.dense")
    states: dict[int, dict[str, Any]] = {0: snapshot(model, optimizer)}
    _train(writer, model, optimizer, 1, 10, states)
    writer.close()
    writer = ChainWriter.open(path, model, optimizer, batch_steps=2)
    writer.snapshot_policy = EAGER
    _train(writer, model, optimizer, 11, 20, states)
    writer.close()
    reader = ChainReader(path)
    assert reader.steps == list(range(21))
    for step in (0, 5, 10, 11, 20):
        assert_state_bits_equal(reader.materialize(step), states[step], f"step {step}")


def test_no_snapshot_without_a_policy(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    writer, model, optimizer = _writer(path, "grad.dense")
    writer.snapshot_policy = None
    _train(writer, model, optimizer, 1, 12, {})
    writer.close()
    assert set(_record_types(path)) == {"append"} and writer.snapshots == 0


def test_inline_snapshot_larger_than_max_bytes_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    writer, model, optimizer = _writer(path, "grad.dense", format_version="1.4")  # no segments before 1.5
    writer.snapshot_policy = SnapshotPolicy(ratio=0.5, min_bytes=0, min_records=3, max_bytes=1)
    _train(writer, model, optimizer, 1, 12, {})
    writer.close()
    assert set(_record_types(path)) == {"append"}


@pytest.mark.parametrize("when", ["before", "after"])
def test_failed_snapshot_record_loses_nothing(tmp_path: Path, when: str) -> None:
    """Creating the snapshot record fails (before: nothing visible; after: linked, then the
    directory sync fails): the chain holds every committed step either way, and a reopened
    writer continues from it."""
    path = tmp_path / "chain"
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = FaultyStore(LocalStore(path), armed=False)
    writer = ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=2, store=store)
    writer.snapshot_policy = None
    states: dict[int, dict[str, Any]] = {0: snapshot(model, optimizer)}
    _train(writer, model, optimizer, 1, 9, states)  # step 9 is pending, not committed
    store.add(Fault(ops=("create_exclusive",), path="log/*", error=errno.EIO, when=when, times=2))
    store.arm()
    with pytest.raises(WriterIOError):
        writer.write_snapshot()  # commits step 9 first: that record fails
    writer.abort()
    store.clear()
    assert _record_types(path).count("snapshot") == 0
    reader = ChainReader(path)
    assert reader.latest_step == (9 if when == "after" else 8)
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), states[step], f"step {step}")

    # Now let the append succeed and the snapshot fail.
    writer = ChainWriter.open(path, model, optimizer, batch_steps=2, store=store)
    writer.snapshot_policy = None
    latest = reader.latest_step
    reader.load_into(model, optimizer)
    _train(writer, model, optimizer, latest + 1, latest + 4, states)
    writer.commit()
    store.add(Fault(ops=("create_exclusive",), path="log/*", error=errno.EIO, when=when, times=1))
    with pytest.raises(WriterIOError):
        writer.write_snapshot()
    writer.abort()
    store.clear()
    reader = ChainReader(path)
    assert reader.steps == list(range(latest + 5))
    assert [r.type for r in reader.records][-1] == ("snapshot" if when == "after" else "append")
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), states[step], f"step {step}")
    assert validate(path).ok
    writer = ChainWriter.open(path, model, optimizer, batch_steps=2)
    writer.snapshot_policy = EAGER
    _train(writer, model, optimizer, latest + 5, latest + 12, states)
    writer.close()
    reader = ChainReader(path)
    assert reader.steps == list(range(latest + 13))
    assert_state_bits_equal(reader.materialize(latest + 12), states[latest + 12])


def test_compact_truncate_validate_on_a_chain_with_writer_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "chain"
    writer, model, optimizer = _writer(path, "state.xor", anchor_every=10)
    states: dict[int, dict[str, Any]] = {0: snapshot(model, optimizer)}
    _train(writer, model, optimizer, 1, 30, states)
    writer.close()
    assert "snapshot" in _record_types(path)
    assert validate(path, deep=True).ok
    plan = compact(path, max_replay=4, keep_last=12, keep_every=5)
    assert plan.committed
    reader = ChainReader(path)
    for step in reader.steps:
        assert_state_bits_equal(reader.materialize(step), states[step], f"compacted step {step}")
    assert truncate(path, 25) == [26, 27, 28, 29, 30]
    reader = ChainReader(path)
    assert reader.latest_step == 25
    assert_state_bits_equal(reader.materialize(25), states[25])
    assert validate(path).ok
