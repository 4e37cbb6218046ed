"""Train a tiny GPT and checkpoint every step with ldformat, once per chain kind.

    python examples/train_tiny.py                 # 60 steps into runs/demo
    python examples/train_tiny.py --steps 120 --out runs/long

For each kind (grad.topk with 1% top-k gradient compression, grad.dense, state.xor) the same
model is trained from the same seed while every step is recorded into a chain. Afterwards
the script checks that the latest step materializes bit for bit to the live state, runs a
deep validation, compares the chain's size and load time with plain torch.save checkpoints,
and finally drives the ``ldtools`` command line. It exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ldformat
from ldformat import ChainReader, ChainWriter, TopK

VOCAB, SEQ, BATCH = 512, 64, 8
KINDS = ("grad.topk", "grad.dense", "state.xor")


# -- model and data ----------------------------------------------------------------------------
class TinyGPT(nn.Module):
    """Decoder-only transformer: pre-LN encoder layers under a causal mask, tied embedding/head."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, width: int = 192, heads: int = 6, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2 initialization keeps the first logits small

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.tok(tokens) + self.pos(torch.arange(n))
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


class MarkovData:
    """Sequences from a fixed random Markov chain: every token has 4 successors, drawn Zipf-like."""

    def __init__(self, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
        self.successors = torch.multinomial(zipf.expand(VOCAB, VOCAB), 4, replacement=True, generator=g)
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + step)
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        choice = torch.randint(0, 4, (BATCH, SEQ + 1), generator=g)
        for t in range(1, SEQ + 1):
            tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


