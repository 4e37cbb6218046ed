"""The flight recorder on a tiny model: a run with an injected spike, the stats, the picture,
the rollback (docs/flight-recorder.md).

    python examples/flight_recorder.py [OUT]      # default: runs/flight-recorder

Trains a small MLP for 60 steps with AdamW, logging the loss with every step; at steps 40
and 41 the learning rate is multiplied by 100. Then it runs ``ldtools stats`` (which flags
step 40 and prints the rollback command), writes ``OUT/history.html`` with ``ldtools plot``,
rolls the chain back with ``ldtools truncate`` and resumes training from step 39 with
``ldformat.resume``. A few seconds on a laptop CPU.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import ldformat
from ldformat import rollback_step, step_history

STEPS = 60
SPIKE = (40, 41)  # the steps whose learning rate is multiplied by 100


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()


def train(chain: Path, model: nn.Module, opt: torch.optim.Optimizer, start: int, end: int,
          spike: tuple[int, ...] = SPIKE) -> None:
    """Steps ``start + 1`` .. ``end`` into ``chain`` (a new chain when ``start`` is 0)."""
    # Every step, whatever it costs: a per-step history is the point here (by default the capture
    # interval adapts to a 3.5 % overhead budget, docs/capture-runtime.md "Bounded cost").
    every_step = ldformat.CaptureOptions(capture_every=1)
    with ldformat.Checkpointer(chain, model, opt, anchor_every=25, batch_steps=10, options=every_step) as ck:
        for step in range(start + 1, end + 1):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            ck.log(loss=loss)  # before optimizer.step(): recorded with this step
            scale = 100.0 if step in spike else 1.0
            for g in opt.param_groups:
                g["lr"] = 1e-3 * scale
            opt.step()


def ldtools(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ldtools", *args], capture_output=True, text=True, check=True)
    return done.stdout


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    chain = out / "chain"
    model, opt = make_model()
    train(chain, model, opt, 0, STEPS)

    report = ldtools("stats", str(chain))
    (out / "stats.txt").write_text(report)
    print(report)
    print(ldtools("plot", str(chain), "-o", str(out / "history.html")))
    try:
        import matplotlib  # noqa: F401  (the optional extra: pip install 'ldformat[plots]')
    except ImportError:
        print("matplotlib is not installed: no history.png (history.html needs nothing)")
    else:
        print(ldtools("plot", str(chain), "-o", str(out / "history.png")))

    # The rollback that stats advises: keep the steps before the first flagged one, resume.
    rollback = rollback_step(list(step_history(str(chain))))
    if rollback is None:
        raise SystemExit("no step was flagged")
    print(ldtools("truncate", str(chain), "--after", str(rollback), "--yes"))
    model, opt = make_model()
    resumed = ldformat.resume(chain, model, opt)
    print(f"resumed at step {resumed}; training on without the spike")
    train(chain, model, opt, resumed, STEPS, spike=())
    print(ldtools("stats", str(chain), "--from", str(rollback - 5)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/flight-recorder"))
