"""Build the golden (reference) chains of the current format version.

Usage::

    python tests/golden/make_golden.py OUTDIR

writes one directory per chain under ``OUTDIR``::

    OUTDIR/golden.json                     what each chain exercises, and its steps
    OUTDIR/<name>/chain/                   the chain itself (ldformat.json, log/, anchors/, deltas/)
    OUTDIR/<name>/expected/<step>.safetensors
                                           the live training state after <step>, captured while
                                           the chain was written (not read back from the chain)

An expected file holds ``model.<state_dict key>`` (tied keys as separate copies),
``optimizer.<param index>.<key>`` and, where a reader must return top-k residuals,
``compressor.<parameter name>``. Its safetensors metadata holds ``step``, ``model_keys``
(the state_dict order, JSON), ``param_groups`` and ``extra`` (tagged JSON, spec "JSON values")
and ``compressor`` (``present`` or ``absent``: whether ``materialize`` returns residuals).

Golden chains are written once per format version and committed (``tests/golden/<version>/``);
every later reader must still read them bit for bit. Never regenerate the files of a released
format version: add a new version directory instead.

The gradient chains use SGD with power-of-two learning rates and momentum, so that every
operation of the replayed optimizer step is correctly rounded: replay is then bit-exact on
every CPU and torch build, which a golden file that later readers must match requires.
(Adam replay is exact only in the recording environment; tests/test_exactness.py covers it
against live training.) The ``state.xor`` chain uses Adam: XOR replay is exact everywhere.
"""

from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

import ldformat
from ldformat.jsonvalue import canonical, encode

VOCAB = 16
WIDTH = 8


class GoldenNet(nn.Module):
    """A model with everything the format must handle, in a few hundred parameters.

    Tied weights (``head.weight`` is ``embed.weight``), a bfloat16 layer, BatchNorm buffers
    (float32 and an int64 counter), a bool buffer, a parameter that the optimizer manages but
    that never receives a gradient (``unused``) and a frozen parameter outside the optimizer.
    """

    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Parameter(torch.randn(3))
        self.frozen = nn.Parameter(torch.randn(2), requires_grad=False)
        self.register_buffer("seen", torch.zeros(4, dtype=torch.bool))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen[int(tokens[0]) % 4] = True
        h = self.embed(tokens)
        h = torch.relu(self.hidden(h.to(torch.bfloat16)).float())
        h = self.norm(h)
        return self.head(h) + self.frozen.sum()


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, VOCAB, (12,), generator=g), torch.randint(0, VOCAB, (12,), generator=g)


def param_groups(model: GoldenNet) -> list[dict[str, Any]]:
    return [
        {"params": [model.embed.weight, model.hidden.weight, model.hidden.bias]},
        {"params": [model.norm.weight, model.norm.bias, model.unused], "lr": 2.0**-6, "momentum": 0.0},
    ]


def sgd(model: GoldenNet) -> torch.optim.Optimizer:
    # Powers of two: every replayed operation is exact or correctly rounded (see module doc).
    return torch.optim.SGD(param_groups(model), lr=2.0**-5, momentum=0.5)


def adam(model: GoldenNet) -> torch.optim.Optimizer:
    groups = param_groups(model)
    del groups[1]["momentum"]
    return torch.optim.Adam(groups, lr=0.01)


def forward_backward(model: GoldenNet, optimizer: torch.optim.Optimizer, step: int, seed: int) -> None:
    model.train()
    x, y = batch(step, seed)
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def extra_state(step: int, scheduler: Any = None) -> dict[str, Any]:
    """Extra state using every tagged JSON form."""
    out: dict[str, Any] = {
        "data": {"epoch": 0, "position": 12 * step},
        "tagged": {
            "tuple": (step, 0.5),
            "nan": float("nan"),
            "neg_inf": float("-inf"),
            "bytes": bytes([step, 0, 255]),
            "int_keys": {1: "one", 2: "two"},
            "$dollar": True,
            "tensor": torch.tensor([step, -step], dtype=torch.int64),
        },
    }
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    return out


