"""The streaming batch encoder is byte-identical to encoding the whole batch with zarr at once."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.storage import MemoryStore

import ldformat
from ldformat.chain.captured import CapturedStep, CapturedTensor
from ldformat.format import delta
from ldformat.format.delta import (
    BatchEncoder,
    Segment,
    decode_batch,
    default_encode_threads,
    encode_batch,
    encode_pool,
)
from ldformat.format.dtypes import dtype_name
from ldformat.format.manifest import SlotInfo


# -- reference: the encoder before streaming (zarr writes each whole concatenated array) --------
def _reference_create(store: MemoryStore, name: str, data: np.ndarray, codec: dict[str, Any]) -> None:
    width = data.dtype.itemsize
    if data.ndim == 1:
        chunks: tuple[int, ...] = (max(1, min(data.shape[0], delta.CHUNK_BYTES // width)),)
    else:
        chunks = tuple(max(1, s) for s in data.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.create_array(
            store,
            name=name,
            data=data,
            chunks=chunks,
            compressors=[BloscCodec(typesize=width, **codec), Crc32cCodec()],
            fill_value=0,
            config={"write_empty_chunks": True},
        )


def reference_encode_batch(slots: list[SlotInfo], rows: list[dict[int, Segment]],
                           attributes: dict[str, Any], values: Any = None) -> dict[str, bytes]:
    counts = np.full((len(rows), len(slots)), -1, dtype=np.int64)
    index_parts: list[np.ndarray] = []
    value_parts: dict[int, list[np.ndarray]] = {}
    for r, row in enumerate(rows):
        for j in sorted(row):
            idx, vals = row[j]
            counts[r, j] = vals.shape[0]
            if idx is not None:
                gaps = np.empty(idx.shape[0], dtype=np.uint32)
                if idx.shape[0]:
                    gaps[0] = idx[0]
                    np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
                index_parts.append(gaps)
            value_parts.setdefault(vals.dtype.itemsize, []).append(vals)
    store = MemoryStore({})
    zarr.open_group(store, mode="w", attributes={"ldformat": attributes})
    _reference_create(store, "counts", counts, {"cname": "zstd", "clevel": 3, "shuffle": "shuffle"})
    if index_parts:
        _reference_create(store, "indices", np.concatenate(index_parts), delta.INDEX_CODECS)
    for width, parts in sorted(value_parts.items()):
        data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if data.shape[0]:
            _reference_create(store, f"values_u{width * 8}", data,
                              delta.VALUE_CODECS if values is None else values)
    return {key: buf.to_bytes() for key, buf in store._store_dict.items()}


@contextmanager
def chunk_bytes(n: int) -> Iterator[None]:
    """CHUNK_BYTES for both encoders (hypothesis refuses function-scoped fixtures)."""
    saved = delta.CHUNK_BYTES
    delta.CHUNK_BYTES = n
    try:
        yield
    finally:
        delta.CHUNK_BYTES = saved


def assert_same_objects(got: dict[str, bytes], want: dict[str, bytes]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


# -- generated batches ------------------------------------------------------------------------
WIDTH_TORCH = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}


def _values(draw: Any, width: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = delta.WIDTH_DTYPES[width]
    style = draw(st.sampled_from(["random", "zeros", "small"]))
    if style == "zeros":  # all-zero chunks must still be written
        return np.zeros(n, dtype)
    high = 4 if style == "small" else 2 ** (8 * width)
    return rng.integers(0, high, size=n, dtype=dtype)


@st.composite
def batches(draw: Any) -> tuple[list[SlotInfo], list[dict[int, Segment]]]:
    slots = []
    for j in range(draw(st.integers(0, 5))):
        width = draw(st.sampled_from(sorted(WIDTH_TORCH)))
        numel = draw(st.one_of(st.integers(0, 12), st.integers(0, 120)))
        encoding = draw(st.sampled_from(["sparse", "dense", "xor"]))
        slots.append(SlotInfo(name=f"s{j}", dtype=dtype_name(WIDTH_TORCH[width]), shape=(numel,), encoding=encoding))
    rows: list[dict[int, Segment]] = []
    for _ in range(draw(st.integers(0, 4))):
        row: dict[int, Segment] = {}
        for j, slot in enumerate(slots):
            if draw(st.integers(0, 3)) == 0:
                continue  # absent
            width = torch.empty(0, dtype=WIDTH_TORCH_BY_NAME[slot.dtype]).element_size()
            numel = slot.shape[0]
            if slot.encoding == "sparse":
                k = draw(st.integers(0, numel))
                idx = np.sort(np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(numel)[:k])
                row[j] = (idx.astype(np.int64), _values(draw, width, k))
            else:
                row[j] = (None, _values(draw, width, numel))
        rows.append(row)
    return slots, rows


WIDTH_TORCH_BY_NAME = {dtype_name(t): t for t in WIDTH_TORCH.values()}


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from([8, 24, 40, 64, 256, 8 << 20]), st.sampled_from([1, 2, 3]),
       st.sampled_from(["zstd", "lz4"]))
def test_streaming_encoder_matches_reference(batch: Any, chunk: int, threads: int, values: str) -> None:
    """Inline, and with chunks compressed on 2 or 3 threads; zstd values (gradients) and lz4
    values (differences): the same bytes as zarr's."""
    slots, rows = batch
    attributes = {"kind": "test", "first": 1, "last": len(rows)}
    codecs = delta.VALUE_CODECS if values == "zstd" else delta.DIFFERENCE_VALUE_CODECS
    with chunk_bytes(chunk):
        want = reference_encode_batch(slots, rows, attributes, codecs)
        encoder = BatchEncoder(encode_pool(threads), codecs)
        for row in rows:
            encoder.start_row()
            for j in sorted(row):
                encoder.add(j, row[j][1], row[j][0])
        got = encoder.finish(len(slots), attributes)
    assert_same_objects(got, want)
    decoded = decode_batch(got, tuple(slots), len(rows), "batch")
    for r, row in enumerate(rows):
        assert sorted(decoded.segments[r]) == sorted(row)
        for j, (idx, vals) in row.items():
            got_idx, got_vals = decoded.segments[r][j]
            assert got_vals.tobytes() == vals.tobytes() and got_vals.dtype == vals.dtype
            assert (got_idx is None) == (idx is None)
            if idx is not None:
                assert got_idx is not None and np.array_equal(got_idx, idx)


