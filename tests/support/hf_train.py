"""Helper process for tests/integrations/test_hf_trainer.py: a Hugging Face Trainer run that may SIGKILL itself.

Run with ``sys.executable``::

    hf_train.py WORKDIR [--steps N] [--dropout P] [--kill-at K [--durable D]] [--snippet FILE]
                [--native | --plain] [--grad-accum G] [--eval] [--collator-rng] [--kwargs JSON]

The process works in ``WORKDIR`` and trains a tiny GPT-2 (built from a config, random
initialization from a fixed seed) on generated token ids with one torch thread (the bits of
a step depend on the thread count). The training is one of:

* default: the README's snippet (``--snippet FILE``, else :data:`SNIPPET`) run with
  ``exec`` on ``model``, ``args``, ``ds``, ``Trainer`` and ``LdformatCallback``; the chain is
  ``runs/hf-chain`` (the snippet's path). ``--kwargs`` replaces the snippet by the same code
  with ``LdformatCallback("runs/hf-chain", **kwargs)``.
* ``--native``: the Trainer's own checkpointing (``save_steps=1`` into ``out/``), resuming
  from its latest checkpoint when there is one: what ldformat is compared with.
* ``--plain``: no checkpointing at all.

``--kill-at K`` SIGKILLs the process from ``on_step_end`` of step ``K``, after waiting until
the chain has committed step ``D`` (``--durable``, default 4), so that the rerun resumes from
the middle of the run. ``--eval`` evaluates every 3 steps; ``--collator-rng`` uses a data collator that draws
from the torch RNG; both move the RNG states between steps.

Writes ``begin.json`` (the Trainer's step at ``on_train_begin``: where it resumed) and, when
training completes, ``final.safetensors`` (every tensor of the model's state dict).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import ldformat
from ldformat.integrations.transformers import LdformatCallback

CHAIN = "runs/hf-chain"
SNIPPET = """\
cb = LdformatCallback("runs/hf-chain")
trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
trainer.train(resume_from_checkpoint=cb.resume_checkpoint())
"""
SAMPLES, SEQ, VOCAB, BATCH = 40, 16, 128, 4  # 10 steps per epoch


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def random_collator(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stacks the batch and hides a random half of the labels: draws from the torch RNG."""
    batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
    labels = batch["labels"].clone()
    labels[torch.rand(labels.shape) < 0.5] = -100
    batch["labels"] = labels
    return batch


class Killer(TrainerCallback):
    def __init__(self, kill_at: int | None, chain: str | None, durable: int) -> None:
        self.kill_at = kill_at
        self.chain = chain
        self.durable = durable

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        Path("begin.json").write_text(json.dumps({"global_step": state.global_step}))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.kill_at is None or state.global_step != self.kill_at:
            return
        if self.chain is not None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    latest = ldformat.ChainReader(self.chain).latest_step
                except ldformat.LdformatError:
                    latest = None
                if latest is not None and latest >= self.durable:
                    break
                time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--durable", type=int, default=4)
    p.add_argument("--snippet")
    p.add_argument("--native", action="store_true")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval", action="store_true")
    p.add_argument("--collator-rng", action="store_true")
    p.add_argument("--kwargs")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.workdir, exist_ok=True)
    os.chdir(a.workdir)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=a.dropout, embd_pdrop=a.dropout, attn_pdrop=a.dropout)
    model = GPT2LMHeadModel(config)
    ds = TokenDataset(SAMPLES, seed=1)
    extra: dict[str, Any] = {}
    if a.eval:
        extra.update(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=BATCH)
    if a.native:
        extra.update(save_strategy="steps", save_steps=1)
    else:
        extra.update(save_strategy="no")
    args = TrainingArguments(
        output_dir="out", max_steps=a.steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=a.grad_accum, learning_rate=1e-3, warmup_steps=3, logging_steps=2,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **extra,
    )
    kill = Killer(a.kill_at, None if a.native or a.plain else CHAIN, a.durable)
    trainer_kwargs: dict[str, Any] = {}
    if a.eval:
        trainer_kwargs["eval_dataset"] = TokenDataset(8, seed=2)
    if a.collator_rng:
        trainer_kwargs["data_collator"] = random_collator

    class Trainer(transformers.Trainer):
        """The Trainer the snippet uses, with the killer and the options above added."""

        def __init__(self, **kwargs: Any) -> None:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), kill]
            super().__init__(**kwargs, **trainer_kwargs)

    if a.native or a.plain:
        trainer = Trainer(model=model, args=args, train_dataset=ds)
        resume = get_last_checkpoint("out") if a.native and os.path.isdir("out") else None  # type: ignore[no-untyped-call]
        trainer.train(resume_from_checkpoint=resume)
    else:
        snippet = Path(a.snippet).read_text() if a.snippet else SNIPPET
        if a.kwargs:
            snippet = snippet.replace(f'LdformatCallback("{CHAIN}")', f'LdformatCallback("{CHAIN}", **kwargs)')
        namespace: dict[str, Any] = {"model": model, "args": args, "ds": ds, "Trainer": Trainer,
                                     "LdformatCallback": LdformatCallback,
                                     "kwargs": json.loads(a.kwargs) if a.kwargs else {}}
        exec(compile(snippet, "snippet", "exec"), namespace)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, "final.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
