"""Checkpoint every training step to S3 (or any S3-compatible store), then read it back.

    export AWS_ENDPOINT_URL=http://localhost:9000 AWS_ALLOW_HTTP=true      # a local S3, if any
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=us-east-1
    python examples/s3_checkpoint.py s3://my-bucket/runs/tiny
    LDFORMAT_URL=s3://my-bucket/runs/tiny python examples/s3_checkpoint.py --steps 50

The bucket must exist (ldformat never creates one) and the prefix must be empty or hold a
chain written by this script: a second run resumes from the latest step and appends. The
script trains a tiny MLP with ``ldformat.Checkpointer`` (every step is captured; batches of
steps are committed in the background), then materializes the latest step from the store,
checks it bit for bit against the live model and optimizer, and validates the chain. It
exits non-zero if any check fails. Needs ``pip install 'ldformat[s3]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import ldformat


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equal bits, not merely equal values."""
    return t.detach().reshape(-1).view(torch.uint8)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", default=os.environ.get("LDFORMAT_URL"),
                        help="where the chain lives, e.g. s3://bucket/prefix (default: $LDFORMAT_URL)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if not args.url:
        parser.error("give the chain's URL (s3://bucket/prefix) as an argument or in LDFORMAT_URL")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(256, 16)
    target = data[:, :4].sum(dim=1, keepdim=True).expand(-1, 4).clone()

    start = ldformat.resume(args.url, model, optimizer)  # 0 for a new chain
    ck = ldformat.Checkpointer(args.url, model, optimizer, mode="xor", step=start,
                               anchor_every=10, batch_steps=5)
    for step in range(start + 1, start + args.steps + 1):
        i = (step * 32) % len(data)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(data[i:i + 32]), target[i:i + 32])
        loss.backward()
        optimizer.step()  # captured by the checkpointer's optimizer hooks
    ck.close()  # commits everything still in flight
    print(f"trained steps {start + 1}..{start + args.steps}, last loss {loss.item():.4f}")

    reader = ldformat.ChainReader(args.url)
    state = reader.materialize()  # the latest step, fetched from the store
    ok = state["step"] == start + args.steps and same_bits(state["model"], model.state_dict())
    live_opt = optimizer.state_dict()["state"]
    ok = ok and all(same_bits(state["optimizer"]["state"][i], live_opt[i]) for i in live_opt)
    print(f"step {state['step']} materialized from {args.url}: {'bit-exact' if ok else 'MISMATCH'}")

    report = ldformat.validate(args.url)
    print(f"validate: {'ok' if report.ok else 'INVALID'} ({len(reader.steps)} steps, anchors {reader.anchors})")
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    return 0 if ok and report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