def test_many_chunks_in_flight_on_a_pool_keep_their_order() -> None:
    """More chunks than the pool holds in flight, from whole-chunk views and from the pending
    buffer: the chunk objects come out in order and the buffers are reused."""
    rng = np.random.default_rng(2)
    slots = [SlotInfo(name=f"s{j}", dtype="float32", shape=(n,), encoding="xor")
             for j, n in enumerate([7, 400, 9, 33, 250])]
    rows: list[dict[int, Segment]] = [
        {j: (None, rng.integers(0, 2**32, size=s.shape[0], dtype=np.uint32)) for j, s in enumerate(slots)}
        for _ in range(4)
    ]
    with chunk_bytes(64):
        want = reference_encode_batch(slots, rows, {"kind": "test"})
        got = encode_batch(slots, rows, {"kind": "test"}, encode_pool(3))
    assert len([k for k in got if k.startswith("values_u32/c/")]) > 4 * 3
    assert_same_objects(got, want)


def test_default_encode_threads_leave_cores_to_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cores, threads in [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (64, 8)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)), raising=False)
        assert default_encode_threads() == threads, cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    for local, threads in [("4", 2), ("8", 1), ("1", 8), ("", 8), ("x", 8)]:  # 16 cores shared by a job's ranks
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert default_encode_threads() == threads, local
    assert encode_pool(1) is None
    assert encode_pool(2) is encode_pool(2)


