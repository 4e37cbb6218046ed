"""Bytes on disk (per step, per delta kind, 1,000-step chains) and anchor write throughput."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .peers import flat_state, fsync_file
from .stats import human_bytes, table, verdict
from .workload import ModelSize, Trainer

CHAIN_STEPS = 1000


def full_checkpoint_bytes(trainer: Trainer, path: Path) -> int:
    """Size of one torch.save of model + optimizer state_dict (what a full checkpoint costs)."""
    torch.save(trainer.state_dict(), path)
    n = path.stat().st_size
    path.unlink()
    return n


def raw_state_bytes(trainer: Trainer) -> int:
    return sum(t.numel() * t.element_size() for t in flat_state(trainer.model, trainer.optimizer).values())


def chain_bytes(chain: str | os.PathLike[str]) -> dict[str, Any]:
    """Where a chain's bytes go: anchors, delta objects by array, log records; raw sizes of the deltas."""
    from ldformat import ChainReader, chain_info
    from ldformat.chain.records import log_path

    reader = ChainReader(chain)
    info = chain_info(reader).to_dict()  # what `ldtools info --json` prints
    state = reader.state
    by_array: dict[str, int] = {}
    raw_values = raw_indices = n_sparse = n_values = 0
    delta_steps = len(state.deltas)
    for entry in state.delta_entries():
        for o in entry.objects:
            key = o.path.split("/")[0] if "/" in o.path else "metadata"
            if o.path.endswith("zarr.json"):
                key = "metadata"
            by_array[key] = by_array.get(key, 0) + o.size
        batch = reader.load_batch(entry)
        for j, slot in enumerate(entry.slots):
            n = int(batch.counts[:, j].clip(min=0).sum())
            width = _width(slot.dtype)
            raw_values += n * width
            n_values += n
            if slot.encoding == "sparse":
                raw_indices += n * 4  # int32 index per kept element
                n_sparse += n
    # Segments (spec §7.9) hold the step entries that snapshot records restate: log metadata too.
    log_sizes = {p: reader.store.size(p) for p in reader.store.list("log") + reader.store.list("segments")}
    records = reader.records
    anchor_records = [r for r in records if r.anchors]
    delta_records = [r for r in records if r.deltas and not r.anchors]
    log_anchor = sum(log_sizes.get(log_path(r.seq), 0) for r in anchor_records)
    log_total = sum(log_sizes.values())
    anchors = sorted(state.anchors.items())
    return {
        "kind": reader.kind,
        "steps": info["steps"],
        "delta_steps": delta_steps,
        "anchors": [s for s, _ in anchors],
        "anchor_bytes": max((a.object.size for _, a in anchors), default=0),
        "delta_bytes": info["delta_bytes"],
        "delta_bytes_per_step": info["delta_bytes"] / max(1, delta_steps),
        "delta_by_array": by_array,
        "log_bytes": log_total,
        "log_records": len(records),
        "log_bytes_per_delta_step": (log_total - log_anchor) / max(1, delta_steps),
        "log_bytes_per_anchor_record": log_anchor / max(1, len(anchor_records)),
        "delta_records": len(delta_records),
        "raw_values_bytes_per_step": raw_values / max(1, delta_steps),
        "raw_indices_bytes_per_step": raw_indices / max(1, delta_steps),
        "kept_elements_per_step": n_sparse / max(1, delta_steps),
        "bytes_on_disk": info["bytes_on_disk"],
    }


def value_codec_variants(chain: str | os.PathLike[str]) -> dict[str, Any]:
    """Re-encode the 32-bit values of the chain's last delta step with codec variants, and
    the order-0 entropy of their byte planes (``"entropy"``)."""
    import numpy as np

    from ldformat import ChainReader

    from .proposals import byte_plane_entropy, codec_variants

    reader = ChainReader(chain)
    step = reader.latest_step
    if step is None or step not in reader.state.deltas:
        return {}
    entry, step_entry = reader.state.deltas[step]
    row = reader.load_batch(entry).row(step_entry.row)
    values = [vals for _idx, vals in row.values() if vals.dtype.itemsize == 4]
    if not values:
        return {}
    flat = np.concatenate(values)
    return {**codec_variants(flat), "entropy": byte_plane_entropy(flat)}


