"""The anchor write path: streamed bytes, overlapped checksum, LocalStore's gathered writes."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ldformat import ChainWriter, LocalStore
from ldformat.chain.validate import validate
from ldformat.format.anchor import anchor_parts, encode_anchor, write_anchor_parts
from ldformat.format.checksum import object_checksum
from ldformat.stores import local as local_module
from ldformat.stores.base import WRITEBACK_CHUNK, Part
from ldformat.stores.memory import MemoryStore


def mixed_tensors(big: int) -> dict[str, torch.Tensor]:
    """Many small tensors of every element size, and large ones crossing write chunks."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i in range(300):
        out[f"small/{i}"] = torch.randn(i % 7 + 1, generator=g).to([torch.float32, torch.float16, torch.int8][i % 3])
    out["big/a"] = torch.randn(big // 4 + 3, generator=g)
    out["big/b"] = torch.randint(0, 100, (big // 8 + 1,), generator=g, dtype=torch.int64)
    out["big/c"] = torch.randn(big // 2 + 1, generator=g).to(torch.bfloat16)
    out["empty"] = torch.empty(0, 3)
    out["flag"] = torch.tensor([True, False])
    return out


@pytest.mark.parametrize("big", [1000, 3 * WRITEBACK_CHUNK // 2])  # below and above the overlap threshold
def test_streamed_anchor_is_canonical(tmp_path: Path, big: int) -> None:
    tensors = mixed_tensors(big)
    joined = encode_anchor(tensors, 7)
    for store in (LocalStore(tmp_path), MemoryStore()):
        anchor = anchor_parts(tensors, 7)
        size, crc = anchor.size, write_anchor_parts(store, "anchors/7-x.safetensors", anchor)
        assert store.read("anchors/7-x.safetensors") == joined
        assert size == len(joined)
        assert crc == object_checksum("anchors/7-x.safetensors", joined)


class FailingStore(MemoryStore):
    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        raise OSError(28, "No space left on device")


def test_failed_write_raises_after_the_checksum_thread_ends() -> None:
    anchor = anchor_parts(mixed_tensors(WRITEBACK_CHUNK), 0)
    with pytest.raises(OSError, match="No space"):
        write_anchor_parts(FailingStore(), "anchors/0-x.safetensors", anchor)
    assert not [t for t in threading.enumerate() if t.name == "ldformat-anchor-crc32c"]


def test_gathered_writes_many_parts_and_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    parts: list[Part] = [rng.integers(0, 256, int(n), np.uint8) for n in rng.integers(0, 9, 3000)]
    parts += [rng.integers(0, 256, 2 * WRITEBACK_CHUNK + 5, np.uint8), b"", bytearray(b"tail"),
              np.arange(12, dtype=np.float64).reshape(3, 4)]
    expected = b"".join(memoryview(p).cast("B") if not isinstance(p, np.ndarray) else p.tobytes() for p in parts)
    store = LocalStore(tmp_path)
    store.write_parts("a/whole", parts)
    assert store.read("a/whole") == expected

    real, calls = os.writev, []

    def short_writev(fd: int, buffers: Sequence[memoryview]) -> int:  # at most 1000 bytes, mid-view
        calls.append(len(buffers))
        return real(fd, [b"".join(bytes(b) for b in buffers)[:1000]])

    monkeypatch.setattr(local_module.os, "writev", short_writev)
    store.write_parts("a/short", parts[:3000])
    assert store.read("a/short") == expected[: sum(len(memoryview(p).cast("B")) for p in parts[:3000])]
    assert calls and max(calls) <= local_module._IOV_MAX


def test_subclass_write_hook_still_sees_every_byte(tmp_path: Path) -> None:
    seen: list[int] = []

    class Hooked(LocalStore):
        def _write_fd(self, fd: int, data: memoryview) -> None:
            seen.append(len(data))
            super()._write_fd(fd, data)

    Hooked(tmp_path).write_parts("x", [b"ab", b"cde", np.zeros(10, np.uint8)])
    assert sum(seen) == 15 and (tmp_path / "x").read_bytes() == b"abcde" + bytes(10)


def test_writer_records_the_checksum_of_a_large_anchor(tmp_path: Path) -> None:
    model = torch.nn.Linear(1024, 1500)  # 6 MiB of parameters: the checksum overlaps the write
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = ChainWriter.create(tmp_path / "chain", model, opt, kind="state.xor", capture_hook=False)
    writer.close()
    report = validate(tmp_path / "chain", deep=True)
    assert report.ok, report.problems
