"""Bounded decoding (spec §6.4, §10.2, §10.3, §10.5, §21.4): hostile sizes are refused before allocating.

Each hostile chain is a copy of a golden chain with one thing changed and every checksum
recomputed, so that only the bounds can refuse it. They are read in a child process whose
address space is limited (``RLIMIT_AS``) to what it uses after importing torch plus
``BUDGET``: a normal read of these small chains fits with room to spare (checked by the
control case), a decode that allocates what a hostile size declares does not. Every read must
end in an ldformat error naming the file, never ``MemoryError`` or a traceback.

The in-process tests cover each check of :func:`ldformat.format.delta.check_slots` and of
:func:`ldformat.format.delta.decode_batch` on its own, and that decoding some rows of a batch agrees
with decoding all of them.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crash_writer import child_env
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs import Blosc
from test_json_strict import copy_chain, golden_chain, last_record, rewrite_log

from ldformat import ChainReader, CorruptChainError
from ldformat.format import delta as delta_module
from ldformat.format.checksum import object_checksum, with_checksum
from ldformat.format.delta import MAX_COUNTS, check_slots, decode_batch, encode_batch
from ldformat.format.jsonvalue import MAX_INLINE_TENSOR_BYTES, MAX_RECORD_BYTES, canonical
from ldformat.format.manifest import SlotInfo

BUDGET = 1 << 30  # address space a child may add to what it maps after importing torch and ldformat
TOPK_BATCH = "deltas/1-3-8f811365"  # rows 0-2 = steps 1-3 of the golden grad.topk chain (spec §22)

# The child: imports torch once, then forks one process per job, limits its address space
# and runs the job's operations; prints one JSON line per job.
RUNNER = r"""
import json, os, resource, sys, traceback, warnings
warnings.simplefilter("ignore")
import torch
import ldformat
try:  # what the first replayed optimizer step imports, once here instead of in every child
    import torch._dynamo
except ImportError:
    pass

def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

def run(job):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_size() + job["budget"]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    results = []
    for op in job["ops"]:
        try:
            if op == "open":
                ldformat.ChainReader(job["chain"])
            elif op.startswith("materialize:"):
                ldformat.ChainReader(job["chain"]).materialize(int(op.split(":")[1]))
            elif op == "validate":
                report = ldformat.validate(job["chain"])
                if not report.ok:
                    results.append(["problem", op, str(report.problems[0])])
                    continue
            results.append(["ok", op, ""])
        except ldformat.LdformatError as e:
            results.append(["ldformat", op, type(e).__name__ + ": " + str(e)])
        except MemoryError:
            results.append(["memory", op, traceback.format_exc()])
        except BaseException:
            results.append(["other", op, traceback.format_exc()])
    return results

jobs = json.loads(sys.argv[1])
for job in jobs:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = run(job)
        except BaseException:
            out = [["other", "setup", traceback.format_exc()]]
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"name": job["name"], "status": status, "results": json.loads(data) if data else None}))
    sys.stdout.flush()