def _width(dtype: str) -> int:
    from ldformat.format.dtypes import parse_dtype

    return torch.empty(0, dtype=parse_dtype(dtype)).element_size()


def extrapolate(b: dict[str, Any], full: int, anchor_every: int, batch_steps: int,
                n: int = CHAIN_STEPS) -> dict[str, Any]:
    """Bytes of an n-step chain: anchors at 0, A, 2A, ... plus n deltas plus their log records."""
    anchors = n // anchor_every + 1
    total = anchors * (b["anchor_bytes"] + b["log_bytes_per_anchor_record"]) + n * (
        b["delta_bytes_per_step"] + b["log_bytes_per_delta_step"])
    return {"steps": n, "anchor_every": anchor_every, "batch_steps": batch_steps, "anchors": anchors,
            "chain_bytes": total, "full_checkpoints_bytes": n * full, "ratio": n * full / total}


def run_bytes(size: ModelSize, overhead: dict[str, Any], workdir: Path, log: Any = print) -> dict[str, Any]:
    """Bytes of the chains the overhead benchmark wrote (real workload steps)."""
    trainer = Trainer(size)
    trainer.step()
    full = full_checkpoint_bytes(trainer, workdir / "full.pt")
    raw_state = raw_state_bytes(trainer)
    del trainer
    out: dict[str, Any] = {"full_checkpoint_bytes": full, "raw_state_bytes": raw_state, "kinds": {}}
    for name, chain in overhead["chains"].items():
        b = chain_bytes(chain)
        pol = overhead["policies"][name]
        per_step = b["delta_bytes_per_step"] + b["log_bytes_per_delta_step"]
        b["bytes_per_step_with_log"] = per_step
        b["full_over_delta"] = full / b["delta_bytes_per_step"]
        b["full_over_delta_with_log"] = full / per_step
        b["chain_1000_policy"] = extrapolate(b, full, pol["anchor_every"], pol["batch_steps"])
        b["chain_1000_a100"] = extrapolate(b, full, 100, pol["batch_steps"])
        if b["kind"] == "grad.topk":
            raw = b["raw_values_bytes_per_step"] + b["raw_indices_bytes_per_step"]
            arr = b["delta_by_array"]
            steps = max(1, b["delta_steps"])
            b["topk_raw_bytes_per_step"] = raw
            b["topk_ratio_vs_raw"] = b["delta_bytes_per_step"] / raw
            b["topk_indices_ratio"] = arr.get("indices", 0) / steps / max(1, b["raw_indices_bytes_per_step"])
            b["topk_values_ratio"] = arr.get("values_u32", 0) / steps / max(1, b["raw_values_bytes_per_step"])
        else:
            b["ratio_vs_raw"] = b["delta_bytes_per_step"] / max(1, b["raw_values_bytes_per_step"])
        b["codec_variants"] = value_codec_variants(chain)
        out["kinds"][name] = b
        log(f"  {name}: {human_bytes(b['delta_bytes_per_step'])}/step of deltas over {b['delta_steps']} steps")
    topk = next((b for b in out["kinds"].values() if b["kind"] == "grad.topk"), None)
    xor = next((b for b in out["kinds"].values() if b["kind"] == "state.xor"), None)
    out["bars"] = {
        "topk_vs_raw_le_0.55": None if topk is None else topk["topk_ratio_vs_raw"] <= 0.55,
        "lowdiff_full_over_delta_ge_200": None if topk is None else topk["full_over_delta_with_log"] >= 200,
        "xor_vs_raw_le_0.7": None if xor is None else xor["ratio_vs_raw"] <= 0.7,
    }
    return out


