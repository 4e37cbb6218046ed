"""Checkpoint every step of a Hugging Face Trainer run with ldformat, and resume after a crash.

    pip install 'ldformat[hf]'
    python examples/hf_trainer.py        # trains a tiny GPT-2 for 200 steps: about 2 minutes on 2 CPU cores

Interrupt it at any point (Ctrl-C, ``kill -9``, a power cut) and run the same command again:
it continues from the chain's latest committed step, and the final weights are bit for bit
those of an uninterrupted run. The chain is ``runs/hf-chain``; ``ldtools info runs/hf-chain``
shows it. Delete that folder to start over.

On resuming, Transformers logs ``There were missing keys in the checkpoint model loaded:
['lm_head.weight']``. GPT-2's output head is tied to its token embedding, and
``save_pretrained`` stores a tied weight once (the Trainer's own checkpoints do the same);
loading ties the head to the embedding again. Nothing is missing from the resumed model.

The model is built from a config (random weights, no download) and trained on generated
token ids, so the example runs anywhere.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ldformat.integrations.transformers import LdformatCallback


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences; the model learns their unigram statistics."""

    def __init__(self, n: int = 256, length: int = 32, vocab: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
    ds = TokenDataset()
    args = TrainingArguments(
        output_dir="runs/hf-trainer",
        max_steps=200,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=50,
        save_strategy="no",  # ldformat checkpoints every step; the Trainer need not save
        report_to=[],
        use_cpu=True,
        seed=0,
    )

    cb = LdformatCallback("runs/hf-chain")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_checkpoint())

    print(f"trained to step {trainer.state.global_step}; chain: runs/hf-chain (try `ldtools info runs/hf-chain`)")


if __name__ == "__main__":
    main()
