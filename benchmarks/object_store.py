"""Object store throughput: ldformat on ``s3://`` against raw obstore doing the same puts and gets.

    python -m benchmarks.object_store --quick     # small state, about 2 minutes on 2 cores
    python -m benchmarks.object_store             # ~192 MiB anchor, about 10-15 minutes

A local S3 server (``moto_server`` on 127.0.0.1 at a free port, started and stopped here)
holds every object; nothing leaves the machine. Three measurements, in one process:

1. **Anchor upload.** One open :class:`ldformat.ChainWriter` (``state.xor``) on
   ``s3://bucket/<prefix>`` writes a fresh anchor of the same live state each round
   (``write_anchor``: snapshot, multipart upload streamed from the tensors, crc32c, commit).
   Against it, raw ``obstore.put`` of *the same bytes* (the anchor object read back once):
   with ldformat's part size and concurrency (``use_multipart=True``), and with obstore's
   defaults. The bar compares the anchor's upload + commit (from the start of its
   ``write_parts`` to the end of ``write_anchor``: data, crc32c and commit) with the raw put;
   the whole ``write_anchor`` (snapshot copy included) is reported too.
2. **Materialize download.** A chain of anchor + K delta steps per kind (``state.xor``,
   ``grad.dense``). ``ChainReader(...).materialize(K)`` (opened outside the timing) with
   ldformat's defaults (ranged reads above 16 MiB) and with ``range_threshold`` huge (one GET
   per object, the setting documented for moto), against raw ``obstore.get`` of exactly the
   objects materialize read (recorded per request): one GET per object in turn, and the same
   requests (8 MiB ranges for objects above the threshold) on ldformat's concurrency. The
   same chain materialized from a local copy is the compute part (decode, checksum, replay);
   materialize minus it estimates the download part.
3. **Commit round trips.** Requests per committed step for each kind, from
   :attr:`ObjectStore.requests`: data requests (``write``/``write_parts``: a multipart upload
   counts create + parts + complete) and the commit path (lock check, record create, ...).

Methods alternate within each round in a rotated order; medians with 95% bootstrap CIs over
rounds. moto is a Python server: it is CPU-bound on this machine and much slower than S3, so
absolute MB/s say little about a cloud; the ratios compare client work on equal terms. The
CPU time of the moto process and of this process is reported per operation.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .stats import fmt_ci, human_bytes, median, public_command, summary, table, verdict
from .workload import configure_threads

BUCKET = "ldformat-bench"
MiB = 1 << 20
DATA_OPS = ("write", "write_parts")
KINDS_MAT = ("state.xor", "grad.dense")
KINDS_COMMIT = ("grad.topk", "grad.dense", "state.xor")
BAR = 0.9


# -- the server ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Moto:
    """``moto_server`` in a subprocess on 127.0.0.1 (the minimum of ``tests/support/s3server.py``)."""

    def __init__(self) -> None:
        exe = Path(sys.executable).parent / "moto_server"
        command = [str(exe)] if exe.exists() else [shutil.which("moto_server") or "moto_server"]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with status {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("PUT", f"/{BUCKET}")  # creates the bucket (moto checks no signature)
                status = conn.getresponse().status
                conn.close()
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moto_server did not answer within 30 s")
            time.sleep(0.1)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# -- an ObjectStore that records what it does -----------------------------------------------------
def traced_store(url: str, **kwargs: Any) -> Any:
    from ldformat.stores import ObjectStore

    class Traced(ObjectStore):
        """ObjectStore recording write_parts spans and every object read (key, bytes)."""

        def __init__(self) -> None:
            super().__init__(url, **kwargs)
            self.spans: list[tuple[str, float, float]] = []
            self.reads: list[tuple[str, int]] = []
            self.read_spans: list[tuple[float, float]] = []

        def write_parts(self, path: str, parts: Sequence[Any]) -> None:
            t0 = time.perf_counter()
            super().write_parts(path, parts)
            self.spans.append((path, t0, time.perf_counter()))

        def read_buffer(self, path: str, max_size: int | None = None) -> Any:
            t0 = time.perf_counter()
            data = super().read_buffer(path, max_size)
            self.read_spans.append((t0, time.perf_counter()))
            self.reads.append((path, len(data)))
            return data

        def read(self, path: str) -> bytes:
            t0 = time.perf_counter()
            data = super().read(path)
            self.read_spans.append((t0, time.perf_counter()))
            self.reads.append((path, len(data)))
            return data

        def io_seconds(self) -> float:
            """Wall time during which at least one read was in flight (the union of the spans)."""
            total, end = 0.0, float("-inf")
            for a, b in sorted(self.read_spans):
                if b > end:
                    total += b - max(a, end)
                    end = b
            return total

    return Traced()


def raw_store(url: str) -> Any:
    import obstore

    return obstore.store.from_url(url)


def delete_prefix(url: str) -> None:
    import obstore

    store = raw_store(url)
    for chunk in obstore.list(store, None, chunk_size=1000):
        for meta in chunk:
            obstore.delete(store, meta["path"])


# -- the state -------------------------------------------------------------------------------------
def make_state(state_mib: float, width: int = 1024, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP + AdamW after one step: params + two moments = about ``state_mib`` MiB of float32."""
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(state_mib * MiB / per_layer))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fake_step(model, opt)
    return model, opt


