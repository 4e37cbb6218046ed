"""Compaction, retention and truncation (spec §16 "Truncation", §17 "Compaction and retention")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat


def build(tmp_path: Path, kind: str, steps: int = 12, batch_steps: int = 4) -> tuple[str, dict[int, Any]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    topk = ldformat.TopK(0.2) if kind == "grad.topk" else None
    path = str(tmp_path / "chain")
    refs = {0: snapshot(model, opt)}
    with ldformat.ChainWriter.create(path, model, opt, kind=kind, compressor=topk, batch_steps=batch_steps) as w:
        for s in range(1, steps + 1):
            train_step(model, opt, s, compress=topk.compress_ if topk else None)
            w.record_step(s)
            refs[s] = snapshot(model, opt)
    return path, refs


def files(path: str) -> dict[str, bytes]:
    """The chain's files, without the writer lock (not committed content, spec §15)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*")
            if p.is_file() and not str(p.relative_to(path)).startswith("lock/")}


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_retention_keeps_exactly_the_policy(tmp_path: Path, kind: str) -> None:
    path, refs = build(tmp_path, kind)
    plan = ldformat.compact(path, keep_last=3, keep_every=4)
    reader = ldformat.ChainReader(path)
    assert reader.steps == [0, 4, 8, 10, 11, 12]
    assert plan.dropped_steps == [1, 2, 3, 5, 6, 7, 9]
    if kind == "state.xor":
        # xor runs between kept steps are merged exactly instead of becoming anchors
        assert plan.merged_deltas == [(0, 4), (4, 8), (8, 10)]
        assert plan.new_anchors == []
    else:
        assert plan.new_anchors == [4, 8, 10]
    for s in reader.steps:
        assert_state_bits_equal(reader.materialize(s), refs[s], f"step {s}")
    assert ldformat.validate(path, deep=True).ok


def test_merged_xor_respects_max_replay(tmp_path: Path) -> None:
    path, refs = build(tmp_path, "state.xor")
    plan = ldformat.compact(path, keep_every=2, max_replay=2)
    reader = ldformat.ChainReader(path)
    for s in reader.steps:
        anchor, chain = reader.state.replay_path(s)
        assert len(chain) <= 2
        assert_state_bits_equal(reader.materialize(s), refs[s], f"step {s}")
    assert plan.merged_deltas and plan.new_anchors


def test_compact_is_idempotent_and_dry_run_changes_nothing(tmp_path: Path) -> None:
    path, refs = build(tmp_path, "grad.topk")
    before = files(path)
    plan = ldformat.compact(path, max_replay=3, dry_run=True)
    assert plan.new_anchors == [4, 8, 12] and not plan.committed
    assert files(path) == before
    ldformat.compact(path, max_replay=3)
    after = files(path)
    again = ldformat.compact(path, max_replay=3)
    assert not again.committed and not again.new_anchors and files(path) == after
    reader = ldformat.ChainReader(path)
    for s in reader.steps:
        assert_state_bits_equal(reader.materialize(s), refs[s], f"step {s}")


def test_reader_opened_before_compaction_still_reads(tmp_path: Path) -> None:
    path, refs = build(tmp_path, "grad.dense")
    reader = ldformat.ChainReader(path)  # holds the old view of the log
    ldformat.compact(path, max_replay=2, keep_last=5)
    assert_state_bits_equal(reader.materialize(12), refs[12], "stale reader")
    assert reader.steps == [8, 9, 10, 11, 12]


def test_truncate_then_append(tmp_path: Path) -> None:
    path, refs = build(tmp_path, "grad.dense", steps=8)
    removed = ldformat.truncate(path, after=5)
    assert removed == [6, 7, 8]
    reader = ldformat.ChainReader(path)
    assert reader.latest_step == 5
    torch.manual_seed(99)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    reader.load_into(model, opt, 5)
    with ldformat.ChainWriter.open(path, model, opt) as w:
        train_step(model, opt, 6)
        w.record_step(6)
    assert_state_bits_equal(ldformat.ChainReader(path).materialize(6), refs[6], "re-appended step 6")
    with pytest.raises(ldformat.StepNotFoundError):
        ldformat.truncate(path, after=40)


def test_compact_refuses_while_a_writer_is_live(tmp_path: Path) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = ldformat.ChainWriter.create(str(tmp_path / "c"), model, opt, kind="grad.dense")
    with pytest.raises(ldformat.ChainLockedError):
        ldformat.compact(str(tmp_path / "c"), max_replay=1)
    writer.close()
    ldformat.compact(str(tmp_path / "c"), max_replay=1)


def test_live_retention_never_passes_its_bound(tmp_path: Path) -> None:
    """The retention of ``max_bytes`` keeps every step from the newest anchor at or below its
    bound (a rank chain's: the sharded chain's newest committed step, spec §20.8)."""
    from ldformat.chain.lock import WriterLock
    from ldformat.chain.maintenance import retain_from_newest_anchor
    from ldformat.stores import open_store

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    path = str(tmp_path / "chain")
    refs = {0: snapshot(model, opt)}
    with ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=2, anchor_every=4) as w:
        for s in range(1, 11):
            train_step(model, opt, s)
            w.record_step(s)
            refs[s] = snapshot(model, opt)
    assert ldformat.ChainReader(path).anchors == [0, 4, 8]
    store = open_store(path)
    lock = WriterLock.acquire(store, path)
    try:
        assert retain_from_newest_anchor(path, store, lock, at_most=3)[0] == []  # only anchor 0 is at or below 3
        dropped, state = retain_from_newest_anchor(path, store, lock, at_most=7)
        assert dropped == [0, 1, 2, 3] and state.steps == list(range(4, 11))
    finally:
        lock.release()
    reader = ldformat.ChainReader(path)
    for s in reader.steps:
        assert_state_bits_equal(reader.materialize(s), refs[s], f"step {s}")
