"""``state.xor`` rows coded as XOR (format 1.5), as differences and with Adam prediction (1.6).

    python -m benchmarks.state_encoding               # the fixed 29.5M workload
    python -m benchmarks.state_encoding --quick       # the quick workload, a minute

One training run (``benchmarks.workload.Trainer``, AdamW) and three ``ChainWriter`` chains of
kind ``state.xor`` over the same live model and optimizer: ``xor``, created as format 1.5
(every slot ``xor``); ``sub``, format 1.6 with ``predict_state = False`` (every slot ``sub``);
``predicted``, format 1.6 as written by default (``v`` and ``w`` of every AdamW parameter
``adam.v``/``adam.w``, the rest ``sub``; spec §11.3). After ``--warmup`` training steps the
chains are created (anchor at that step); then every measured step is recorded into each, in
an order that rotates from step to step. Reported per chain:

- delta bytes per step (every object of the delta batches, metadata included) against the raw
  state (every stored tensor's bytes);
- CPU per recorded step: ``time.process_time()`` around ``record_step``, which snapshots the
  state, computes the delta, compresses, checksums and, every ``batch_steps`` steps, writes
  and fsyncs the batch and its commit record: what the capture runtime's background thread
  spends on a step, on the training thread here so that nothing else runs meanwhile;
- ``materialize`` of the last step (anchor + every measured delta), wall time, rounds
  interleaved with the order alternating, and bit for bit against the live state.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ldformat

from .stats import bootstrap_ci, human_bytes, median
from .workload import QUICK_WORKLOAD, WORKLOAD, ModelSize, Trainer, configure_threads, n_params

#: chain name: (format version, Adam prediction)
ENCODINGS = {"xor": ("1.5", False), "sub": ("1.6", False), "predicted": ("1.6", True)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _raw_bytes(trainer: Trainer) -> int:
    """Bytes of the state's tensors, each stored tensor once (a tied weight is one tensor)."""
    seen: dict[int, int] = {}
    for name, t in _live_bits(trainer).items():
        if name.startswith("model/"):
            t = trainer.model.state_dict()[name[len("model/"):]]
        seen.setdefault(t.untyped_storage().data_ptr() if name.startswith("model/") else id(t), t.nbytes)
    return sum(seen.values())


def _live_bits(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": _bits(v).clone() for k, v in trainer.model.state_dict().items()}
    for i, st in trainer.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer/{i}/{k}"] = _bits(v).clone()
    return out


def _same(state: dict[str, Any], live: dict[str, torch.Tensor]) -> bool:
    got = {f"model/{k}": _bits(v) for k, v in state["model"].items()}
    for i, st in state["optimizer"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                got[f"optimizer/{i}/{k}"] = _bits(v)
    return got.keys() == live.keys() and all(torch.equal(got[n], live[n]) for n in live)


def _delta_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "deltas").rglob("*") if p.is_file())


def run(size: ModelSize, warmup: int, steps: int, rounds: int, workdir: Path) -> dict[str, Any]:
    trainer = Trainer(size)
    trainer.prefetch(1, warmup + steps)
    t0 = time.perf_counter()
    for _ in range(warmup):
        trainer.step()
    train_s = time.perf_counter() - t0
    writers = {}
    for enc, (version, predict) in ENCODINGS.items():
        writers[enc] = ldformat.ChainWriter.create(workdir / enc, trainer.model, trainer.optimizer, kind="state.xor",
                                                   format_version=version, batch_steps=4, step=warmup)
        writers[enc].predict_state = predict
    raw = _raw_bytes(trainer)
    cpu: dict[str, list[float]] = {enc: [] for enc in ENCODINGS}
    order = list(ENCODINGS)
    for i in range(steps):
        trainer.step()
        for enc in order[i % len(order):] + order[: i % len(order)]:
            c0 = time.process_time()
            writers[enc].record_step(warmup + i + 1)
            cpu[enc].append(time.process_time() - c0)
    for w in writers.values():
        w.close()
    live = _live_bits(trainer)
    last = warmup + steps
    mat: dict[str, list[float]] = {enc: [] for enc in ENCODINGS}
    exact = {enc: True for enc in ENCODINGS}
    for r in range(rounds):
        for enc in order[r % len(order):] + order[: r % len(order)]:
            t0 = time.perf_counter()
            state = ldformat.ChainReader(workdir / enc).materialize(last)
            mat[enc].append(time.perf_counter() - t0)
            exact[enc] = exact[enc] and _same(state, live)
            del state
    slots = {enc: sorted({s.encoding for e in ldformat.ChainReader(workdir / enc).state.delta_entries()
                          for s in e.slots}) for enc in ENCODINGS}
    out: dict[str, Any] = {"model": size.to_dict(), "parameters": n_params(trainer.model), "warmup": warmup,
                           "steps": steps, "rounds": rounds, "raw_state_bytes": raw,
                           "warmup_train_s_per_step": train_s / max(1, warmup), "chains": {}}
    for enc, (version, predict) in ENCODINGS.items():
        per_step = _delta_bytes(workdir / enc) / steps
        out["chains"][enc] = {
            "format_version": version, "predict_state": predict, "slot_encodings": slots[enc],
            "delta_bytes_per_step": per_step, "ratio": per_step / raw,
            "record_cpu_s": cpu[enc], "record_cpu_median_s": median(cpu[enc]),
            "record_cpu_ci": bootstrap_ci(cpu[enc]),
            "materialize_s": mat[enc], "materialize_median_s": median(mat[enc]), "exact": exact[enc],
        }
    return out


