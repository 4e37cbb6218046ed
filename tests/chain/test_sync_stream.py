"""``sync`` copies large objects of a local chain mapped and verified chunk by chunk, not read
into memory whole (so that an anchor goes to an object store in parts without a full-size
buffer): the replica is bit-exact, and a damaged source object is refused, named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from models import TinyNet, assert_state_bits_equal, snapshot, train_step

import ldformat
from ldformat import ChainReader, ChainWriter
from ldformat.chain import replicate
from ldformat.stores import LocalStore


def _chain(path: Path) -> dict[int, dict[str, object]]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    truth = {0: snapshot(model, optimizer)}
    with ChainWriter.create(path, model, optimizer, kind="state.xor", batch_steps=2, anchor_every=3) as writer:
        for step in range(1, 6):
            train_step(model, optimizer, step)
            writer.record_step(step)
            truth[step] = snapshot(model, optimizer)
    return truth


def test_large_objects_are_copied_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    truth = _chain(src)
    monkeypatch.setattr(replicate, "STREAM_BYTES", 1)  # every object counts as large here
    monkeypatch.setattr(replicate, "STREAM_CHUNK", 64)
    mapped: list[int] = []
    real_memmap = np.memmap

    def spy(*args: object, **kwargs: object) -> np.memmap:  # type: ignore[type-arg]
        m = real_memmap(*args, **kwargs)  # type: ignore[call-overload]
        mapped.append(len(m))
        return m  # type: ignore[no-any-return]

    monkeypatch.setattr(np, "memmap", spy)
    report = ldformat.sync(src, "memory://sync-stream")
    assert report.objects_copied == len(mapped) > 0
    reader = ChainReader("memory://sync-stream")
    for step, want in truth.items():
        assert_state_bits_equal(reader.materialize(step), want, f"step {step}")
    assert ldformat.validate("memory://sync-stream").ok


def test_a_damaged_large_object_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _chain(src)
    monkeypatch.setattr(replicate, "STREAM_BYTES", 1)
    store = LocalStore(src)
    victim = next(p for p in store.list("anchors") if p.endswith(".safetensors"))
    data = bytearray(store.read(victim))
    data[-1] ^= 0x01
    (src / victim).write_bytes(bytes(data))
    with pytest.raises(ldformat.CorruptChainError, match=rf"{victim}: crc32c mismatch"):
        ldformat.sync(src, tmp_path / "dst")