def make_run(steps: int) -> tuple[TinyGPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = TinyGPT()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("pos")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.startswith("pos"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    return model, opt, sched


# -- checks and measurements -------------------------------------------------------------------
def int_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where two nested states differ (tensors compared bitwise as integers)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return [f"{where}: dtype/shape"]
        return [] if torch.equal(int_view(got), int_view(want)) else [f"{where}: bits differ"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys differ"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def live_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def median_time(fn: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# -- one training run per kind -----------------------------------------------------------------
def train(kind: str, chain: Path, steps: int, data: MarkovData) -> dict[str, Any]:
    model, opt, sched = make_run(steps)
    topk = TopK(0.01) if kind == "grad.topk" else None
    losses = []
    t0 = time.perf_counter()
    writer = ChainWriter.create(chain, model, opt, kind=kind, compressor=topk, batch_steps=8, anchor_every=50,
                                extra={"scheduler": sched.state_dict()})
    with writer:
        for step in range(1, steps + 1):
            x, y = data.batch(step)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if topk is not None:
                topk.compress_(model)  # the compressed gradient is what the step uses and what is recorded
            opt.step()
            sched.step()
            losses.append(loss.item())
            writer.record_step(step, extra={"scheduler": sched.state_dict(), "loss": losses[-1]})
    return {"model": model, "opt": opt, "sched": sched, "losses": losses, "seconds": time.perf_counter() - t0}


def check_and_measure(kind: str, chain: Path, run: dict[str, Any], full_path: Path) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    model, opt, sched = run["model"], run["opt"], run["sched"]
    reader = ChainReader(chain)
    latest = reader.latest_step
    assert latest is not None, f"{chain}: no committed step"
    state = reader.materialize(latest)
    got = {"model": state["model"], "optimizer": state["optimizer"], "scheduler": state["extra"]["scheduler"]}
    diffs = differences(got, live_state(model, opt, sched))
    if diffs:
        problems.append(f"{kind}: step {latest} does not match the live state: {', '.join(diffs[:3])}")

    report = ldformat.validate(chain, deep=True)
    if not report.ok:
        problems.extend(f"{kind}: validate: {p}" for p in report.problems)

    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, full_path)
    full = full_path.stat().st_size
    info = ldformat.chain_info(reader).to_dict()  # what `ldtools info --json` prints
    t_mat = median_time(lambda: ChainReader(chain).materialize(latest))
    t_load = median_time(lambda: torch.load(full_path, weights_only=True))
    return {
        "latest": latest,
        "steps": info["steps"],
        "anchors": info["anchors"],
        "delta_per_step": info["delta_bytes_per_step"],
        "full": full,
        "total": info["bytes_on_disk"],
        "t_mat": t_mat,
        "t_load": t_load,
        "replay": len(reader.state.replay_path(latest)[1]),
        "valid": report.ok,
        "drift": report.drift,
        "bit_exact": not diffs,
    }, problems


def print_table(kind: str, run: dict[str, Any], m: dict[str, Any]) -> None:
    n = m["steps"]
    rows = [
        ("training", f"{len(run['losses'])} steps in {run['seconds']:.1f} s, loss {run['losses'][0]:.2f} -> "
                     f"{run['losses'][-1]:.2f}" + ("  (top-k gradients: this mode changes training; "
                                                  "the other two train exactly as without ldformat)"
                                                  if kind == "grad.topk" else "")),
        ("delta per step", f"{human(m['delta_per_step'])}  (one full checkpoint: {human(m['full'])}, "
                           f"{m['full'] / m['delta_per_step']:.1f}x larger)"),
        ("whole chain", f"{human(m['total'])} for {n} steps, anchors at {m['anchors']}  vs "
                        f"{human(n * m['full'])} for {n} full checkpoints ({n * m['full'] / m['total']:.1f}x smaller)"),
        (f"load step {m['latest']}", f"materialize {m['t_mat'] * 1000:.0f} ms (anchor + {m['replay']} deltas)  vs "
                                     f"torch.load {m['t_load'] * 1000:.0f} ms  (median of 3)"),
        ("checks", f"bit-exact vs live state: {'yes' if m['bit_exact'] else 'NO'};  validate --deep: "
                   f"{'ok' if m['valid'] else 'FAILED'}, replay drift "
                   f"{max((d['max_ulps'] for d in m['drift']), default=0)} ULPs"),
    ]
    print(f"\n== {kind} ==")
    for label, value in rows:
        print(f"  {label:<15} {value}")


def ldtools(*args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "ldtools", *args]
    print(f"\n$ ldtools {' '.join(args)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).rstrip()
    if output:
        print("  " + output.replace("\n", "\n  "))
    return proc.returncode, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory (recreated)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(2)
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    started = time.perf_counter()
    data = MarkovData()
    n_params = sum(p.numel() for p in TinyGPT().parameters())
    print(f"TinyGPT: {n_params / 1e6:.2f}M parameters (tied embedding/head), vocab {VOCAB}, seq {SEQ}, "
          f"batch {BATCH}; AdamW + warmup/cosine LR; torch {torch.__version__}, 2 threads")
    print(f"{args.steps} steps per kind, every step recorded (batch_steps=8, anchor_every=50) into {out}/<kind>")

    problems: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        chain = out / kind
        run = train(kind, chain, args.steps, data)
        runs[kind] = run
        measured, found = check_and_measure(kind, chain, run, out / f"{kind}.full.pt")
        problems.extend(found)
        print_table(kind, run, measured)

    # The command line on the grad.topk chain.
    kind = KINDS[0]
    code, _ = ldtools("validate", str(out / kind))
    if code != 0:
        problems.append(f"ldtools validate {out / kind} exited {code}")
    latest = ChainReader(out / kind).latest_step
    target = out / "step.pt"
    code, _ = ldtools("materialize", str(out / kind), "--step", str(latest), "-o", str(target))
    if code != 0:
        problems.append(f"ldtools materialize exited {code}")
    else:
        loaded = torch.load(target, weights_only=True)
        run = runs[kind]
        got = {"model": loaded["model"], "optimizer": loaded["optimizer"], "scheduler": loaded["extra"]["scheduler"]}
        diffs = differences(got, live_state(run["model"], run["opt"], run["sched"]))
        print(f"  torch.load({target}, weights_only=True): step {loaded['step']}, "
              f"{'bit-exact vs the live state' if not diffs else 'DIFFERS: ' + ', '.join(diffs[:3])}")
        if diffs:
            problems.append(f"{target} differs from the live state")

    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    if problems:
        print("\nFAILED:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
