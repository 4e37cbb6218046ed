"""Helper process for tests/integrations/test_lightning.py: a tiny Lightning training run, killed or not.

``python lightning_train.py CONFIG_JSON`` runs every run of the config, each in a process
forked from this one after the imports (importing Lightning costs seconds; a fork,
milliseconds); a forked run has trained nothing before, like a rerun of a script. The config
is ``{"steps": N, "runs": [RUN, ...]}`` and a run is ``{"name", "chain", "out", "dropout",
"kill_at", "method", "then"}`` plus options (``batch_steps``, ``wait``, ``loader``:
``"stateful"`` or ``"plain"``, ``val``, ``accumulate``, ``model``: ``"mlp"`` or ``"gpt2"``):

* ``method`` ``"ldformat"``: ``LdformatCheckpoint(chain)`` and
  ``trainer.fit(..., ckpt_path=cb.resume_checkpoint())``; ``"lightning"``: Lightning's own
  ``ModelCheckpoint(dirpath=chain, every_n_train_steps=1, save_last=True)`` and
  ``ckpt_path="last"`` (the baseline the integration is compared with);
* ``kill_at``: the run SIGKILLs itself at ``on_train_batch_end`` of that global step; with
  ``"wait": true`` once the step before it is durable, so that the rerun resumes from
  ``kill_at - 1`` (with ``"method": "lightning"`` the last checkpoint is of that step too);
* ``then``: a run forked after this one was reaped (the rerun of the same script);
* ``out``: where the final model and optimizer state go (``torch.save``), with the step the
  run resumed from.

Runs in the list are forked together (concurrently); a ``then`` run waits for its parent.
Prints one JSON line: ``{name: how the process ended}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, ...) is not under test here

import lightning.pytorch as L  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from ldformat.integrations.lightning import LdformatCheckpoint  # noqa: E402

BATCH = 8
SAMPLES = 60  # 8 batches per epoch, the last one short: runs cross epoch boundaries


class TinyModule(L.LightningModule):
    """An MLP with dropout and BatchNorm (buffers: running stats, an int64 counter) under AdamW + a step LR schedule."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(32, 1))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen += x.shape[0]
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinyGPT2(L.LightningModule):
    """A GPT-2 language model built from a ``GPT2Config`` (2 layers, width 32, tied embeddings,
    dropout in every place GPT-2 has one), nothing downloaded, under AdamW + a step LR schedule."""

    def __init__(self, dropout: float) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        self.net = GPT2LMHeadModel(config)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    configure_optimizers = TinyModule.configure_optimizers


VOCAB, SEQ = 64, 16


def token_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


class KillAt(L.Callback):
    def __init__(self, step: int, cb: LdformatCheckpoint | None) -> None:
        self.step = step
        self.cb = cb

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 30
        while self.cb is not None and time.monotonic() < deadline:
            ck = self.cb.checkpointer
            if ck is None or (ck.durable_step or 0) >= self.step - 1:
                break
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)


def train(run: dict[str, Any], steps: int) -> None:
    torch.set_num_threads(1)  # the bits of a step depend on the thread count
    L.seed_everything(0, verbose=False)
    gpt2 = run.get("model", "mlp") == "gpt2"
    model: L.LightningModule = TinyGPT2(run["dropout"]) if gpt2 else TinyModule(run["dropout"])
    data = token_dataset() if gpt2 else dataset()
    loader_class = StatefulDataLoader if run.get("loader", "stateful") == "stateful" else DataLoader
    loader = loader_class(data, batch_size=BATCH, shuffle=True)
    val = DataLoader(data, batch_size=20) if run.get("val") else None
    trainer_args: dict[str, Any] = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                        enable_progress_bar=False, enable_model_summary=False,
                                        deterministic=True, accumulate_grad_batches=run.get("accumulate", 1),
                                        val_check_interval=5 if val is not None else None,
                                        limit_val_batches=None if val is not None else 0)
    cb, ckpt_path = None, None
    if run["method"] == "ldformat":
        cb = LdformatCheckpoint(run["chain"], batch_steps=run.get("batch_steps", "auto"))
        callbacks: list[L.Callback] = [cb]
        trainer_args["enable_checkpointing"] = False
        ckpt_path = cb.resume_checkpoint()
    else:
        callbacks = [L.callbacks.ModelCheckpoint(dirpath=run["chain"], every_n_train_steps=1, save_last=True,
                                                 save_top_k=0)]
        last = Path(run["chain"], "last.ckpt")
        ckpt_path = str(last) if last.exists() else None
    if run.get("kill_at"):
        callbacks.insert(0, KillAt(run["kill_at"], cb if run.get("wait") else None))
    resumed_from = torch.load(ckpt_path, weights_only=True)["global_step"] if ckpt_path else None
    trainer = L.Trainer(callbacks=callbacks, **trainer_args)
    trainer.fit(model, loader, val, ckpt_path=ckpt_path)
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                "global_step": trainer.global_step, "resumed_from": resumed_from}, run["out"])


def fork(run: dict[str, Any], steps: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(run, steps)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    config = json.loads(sys.argv[1])
    steps = config["steps"]
    results: dict[str, str] = {}
    running = {fork(run, steps): run for run in config["runs"]}
    while running:
        pid, status = os.wait()
        run = running.pop(pid)
        results[run["name"]] = ended(status)
        if run.get("then"):
            running[fork(run["then"], steps)] = run["then"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