"""


# -- editing golden chains ----------------------------------------------------------------------
def set_object(chain: Path, group: str, key: str, data: bytes) -> None:
    """Replace a batch object and make every record reference it with its new size and checksum."""
    (chain / group / key).write_bytes(data)
    crc = object_checksum(f"{group}/{key}", data)

    def change(doc: dict[str, Any]) -> None:
        for d in doc["deltas"]:
            if d["path"] == group:
                for o in d["objects"]:
                    if o["path"] == key:
                        o["size"], o["crc32c"] = len(data), crc

    rewrite_log(chain, change)


def set_slot(chain: Path, group: str, name: str, **fields: Any) -> None:
    def change(doc: dict[str, Any]) -> None:
        for d in doc["deltas"]:
            if d["path"] == group:
                for s in d["slots"]:
                    if s["name"] == name:
                        s.update(fields)

    rewrite_log(chain, change)


def chunk(data: bytes) -> bytes:
    """A chunk as the crc32c codec stores it: the bytes, then their crc32c (little-endian)."""
    import google_crc32c

    return data + int(google_crc32c.value(data)).to_bytes(4, "little")


def counts_chunk(counts: np.ndarray) -> bytes:
    return chunk(Blosc(cname="zstd", clevel=3, shuffle=Blosc.SHUFFLE).encode(np.ascontiguousarray(counts)))


def read_counts(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(Blosc().decode(raw[:-4]), np.int64).reshape(shape).copy()


_BOMB: list[bytes] = []


def blosc_bomb() -> bytes:
    """1.5 GiB of zeros as an 87 KB blosc frame (made once)."""
    if not _BOMB:
        zeros = np.zeros(3 << 29, np.uint8)
        _BOMB.append(Blosc(cname="zstd", clevel=9, shuffle=Blosc.NOSHUFFLE).encode(zeros))
    return _BOMB[0]


def hostile_chains(tmp_path: Path) -> dict[str, tuple[Path, list[str], str]]:
    """name -> (chain, operations, what the error must say) for every hostile case, plus the control."""
    out: dict[str, tuple[Path, list[str], str]] = {}

    def make(name: str, kind: str = "grad.topk") -> Path:
        return copy_chain(kind, tmp_path / name)

    out["control"] = (make("control"), ["materialize:2", "validate"], "")

    chain = make("sparse-count")  # grad/0 (128 elements) claims 2^29 stored elements in row 0
    raw = (chain / TOPK_BATCH / "counts/c/0/0").read_bytes()
    counts = read_counts(raw, (3, 9))
    counts[0, 0] = 1 << 29
    set_object(chain, TOPK_BATCH, "counts/c/0/0", counts_chunk(counts))
    out["sparse-count"] = (chain, ["materialize:1", "validate"], "counts of grad/0 (row 0) is 536870912")

    chain = make("sparse-shape")  # a sparse slot of 2^29 float32 elements: a 2 GiB zero fill
    set_slot(chain, TOPK_BATCH, "grad/0", shape=[1 << 29])
    out["sparse-shape"] = (chain, ["materialize:1", "validate"], "slot 'grad/0' is float32 [536870912]")

    chain = make("huge-shape")  # a 4 TiB torch.zeros
    set_slot(chain, TOPK_BATCH, "grad/0", shape=[1 << 20, 1 << 20])
    out["huge-shape"] = (chain, ["materialize:1", "validate"], "the schema says float32 [16, 8]")

    chain = make("xor-state-shape", "state.xor")
    group = next(d["path"] for d in json.loads(last_record(chain).read_bytes())["deltas"] if d["path"].startswith(
        "deltas/3-"))
    set_slot(chain, group, "optimizer/0/exp_avg", shape=[1 << 40])
    out["xor-state-shape"] = (chain, ["materialize:3", "validate"], "more elements than the")

    chain = make("blosc-bomb")  # an 87 KB chunk that decompresses to 1.5 GiB
    set_object(chain, TOPK_BATCH, "values_u32/c/0", chunk(blosc_bomb()))
    out["blosc-bomb"] = (chain, ["materialize:1", "validate"], "declares 1610612736 decompressed bytes")

    chain = make("huge-record")  # canonical, with a valid checksum: only the size limit refuses it
    path = last_record(chain)
    doc = json.loads(path.read_bytes())
    doc["deltas"][0]["steps"][0]["extra"]["pad"] = ""
    pad = MAX_RECORD_BYTES + 1 - len(canonical(with_checksum(doc)) + b"\n")
    doc["deltas"][0]["steps"][0]["extra"]["pad"] = "x" * pad
    path.write_bytes(canonical(with_checksum(doc)) + b"\n")
    assert path.stat().st_size == MAX_RECORD_BYTES + 1
    out["huge-record"] = (chain, ["open", "validate"], f"more than the {MAX_RECORD_BYTES}")

    chain = make("oversize-tensor")
    path = last_record(chain)
    doc = json.loads(path.read_bytes())
    size = MAX_INLINE_TENSOR_BYTES + 1
    doc["deltas"][0]["steps"][0]["extra"]["rng"] = {
        "$tensor": {"dtype": "uint8", "shape": [size], "data": base64.b64encode(bytes(size)).decode()}}
    path.write_bytes(canonical(with_checksum(doc)) + b"\n")
    out["oversize-tensor"] = (chain, ["open", "validate"], "$tensor")
    return out


def run_limited(jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    env = {**child_env(), "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return {(line := json.loads(text))["name"]: line for text in proc.stdout.splitlines()}


@pytest.mark.procs
def test_hostile_chains_fail_cleanly_under_a_memory_limit(tmp_path: Path) -> None:
    cases = hostile_chains(tmp_path)
    results = run_limited([{"name": name, "chain": str(chain), "ops": ops, "budget": BUDGET}
                           for name, (chain, ops, _) in cases.items()])
    assert sorted(results) == sorted(cases)
    for name, (chain, ops, fragment) in cases.items():
        got = results[name]
        assert got["status"] == 0, (name, got)
        assert [r[1] for r in got["results"]] == ops, (name, got)
        for outcome, op, message in got["results"]:
            if name == "control":
                assert outcome == "ok", (name, op, message)
                continue
            if op == "validate":  # the report names the problem
                assert outcome == "problem", (name, op, message)
            else:
                assert outcome == "ldformat", (name, op, message)  # never MemoryError or a traceback
                assert "CorruptChainError" in message or "FormatError" in message, (name, op, message)
                assert str(chain) in message, (name, op, message)
            assert fragment in message, (name, op, fragment, message)


# -- check_slots ----------------------------------------------------------------------------------
def golden_schema(kind: str) -> dict[str, Any]:
    root = json.loads((golden_chain(kind) / "ldformat.json").read_bytes())
    schema: dict[str, Any] = root["schema"]
    return schema


def slot(name: str, dtype: str = "float32", shape: tuple[int, ...] = (16, 8), encoding: str = "sparse") -> SlotInfo:
    return SlotInfo(name=name, dtype=dtype, shape=shape, encoding=encoding)


def test_the_slots_of_every_golden_batch_pass() -> None:
    for kind in ("grad.dense", "grad.topk", "state.xor"):
        reader = ChainReader(golden_chain(kind))
        for entry in reader.state.delta_entries():
            check_slots(entry.slots, reader.root.schema, kind, entry.path)


@pytest.mark.parametrize("kind, slots, why", [
    ("grad.topk", [slot("grad/0"), slot("grad/0")], "appears twice"),
    ("grad.topk", [slot("grad/0", dtype="complex128")], "not one of spec §5.6.4"),
    ("grad.topk", [slot("grad/0", encoding="dense")], "a grad.topk chain stores it as 'sparse'"),
    ("grad.dense", [slot("grad/0")], "a grad.dense chain stores it as 'dense'"),
    ("grad.topk", [slot("optimizer/0/exp_avg", encoding="xor")], "not a slot name a grad.topk chain uses"),
    ("state.xor", [slot("grad/0", encoding="xor")], "not a slot name a state.xor chain uses"),
    ("grad.topk", [slot("compressor/embed.weight")], "not a slot name"),
    ("grad.topk", [slot("grad/")], "not a slot name"),
    ("grad.topk", [slot("grad/6")], "names no optimizer parameter"),
    ("grad.topk", [slot("grad/00")], "names no optimizer parameter"),
    ("grad.topk", [slot("grad/-1")], "names no optimizer parameter"),
    ("grad.topk", [slot("grad/0", shape=(128,))], "the schema says float32 [16, 8]"),
    ("grad.topk", [slot("grad/0", shape=(1 << 40,))], "the schema says float32 [16, 8]"),
    ("grad.topk", [slot("grad/0", dtype="float64")], "the schema says float32 [16, 8]"),
    ("grad.topk", [slot("model/head.weight", encoding="dense")], "names no stored schema.model entry"),
    ("grad.topk", [slot("model/nope", encoding="dense")], "names no stored schema.model entry"),
    ("grad.topk", [slot("model/seen", dtype="uint8", shape=(4,), encoding="dense")], "the schema says bool [4]"),
    ("state.xor", [slot("optimizer/9/exp_avg", encoding="xor")], "names no optimizer parameter"),
    ("state.xor", [slot("optimizer/0/", encoding="xor")], "names no optimizer parameter"),
    ("state.xor", [slot("optimizer/0/exp_avg", shape=(1 << 40,), encoding="xor")], "more elements than the"),
    ("state.xor", [slot("optimizer/0/exp_avg", shape=(0, 1 << 62, 1 << 62), encoding="xor")], "more elements"),
])
def test_check_slots_refuses(kind: str, slots: list[SlotInfo], why: str) -> None:
    with pytest.raises(CorruptChainError) as info:
        check_slots(tuple(slots), golden_schema(kind), kind, "chain/deltas/x")
    assert str(info.value).startswith("chain/deltas/x: "), str(info.value)
    assert why in str(info.value)


@pytest.mark.parametrize("widen", [False, True])
def test_optimizer_slots_may_hold_a_matrix_over_all_parameters(widen: bool) -> None:
    """max(2^20, P^2) elements (spec §10.3): a preconditioner over the parameter elements fits."""
    schema = golden_schema("state.xor")
    if widen:  # P = 2^12: P^2 = 2^24 is above the floor
        first = next(e for e in schema["model"] if e["role"] == "parameter" and e["alias_of"] is None)
        first["shape"] = [(1 << 12) - sum(int(np.prod(e["shape"])) for e in schema["model"] if e is not first
                                          and e["role"] == "parameter" and e["alias_of"] is None)]
    total = sum(int(np.prod(e["shape"])) for e in schema["model"]
                if e["role"] == "parameter" and e["alias_of"] is None)
    bound = max(1 << 20, total * total)
    assert bound == (1 << 24 if widen else 1 << 20)
    for name in ("optimizer/0/big", "optimizer/ref/state/0/blocks/0/statistics/0"):
        check_slots((slot(name, shape=(2, bound // 2), encoding="xor"),), schema, "state.xor", "b")
        with pytest.raises(CorruptChainError, match=f"more elements than the {bound} "):
            check_slots((slot(name, shape=(bound + 1,), encoding="xor"),), schema, "state.xor", "b")


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("model"),
    lambda s: s["optimizer"].update(params="x"),
    lambda s: s["optimizer"]["params"].append("nope"),
    lambda s: s["model"][0].update(shape=[-1]),
    lambda s: s["model"][0].update(shape=[0, 1 << 62, 1 << 62]),
    lambda s: s["model"][0].update(dtype="complex128"),
    lambda s: s["model"].append(7),
])
def test_check_slots_refuses_a_malformed_schema(mutate: Callable[[dict[str, Any]], None]) -> None:
    schema = golden_schema("grad.topk")
    mutate(schema)
    with pytest.raises(CorruptChainError, match="schema"):
        check_slots((slot("grad/0"),), schema, "grad.topk", "b")


def test_the_reader_checks_slots_before_reading_the_batch(tmp_path: Path) -> None:
    chain = copy_chain("grad.topk", tmp_path)
    set_slot(chain, TOPK_BATCH, "grad/1", dtype="float32")  # bfloat16 in the schema
    for p in (chain / TOPK_BATCH).rglob("c/*"):  # nothing of the batch may be needed to refuse it
        if p.is_file():
            p.unlink()
    with pytest.raises(CorruptChainError, match="the schema says bfloat16") as info:
        ChainReader(chain).materialize(1)
    assert f"{chain}/{TOPK_BATCH}" in str(info.value)


# -- decode_batch -------------------------------------------------------------------------------
def small_batch() -> tuple[tuple[SlotInfo, ...], dict[str, bytes]]:
    slots = (SlotInfo(name="a", dtype="float32", shape=(6,), encoding="sparse"),
             SlotInfo(name="b", dtype="float32", shape=(3,), encoding="dense"),
             SlotInfo(name="c", dtype="bfloat16", shape=(2,), encoding="xor"))
    rows = [{0: (np.array([1, 4]), np.array([7, 8], np.uint32)), 1: (None, np.arange(3, dtype=np.uint32)),
             2: (None, np.array([5, 6], np.uint16))},
            {0: (np.array([0]), np.array([9], np.uint32))},
            {1: (None, np.arange(3, 6, dtype=np.uint32)), 2: (None, np.array([1, 2], np.uint16))}]
    return slots, encode_batch(list(slots), rows, {"kind": "test"})


def edit_metadata(objects: dict[str, bytes], name: str, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(objects[f"{name}/zarr.json"])
    change(meta)
    objects[f"{name}/zarr.json"] = json.dumps(meta).encode()


class Recording(dict):  # type: ignore[type-arg]
    def __init__(self, objects: Mapping[str, bytes]) -> None:
        super().__init__(objects)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> bytes:
        self.read.append(key)
        return super().__getitem__(key)


def test_small_batch_decodes() -> None:
    slots, objects = small_batch()
    batch = decode_batch(objects, slots, 3, "b")
    assert sorted(batch.row(0)) == ["a", "b", "c"] and sorted(batch.row(1)) == ["a"]
    assert batch.row(0)["a"][0].tolist() == [1, 4] and batch.row(2)["b"][1].tolist() == [3, 4, 5]


def chunk_grid_shape(meta: dict[str, Any], n: int, c: int) -> None:
    meta["shape"] = [n]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [c]


@pytest.mark.parametrize("name, change, why", [
    ("values_u32", lambda m: chunk_grid_shape(m, 1 << 40, 1 << 40), "has 1099511627776 elements; the counts"),
    ("values_u32", lambda m: chunk_grid_shape(m, 1 << 40, 1), "chunks; the commit record lists"),
    ("values_u32", lambda m: chunk_grid_shape(m, 11, 12), "does not fit shape"),
    ("values_u32", lambda m: chunk_grid_shape(m, 11, 0), "does not fit shape"),
    ("values_u32", lambda m: m.update(data_type="uint8"), "values_u32 is uint32"),
    ("indices", lambda m: m.update(data_type="int64"), "indices is uint32"),
    ("counts", lambda m: m.update(data_type="int32"), "counts is int64"),
    ("counts", lambda m: m.update(shape=[1 << 30, 3]), "counts has shape [1073741824, 3], expected [3, 3]"),
    ("values_u16", lambda m: m.update(shape=[4, 1], chunk_grid={"name": "regular", "configuration": {
        "chunk_shape": [4, 1]}}), "has 2 dimensions"),
    ("values_u32", lambda m: m.update(node_type="group"), "not Zarr v3 array metadata"),
    ("values_u32", lambda m: m["codecs"].insert(1, {"name": "sharding_indexed", "configuration": {}}),
     "decodes only bytes"),
    ("values_u32", lambda m: m["chunk_grid"].update(name="rectilinear"), "not a regular grid"),
])
def test_array_metadata_is_checked_before_decompressing(name: str, change: Callable[[dict[str, Any]], None],
                                                        why: str) -> None:
    slots, objects = small_batch()
    edit_metadata(objects, name, change)
    recorded = Recording(objects)
    with pytest.raises(CorruptChainError) as info:
        decode_batch(recorded, slots, 3, "b")
    assert why in str(info.value), str(info.value)
    assert not [k for k in recorded.read if "/c/" in k and not k.startswith("counts/")], recorded.read


def test_an_unknown_array_is_refused() -> None:
    slots, objects = small_batch()
    objects["extra/zarr.json"] = objects["values_u32/zarr.json"]
    with pytest.raises(CorruptChainError, match="not the metadata of a batch array"):
        decode_batch(objects, slots, 3, "b")


def test_metadata_json_is_parsed_strictly() -> None:
    slots, objects = small_batch()
    objects["values_u32/zarr.json"] = objects["values_u32/zarr.json"].replace(b'"zarr_format"', b'"x": NaN, '
                                                                                b'"zarr_format"', 1)
    with pytest.raises(CorruptChainError, match="b/values_u32/zarr.json: not valid JSON"):
        decode_batch(objects, slots, 3, "b")


def test_too_many_counts_are_refused_before_reading_anything() -> None:
    slots, objects = small_batch()
    recorded = Recording(objects)
    rows = MAX_COUNTS // 3 + 1
    with pytest.raises(CorruptChainError, match=f"exceed the {MAX_COUNTS} counts"):
        decode_batch(recorded, slots, rows, "b", range(0, 1))
    assert recorded.read == []


def replace_chunk(objects: dict[str, bytes], key: str, frame: bytes) -> None:
    objects[key] = chunk(frame)


def test_a_blosc_frame_declaring_another_size_is_refused_before_decompressing() -> None:
    slots, objects = small_batch()
    replace_chunk(objects, "values_u32/c/0", Blosc(cname="zstd").encode(np.zeros(1 << 20, np.uint32)))
    with pytest.raises(CorruptChainError, match="declares 4194304 decompressed bytes; its chunk shape gives 36"):
        decode_batch(objects, slots, 3, "b")


def test_a_blosc_header_lying_about_its_compressed_size_is_refused() -> None:
    slots, objects = small_batch()
    frame = bytearray(Blosc(cname="zstd").encode(np.arange(9, dtype=np.uint32)))
    frame[12:16] = (len(frame) + 100).to_bytes(4, "little")
    replace_chunk(objects, "values_u32/c/0", bytes(frame))
    with pytest.raises(CorruptChainError, match="malformed blosc header"):
        decode_batch(objects, slots, 3, "b")


def zarr_batch(codec: Any) -> tuple[tuple[SlotInfo, ...], dict[str, bytes]]:
    """A one-row batch whose arrays use ``codec`` then crc32c (decoded through zarr)."""
    import zarr
    from zarr.codecs import Crc32cCodec
    from zarr.storage import MemoryStore

    slots = (SlotInfo(name="s0", dtype="float32", shape=(1000,), encoding="dense"),)
    store = MemoryStore({})
    zarr.open_group(store, mode="w", attributes={"ldformat": {"kind": "test"}})
    for name, arr in [("counts", np.array([[1000]], np.int64)), ("values_u32", np.arange(1000, dtype=np.uint32))]:
        zarr.create_array(store, name=name, data=arr, chunks=arr.shape, compressors=[codec, Crc32cCodec()],
                          fill_value=0)
    return slots, {k: v.to_bytes() for k, v in store._store_dict.items()}


@pytest.mark.parametrize("which", ["gzip", "zstd"])
def test_other_codecs_decode_within_bounds(which: str) -> None:
    from zarr.codecs import GzipCodec, ZstdCodec

    slots, objects = zarr_batch(GzipCodec() if which == "gzip" else ZstdCodec())
    assert delta_module.profile_arrays(objects, "b") is None
    assert decode_batch(objects, slots, 1, "b").row(0)["s0"][1].tolist() == list(range(1000))


def test_a_gzip_bomb_is_refused_after_a_bounded_read() -> None:
    from zarr.codecs import GzipCodec

    slots, objects = zarr_batch(GzipCodec())
    c = zlib.compressobj(wbits=31)
    bomb = c.compress(bytes(64 << 20)) + c.flush()
    replace_chunk(objects, "values_u32/c/0", bomb)
    with pytest.raises(CorruptChainError, match="not one gzip member of at most 4000 decompressed bytes"):
        decode_batch(objects, slots, 1, "b")


def test_a_zstd_frame_without_content_size_is_refused() -> None:
    from zarr.codecs import ZstdCodec

    slots, objects = zarr_batch(ZstdCodec())
    frame = bytearray(objects["values_u32/c/0"][:-4])
    frame[4] &= 0x3F  # Frame_Content_Size_flag = 0, Single_Segment_flag kept: no content size
    if frame[4] & 0x20:
        frame[4] &= ~0x20 & 0xFF
    replace_chunk(objects, "values_u32/c/0", bytes(frame))
    with pytest.raises(CorruptChainError, match="values_u32/c/0"):
        decode_batch(objects, slots, 1, "b")


# -- counts, partial and full decoding -----------------------------------------------------------
def with_counts(objects: dict[str, bytes], shape: tuple[int, int], change: Callable[[np.ndarray], None]) -> None:
    counts = read_counts(objects["counts/c/0/0"], shape)
    change(counts)
    objects["counts/c/0/0"] = counts_chunk(counts)


@pytest.mark.parametrize("row, col, value, why", [
    (1, 0, 7, "counts of a (row 1) is 7; it must be at most 6 for a sparse slot"),
    (1, 0, 1 << 29, "counts of a (row 1) is 536870912"),
    (2, 1, 2, "counts of b (row 2) is 2; it must be -1 or 3 for a dense slot"),
    (0, 2, 0, "counts of c (row 0) is 0; it must be -1 or 2 for a xor slot"),
    (1, 1, -2, "counts of b (row 1) is -2"),
])
def test_every_count_is_checked_whatever_rows_are_decoded(row: int, col: int, value: int, why: str) -> None:
    slots, objects = small_batch()
    with_counts(objects, (3, 3), lambda c: c.__setitem__((row, col), value))
    for wanted in (None, range(0, 1), range(1, 2), range(2, 3), range(0, 0)):
        recorded = Recording(objects)
        with pytest.raises(CorruptChainError) as info:
            decode_batch(recorded, slots, 3, "b", wanted)
        assert why in str(info.value), (wanted, str(info.value))
        assert not [k for k in recorded.read if "/c/" in k and not k.startswith("counts/")], recorded.read


def test_arrays_longer_than_the_counts_are_refused_by_partial_and_full_decoding() -> None:
    slots, objects = small_batch()
    with_counts(objects, (3, 3), lambda c: c.__setitem__((2, 1), -1))  # 3 values left over at the end
    for wanted in (None, range(0, 1)):
        with pytest.raises(CorruptChainError, match="values_u32 has 9 elements; the counts of the batch give 6"):
            decode_batch(objects, slots, 3, "b", wanted)


def test_empty_tensors() -> None:
    """Slots of 0 elements: a sparse one stores 0 elements (k = 1 of nothing is refused), dense ones 0."""
    slots = (SlotInfo(name="e", dtype="float32", shape=(0,), encoding="sparse"),
             SlotInfo(name="f", dtype="int64", shape=(3, 0), encoding="dense"),
             SlotInfo(name="g", dtype="bool", shape=(), encoding="dense"))
    rows = [{0: (np.zeros(0, np.int64), np.zeros(0, np.uint32)), 1: (None, np.zeros(0, np.uint64)),
             2: (None, np.ones(1, np.uint8))}]
    objects = encode_batch(list(slots), rows, {"kind": "test"})
    batch = decode_batch(objects, slots, 1, "b")
    row = batch.row(0)
    assert row["e"][0] is not None and row["e"][0].shape == (0,) and row["f"][1].shape == (0,)
    tensor = delta_module.segment_to_tensor(row["e"], slots[0])
    assert tensor.shape == (0,)
    # top-k with k = 1 on an empty tensor: one index into nothing
    bad = encode_batch(list(slots), [{0: (np.zeros(1, np.int64), np.zeros(1, np.uint32))}], {"kind": "test"})
    for wanted in (None, range(0, 1)):
        with pytest.raises(CorruptChainError, match="counts of e .row 0. is 1; it must be at most 0"):
            decode_batch(bad, slots, 1, "b", wanted)


@st.composite
def corrupted_batches(draw: Any) -> tuple[tuple[SlotInfo, ...], dict[str, bytes], int]:
    n_slots = draw(st.integers(1, 4))
    slots = tuple(SlotInfo(name=f"s{j}", dtype=draw(st.sampled_from(["float32", "bfloat16", "uint8", "int64"])),
                           shape=(draw(st.integers(0, 9)),), encoding=draw(st.sampled_from(["sparse", "dense"])))
                  for j in range(n_slots))
    widths = {"float32": np.uint32, "bfloat16": np.uint16, "uint8": np.uint8, "int64": np.uint64}
    n_rows = draw(st.integers(1, 5))
    rows = []
    for _ in range(n_rows):
        row: dict[int, Any] = {}
        for j, s in enumerate(slots):
            if draw(st.booleans()):
                continue
            if s.encoding == "sparse":
                idx = np.array(sorted(draw(st.sets(st.integers(0, max(0, s.numel - 1)), max_size=s.numel))),
                               np.int64)
                row[j] = (idx, np.arange(len(idx)).astype(widths[s.dtype]))
            else:
                row[j] = (None, np.arange(s.numel).astype(widths[s.dtype]))
        rows.append(row)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta_module, "CHUNK_BYTES", 8)
        objects = encode_batch(list(slots), rows, {"kind": "test"})
    how = draw(st.sampled_from(["none", "count", "index", "gap"]))
    if how == "count":
        r, j = draw(st.integers(0, n_rows - 1)), draw(st.integers(0, n_slots - 1))
        value = draw(st.sampled_from([-2, slots[j].numel + 1, max(0, slots[j].numel - 1)]))
        with_counts(objects, (n_rows, n_slots), lambda c: c.__setitem__((r, j), value))
    elif how in ("index", "gap") and "indices/zarr.json" in objects:
        keys = sorted(k for k in objects if k.startswith("indices/c/"))
        key = draw(st.sampled_from(keys)) if keys else None
        gaps = np.frombuffer(Blosc().decode(objects[key][:-4]), np.uint32).copy() if key else np.zeros(0)
        if key and len(gaps):
            gaps[draw(st.integers(0, len(gaps) - 1))] = 0 if how == "gap" else 1 << 31
            objects[key] = chunk(Blosc(cname="zstd", typesize=4).encode(gaps))
    return slots, objects, n_rows


def outcome(objects: Mapping[str, bytes], slots: tuple[SlotInfo, ...], rows: int,
            wanted: range | None) -> tuple[str, Any]:
    try:
        batch = decode_batch(objects, slots, rows, "b", wanted)
    except CorruptChainError as e:
        return "error", str(e)
    return "ok", {r: {n: (None if i is None else i.tolist(), v.tobytes()) for n, (i, v) in batch.row(r).items()}
                  for r in (range(rows) if wanted is None else wanted)}


@settings(max_examples=150, deadline=None)
@given(corrupted_batches(), st.data())
def test_partial_decoding_agrees_with_full_decoding(batch: Any, data: Any) -> None:
    """Rows decoded alone equal the same rows decoded with all others; an error in their metadata,
    counts or their own segments is the same error. Only damage confined to other rows' elements
    goes unseen by a partial decode (a full check reads every object, spec §10.5)."""
    slots, objects, rows = batch
    first = data.draw(st.integers(0, rows - 1))
    wanted = range(first, data.draw(st.integers(first + 1, rows)))
    full, part = outcome(objects, slots, rows, None), outcome(objects, slots, rows, wanted)
    if full[0] == "ok":
        assert part[0] == "ok", part
        assert part[1] == {r: full[1][r] for r in wanted}
    elif part[0] == "error":
        assert part[1] == full[1], (part, full)
    else:  # the partial decode succeeded: the damage is in rows it did not decode
        bad_row = int(full[1].split(" (row ")[1].split(")")[0])
        assert bad_row not in wanted, (part, full)
        assert "counts of" not in full[1]