# -- capturing and checking states -------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict[str, Any] | None,
            compressor: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The live state in the shape ``ChainReader.materialize`` returns (deep copies)."""
    osd = optimizer.state_dict()
    state = {i: {k: v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
             for i, s in osd["state"].items()}
    out: dict[str, Any] = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {"state": {i: s for i, s in state.items() if s}, "param_groups": osd["param_groups"]},
        "step": step,
        "extra": extra or {},
    }
    if compressor is not None:
        out["compressor"] = {k: v.detach().clone() for k, v in compressor.items()}
    return out


def json_text(value: Any) -> str:
    return canonical(encode(value)).decode()


def state_to_file(state: dict[str, Any], path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state["model"].items():
        tensors[f"model.{k}"] = v.detach().clone().contiguous()
    for i, entry in state["optimizer"]["state"].items():
        for k, v in entry.items():
            tensors[f"optimizer.{i}.{k}"] = v.detach().clone().contiguous()
    for k, v in state.get("compressor", {}).items():
        tensors[f"compressor.{k}"] = v.detach().clone().contiguous()
    metadata = {
        "ldformat.golden": "1",
        "step": str(state["step"]),
        "model_keys": json.dumps(list(state["model"])),
        "param_groups": json_text(state["optimizer"]["param_groups"]),
        "extra": json_text(state["extra"]),
        "compressor": "present" if "compressor" in state else "absent",
    }
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Bitwise equality of two states (integer views: -0.0 != +0.0, NaN == NaN)."""
    if list(got["model"]) != list(want["model"]):
        raise AssertionError(f"{where}: model keys {list(got['model'])} != {list(want['model'])}")
    pairs = [(f"model {k}", got["model"][k], v) for k, v in want["model"].items()]
    gs, ws = got["optimizer"]["state"], want["optimizer"]["state"]
    if {i: sorted(s) for i, s in gs.items()} != {i: sorted(s) for i, s in ws.items()}:
        raise AssertionError(f"{where}: optimizer state keys differ")
    pairs += [(f"optimizer {i}/{k}", gs[i][k], v) for i, s in ws.items() for k, v in s.items()]
    if ("compressor" in got) != ("compressor" in want):
        raise AssertionError(f"{where}: compressor residuals present in only one state")
    if "compressor" in want:
        if sorted(got["compressor"]) != sorted(want["compressor"]):
            raise AssertionError(f"{where}: compressor residual names differ")
        pairs += [(f"compressor {k}", got["compressor"][k], v) for k, v in want["compressor"].items()]
    for name, g, w in pairs:
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(bits(g), bits(w)):
            raise AssertionError(f"{where}: {name} differs")
    for key in ("param_groups",):
        if json_text(got["optimizer"][key]) != json_text(want["optimizer"][key]):
            raise AssertionError(f"{where}: optimizer {key} differ")
    if json_text(got["extra"]) != json_text(want["extra"]):
        raise AssertionError(f"{where}: extra differs")


# -- the chains ----------------------------------------------------------------------------------

def make_grad_dense(chain: Path) -> dict[int, dict[str, Any]]:
    """Anchors every 3 steps, a hand-set lr, a skipped optimizer step, a scheduler in ``extra``;
    then truncate after step 4, re-open and train steps 5-6 again on other data (a rewind)."""
    torch.manual_seed(0)
    model = GoldenNet()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    live: dict[int, dict[str, Any]] = {}
    writer = ldformat.ChainWriter.create(chain, model, opt, kind="grad.dense", batch_steps=2, anchor_every=3,
                                         extra=extra_state(0, sched))
    live[0] = capture(model, opt, 0, extra_state(0, sched), None)
    for step in range(1, 6):
        forward_backward(model, opt, step, seed=1)
        if step == 2:
            for g in opt.param_groups:  # set by hand: the step uses it, param_groups keep it too
                g["lr"] = g["lr"] * 2
        if step != 3:  # step 3: the optimizer step is skipped (as GradScaler does on inf/NaN)
            opt.step()
            sched.step()
        writer.record_step(step, extra=extra_state(step, sched))
        live[step] = capture(model, opt, step, extra_state(step, sched), None)
    writer.close()

    removed = ldformat.truncate(chain, 4)
    if removed != [5]:
        raise AssertionError(f"truncate removed {removed}")
    del live[5]

    torch.manual_seed(1)
    model = GoldenNet()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loaded = ldformat.ChainReader(chain).load_into(model, opt, 4)
    sched.load_state_dict(loaded["extra"]["scheduler"])
    writer = ldformat.ChainWriter.open(chain, model, opt, batch_steps=2, anchor_every=3)
    for step in (5, 6):
        forward_backward(model, opt, step, seed=2)
        opt.step()
        sched.step()
        writer.record_step(step, extra=extra_state(step, sched))
        live[step] = capture(model, opt, step, extra_state(step, sched), None)
    writer.close()
    return live


def make_grad_topk(chain: Path) -> dict[int, dict[str, Any]]:
    """Top-k 25% with error feedback, anchors every 4 steps, 3 steps per batch; then compacted
    with max_replay=2, which folds steps 3 and 7 into new anchors that carry no residuals."""
    torch.manual_seed(0)
    model = GoldenNet()
    opt = sgd(model)
    topk = ldformat.TopK(0.25)
    live: dict[int, dict[str, Any]] = {}
    writer = ldformat.ChainWriter.create(chain, model, opt, kind="grad.topk", compressor=topk, batch_steps=3,
                                         anchor_every=4)
    live[0] = capture(model, opt, 0, {}, topk.state_dict())
    for step in range(1, 8):
        forward_backward(model, opt, step, seed=1)
        topk.compress_(model)
        opt.step()
        writer.record_step(step, extra={"position": step})
        residuals = topk.state_dict() if step % 4 == 0 else None  # only the writer's anchors have them
        live[step] = capture(model, opt, step, {"position": step}, residuals)
    writer.close()
    plan = ldformat.compact(chain, max_replay=2)
    if plan.new_anchors != [3, 7]:
        raise AssertionError(f"unexpected compaction plan {plan.to_dict()}")
    for step in plan.new_anchors:
        live[step]["compressor"] = {}  # compaction anchors carry no residuals
    return live


