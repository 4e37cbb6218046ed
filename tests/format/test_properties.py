"""Round-trip properties of the encodings and the records (hypothesis)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ldformat.errors import CorruptChainError
from ldformat.format import delta
from ldformat.format.checksum import verify_checksum, with_checksum
from ldformat.format.delta import decode_batch, encode_batch, segment_to_tensor, tensor_bits, xor_into
from ldformat.format.jsonvalue import canonical, decode, encode
from ldformat.format.manifest import AnchorEntry, DeltaEntry, ObjectRef, Record, SlotInfo, StepEntry

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.text(max_size=8),
    st.sampled_from([math.inf, -math.inf]),
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
        st.dictionaries(st.integers(0, 100), inner, max_size=3),
    ),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    """Equality that compares floats by bits and keeps tuple/list apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(json_values)
def test_json_values_round_trip_exactly(value: Any) -> None:
    data = encode(value)
    canonical(data)  # plain, strict JSON
    assert same(decode(data), value)


def test_nan_and_tensor_round_trip() -> None:
    v = decode(encode({"x": float("nan"), "t": torch.arange(5, dtype=torch.int16), "b": b"\x00\xff"}))
    assert math.isnan(v["x"]) and v["b"] == b"\x00\xff"
    assert torch.equal(v["t"], torch.arange(5, dtype=torch.int16))


@given(st.dictionaries(st.text(max_size=5), json_leaf, max_size=5))
def test_checksum_detects_any_change(doc: dict[str, Any]) -> None:
    signed = with_checksum({"body": encode(doc)})
    verify_checksum(signed, "doc")
    tampered = dict(signed, body={"changed": True, **signed["body"]})
    with pytest.raises(CorruptChainError):
        verify_checksum(tampered, "doc")


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


@st.composite
def batches(draw: Any) -> tuple[list[SlotInfo], list[dict[int, Any]], list[dict[int, torch.Tensor]]]:
    n_slots = draw(st.integers(1, 4))
    slots, shapes = [], []
    for j in range(n_slots):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))
        encoding = draw(st.sampled_from(["sparse", "dense", "xor"]))
        from ldformat.format.dtypes import dtype_name

        slots.append(SlotInfo(name=f"s{j}", dtype=dtype_name(dtype), shape=shape, encoding=encoding))
        shapes.append((dtype, shape))
    rows, dense_rows = [], []
    for _ in range(draw(st.integers(1, 3))):
        row, dense = {}, {}
        for j, (dtype, shape) in enumerate(shapes):
            if draw(st.booleans()) and draw(st.booleans()):
                continue  # absent
            seed = draw(st.integers(0, 2**31))
            g = torch.Generator().manual_seed(seed)
            t = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).to(torch.float64).to(dtype)
            if dtype.is_floating_point:
                t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            numel = t.numel()
            if slots[j].encoding == "sparse":
                k = draw(st.integers(0, numel))
                idx = torch.randperm(numel, generator=g)[:k].sort().values
                mask = torch.zeros(numel, dtype=torch.bool)
                mask[idx] = True
                flat = torch.where(mask, t.reshape(-1), torch.zeros((), dtype=dtype))
                t = flat.reshape(shape)
                row[j] = (idx.numpy().astype(np.int64), tensor_bits(t.reshape(-1)[idx]))
            else:
                row[j] = (None, tensor_bits(t))
            dense[j] = t
        rows.append(row)
        dense_rows.append(dense)
    return slots, rows, dense_rows


@settings(max_examples=40, deadline=None)
@given(batches())
def test_delta_batches_round_trip_bit_exactly(batch: Any) -> None:
    slots, rows, dense_rows = batch
    objects = encode_batch(slots, rows, {"kind": "test"})
    decoded = decode_batch(objects, tuple(slots), len(rows), "batch")
    for r, dense in enumerate(dense_rows):
        row = decoded.row(r)
        assert sorted(row) == sorted(slots[j].name for j in dense)
        for j, want in dense.items():
            got = segment_to_tensor(row[slots[j].name], slots[j])
            assert got.dtype == want.dtype and got.shape == want.shape
            assert tensor_bits(got).tobytes() == tensor_bits(want).tobytes()


