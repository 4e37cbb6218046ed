"""Lightning: checkpoint every optimizer step with ldformat, and continue after a crash.

    python examples/lightning.py --fresh --kill-at 80   # a new chain; dies like a crash (SIGKILL) after step 80
    python examples/lightning.py                        # the same command continues from the chain to step 200
    python examples/lightning.py --fresh --kill-at 80; python examples/lightning.py --verify
        # the same, then also trains an uninterrupted run and compares the weights bit for bit

--fresh deletes the chain (runs/lightning/chain) first. Without it the script continues the
chain that is there: once that chain has reached --steps, there is nothing left to train and
--kill-at never fires.

The model is a small causal transformer with dropout, trained on synthetic token sequences;
the data come from torchdata's ``StatefulDataLoader``, whose position Lightning records, so
a run resumed in the middle of an epoch sees the same batches. ``LdformatCheckpoint`` records
every optimizer step and ``cb.resume_checkpoint()`` turns the chain's latest step into the
``.ckpt`` that ``trainer.fit`` resumes from (None on a fresh chain): the resumed run ends
bit-identical to an uninterrupted one, dropout included. ``--verify`` checks that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

# This file is named lightning.py: keep its folder off the import path, or `import lightning`
# would import this file instead of the Lightning package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import ldformat  # noqa: E402
from ldformat.integrations.lightning import LdformatCheckpoint  # noqa: E402

VOCAB, SEQ = 64, 32


class TinyLM(L.LightningModule):
    """A two-layer causal transformer with dropout, AdamW and a cosine LR schedule."""

    def __init__(self, width: int = 32, dropout: float = 0.1, steps: int = 200) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(SEQ, width)
        self.blocks = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=dropout, batch_first=True, norm_first=True),
            num_layers=2, enable_nested_tensor=False,
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.blocks(h, mask=mask, is_causal=True))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams["steps"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def token_data(n: int = 640) -> TensorDataset:
    """Sequences that count up modulo VOCAB from a random start, with 10% of tokens replaced by noise."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(VOCAB, (n, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    return TensorDataset(torch.where(noise, torch.randint(VOCAB, tokens.shape, generator=g), tokens))


class KillAt(L.Callback):
    """Simulates a crash: SIGKILL (no cleanup, no flush) once ``trainer.global_step`` reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"-- killing the process after step {self.step} (run the command again to continue)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train(chain: Path, steps: int, kill_at: int | None = None) -> TinyLM:
    """The whole training script: the same code starts a run and continues a crashed one."""
    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)  # the bits of a step depend on the thread count (keep it fixed to compare runs)
    model = TinyLM(steps=steps)
    loader = StatefulDataLoader(token_data(), batch_size=32, shuffle=True)
    cb = LdformatCheckpoint(chain)
    trainer = L.Trainer(max_steps=steps, callbacks=[cb, *([KillAt(kill_at)] if kill_at else [])],
                        accelerator="cpu", devices=1, deterministic=True, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    ckpt_path = cb.resume_checkpoint()  # None on a fresh chain
    print(f"-- {'resuming from ' + ckpt_path if ckpt_path else 'starting a new chain'} at {chain}", flush=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/lightning"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL the process after this step")
    parser.add_argument("--fresh", action="store_true", help="delete the chain first")
    parser.add_argument("--verify", action="store_true", help="compare with an uninterrupted run, bit for bit")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    chain = args.out / "chain"
    if args.fresh:
        shutil.rmtree(chain, ignore_errors=True)

    model = train(chain, args.steps, args.kill_at)

    reader = ldformat.ChainReader(chain)
    print(f"-- chain: steps {reader.steps[0]}..{reader.latest_step}, {len(reader.anchors)} anchors, "
          f"{reader.bytes_on_disk() / 2**20:.1f} MiB on disk; "
          f"validate: {'ok' if ldformat.validate(chain).ok else 'FAILED'}")
    if args.verify:
        reference = args.out / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        uninterrupted = train(reference, args.steps)
        same = same_bits(model.state_dict(), uninterrupted.state_dict())
        print(f"-- final weights {'bit-identical to' if same else 'DIFFER from'} an uninterrupted run")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
