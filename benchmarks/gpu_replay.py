"""Materialize a chain recorded on a GPU: replay on the GPU against replay on the CPU.

``python -m benchmarks.gpu_replay [--steps N] [--size NAME] [--out DIR]`` trains the fixed
workload on CUDA with a ``Checkpointer`` in ``lowdiff+`` and ``xor`` mode (one anchor, then
``--steps`` deltas), keeping a CPU copy of the live state of the last step. It then
materializes that step from each chain: gradient chains with ``replay_device="cuda"`` and
on the CPU, ``xor`` on the CPU, and reports per run the wall time and how many elements
differ from the live state (bits compared as integers). Gradient replay is exact only on
the device type that recorded the chain (spec §11.8): the CPU row measures that drift.
Writes ``gpu_replay.md`` and ``gpu_replay.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .workload import QUICK_WORKLOAD, WORKLOAD, Trainer, n_params


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def live_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().to("cpu", copy=True) for k, v in trainer.model.state_dict().items()}
    for i, st in trainer.optimizer.state_dict()["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer/{i}/{key}"] = v.detach().to("cpu", copy=True)
    return out


def differing(state: dict[str, Any], want: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(elements that differ, tensors that differ, elements compared)."""
    got = {f"model/{k}": v for k, v in state["model"].items()}
    for i, st in state["optimizer"]["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                got[f"optimizer/{i}/{key}"] = v
    elements = tensors = total = 0
    for name, w in want.items():
        g = got[name]
        n = int((_bits(g) != _bits(w)).sum())
        elements += n
        tensors += int(n > 0)
        total += w.numel()
    return elements, tensors, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_replay", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="deltas after the anchor")
    parser.add_argument("--quick", action="store_true", help="the small workload")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu_replay: needs a CUDA device")
        return 2
    import ldformat
    from ldformat import ChainReader

    size = QUICK_WORKLOAD if args.quick else WORKLOAD
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-replay-"))
    try:
        for mode in ("lowdiff+", "xor"):
            trainer = Trainer(size, device="cuda")
            trainer.prefetch(1, 2 + args.steps)
            trainer.step()
            trainer.step()  # AdamW state exists before the chain starts
            chain = work / mode
            ck = ldformat.Checkpointer(chain, trainer.model, trainer.optimizer, mode=mode,
                                       anchor_every=args.steps + 1, batch_steps=5)
            for _ in range(args.steps):
                trainer.step()
            torch.cuda.synchronize()
            want = live_tensors(trainer)
            ck.close()
            devices = ["cuda", "cpu"] if mode != "xor" else ["cpu"]
            for device in devices:
                reader = ChainReader(chain, replay_device=device)
                last = reader.latest_step
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ldformat.ReplayEnvironmentWarning)
                    t0 = time.perf_counter()
                    state = reader.materialize(last)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                diff, tensors, total = differing(state, want)
                row = {"mode": mode, "replay_device": device, "deltas": args.steps, "seconds": seconds,
                       "elements_differing": diff, "tensors_differing": tensors, "elements": total}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del trainer, ck
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "model": size.to_dict(), "parameters": n_params(Trainer(size).model)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_replay.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# Materializing a chain recorded on a GPU",
        "",
        f"{meta['gpu']}, torch {meta['torch']} (CUDA {meta['cuda']}); workload {size.name} "
        f"({meta['parameters'] / 1e6:.1f}M parameters), AdamW; anchor + {args.steps} deltas. "
        "Command: `python -m benchmarks.gpu_replay`.",
        "",
        "| chain | replay on | materialize (s) | elements differing from the live state | tensors differing |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['replay_device']} | {r['seconds']:.2f} | "
                     f"{r['elements_differing']:,} of {r['elements']:,} | {r['tensors_differing']} |")
    (args.out / "gpu_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