class _CountingObjects(dict):  # type: ignore[type-arg]
    """A batch's objects that remember which keys were read."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(objects)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> bytes:
        self.read.add(key)
        return super().__getitem__(key)


@settings(max_examples=40, deadline=None)
@given(batches(), st.data())
def test_decoding_some_rows_reads_only_their_chunks(batch: Any, data: Any) -> None:
    slots, rows, dense_rows = batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta, "CHUNK_BYTES", 16)  # many chunks, so rows share and skip chunks
        objects = encode_batch(slots, rows, {"kind": "test"})
    first = data.draw(st.integers(0, len(rows) - 1))
    stop = data.draw(st.integers(first + 1, len(rows)))
    counting = _CountingObjects(objects)
    part = decode_batch(counting, tuple(slots), len(rows), "batch", range(first, stop))
    full = decode_batch(objects, tuple(slots), len(rows), "batch")
    for r in range(first, stop):
        got, want = part.row(r), full.row(r)
        assert sorted(got) == sorted(want)
        for name, (idx, vals) in want.items():
            assert vals.tobytes() == got[name][1].tobytes()
            assert (idx is None) == (got[name][0] is None)
            if idx is not None:
                assert np.array_equal(idx, got[name][0])
    with pytest.raises(KeyError):
        part.row(stop if stop < len(rows) else first - 1)
    # Exactly the chunks holding the wanted rows' elements were read (besides metadata and counts).
    expected = set()
    for array, width in [(f"values_u{w * 8}", w) for w in (1, 2, 4, 8)] + [("indices", 4)]:
        def elements(rs: list[dict[int, Any]], array: str = array, width: int = width) -> int:
            return sum(vals.shape[0] for row in rs for idx, vals in row.values()
                       if (array == "indices" and idx is not None)
                       or (array != "indices" and vals.dtype.itemsize == width))
        lo, hi = elements(rows[:first]), elements(rows[:stop])
        per_chunk = 16 // width
        if lo < hi:
            expected |= {f"{array}/c/{i}" for i in range(lo // per_chunk, -(-hi // per_chunk))}
    chunks_read = {k for k in counting.read if "/c/" in k and not k.startswith("counts/")}
    assert chunks_read == expected


@given(st.integers(0, 2**31), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_xor_is_its_own_inverse(seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(17, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(17, generator=g, dtype=torch.float64).to(dtype)
    delta = np.bitwise_xor(tensor_bits(a), tensor_bits(b))
    x = a.clone()
    xor_into(x, (None, delta))
    assert tensor_bits(x).tobytes() == tensor_bits(b).tobytes()


refs = st.builds(ObjectRef, path=st.from_regex(r"[a-z0-9]{1,6}(/[a-z0-9][a-z0-9.]{0,5}){0,2}", fullmatch=True),
                 size=st.integers(0, 2**40), crc32c=st.from_regex(r"[0-9a-f]{8}", fullmatch=True))


@st.composite
def records(draw: Any) -> Record:
    groups = [encode({"lr": draw(st.floats(0, 1)), "betas": (0.9, 0.999), "params": [0, 1]})]
    anchors = tuple(
        AnchorEntry(step=s, object=ObjectRef(path=f"anchors/{s}-{draw(refs).path.replace('/', '')}",
                                             size=draw(refs).size, crc32c=draw(refs).crc32c), param_groups=groups,
                    extra=encode(draw(st.dictionaries(st.text(max_size=3), json_leaf, max_size=2))))
        for s in draw(st.lists(st.integers(0, 100), max_size=2, unique=True))
    )
    steps = tuple(
        StepEntry(step=s + 1, base=s, row=i, stepped=draw(st.booleans()), hyper=groups, param_groups=groups, extra={})
        for i, s in enumerate(draw(st.lists(st.integers(0, 100), min_size=1, max_size=3, unique=True)))
    )
    delta = DeltaEntry(path="deltas/1-3-abcd", objects=tuple(draw(st.lists(refs, max_size=3))),
                       slots=(SlotInfo(name="grad/0", dtype="float32", shape=(3, 2), encoding="sparse"),),
                       rows=len(steps), steps=steps)
    return Record(seq=draw(st.integers(1, 10**6)), type=draw(st.sampled_from(["append", "snapshot"])),
                  prev=draw(st.one_of(st.none(), st.from_regex(r"[0-9a-f]{8}", fullmatch=True))),
                  time="2026-01-01T00:00:00.000Z", writer="host:1", reason="append", anchors=anchors,
                  deltas=(delta,))


@given(records())
def test_records_round_trip(record: Record) -> None:
    data = record.to_bytes()
    back = Record.from_bytes(data, "record")
    assert back.to_bytes() == data
    assert back.anchors == record.anchors and back.deltas == record.deltas


@settings(max_examples=30, deadline=None)
@given(batches(), st.data())
def test_direct_decoder_matches_zarr(batch: Any, data: Any) -> None:
    """Arrays in the 1.0 codec chain are decoded without zarr; zarr must agree on every row."""
    slots, rows, _ = batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta, "CHUNK_BYTES", data.draw(st.sampled_from([8, 24, 1 << 23])))
        objects = encode_batch(slots, rows, {"kind": "test"})
    first = data.draw(st.integers(0, len(rows) - 1))
    wanted = range(first, data.draw(st.integers(first + 1, len(rows))))
    assert delta.profile_arrays(objects, "batch") is not None
    direct = decode_batch(objects, tuple(slots), len(rows), "batch", wanted)
    from ldformat.format.delta import decode as decode_module

    real_checks, real_zarr, zarr_calls = decode_module.decode_batch_checks, decode_module._decode_with_zarr, []

    def checks_then_zarr(*args: Any) -> None:  # every check, then the path taken for other codec chains
        real_checks(*args)

    def counted_zarr(*args: Any) -> Any:
        zarr_calls.append(args)
        return real_zarr(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_module, "decode_batch_checks", checks_then_zarr)
        mp.setattr(decode_module, "_decode_with_zarr", counted_zarr)
        via_zarr = decode_batch(objects, tuple(slots), len(rows), "batch", wanted)
    assert zarr_calls, "the second decoding went through zarr"
    assert np.array_equal(direct.counts, via_zarr.counts)
    for r in wanted:
        a, b = direct.row(r), via_zarr.row(r)
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name][1].dtype == b[name][1].dtype and a[name][1].tobytes() == b[name][1].tobytes()
            assert (a[name][0] is None and b[name][0] is None) or np.array_equal(a[name][0], b[name][0])


def test_other_zarr_codecs_decode_through_zarr() -> None:
    """A batch whose arrays use another Zarr v3 codec chain is still read (spec §10.2)."""
    import zarr
    from zarr.codecs import Crc32cCodec, GzipCodec
    from zarr.storage import MemoryStore

    from ldformat.format.dtypes import dtype_name

    slots = (SlotInfo(name="s0", dtype=dtype_name(torch.float32), shape=(3,), encoding="dense"),)
    values = np.array([1.0, -2.5, 3.25], np.float32).view(np.uint32)
    store = MemoryStore({})
    zarr.open_group(store, mode="w", attributes={"ldformat": {"kind": "test"}})
    for name, arr in [("counts", np.array([[3]], np.int64)), ("values_u32", values)]:
        zarr.create_array(store, name=name, data=arr, chunks=arr.shape, compressors=[GzipCodec(), Crc32cCodec()],
                          fill_value=0)
    objects = {k: v.to_bytes() for k, v in store._store_dict.items()}
    assert delta.profile_arrays(objects, "batch") is None
    decoded = decode_batch(objects, slots, 1, "batch")
    assert decoded.row(0)["s0"][1].tobytes() == values.tobytes()


def test_direct_decoder_refuses_a_damaged_chunk() -> None:
    slots = [SlotInfo(name="s0", dtype="float32", shape=(4,), encoding="dense")]
    objects = encode_batch(slots, [{0: (None, np.arange(4, dtype=np.uint32))}], {"kind": "test"})
    damaged = dict(objects)
    chunk = bytearray(damaged["values_u32/c/0"])
    chunk[len(chunk) // 2] ^= 1
    damaged["values_u32/c/0"] = bytes(chunk)
    with pytest.raises(CorruptChainError, match="crc32c"):
        decode_batch(damaged, tuple(slots), 1, "batch")