def test_segment_larger_than_several_chunks_and_offset_by_others() -> None:
    rng = np.random.default_rng(0)
    slots = [SlotInfo(name=f"s{j}", dtype="float32", shape=(n,), encoding="xor") for j, n in enumerate([5, 1000, 3])]
    rows: list[dict[int, Segment]] = [
        {j: (None, rng.integers(0, 2**32, size=s.shape[0], dtype=np.uint32)) for j, s in enumerate(slots)}
        for _ in range(3)
    ]
    with chunk_bytes(64):  # 16 elements per chunk: the middle segment covers ~60 chunks
        want = reference_encode_batch(slots, rows, {"kind": "test"})
        got = encode_batch(slots, rows, {"kind": "test"})
    assert len([k for k in got if k.startswith("values_u32/c/")]) == -(-3 * 1008 // 16)
    assert_same_objects(got, want)


def test_full_size_chunks_of_a_realistic_xor_delta() -> None:
    """Default 8 MiB chunks, a partial last chunk, float32 XORs of Adam-like changes."""
    rng = np.random.default_rng(1)
    state = rng.standard_normal(5_000_000, dtype=np.float32)
    after = state * (1 + np.float32(1e-3) * rng.standard_normal(state.shape[0], dtype=np.float32))
    xor = np.bitwise_xor(state.view(np.uint32), after.view(np.uint32))
    slots = [SlotInfo(name="a", dtype="float32", shape=(3_000_000,), encoding="xor"),
             SlotInfo(name="b", dtype="float32", shape=(2_000_000,), encoding="xor")]
    rows: list[dict[int, Segment]] = [{0: (None, xor[:3_000_000]), 1: (None, xor[3_000_000:])}]
    want = reference_encode_batch(slots, rows, {"kind": "test"})
    assert_same_objects(encode_batch(slots, rows, {"kind": "test"}), want)


def test_zero_rows_and_zero_slots() -> None:
    slots = [SlotInfo(name="a", dtype="float32", shape=(4,), encoding="dense")]
    for s in ([], slots):
        assert_same_objects(encode_batch(s, [], {"kind": "test"}), reference_encode_batch(s, [], {"kind": "test"}))
    assert_same_objects(BatchEncoder().finish(1, {"kind": "test"}), reference_encode_batch(slots, [], {"kind": "test"}))


@pytest.mark.parametrize("threads", [1, 2])
def test_caller_may_reuse_its_buffers_after_add(threads: int) -> None:
    buf = np.arange(50, dtype=np.uint16)
    slots = [SlotInfo(name="a", dtype="bfloat16", shape=(50,), encoding="dense")]
    with chunk_bytes(64):  # 32 elements per chunk: each add leaves a tail behind
        enc = BatchEncoder(encode_pool(threads))
        rows: list[dict[int, Segment]] = []
        for r in range(3):
            buf[:] = np.arange(50, dtype=np.uint16) * (r + 1)
            enc.start_row()
            enc.add(0, buf)
            rows.append({0: (None, buf.copy())})
        buf[:] = 0
        assert_same_objects(enc.finish(1, {"kind": "test"}), reference_encode_batch(slots, rows, {"kind": "test"}))


def test_segments_must_come_in_slot_order() -> None:
    enc = BatchEncoder()
    enc.start_row()
    enc.add(1, np.zeros(2, np.uint32))
    with pytest.raises(ValueError):
        enc.add(0, np.zeros(2, np.uint32))


# -- the writer feeds the encoder as steps arrive ---------------------------------------------
def _objects_of_batches(path: Path, writer: ldformat.ChainWriter) -> list[tuple[Any, dict[str, bytes]]]:
    out = []
    for entry in writer._state.delta_entries():
        out.append((entry, {o.path: (path / entry.path / o.path).read_bytes() for o in entry.objects}))
    return out


def reference_difference(new: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
    """Spec §11.3's ``sub`` values in Python integers: zigzag((new - prev) mod 2^W), where an
    absent base is all-zero bits."""
    width = 8 * new.dtype.itemsize
    out = []
    for i, x in enumerate(new.tolist()):
        d = (x - (0 if prev is None else int(prev[i]))) % (1 << width)
        signed = d - (1 << width) if d >= 1 << (width - 1) else d
        out.append(2 * signed if signed >= 0 else -2 * signed - 1)
    return np.array(out, dtype=new.dtype)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("kind", "version"), [("grad.dense", "1.6"), ("state.xor", "1.5"), ("state.xor", "1.6")])
def test_writer_batches_match_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str,
                                        version: str, threads: int) -> None:
    """Reused capture buffers, tensors in changing order, one appearing and one absent; a
    state.xor chain of format 1.5 stores XORs, one of 1.6 differences (spec §11.3). With
    ``encode_threads`` 3 the chunks are compressed on a pool: the same bytes."""
    monkeypatch.setattr(delta, "CHUNK_BYTES", 64)
    # The slots below are made up to exercise the encoder (names and dtypes no schema has), so the
    # writer's check that a reader would accept each slot is off here; the bytes are compared.
    monkeypatch.setattr("ldformat.chain.writer.check_slots", lambda *args: None)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "chain"
    writer = ldformat.ChainWriter.create(path, model, opt, kind=kind, batch_steps=3, capture_hook=False,
                                         format_version=version)
    writer.encode_threads = threads
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ldformat.UsageError, match="encode_threads must be a count"):
            writer.encode_threads = bad  # type: ignore[assignment]
    sub = kind == "state.xor" and version == "1.6"
    rng = np.random.default_rng(2)
    buffers = {"a": np.zeros(37, np.uint32), "b": np.zeros(10, np.uint16), "c": np.zeros(0, np.uint64),
               "d": np.zeros(70, np.uint8), "e": np.zeros(9, np.uint64)}
    dtypes = {"a": "float32", "b": "bfloat16", "c": "int64", "d": "uint8", "e": "float64"}
    orders = [["a", "b", "c"], ["c", "d", "a", "b"], ["b", "a", "e", "d"], ["d", "a", "b", "c", "e"], ["e", "a"]]
    sparse_idx = np.array([1, 4, 5, 9], np.int64)
    expected: list[dict[int, Segment]] = []
    names: dict[str, int] = {}
    base: dict[str, np.ndarray] = {}
    all_rows = []
    for step, order in enumerate(orders, start=1):
        tensors, row = {}, {}
        for n in order:
            b = buffers[n]
            b[:] = rng.integers(0, 2 ** (8 * b.itemsize), size=b.shape[0], dtype=b.dtype) // (1 + (step % 2) * 7)
            sparse = kind != "state.xor" and n == "b"
            vals = b[sparse_idx] if sparse else b
            indices = sparse_idx.copy() if sparse else None
            tensors[f"t/{n}"] = CapturedTensor(bits=vals, dtype=dtypes[n], shape=b.shape, indices=indices)
            j = names.setdefault(n, len(names))
            if kind == "state.xor":
                prev = base.get(n)
                if sub:
                    row[j] = (None, reference_difference(b, prev))
                else:
                    row[j] = (None, b.copy() if prev is None else np.bitwise_xor(b, prev))
                base[n] = b.copy()
            else:
                row[j] = (None if indices is None else indices.copy(), vals.copy())
        if kind == "state.xor":
            for n in [n for n in base if n not in order]:
                del base[n]
        writer.append(CapturedStep(step=step, stepped=True, hyper=None, param_groups=[], extra={}, tensors=tensors,
                                   scratch=True))
        expected.append(row)
        if len(expected) == 3:
            all_rows.append((names, expected))
            expected, names = [], {}
    writer.commit()
    all_rows.append((names, expected))
    batches = sorted(_objects_of_batches(path, writer), key=lambda eo: eo[0].steps[0].step)
    assert len(batches) == 2
    for (entry, objects), (slot_names, rows) in zip(batches, all_rows, strict=True):
        assert [s.name for s in entry.slots] == [f"t/{n}" for n in slot_names]
        if kind == "state.xor":
            assert {s.encoding for s in entry.slots} == ({"sub"} if sub else {"xor"})
        first, last = entry.steps[0].step, entry.steps[-1].step
        with chunk_bytes(64):
            want = reference_encode_batch(list(entry.slots), rows, {"kind": kind, "first": first, "last": last})
        assert_same_objects(objects, want)
    writer.close()


def test_xor_chain_with_small_chunks_replays_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Value chunks that span rows and tensors, through the writer and back through the reader."""
    from models import TinyNet, assert_state_bits_equal, snapshot, train_step

    monkeypatch.setattr(delta, "CHUNK_BYTES", 256)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    path = str(tmp_path / "chain")
    writer = ldformat.ChainWriter.create(path, model, opt, kind="state.xor", batch_steps=3)
    refs = {0: snapshot(model, opt)}
    for step in range(1, 8):
        train_step(model, opt, step)
        writer.record_step(step)
        refs[step] = snapshot(model, opt)
    writer.close()
    reader = ldformat.ChainReader(path)
    for step, ref in refs.items():
        assert_state_bits_equal(reader.materialize(step), ref, f"step {step}")