def report_bytes(res: dict[str, Any]) -> str:
    full = res["full_checkpoint_bytes"]
    lines = [f"One full checkpoint (torch.save of model + AdamW state_dict): {human_bytes(full)} "
             f"(raw state tensors {human_bytes(res['raw_state_bytes'])}). Deltas measured on the chains written "
             "by the overhead benchmark (real workload steps); 'with log' adds the commit-log bytes per step.", ""]
    rows = []
    for name, b in res["kinds"].items():
        rows.append([name, b["kind"], b["delta_steps"], human_bytes(b["delta_bytes_per_step"]),
                     human_bytes(b["bytes_per_step_with_log"]), f"{b['full_over_delta']:.0f}x",
                     f"{b['full_over_delta_with_log']:.0f}x", human_bytes(b["anchor_bytes"])])
    lines.append(table(["mode", "kind", "delta steps", "delta bytes/step", "with log", "full / delta",
                        "full / (delta+log)", "anchor"], rows))
    lines.append("")
    lines.append(f"Bar: `lowdiff` delta bytes per step >= 200x smaller than a full checkpoint (delta + log): "
                 f"{verdict(res['bars']['lowdiff_full_over_delta_ge_200'])}")
    lines.append("")
    rows = []
    for name, b in res["kinds"].items():
        for key, label in (("chain_1000_policy", "policy"), ("chain_1000_a100", "stated")):
            e = b[key]
            rows.append([name, f"{e['anchor_every']} ({label})", e["anchors"], human_bytes(e["chain_bytes"]),
                         human_bytes(e["full_checkpoints_bytes"]), f"{e['ratio']:.1f}x"])
    lines.append("1,000-step chain, extrapolated from the measured bytes: (1000 // A + 1) anchors x (anchor + its "
                 "log record) + 1000 x (delta + log bytes per step), vs 1,000 full checkpoints.")
    lines.append("")
    lines.append(table(["mode", "anchor every A", "anchors", "1,000-step chain", "1,000 full checkpoints",
                        "smaller by"], rows))
    lines.append("")
    rows = []
    for name, b in res["kinds"].items():
        arr = b["delta_by_array"]
        steps = max(1, b["delta_steps"])
        if b["kind"] == "grad.topk":
            rows.append([name, f"{b['kept_elements_per_step']:.0f} kept values/step",
                         human_bytes(b["topk_raw_bytes_per_step"]) + " (int32 index + fp32 value)",
                         f"{b['topk_ratio_vs_raw']:.3f}x (indices {b['topk_indices_ratio']:.3f}x, values "
                         f"{b['topk_values_ratio']:.3f}x)", "<= 0.55x " + verdict(res["bars"]["topk_vs_raw_le_0.55"])])
        else:
            bar = "<= 0.7x " + verdict(res["bars"]["xor_vs_raw_le_0.7"]) if b["kind"] == "state.xor" else "-"
            rows.append([name, ", ".join(f"{k} {human_bytes(v / steps)}" for k, v in sorted(arr.items())),
                         human_bytes(b["raw_values_bytes_per_step"]) + " raw", f"{b['ratio_vs_raw']:.3f}x", bar])
    lines.append(table(["mode", "per step", "raw", "stored / raw", "bar"], rows))
    lines.append("")
    lines.append("Value codec variants (proposal for ldformat/delta.py VALUE_CODECS), on the 32-bit values of the last "
                 "delta step of each chain, one thread; ratio = compressed / raw:")
    lines.append("")
    rows = []
    for name, b in res["kinds"].items():
        for variant, v in b.get("codec_variants", {}).items():
            if variant != "entropy":
                rows.append([name, variant, f"{v['ratio']:.3f}", f"{v['encode_core_s']:.3f}",
                             f"{v['decode_core_s']:.3f}"])
    lines.append(table(["mode", "codec", "ratio", "encode core-s", "decode core-s"], rows))
    lines.append("")
    rows = []
    for name, b in res["kinds"].items():
        e = b.get("codec_variants", {}).get("entropy")
        if e:
            rows.append([name, " / ".join(f"{x:.2f}" for x in reversed(e["plane_bits"])), f"{e['bound_ratio']:.3f}"])
    lines.append("Why a ratio stops where it does: order-0 entropy of each byte plane of the same 32-bit values "
                 "(most significant byte first; 8 bits = incompressible). A byte-shuffling coder reaches about the "
                 "bound; only a different delta transform could go lower.")
    lines.append("")
    lines.append(table(["mode", "entropy bits per byte plane (MSB ... LSB)", "bound on stored / raw"], rows))
    return "\n".join(lines)