def make_state_xor(chain: Path) -> dict[int, dict[str, Any]]:
    """Adam (optimizer state appears at step 1), 8 steps, 3 per batch; then compacted with
    keep_last=2, keep_every=3: steps 1, 2, 4, 5 are dropped and the xor deltas 0->3 and 3->6
    are merged exactly (step entries whose base is not step - 1)."""
    torch.manual_seed(0)
    model = GoldenNet()
    opt = adam(model)
    live: dict[int, dict[str, Any]] = {}
    writer = ldformat.ChainWriter.create(chain, model, opt, kind="state.xor", batch_steps=3)
    live[0] = capture(model, opt, 0, {}, None)
    for step in range(1, 9):
        forward_backward(model, opt, step, seed=1)
        opt.step()
        writer.record_step(step, extra={"position": step})
        live[step] = capture(model, opt, step, {"position": step}, None)
    writer.close()
    plan = ldformat.compact(chain, keep_last=2, keep_every=3)
    if plan.merged_deltas != [(0, 3), (3, 6)] or plan.dropped_steps != [1, 2, 4, 5]:
        raise AssertionError(f"unexpected compaction plan {plan.to_dict()}")
    for step in plan.dropped_steps:
        del live[step]
    return live


class _FailingCommitStore(ldformat.LocalStore):
    """Fails the creation of commit records once armed: the crash between data and commit."""

    armed = False

    def create_exclusive(self, path: str, data: bytes) -> None:
        if self.armed and path.startswith("log/"):
            raise OSError(errno.EIO, "injected I/O error")
        super().create_exclusive(path, data)


def make_state_xor_leftovers(chain: Path) -> dict[int, dict[str, Any]]:
    """Never compacted (the log starts at record 1), SGD momentum, 2 steps per batch; steps 5-6
    were written and synced but their commit record failed, so the chain ends at step 4 and
    holds an unreferenced delta group that readers ignore."""
    torch.manual_seed(0)
    model = GoldenNet()
    opt = sgd(model)
    store = _FailingCommitStore(chain)
    chain.mkdir(parents=True)
    live: dict[int, dict[str, Any]] = {}
    writer = ldformat.ChainWriter.create(chain, model, opt, kind="state.xor", batch_steps=2, store=store)
    live[0] = capture(model, opt, 0, {}, None)
    for step in range(1, 7):
        forward_backward(model, opt, step, seed=1)
        opt.step()
        if step == 6:
            store.armed = True
            try:
                writer.record_step(step, extra={"position": step})
            except ldformat.WriterIOError:
                writer.abort()
                break
            raise AssertionError("the injected commit failure did not happen")
        writer.record_step(step, extra={"position": step})
        live[step] = capture(model, opt, step, {"position": step}, None)
    del live[5]
    leftovers = [p for p in store.list("deltas") if p.startswith("deltas/5-6-")]
    if not leftovers:
        raise AssertionError("no leftover objects were written")
    return live


CHAINS = {
    "grad.dense": (make_grad_dense, "anchors every 3 steps, hand-set lr, a skipped optimizer step (stepped: "
                   "false), scheduler and tagged JSON in extra, truncate after 4, re-open and append 5-6"),
    "grad.topk": (make_grad_topk, "top-k 25% with error feedback, residuals in writer anchors, compaction "
                  "with max_replay=2 (new anchors 3 and 7 without residuals)"),
    "state.xor": (make_state_xor, "Adam with lazily appearing state, compaction keep_last=2 keep_every=3 "
                  "(exact XOR merges 0->3 and 3->6)"),
    "state.xor-leftovers": (make_state_xor_leftovers, "log from record 1 (append records only), SGD momentum, "
                            "an uncommitted delta group of steps 5-6 left by a failed commit"),
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/golden/make_golden.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if out.exists() and any(out.iterdir()):
        print(f"{out}: exists and is not empty; golden files of a released version are never rewritten",
              file=sys.stderr)
        return 2
    index: dict[str, Any] = {"format_version": ldformat.FORMAT_VERSION, "torch": torch.__version__, "chains": {}}
    for name, (make, description) in CHAINS.items():
        chain = out / name / "chain"
        expected_dir = out / name / "expected"
        expected_dir.mkdir(parents=True)
        live = make(chain)
        # The released writer lock is not committed content and names this host: leave it out.
        shutil.rmtree(chain / "lock", ignore_errors=True)
        reader = ldformat.ChainReader(chain)
        if reader.steps != sorted(live):
            raise AssertionError(f"{name}: chain steps {reader.steps} != expected {sorted(live)}")
        for step, state in sorted(live.items()):
            assert_same(reader.materialize(step), state, f"{name} step {step}")
            state_to_file(state, expected_dir / f"{step}.safetensors")
        report = ldformat.validate(chain, deep=True)
        if not report.ok:
            raise AssertionError(f"{name}: {[str(p) for p in report.problems]}")
        index["chains"][name] = {
            "kind": reader.kind,
            "steps": reader.steps,
            "anchors": reader.anchors,
            "description": description,
        }
    (out / "golden.json").write_text(json.dumps(index, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(CHAINS)} golden chains to {out} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
