"""Anchor write throughput against its peers, interleaved in one process.

Methods, each from tensors already in host memory up to a durable file (data written,
file and directory fsynced):

* ``ldformat anchor``: the writer's anchor path (:func:`ldformat.format.anchor.anchor_parts` and
  :func:`~ldformat.format.anchor.write_anchor_parts` on a :class:`~ldformat.LocalStore`: header,
  streamed write, path-seeded crc32c) and ``store.sync`` of the object;
* ``ldformat write_parts, then crc32c``: the same bytes written by ``store.write_parts``
  followed by a separate crc32c pass (the path before the anchor writer overlapped them);
* ``safetensors.save_file + fsync``;
* ``raw sequential write + fsync``: the anchor's bytes, already joined in memory, in 8 MiB
  ``os.write`` calls, then fsync: the disk's limit; and the same with
  ``posix_fadvise(DONTNEED)`` after each piece (as ``benchmarks.run``'s anchor section). The
  raw bar is taken against the faster of the two.

The snapshot copy of live (possibly GPU) state into host memory is *not* counted: it is
the same for every method, and ``save_file`` also starts from tensors in memory.

Every method starts with the disk's write queue drained (``os.sync``, not timed); the order
rotates each round. Ratios are of median throughputs.

By default every method rewrites its own file each round, so after the first round the file
system reuses the blocks it just freed. ``--new-files`` gives every round new files, kept
to the end: on a thin-provisioned virtual disk, blocks never written before can be several
times slower (on the machine of ``benchmarks/results/anchor_write.md``, about 375 MB/s
against 1.3-2 GB/s for every method, raw writes included). An anchor is always a new file;
whether its blocks are fresh depends on what retention and the file system freed before.

Run: ``python -m benchmarks.anchor_write [--quick] [--rounds N] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .peers import flat_state, fsync_file
from .workload import QUICK_WORKLOAD, WORKLOAD, Trainer

CHUNK = 8 << 20


def workload_tensors(quick: bool) -> dict[str, torch.Tensor]:
    trainer = Trainer(QUICK_WORKLOAD if quick else WORKLOAD)
    trainer.step()  # AdamW state exists after the first step
    return flat_state(trainer.model, trainer.optimizer)


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import save_file

    from ldformat import LocalStore
    from ldformat.format.anchor import anchor_parts, encode_anchor, write_anchor_parts
    from ldformat.format.checksum import object_checksum, object_checksum_parts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small workload (about 40 MiB of state)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 3)")
    ap.add_argument("--dir", default=None, help="directory to write in (default: a temporary one)")
    ap.add_argument("--only", default=None, help="comma-separated method name prefixes")
    ap.add_argument("--new-files", action="store_true", help="new files every round, kept to the end")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)

    tensors = workload_tensors(args.quick)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    root = Path(tempfile.mkdtemp(prefix="anchor-write-", dir=args.dir))
    store = LocalStore(root / "store")
    joined = encode_anchor(tensors, 0)
    path = "anchors/0-x.safetensors"
    this_round = [0]

    def fresh(name: str) -> str:
        """``name``, or with ``--new-files`` a name of this round's own."""
        return f"{this_round[0]}-{name}" if args.new_files else name

    def ld_anchor() -> int:
        anchor = anchor_parts(tensors, 0)  # as ChainWriter._write_anchor_object does
        name = f"anchors/{fresh('x.safetensors')}"
        write_anchor_parts(store, name, anchor)
        store.sync([name])
        return anchor.size

    def ld_sequential() -> int:
        anchor = anchor_parts(tensors, 0)
        name = f"anchors/{fresh('seq.safetensors')}"
        store.write_parts(name, anchor.parts)
        object_checksum_parts(name, anchor.parts)
        store.sync([name])
        return anchor.size

    def st_save() -> int:
        p = root / fresh("st.safetensors")
        save_file(tensors, str(p))
        fsync_file(p)
        fsync_file(root)
        return p.stat().st_size

    def raw_write() -> int:
        p = root / fresh("raw.bin")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(joined)
            offset = 0
            while offset < len(view):
                offset += os.write(fd, view[offset : offset + CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_file(root)
        return len(joined)

    def raw_write_hinted() -> int:
        # As run.py's anchor section: posix_fadvise(DONTNEED) after each piece starts writeback early.
        p = root / fresh("raw-hinted.bin")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(joined)
            offset = 0
            while offset < len(view):
                n = os.write(fd, view[offset : offset + CHUNK])
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
                offset += n
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_file(root)
        return len(joined)

    methods: dict[str, Callable[[], int]] = {
        "ldformat anchor (anchor_parts + write_anchor_parts + sync)": ld_anchor,
        "ldformat write_parts, then crc32c": ld_sequential,
        "safetensors.save_file + fsync": st_save,
        "raw sequential write + fsync": raw_write,
        "raw sequential write + fadvise + fsync": raw_write_hinted,
    }
    if args.only:
        wanted = tuple(args.only.split(","))
        methods = {k: v for k, v in methods.items() if k.startswith(wanted) or not k.startswith("ldformat")}
    times: dict[str, list[float]] = {m: [] for m in methods}
    sizes: dict[str, int] = {}
    try:
        # The written anchor is the canonical one, with the checksum of the joined bytes.
        anchor = anchor_parts(tensors, 0)
        size, crc = anchor.size, write_anchor_parts(store, path, anchor)
        del anchor
        assert store.read(path) == joined and size == len(joined), "the anchor differs from encode_anchor"
        assert crc == object_checksum(path, joined), "the checksum differs from object_checksum"
        items = list(methods.items())
        for r in range(rounds):
            this_round[0] = r + 1
            for name, fn in items[r % len(items):] + items[: r % len(items)]:
                os.sync()  # the disk's write queue drained before every method (not timed)
                t0 = time.perf_counter()
                sizes[name] = fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mib = 1 << 20
    print(f"state: {len(tensors)} tensors, {state_bytes / mib:.2f} MiB; anchor object {len(joined) / mib:.2f} MiB; "
          f"{rounds} interleaved rounds, os.sync before each method; "
          f"{'new files every round' if args.new_files else 'each method rewrites its own file'}")
    print(f"{'method':48} {'median ms':>10} {'MiB/s':>8}  all ms")
    rate: dict[str, float] = {}
    for name in methods:
        med = statistics.median(times[name])
        rate[name] = sizes[name] / med / mib
        print(f"{name:48} {med * 1e3:10.1f} {rate[name]:8.0f}  {' '.join(f'{t * 1e3:.0f}' for t in times[name])}")
    for name in methods:
        if name.startswith("ldformat"):
            st = rate[name] / rate["safetensors.save_file + fsync"]
            raw = rate[name] / max(v for k, v in rate.items() if k.startswith("raw"))
            print(f"{name}: {st:.2f}x safetensors.save_file (bar >= 0.95x: {'met' if st >= 0.95 else 'NOT met'}), "
                  f"{raw:.2f}x the faster raw write (bar >= 0.9x: {'met' if raw >= 0.9 else 'NOT met'})")


if __name__ == "__main__":
    main()