# -- anchor write throughput ---------------------------------------------------------------
def run_anchor_throughput(size: ModelSize, workdir: Path, reps: int, log: Any = print) -> dict[str, Any]:
    from safetensors.torch import save_file

    from ldformat import ChainWriter, LocalStore
    from ldformat.format.anchor import anchor_parts, encode_anchor, write_anchor_parts
    from ldformat.format.checksum import object_checksum, object_checksum_parts

    trainer = Trainer(size)
    trainer.step()
    tensors = flat_state(trainer.model, trainer.optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    root = workdir / "anchor-throughput"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    chain = root / "chain"
    writer = ChainWriter.create(chain, trainer.model, trainer.optimizer, kind="state.xor", capture_hook=False)
    raw_payload = encode_anchor(tensors, 0)
    store = LocalStore(root / "core")

    def ld_write_anchor() -> int:
        before = {p for p in writer.store.list("anchors")}
        writer.write_anchor(0)  # snapshot copy + encode + checksum + write + fsync + commit record
        new = [p for p in writer.store.list("anchors") if p not in before]
        size_ = sum(writer.store.size(p) for p in new)
        for p in before:  # keep the disk from filling: the replaced anchor is garbage
            writer.store.delete(p)
        return size_

    def ld_core() -> int:
        anchor = anchor_parts(tensors, 0)  # header + zero-copy views of the tensors
        path = "anchors/0-x.safetensors"
        write_anchor_parts(store, path, anchor)  # the checksum overlaps the write, as the writer does
        store.sync([path])
        return anchor.size

    def st_save() -> int:
        p = root / "st.safetensors"
        save_file(tensors, str(p))
        fsync_file(p)
        fsync_file(root)
        return p.stat().st_size

    def torch_save() -> int:
        p = root / "t.pt"
        with open(p, "wb") as f:
            torch.save(trainer.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_file(root)
        return p.stat().st_size

    def raw_write() -> int:
        # The disk's limit: the same bytes in 8 MiB writes, each followed by the early-writeback
        # hint LocalStore gives (posix_fadvise DONTNEED starts writeback without waiting), then fsync.
        p = root / "raw.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(raw_payload)
            offset = 0
            while offset < len(view):
                piece = view[offset : offset + (8 << 20)]
                while piece:
                    n = os.write(fd, piece)
                    piece = piece[n:]
                    offset += n
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, offset - (8 << 20), 8 << 20, os.POSIX_FADV_DONTNEED)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_file(root)
        return len(raw_payload)

    methods = {
        "ldformat anchor (streamed write + crc32c + fsync)": ld_core,
        "ldformat ChainWriter.write_anchor (+ state copy + commit)": ld_write_anchor,
        "safetensors.save_file + fsync": st_save,
        "torch.save + fsync": torch_save,
        "raw sequential write + fsync": raw_write,
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    sizes: dict[str, int] = {}
    for r in range(reps):
        for name, fn in list(methods.items())[r % len(methods):] + list(methods.items())[: r % len(methods)]:
            os.sync()  # every method starts with the disk's write queue drained (not timed)
            t0 = time.perf_counter()
            sizes[name] = fn()
            times[name].append(time.perf_counter() - t0)
    # Component times of the ldformat anchor path (one rep each).
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    snap = writer.snapshot_anchor_tensors()
    parts["snapshot copy"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    anchor = anchor_parts(snap, 0)
    parts["header"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.write_parts("anchors/parts", anchor.parts)
    parts["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    crc = object_checksum_parts("anchors/x", anchor.parts)
    parts["crc32c"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.sync(["anchors/parts"])
    parts["fsync"] = time.perf_counter() - t0
    # The streamed object equals the joined encoding, and its bytes do not depend on the process.
    joined = encode_anchor(snap, 0)
    consistent = (store.read("anchors/parts") == joined and crc == object_checksum("anchors/x", joined))
    del snap, anchor, joined
    writer.close()
    shutil.rmtree(root, ignore_errors=True)
    res: dict[str, Any] = {"state_bytes": nbytes, "reps": reps, "methods": {}, "ldformat_parts_s": parts,
                           "streamed_equals_joined": consistent}
    for name in methods:
        med = statistics.median(times[name])
        res["methods"][name] = {"bytes": sizes[name], "seconds": times[name], "median_s": med,
                                "mb_per_s": sizes[name] / med / 1e6}
    ld = res["methods"]["ldformat anchor (streamed write + crc32c + fsync)"]["mb_per_s"]
    st = res["methods"]["safetensors.save_file + fsync"]["mb_per_s"]
    raw = res["methods"]["raw sequential write + fsync"]["mb_per_s"]
    ts = res["methods"]["torch.save + fsync"]["mb_per_s"]
    api = res["methods"]["ldformat ChainWriter.write_anchor (+ state copy + commit)"]["mb_per_s"]
    res["ratios"] = {"ldformat_vs_safetensors": ld / st, "ldformat_vs_raw": ld / raw, "torch_save_vs_ldformat": ts / ld,
                     "write_anchor_vs_safetensors": api / st, "write_anchor_vs_raw": api / raw}
    res["bars"] = {"vs_safetensors_ge_0.95": ld / st >= 0.95, "vs_raw_ge_0.9": ld / raw >= 0.9}
    log(f"  anchor write: ldformat {ld:.0f} MB/s, safetensors {st:.0f} MB/s, raw {raw:.0f} MB/s")
    return res


def report_anchor(res: dict[str, Any]) -> str:
    rows = [[name, human_bytes(m["bytes"]), f"{m['median_s']:.3f}", f"{m['mb_per_s']:.0f}"]
            for name, m in res["methods"].items()]
    r = res["ratios"]
    lines = [f"State of the workload after one step ({human_bytes(res['state_bytes'])} of tensors); median of "
             f"{res['reps']} interleaved repetitions, the write queue drained (os.sync) before each; every method "
             "fsyncs the file and its directory.", "",
             table(["method", "bytes", "median s", "MB/s"], rows), "",
             table(["figure", "ratio", "bar"], [
                 ["ldformat anchor / safetensors.save_file (throughput)", f"{r['ldformat_vs_safetensors']:.2f}x",
                  ">= 0.95x " + verdict(res["bars"]["vs_safetensors_ge_0.95"])],
                 ["ldformat anchor / raw sequential write", f"{r['ldformat_vs_raw']:.2f}x",
                  ">= 0.9x " + verdict(res["bars"]["vs_raw_ge_0.9"])],
                 ["ChainWriter.write_anchor / safetensors.save_file", f"{r['write_anchor_vs_safetensors']:.2f}x",
                  "reported"],
                 ["torch.save / ldformat anchor", f"{r['torch_save_vs_ldformat']:.2f}x", "reported"],
             ]), "",
             "The raw write is the disk's limit: the same bytes in 8 MiB writes with the early-writeback hint "
             "ldformat's LocalStore gives (posix_fadvise DONTNEED after each piece), then fsync. The streamed anchor "
             "equals encode_anchor's joined bytes (canonical header, reproducible across processes) with the same "
             f"checksum: {'verified' if res['streamed_equals_joined'] else 'NOT equal'}.", "",
             "ldformat anchor path, one repetition by part: " + ", ".join(
                 f"{k} {v * 1000:.0f} ms" for k, v in res["ldformat_parts_s"].items())]
    return "\n".join(lines)

