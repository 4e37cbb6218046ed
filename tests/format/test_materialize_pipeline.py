"""The row-at-a-time replay pipeline (RowDecoder, numpy XOR) agrees bit for bit with decode_batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ldformat.errors import CorruptChainError
from ldformat.format import delta
from ldformat.format.delta import RowDecoder, Segment, decode_batch, encode_batch, xor_into
from ldformat.format.manifest import SlotInfo


def _batch(monkeypatch: pytest.MonkeyPatch, rows: int = 5) -> tuple[tuple[SlotInfo, ...], dict[str, bytes]]:
    # small chunks, so that rows straddle chunk boundaries and chunks lie wholly inside rows
    monkeypatch.setattr(delta, "CHUNK_BYTES", 4096)
    rng = np.random.default_rng(0)
    slots = tuple(SlotInfo(name=n, dtype=d, shape=s, encoding="xor") for n, d, s in [
        ("model/a", "float32", (700,)), ("model/b", "float16", (3, 300)), ("optimizer/0/exp_avg", "float32", (1500,))])
    data: list[dict[int, Segment]] = []
    for r in range(rows):
        row: dict[int, Segment] = {}
        for j, s in enumerate(slots):
            if r == 2 and j == 1:
                continue  # an absent slot
            width = 2 if s.dtype == "float16" else 4
            bits = rng.integers(0, 1 << (8 * width), s.numel, dtype=np.uint64)
            row[j] = (None, bits.astype(delta.WIDTH_DTYPES[width]))
        data.append(row)
    return slots, encode_batch(list(slots), data, {})


def test_rows_one_at_a_time_match_decode_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    slots, objects = _batch(monkeypatch)
    whole = decode_batch(objects, slots, 5, "batch")
    decoder = RowDecoder(objects, slots, 5, "batch", range(1, 5))
    kept = []
    for r in range(1, 5):
        row = decoder.row(r)
        expected = whole.row(r)
        assert sorted(row.row(r)) == sorted(expected)
        for name, (idx, vals) in row.row(r).items():
            assert idx is None and np.array_equal(vals, expected[name][1])
        kept.append({n: v.copy() for n, (_, v) in row.row(r).items()})
    with pytest.raises(KeyError):
        decoder.row(0)


def test_next_batch_reuses_the_buffers_without_touching_the_row_in_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that follows another takes its row buffers, going on with its turns: the last
    row of the previous batch (still being replayed) keeps its values while the next batch's
    first row is decoded, and that row lands in the buffer the previous batch used before."""
    slots, first = _batch(monkeypatch)
    _, second = _batch(monkeypatch, rows=3)
    decoder = RowDecoder(first, slots, 5, "first", range(3, 5))
    decoder.row(3)
    last = decoder.row(4).row(4)
    kept = {n: v.copy() for n, (_, v) in last.items()}
    follower = RowDecoder(second, slots, 3, "second", range(3), follows=decoder)
    row = follower.row(0).row(0)
    expected = decode_batch(second, slots, 3, "second").row(0)
    for name, (_, vals) in row.items():
        assert np.array_equal(vals, expected[name][1])
    for name, (_, vals) in last.items():  # not overwritten
        assert np.array_equal(vals, kept[name]), name
    assert follower._buffers is decoder._buffers  # no new memory for the second batch
    # without `follows`, a decoder starts with buffers of its own
    assert RowDecoder(second, slots, 3, "second", range(3))._buffers is not decoder._buffers


def test_damaged_chunk_fails_when_its_row_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    slots, objects = _batch(monkeypatch)
    key = sorted(k for k in objects if k.startswith("values_u32/c/"))[-1]
    damaged = bytearray(objects[key])
    damaged[20] ^= 0xFF
    decoder = RowDecoder({**objects, key: bytes(damaged)}, slots, 5, "batch", range(5))
    decoder.row(0)  # its chunks are intact
    with pytest.raises(CorruptChainError, match="crc32c"):
        for r in range(1, 5):
            decoder.row(r)


def test_declared_size_is_checked_before_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    slots, objects = _batch(monkeypatch)
    key = "values_u32/c/0"
    frame = bytearray(objects[key][:-4])
    frame[4:8] = (1 << 30).to_bytes(4, "little")  # nbytes in the blosc header
    import google_crc32c

    forged = bytes(frame) + int(google_crc32c.value(bytes(frame))).to_bytes(4, "little")
    decoder = RowDecoder({**objects, key: forged}, slots, 5, "batch", range(5))
    with pytest.raises(CorruptChainError, match="declares"):
        decoder.row(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.bool])
def test_xor_into_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, 2, (7, 9), generator=g).to(dtype) if dtype == torch.bool else \
        torch.randn(7, 9, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 255, (7, 9), generator=g).to(dtype)
    width = target.element_size()
    bits = np.random.default_rng(2).integers(0, 2 if dtype == torch.bool else 1 << (8 * width), target.numel(),
                                             dtype=np.uint64).astype(delta.WIDTH_DTYPES[width])
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    expected = target.view(view).reshape(-1) ^ torch.from_numpy(bits.view(delta.SIGNED_NP[width]))
    xor_into(target, (None, bits))
    assert torch.equal(target.view(view).reshape(-1), expected)
    with pytest.raises(ValueError):
        xor_into(target, (None, bits[:-1]))
