"""The fixed benchmark workload: a GPT-style model defined here, AdamW, synthetic tokens.

The full workload is 8 pre-LN transformer blocks, width 512, 8 heads, vocabulary 8192,
sequence 256, tied embedding/head (29.5M parameters), batch 8 x 256, AdamW. ``--quick`` uses
the same code at a smaller size. Every configuration runs with ``torch.set_num_threads(2)``
and one blosc thread (set by :func:`configure_threads`; the GPU benchmark sets its own torch
threads). :class:`Trainer` runs on the CPU unless given a ``device``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    name: str
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.layers} layers, d={self.width}, {self.heads} heads, vocab {self.vocab}, seq {self.seq}, "
                f"batch {self.batch}, tied embedding")


# ~30M parameters, batch 8 x sequence 256.
WORKLOAD = ModelSize("gpt-30m", layers=8, width=512, heads=8, vocab=8192, seq=256, batch=8)
QUICK_WORKLOAD = ModelSize("gpt-3m", layers=4, width=192, heads=6, vocab=4096, seq=64, batch=8)

# Fast steps on one torch thread (benchmarks/interval.py): a small GPT on few tokens, so that a step
# (<= 0.1 s) is short against the state it checkpoints, as on a GPU node.
FAST_WORKLOAD = ModelSize("gpt-4m-fast", layers=4, width=256, heads=4, vocab=4096, seq=32, batch=2)
QUICK_FAST_WORKLOAD = ModelSize("gpt-0.7m-fast", layers=2, width=128, heads=4, vocab=2048, seq=32, batch=2)

# Scaling (bytes per step, materialize time): cheap runs, so a shorter sequence than the workload.
SCALING_SIZES = [
    ModelSize("gpt-7m", layers=4, width=256, heads=4, vocab=8192, seq=128, batch=4),
    ModelSize("gpt-14m", layers=6, width=384, heads=6, vocab=8192, seq=128, batch=4),
    WORKLOAD,
    ModelSize("gpt-60m", layers=8, width=768, heads=12, vocab=8192, seq=128, batch=4),
]
QUICK_SCALING_SIZES = [
    ModelSize("gpt-0.6m", layers=2, width=96, heads=4, vocab=2048, seq=32, batch=4),
    ModelSize("gpt-1.4m", layers=3, width=128, heads=4, vocab=4096, seq=32, batch=4),
    QUICK_WORKLOAD,
]


def configure_threads(torch_threads: int = 2) -> None:
    """torch threads (2 for the CPU benchmarks) and codec threads = 1 in every configuration."""
    torch.set_num_threads(torch_threads)
    try:
        import numcodecs.blosc

        numcodecs.blosc.set_nthreads(1)
        numcodecs.blosc.use_threads = False
    except ImportError:  # pragma: no cover - numcodecs is a dependency of ldformat
        pass


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and a tied embedding/head."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(size.vocab, size.width)
        self.pos = nn.Embedding(size.seq, size.width)
        self.blocks = nn.ModuleList(Block(size.width, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * size.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() deduplicates the tied weight


class Data:
    """Synthetic tokens: a fixed random bigram table makes the loss go down a little."""

    def __init__(self, size: ModelSize, seed: int = 1234) -> None:
        self.size = size
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, size.vocab, (size.vocab, 4), generator=g)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.size
        g = torch.Generator().manual_seed(self.seed + step)
        choice = torch.randint(0, 4, (s.batch, s.seq + 1), generator=g)
        noise = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g)
        use_noise = torch.rand(s.batch, s.seq + 1, generator=g) < 0.2
        tokens = torch.empty(s.batch, s.seq + 1, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for t in range(1, s.seq + 1):
            nxt = self.successors[tokens[:, t - 1], choice[:, t]]
            tokens[:, t] = torch.where(use_noise[:, t], noise[:, t], nxt)
        return tokens[:, :-1], tokens[:, 1:]


class Trainer:
    """One training run: model, AdamW, data; ``step()`` runs one optimizer step.

    ``device``: where the model, optimizer state and batches live. Batches are generated on the
    CPU (pinned when the device is CUDA) and copied to the device at the start of a step.
    """

    def __init__(self, size: ModelSize, seed: int = 0, compressor: Any = None, data: ModelSize | None = None,
                 device: str | torch.device = "cpu") -> None:
        """``data``: a different batch/sequence for the tokens (cheap steps); defaults to ``size``."""
        torch.manual_seed(seed)
        self.size = size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # Initialised on the CPU, then moved: the same initial weights on every device.
        self.model = GPT(size).to(self.device)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-4, betas=(0.9, 0.95),
        )
        self.data = Data(data or size)
        self.compressor = compressor  # a ldformat.TopK: the training's own gradient compression
        self.steps = 0
        self.compress_s = 0.0
        self._batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _host_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(step % 64)
        if self.cuda:  # pinned, so that the copy in step() can be asynchronous
            x, y = x.contiguous().pin_memory(), y.contiguous().pin_memory()
        return x, y

    def prefetch(self, first: int, count: int) -> None:
        """Generate batches ahead (untimed), so that data generation is not part of a step."""
        self._batches = {s: self._host_batch(s) for s in range(first, first + count)}

    def step(self) -> float:
        import time

        self.steps += 1
        batch = self._batches.pop(self.steps, None)
        x, y = batch if batch is not None else self._host_batch(self.steps)
        if self.cuda:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, self.size.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        events: tuple[Any, Any] | None = None
        if self.compressor is not None:
            if self.cuda:
                # Kernels run asynchronously: time them with events, not the host clock.
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
                self.compressor.compress_(self.model)
                events[1].record()
            else:
                t0 = time.perf_counter()
                self.compressor.compress_(self.model)
                self.compress_s += time.perf_counter() - t0
        self.optimizer.step()
        value = float(loss.detach())  # waits for the step's kernels on the current stream
        if events is not None:
            events[1].synchronize()
            self.compress_s += events[0].elapsed_time(events[1]) / 1000.0
        return value

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