def fake_step(model: torch.nn.Module, opt: torch.optim.Optimizer, compressor: Any = None) -> None:
    """One optimizer step on random gradients (the replay cost does not depend on where they came from)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    if compressor is not None:
        compressor.compress_(model)
    opt.step()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() for p in model.parameters())
    return n * 4 * 3


# -- timing helpers ----------------------------------------------------------------------------------
class Meter:
    """Wall time, this process's CPU and the moto server's CPU of one operation."""

    def __init__(self, moto: Moto) -> None:
        self.moto = moto

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        gc.collect()
        c0, s0, t0 = time.process_time(), self.moto.cpu_s(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        return out, {"wall_s": wall, "client_cpu_s": time.process_time() - c0, "server_cpu_s": self.moto.cpu_s() - s0}


def rotated(items: list[str], r: int) -> list[str]:
    k = r % len(items)
    return items[k:] + items[:k]


def cores(runs: list[dict[str, float]], key: str) -> float:
    return median([r[key] / r["wall_s"] for r in runs if r["wall_s"] > 0])


def op_counts(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(set(after) | set(before)) if after[k] - before[k]}


def split_counts(counts: dict[str, int]) -> tuple[int, int]:
    data = sum(v for k, v in counts.items() if k in DATA_OPS)
    return data, sum(counts.values()) - data


# -- 1. anchor upload ------------------------------------------------------------------------------
def bench_upload(moto: Moto, state_mib: float, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    import obstore

    from ldformat import ChainWriter
    from ldformat.stores.object import CONCURRENCY, PART_SIZE

    model, opt = make_state(state_mib)
    url = f"s3://{BUCKET}/upload-ld"
    store = traced_store(url)
    writer = ChainWriter.create(url, model, opt, kind="state.xor", store=store)
    anchor = store.spans[-1][0]
    data = bytes(obstore.get(raw_store(url), anchor).bytes())
    size = len(data)
    log(f"  anchor object: {human_bytes(size)} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params "
        f"+ AdamW moments); part size {human_bytes(PART_SIZE)}, concurrency {CONCURRENCY}")
    raw_url = f"s3://{BUCKET}/upload-raw"
    raw = raw_store(raw_url)
    ld_raw = raw_store(url)
    meter = Meter(moto)
    runs: dict[str, list[dict[str, Any]]] = {"ldformat": [], "raw_same_parts": [], "raw_defaults": []}
    counts: list[dict[str, int]] = []

    def ld() -> dict[str, Any]:
        before = Counter(store.requests)
        spans = len(store.spans)
        t0 = time.perf_counter()
        writer.write_anchor(0)
        t1 = time.perf_counter()
        (path, s0, s1), = store.spans[spans:]
        c = op_counts(before, store.requests)
        counts.append(c)
        for p in _anchors_in(url):  # superseded anchors are unreferenced: removed to keep moto's memory flat
            if p != path:
                obstore.delete(ld_raw, p)
        return {"upload_commit_s": t1 - s0, "write_parts_s": s1 - s0, "after_upload_s": t1 - s1,
                "commit_s": writer.last_commit_seconds, "before_upload_s": s0 - t0, "requests": c}

    def raw_put(**kw: Any) -> Callable[[], None]:
        def go() -> None:
            obstore.put(raw, "anchor.safetensors", data, **kw)
        return go

    methods: dict[str, Callable[[], Any]] = {
        "ldformat": ld,
        "raw_same_parts": raw_put(use_multipart=True, chunk_size=PART_SIZE, max_concurrency=CONCURRENCY),
        "raw_defaults": raw_put(),
    }
    for r in range(rounds):
        for name in rotated(list(methods), r):
            extra, m = meter(methods[name])
            runs[name].append({**m, **(extra or {})})
        log(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {size / MiB / (runs[n][-1].get('upload_commit_s') or runs[n][-1]['wall_s']):.0f} MB/s"
            for n in methods))
    writer.close()
    delete_prefix(url)
    delete_prefix(raw_url)
    ld_up = [size / x["upload_commit_s"] for x in runs["ldformat"]]
    ld_all = [size / x["wall_s"] for x in runs["ldformat"]]
    out: dict[str, Any] = {"anchor_bytes": size, "part_size": PART_SIZE, "concurrency": CONCURRENCY,
                           "runs": runs, "requests_per_anchor": counts[-1] if counts else {}}
    out["throughput_Bps"] = {
        "ldformat upload+commit": summary(ld_up),
        "ldformat write_anchor (snapshot incl.)": summary(ld_all),
        "raw put, same parts": summary([size / x["wall_s"] for x in runs["raw_same_parts"]]),
        "raw put, obstore defaults": summary([size / x["wall_s"] for x in runs["raw_defaults"]]),
    }
    out["ratio"] = {
        "vs raw same parts": summary([a / (size / b["wall_s"]) for a, b in zip(ld_up, runs["raw_same_parts"],
                                                                              strict=True)]),
        "vs raw defaults": summary([a / (size / b["wall_s"]) for a, b in zip(ld_up, runs["raw_defaults"],
                                                                            strict=True)]),
        "write_anchor vs raw same parts": summary([a / (size / b["wall_s"]) for a, b in zip(
            ld_all, runs["raw_same_parts"], strict=True)]),
    }
    out["breakdown_s"] = {k: median([x[k] for x in runs["ldformat"]])
                          for k in ("before_upload_s", "write_parts_s", "after_upload_s", "commit_s")}
    out["cores"] = {n: {"client": cores(v, "client_cpu_s"), "server": cores(v, "server_cpu_s")}
                    for n, v in runs.items()}
    return out


def _anchors_in(url: str) -> list[str]:
    import obstore

    return [m["path"] for chunk in obstore.list(raw_store(url), "anchors", chunk_size=1000) for m in chunk]


# -- 2. materialize download ------------------------------------------------------------------------
def build_chain(url: str, kind: str, state_mib: float, k: int, batch_steps: int) -> dict[str, Any]:
    from ldformat import ChainWriter

    model, opt = make_state(state_mib, seed=1)
    store = traced_store(url)
    writer = ChainWriter.create(url, model, opt, kind=kind, store=store, batch_steps=batch_steps)
    for s in range(1, k + 1):
        fake_step(model, opt)
        writer.record_step(s)
    writer.close()
    return {"state_bytes": state_bytes(model, opt)}


def copy_local(url: str, dest: Path) -> None:
    import obstore

    store = raw_store(url)
    for chunk in obstore.list(store, None, chunk_size=1000):
        for meta in chunk:
            target = dest / meta["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(obstore.get(store, meta["path"]).bytes()))


def raw_gets(url: str, objects: list[tuple[str, int]], *, concurrency: int, part_size: int, threshold: int
             ) -> Callable[[], int]:
    """Raw obstore GETs of ``objects``: one per object in turn (concurrency 1), or the requests
    ldformat sends (ranges of ``part_size`` above ``threshold``) on ``concurrency`` threads."""
    import obstore

    store = raw_store(url)

    def whole(key: str) -> int:
        return len(obstore.get(store, key).bytes())

    def ranged(key: str, start: int, end: int) -> int:
        return len(obstore.get(store, key, options={"range": (start, end)}).bytes())

    def go() -> int:
        if concurrency == 1:
            return sum(whole(key) for key, _ in objects)
        with ThreadPoolExecutor(concurrency) as pool:
            futures = []
            for key, size in objects:
                if size > threshold:
                    futures += [pool.submit(ranged, key, s, min(s + part_size, size))
                                for s in range(0, size, part_size)]
                else:
                    futures.append(pool.submit(whole, key))
            return sum(f.result() for f in futures)

    return go


def bench_materialize(moto: Moto, state_mib: float, k: int, batch_steps: int, rounds: int, workdir: Path,
                      log: Callable[[str], None]) -> dict[str, Any]:
    from ldformat import ChainReader
    from ldformat.stores.object import CONCURRENCY, MULTIPART_THRESHOLD, PART_SIZE

    meter = Meter(moto)
    out: dict[str, Any] = {"k": k, "batch_steps": batch_steps, "kinds": {}}
    for kind in KINDS_MAT:
        url = f"s3://{BUCKET}/mat-{kind.replace('.', '-')}"
        t0 = time.perf_counter()
        info = build_chain(url, kind, state_mib, k, batch_steps)
        local = workdir / kind
        copy_local(url, local)
        log(f"  {kind}: chain of anchor + {k} steps written in {time.perf_counter() - t0:.1f} s")
        # Which objects materialize reads (and check that both readers agree bit for bit).
        probe = traced_store(url)
        reader = ChainReader(url, store=probe)
        probe.reads.clear()
        reference = reader.materialize(k)
        objects = list(probe.reads)
        requests_per_materialize = dict(probe.requests)
        total = sum(n for _, n in objects)
        same = _same_state(reference, ChainReader(local).materialize(k))
        del reference
        log(f"  {kind}: materialize reads {len(objects)} objects, {human_bytes(total)}; local copy identical: {same}")

        readers = {
            "ldformat": {},
            "ldformat one GET per object": {"range_threshold": 1 << 62},
        }
        methods: dict[str, Callable[[], Any]] = {
            "local copy (compute)": lambda local=local: ChainReader(local).materialize(k),
            "raw GETs, same requests, concurrent": raw_gets(url, objects, concurrency=CONCURRENCY,
                                                            part_size=PART_SIZE, threshold=MULTIPART_THRESHOLD),
            "raw GETs, one per object, sequential": raw_gets(url, objects, concurrency=1, part_size=PART_SIZE,
                                                             threshold=1 << 62),
        }
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in [*readers, *methods]}
        for r in range(rounds):
            for name in rotated(list(runs), r):
                if name in readers:
                    st = traced_store(url, **readers[name])
                    reader = ChainReader(url, store=st)  # opened outside the timing
                    st.read_spans.clear()
                    _, m = meter(lambda reader=reader: reader.materialize(k))  # type: ignore[misc]
                    m["io_s"] = st.io_seconds()
                    m["serial_read_s"] = sum(b - a for a, b in st.read_spans)
                    del reader
                else:
                    _, m = meter(methods[name])
                runs[name].append(m)
            log(f"  {kind} round {r + 1}/{rounds}: " + ", ".join(f"{n} {runs[n][-1]['wall_s']:.2f} s" for n in runs))
        res: dict[str, Any] = {"objects": len(objects), "bytes": total, "state_bytes": info["state_bytes"],
                               "requests_per_materialize": requests_per_materialize, "local_identical": same,
                               "runs": runs}
        walls = {n: [x["wall_s"] for x in v] for n, v in runs.items()}
        res["seconds"] = {n: summary(v) for n, v in walls.items()}
        res["throughput_Bps"] = {n: summary([total / x for x in v]) for n, v in walls.items()}
        compute = walls["local copy (compute)"]
        res["download_s"] = {n: summary([max(1e-9, a - c) for a, c in zip(walls[n], compute, strict=True)])
                             for n in readers}
        res["io_s"] = {n: summary([x["io_s"] for x in runs[n]]) for n in readers}
        res["objects_read"] = objects
        raw_c, raw_s = walls["raw GETs, same requests, concurrent"], walls["raw GETs, one per object, sequential"]
        res["ratio"] = {}
        for n in readers:
            dl = [max(1e-9, a - c) for a, c in zip(walls[n], compute, strict=True)]
            ratio = res["ratio"]
            io = [x["io_s"] for x in runs[n]]
            ratio[f"{n} total vs raw concurrent"] = summary([b / a for a, b in zip(walls[n], raw_c, strict=True)])
            ratio[f"{n} I/O in flight vs raw concurrent"] = summary([b / a for a, b in zip(io, raw_c, strict=True)])
            ratio[f"{n} I/O in flight vs raw sequential"] = summary([b / a for a, b in zip(io, raw_s, strict=True)])
            ratio[f"{n} download vs raw concurrent"] = summary([b / a for a, b in zip(dl, raw_c, strict=True)])
            ratio[f"{n} download vs raw sequential"] = summary([b / a for a, b in zip(dl, raw_s, strict=True)])
        res["cores"] = {n: {"client": cores(v, "client_cpu_s"), "server": cores(v, "server_cpu_s")}
                        for n, v in runs.items()}
        out["kinds"][kind] = res
        delete_prefix(url)
        shutil.rmtree(local, ignore_errors=True)
    return out


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[x], b[x]) for x in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            _same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- 3. commit round trips ---------------------------------------------------------------------------
def bench_commits(steps: int, log: Callable[[str], None]) -> dict[str, Any]:
    from ldformat import ChainWriter, TopK

    out: dict[str, Any] = {}
    for kind in KINDS_COMMIT:
        url = f"s3://{BUCKET}/commit-{kind.replace('.', '-')}"
        torch.manual_seed(2)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compressor = TopK(0.01) if kind == "grad.topk" else None
        fake_step(model, opt, compressor)
        store = traced_store(url)
        writer = ChainWriter.create(url, model, opt, kind=kind, store=store, batch_steps=1, compressor=compressor)
        created = dict(store.requests)
        per_step = []
        for s in range(1, steps + 1):
            fake_step(model, opt, compressor)
            before = Counter(store.requests)
            writer.record_step(s)
            per_step.append(op_counts(before, store.requests))
        before = Counter(store.requests)
        writer.close()
        closed = op_counts(before, store.requests)
        # Re-opening to append (one-time, like create).
        store2 = traced_store(url)
        w2 = ChainWriter.open(url, model, opt, store=store2, batch_steps=1, compressor=compressor)
        opened = dict(store2.requests)
        w2.close()
        data, commit = zip(*(split_counts(c) for c in per_step), strict=True)
        out[kind] = {"create": created, "per_step": per_step, "close": closed, "open": opened,
                     "data_per_step": max(data), "commit_path_per_step": max(commit)}
        log(f"  {kind}: per committed step {per_step[-1]} -> data {max(data)}, commit path {max(commit)}; "
            f"create {sum(created.values())}, open {sum(opened.values())}, close {sum(closed.values())} requests")
        delete_prefix(url)
    return out


# -- the report -------------------------------------------------------------------------------------------
def _mbps(s: dict[str, Any]) -> str:
    return fmt_ci(s, 1 / MiB, 0)


def report(res: dict[str, Any]) -> str:
    lines: list[str] = []
    up = res.get("upload")
    if up:
        lines += ["## 1. Anchor upload", "",
                  f"Anchor object {human_bytes(up['anchor_bytes'])}; ldformat's multipart part size "
                  f"{human_bytes(up['part_size'])}, {up['concurrency']} parts in flight. {len(up['runs']['ldformat'])} "
                  "rounds, methods rotated per round. MiB/s: median [95% CI].", ""]
        rows = [[n, _mbps(s), f"{cores(up['runs'][key], 'client_cpu_s'):.2f}",
                 f"{cores(up['runs'][key], 'server_cpu_s'):.2f}"]
                for (n, s), key in zip(up["throughput_Bps"].items(),
                                       ("ldformat", "ldformat", "raw_same_parts", "raw_defaults"), strict=True)]
        lines += [table(["method", "MiB/s", "client cores", "moto cores"], rows), ""]
        lines += [table(["ratio (ldformat upload+commit / raw)", "median [95% CI]", f"bar >= {BAR}"],
                        [[n, fmt_ci(s, digits=3), verdict(s["median"] >= BAR) if "write_anchor" not in n else "(info)"]
                         for n, s in up["ratio"].items()]), ""]
        b = up["breakdown_s"]
        lines += [f"ldformat's anchor, medians: snapshot + header before the upload {b['before_upload_s']:.3f} s, "
                  f"write_parts {b['write_parts_s']:.3f} s, then crc32c + commit {b['after_upload_s']:.3f} s "
                  f"(of which the commit {b['commit_s']:.3f} s). Requests of one anchor: "
                  f"`{json.dumps(up['requests_per_anchor'])}`.", ""]
    mat = res.get("materialize")
    if mat:
        lines += ["## 2. Materialize download", "",
                  f"`materialize(K)` of anchor + K={mat['k']} steps (batch_steps {mat['batch_steps']}); the reader is "
                  "opened (root + log read) outside the timing. Raw: obstore GETs of exactly the objects materialize "
                  "read. 'Reads in flight': the wall time during which at least one of materialize's reads "
                  "(`read_buffer`) was in progress, the union over its threads: its download time, compared "
                  "with the raw GETs (the bar). 'download' rows: materialize minus the same materialize from a "
                  "local copy (the compute part: decode, crc32c, replay), a rougher estimate (materialize "
                  "prefetches the next batch during replay, and the subtraction carries both runs' noise).", ""]
        for kind, k in mat["kinds"].items():
            lines += [f"### {kind}: {k['objects']} objects, {human_bytes(k['bytes'])} read "
                      f"(state {human_bytes(k['state_bytes'])})", ""]
            rows = [[n, fmt_ci(k["seconds"][n], digits=2), fmt_ci(k["io_s"][n], digits=2) if n in k["io_s"] else "",
                     _mbps(k["throughput_Bps"][n]), f"{k['cores'][n]['client']:.2f}",
                     f"{k['cores'][n]['server']:.2f}"] for n in k["seconds"]]
            lines += [table(["method", "seconds", "of which reads in flight", "MiB/s (bytes read / seconds)",
                             "client cores", "moto cores"], rows), ""]
            rows = [[n, fmt_ci(s, digits=3), verdict(s["median"] >= BAR) if n == "ldformat I/O in flight vs raw "
                     "concurrent" else "(info)"] for n, s in k["ratio"].items()]
            lines += [table(["ratio (raw time / ldformat time)", "median [95% CI]", f"bar >= {BAR}"], rows), ""]
            lines += [f"Requests of one materialize (reader open included): "
                      f"`{json.dumps(k['requests_per_materialize'])}`.", ""]
    com = res.get("commits")
    if com:
        lines += ["## 3. Requests per committed step", "",
                  "batch_steps=1 (every step committed), a small model. Data: `write`/`write_parts` (a multipart "
                  "upload counts create + parts + complete); commit path: everything else. A PUT is durable when it "
                  "returns, so `sync` sends nothing for objects this writer wrote.", ""]
        rows = [[kind, json.dumps(c["per_step"][-1]), c["data_per_step"], c["commit_path_per_step"],
                 verdict(c["commit_path_per_step"] <= 2), sum(c["create"].values()), sum(c["open"].values()),
                 sum(c["close"].values())] for kind, c in com.items()]
        lines += [table(["kind", "requests of one step", "data", "commit path", "bar <= 2", "create (once)",
                         "open (once)", "close (once)"], rows), ""]
        lines += ["One-time requests by op: " + "; ".join(
            f"{kind}: create `{json.dumps(c['create'])}`, open `{json.dumps(c['open'])}`, close "
            f"`{json.dumps(c['close'])}`" for kind, c in com.items()), "",
            "A writer that holds its lock longer than half a lease (30 s by default) renews it at its next "
            "commit: one HEAD (lock check), one conditional PUT (next lock generation) and one DELETE (the "
            "superseded generation), at most once per 30 s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .run import machine, scrub

    parser = argparse.ArgumentParser(prog="python -m benchmarks.object_store", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (about 2 minutes)")
    parser.add_argument("--state-mib", type=float, default=None,
                        help="MiB of float32 state in the uploaded anchor (params + AdamW moments; "
                             "default 192, quick 48)")
    parser.add_argument("--chain-state-mib", type=float, default=None,
                        help="MiB of state of the materialized chains (default 48, quick 12)")
    parser.add_argument("--k", type=int, default=None, help="delta steps after the anchor (default 10, quick 4)")
    parser.add_argument("--batch-steps", type=int, default=None, help="steps per delta batch (default 8, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 3)")
    parser.add_argument("--only", default="upload,materialize,commits", help="sections to run")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default benchmarks/results, --quick: benchmarks/results/quick)")
    args = parser.parse_args(argv)
    quick = args.quick
    state_mib = args.state_mib or (48 if quick else 192)
    chain_mib = args.chain_state_mib or (12 if quick else 96)
    k = args.k or (4 if quick else 10)
    batch_steps = args.batch_steps or (2 if quick else 8)
    rounds = args.rounds or (3 if quick else 5)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    out_dir: Path = args.out or Path("benchmarks/results/quick" if quick else "benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    given = argv if argv is not None else sys.argv[1:]
    command = public_command("benchmarks.object_store", given)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    configure_threads()
    started = time.perf_counter()
    print(f"# ldformat object store benchmark ({'quick' if quick else 'full'}): {command}", flush=True)

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {text}", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="ldformat-objstore-"))
    moto = Moto()
    saved = {n: os.environ.get(n) for n in moto.env()}
    os.environ.update(moto.env())
    res: dict[str, Any] = {}
    try:
        import moto as moto_pkg
        import obstore

        versions = {"obstore": getattr(obstore, "__version__", "0.12.1"), "moto": moto_pkg.__version__}
        if "upload" in sections:
            log("1. anchor upload")
            res["upload"] = bench_upload(moto, state_mib, rounds, log)
        if "materialize" in sections:
            log("2. materialize download")
            res["materialize"] = bench_materialize(moto, chain_mib, k, batch_steps, rounds, workdir, log)
        if "commits" in sections:
            log("3. commit round trips")
            res["commits"] = bench_commits(4, log)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        moto.stop()
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        shutil.rmtree(workdir, ignore_errors=True)
    info = machine()
    res.update({"command": command, "mode": "quick" if quick else "full", "machine": info, "versions": versions,
                "plan": {"state_mib": state_mib, "chain_state_mib": chain_mib, "k": k, "batch_steps": batch_steps,
                         "rounds": rounds, "sections": sections}, "wall_s": time.perf_counter() - started})
    md = [
        "# ldformat benchmarks: object store (S3 via moto) vs raw obstore", "",
        f"Command: `{command}` ({res['mode']} mode; {res['wall_s'] / 60:.1f} min)", "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {(info['memory_bytes'] or 0) / 2**30:.0f} GiB memory; "
        f"{info['os']}. Versions: python {info['python']}, torch {info['torch']}, obstore {versions['obstore']}, "
        f"moto {versions['moto']}, ldformat {info['ldformat']}.", "",
        "**Caveat.** The server is `moto_server` (moto's S3 in a Python process) on 127.0.0.1, sharing the "
        f"{info['cores']} cores with the client. It is CPU-bound and far slower than real S3 (it copies every "
        "object and part in Python and reads a whole object for every ranged GET), so the absolute MiB/s "
        "measure moto more than the client; the ratios compare ldformat with raw obstore doing the same "
        "requests against the same server. 'moto cores' is the server process's CPU time / wall time, "
        "'client cores' this process's (obstore's I/O threads included).", "",
        report(res),
    ]
    text = "\n".join(md) + "\n"
    print(text, flush=True)
    (out_dir / "object_store.md").write_text(text)
    (out_dir / "object_store.json").write_text(json.dumps(scrub(res, str(workdir)), indent=1, default=str) + "\n")
    print(f"wrote {out_dir / 'object_store.md'} and {out_dir / 'object_store.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