def report(res: dict[str, Any], command: str) -> str:
    chains = res["chains"]
    xor = chains["xor"]
    lines = [
        "# state.xor rows: XOR (format 1.5), differences and Adam prediction (format 1.6)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: 2-core AMD EPYC, no GPU; torch {torch.__version__}, ldformat {ldformat.__version__}. "
        f"Workload: {res['parameters'] / 1e6:.1f}M parameters, AdamW; {res['warmup']} warm-up steps, then "
        f"{res['steps']} recorded steps into each chain (the order rotating by step), batches of 4 steps; "
        f"materialize of the last step (anchor + {res['steps']} deltas) {res['rounds']} rounds, the order "
        f"rotating. Raw state per step: {human_bytes(res['raw_state_bytes'])}.",
        "",
        "| chain | format | slot encodings | delta bytes/step | / raw state | vs xor "
        "| record CPU core-s/step, median [95% CI] | materialize s (median) | bit-exact vs live |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in chains.items():
        lo, hi = c["record_cpu_ci"]
        lines.append(f"| {name} | {c['format_version']} | {', '.join(c['slot_encodings'])} | "
                     f"{human_bytes(c['delta_bytes_per_step'])} | {c['ratio']:.3f}x | "
                     f"{c['ratio'] / xor['ratio']:.3f}x | "
                     f"{c['record_cpu_median_s']:.3f} [{lo:.3f}, {hi:.3f}] | {c['materialize_median_s']:.2f} | "
                     f"{'yes' if c['exact'] else '**NO**'} |")
    best = chains["predicted"]
    lines += [
        "",
        f"Bar (issue: a lossless state delta <= 0.60x of the raw state): "
        f"{'**met**' if best['ratio'] <= 0.60 else '**NOT met**'} ({best['ratio']:.3f}x, the default of format 1.6).",
        "",
        "Record CPU includes the state snapshot (a copy of every tensor), the delta (and prediction), compression, "
        "crc32c and, every 4th step, the batch's writes, fsync and commit record, for every chain alike.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick workload")
    ap.add_argument("--warmup", type=int, default=None, help="training steps before the chains start (default 20)")
    ap.add_argument("--steps", type=int, default=None, help="recorded steps (default 12; --quick 8)")
    ap.add_argument("--rounds", type=int, default=3, help="materialize rounds per chain")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results; "
                                                              "--quick: benchmarks/results/quick)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the chains go (default: a temp dir)")
    args = ap.parse_args(argv)
    configure_threads()
    size = QUICK_WORKLOAD if args.quick else WORKLOAD
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 20)
    steps = args.steps if args.steps is not None else (8 if args.quick else 12)
    out = args.out or Path("benchmarks/results") / ("quick" if args.quick else "")
    work = Path(tempfile.mkdtemp(prefix="ldbench-enc-", dir=args.workdir))
    try:
        res = run(size, warmup, steps, args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m benchmarks.state_encoding" + (" --quick" if args.quick else "")
    text = report(res, command)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_encoding.md").write_text(text)
    (out / "state_encoding.json").write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    return 0 if all(c["exact"] for c in res["chains"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
