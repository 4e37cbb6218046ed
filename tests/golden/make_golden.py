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
``optimizer.<param index>.<key>`` (every per-parameter state tensor under a string key) and,
where a reader must return top-k residuals, ``compressor.<parameter name>``. Its safetensors
metadata holds ``step``, ``model_keys`` (the state_dict order, JSON), ``param_groups`` and
``extra`` (tagged JSON, spec "JSON values"), ``compressor`` (``present`` or ``absent``: whether
``materialize`` returns residuals) and, from format 1.2 on, ``optimizer``: the tagged JSON of
the whole live ``optimizer.state_dict()`` except ``param_groups`` (its ``state`` and any other
top-level entries), every tensor inline as ``$tensor`` (spec §3.4).

Golden chains are written once per format version and committed (``tests/golden/<version>/``);
every later reader must still read them bit for bit. Never regenerate the files of a released
format version: add a new version directory instead.

The gradient chains use SGD with power-of-two learning rates and momentum, so that every
operation of the replayed optimizer step is correctly rounded: replay is then bit-exact on
every CPU and torch build, which a golden file that later readers must match requires.
(Adam replay is exact only in the recording environment; tests/capture/test_exactness.py covers it
against live training.) The ``state.xor`` chain uses Adam: its replay is exact everywhere (from
format 1.6 on its ``v`` and ``w`` are coded by Adam prediction, spec §11.3.1, and its merged
deltas are differences of replayed states).
The ``state.xor-structure`` chain uses an optimizer whose ``state_dict()`` holds everything
that is not a per-parameter tensor (the optimizer structure of spec §8.2).
"""

from __future__ import annotations

import copy
import errno
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, cast

import safetensors.torch
import torch
from torch import nn

import ldformat
from ldformat.chain.writer import SnapshotPolicy
from ldformat.format.jsonvalue import canonical, encode

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
    """The live state in the shape ``ChainReader.materialize`` returns (deep copies): the whole
    ``optimizer.state_dict()``, non-tensor values, empty per-parameter states and top-level
    entries included (spec §8.2)."""
    out: dict[str, Any] = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "step": step,
        "extra": extra or {},
    }
    if compressor is not None:
        out["compressor"] = {k: v.detach().clone() for k, v in compressor.items()}
    return out


def json_text(value: Any) -> str:
    return canonical(encode(value)).decode()


def without_param_groups(optimizer_state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer ``state_dict()`` without ``param_groups``: its ``state`` and top-level entries."""
    return {k: v for k, v in optimizer_state.items() if k != "param_groups"}


def state_tensors(optimizer_state: dict[Any, Any]) -> dict[str, torch.Tensor]:
    """``optimizer.<i>.<key>`` for every per-parameter state tensor under a string key."""
    return {f"optimizer.{i}.{k}": v for i, s in optimizer_state["state"].items() if isinstance(s, dict)
            for k, v in s.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}


def state_to_file(state: dict[str, Any], path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state["model"].items():
        tensors[f"model.{k}"] = v.detach().clone().contiguous()
    for k, v in state_tensors(state["optimizer"]).items():
        tensors[k] = v.detach().clone().contiguous()
    for k, v in state.get("compressor", {}).items():
        tensors[f"compressor.{k}"] = v.detach().clone().contiguous()
    metadata = {
        "ldformat.golden": "1",
        "step": str(state["step"]),
        "model_keys": json.dumps(list(state["model"])),
        "param_groups": json_text(state["optimizer"]["param_groups"]),
        "extra": json_text(state["extra"]),
        "compressor": "present" if "compressor" in state else "absent",
        "optimizer": json_text(without_param_groups(state["optimizer"])),
    }
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def same_value(got: Any, want: Any, where: str) -> None:
    """Structural equality of decoded values: the same types (a tuple is not a list, an int not a
    float or a bool), dict keys in any order, floats and tensors bit for bit."""
    if type(got) is not type(want):
        raise AssertionError(f"{where}: {type(got).__name__} != {type(want).__name__}")
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(bits(got), bits(want)):
            raise AssertionError(f"{where}: tensors differ")
    elif isinstance(want, dict):
        if set(map(repr, got)) != set(map(repr, want)) or len(got) != len(want):
            raise AssertionError(f"{where}: keys {sorted(map(repr, got))} != {sorted(map(repr, want))}")
        for k, v in want.items():
            same_value(got[k], v, f"{where}.{k!r}")
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"{where}: length {len(got)} != {len(want)}")
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            same_value(g, w, f"{where}[{j}]")
    elif isinstance(want, float):
        if not (got == want and math.copysign(1, got) == math.copysign(1, want) or got != got and want != want):
            raise AssertionError(f"{where}: {got!r} != {want!r}")
    elif got != want:
        raise AssertionError(f"{where}: {got!r} != {want!r}")


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Bitwise equality of two states (integer views: -0.0 != +0.0, NaN == NaN)."""
    if list(got["model"]) != list(want["model"]):
        raise AssertionError(f"{where}: model keys {list(got['model'])} != {list(want['model'])}")
    pairs = [(f"model {k}", got["model"][k], v) for k, v in want["model"].items()]
    if ("compressor" in got) != ("compressor" in want):
        raise AssertionError(f"{where}: compressor residuals present in only one state")
    if "compressor" in want:
        if sorted(got["compressor"]) != sorted(want["compressor"]):
            raise AssertionError(f"{where}: compressor residual names differ")
        pairs += [(f"compressor {k}", got["compressor"][k], v) for k, v in want["compressor"].items()]
    for name, g, w in pairs:
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(bits(g), bits(w)):
            raise AssertionError(f"{where}: {name} differs")
    # The whole optimizer state_dict: tensors, Python values, empty states, global and top-level entries.
    same_value(without_param_groups(got["optimizer"]), without_param_groups(want["optimizer"]), f"{where}: optimizer")
    for key in ("param_groups",):
        if json_text(got["optimizer"][key]) != json_text(want["optimizer"][key]):
            raise AssertionError(f"{where}: optimizer {key} differ")
    if json_text(got["extra"]) != json_text(want["extra"]):
        raise AssertionError(f"{where}: extra differs")


# -- the chains ----------------------------------------------------------------------------------

# From 1.5 on, the golden chains hold segmented snapshots (spec §7.9): written after every
# second record, far more often than the default policy would for chains this small.
EAGER_SNAPSHOTS = SnapshotPolicy(ratio=0.5, min_bytes=0, min_records=2)


def create_writer(*args: Any, **kwargs: Any) -> ldformat.ChainWriter:
    writer = ldformat.ChainWriter.create(*args, **kwargs)
    if writer.snapshot_policy is not None:
        writer.snapshot_policy = EAGER_SNAPSHOTS
    return writer


def open_writer(*args: Any, **kwargs: Any) -> ldformat.ChainWriter:
    writer = ldformat.ChainWriter.open(*args, **kwargs)
    if writer.snapshot_policy is not None:
        writer.snapshot_policy = EAGER_SNAPSHOTS
    return writer


def make_grad_dense(chain: Path) -> dict[int, dict[str, Any]]:
    """Anchors every 3 steps, a hand-set lr, a skipped optimizer step, a scheduler in ``extra``;
    then truncate after step 4, re-open and train steps 5-6 again on other data (a rewind)."""
    torch.manual_seed(0)
    model = GoldenNet()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    live: dict[int, dict[str, Any]] = {}
    writer = create_writer(chain, model, opt, kind="grad.dense", batch_steps=2, anchor_every=3,
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
    writer = open_writer(chain, model, opt, batch_steps=2, anchor_every=3)
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
    writer = create_writer(chain, model, opt, kind="grad.topk", compressor=topk, batch_steps=3,
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


def write_xor_steps(chain: Path, model: GoldenNet, opt: torch.optim.Optimizer,
                    anchor_every: int | None) -> dict[int, dict[str, Any]]:
    """A state.xor chain of steps 0-8, 3 per batch; the live state of every step."""
    live: dict[int, dict[str, Any]] = {}
    writer = create_writer(chain, model, opt, kind="state.xor", batch_steps=3,
                                         anchor_every=anchor_every)
    live[0] = capture(model, opt, 0, {}, None)
    for step in range(1, 9):
        forward_backward(model, opt, step, seed=1)
        opt.step()
        writer.record_step(step, extra={"position": step})
        live[step] = capture(model, opt, step, {"position": step}, None)
    writer.close()
    return live


def make_state_xor(chain: Path) -> dict[int, dict[str, Any]]:
    """Adam (optimizer state appears at step 1), 8 steps, 3 per batch; then compacted with
    keep_last=2, keep_every=3: steps 1, 2, 4, 5 are dropped and the xor deltas 0->3 and 3->6
    are merged exactly (step entries whose base is not step - 1)."""
    torch.manual_seed(0)
    model = GoldenNet()
    live = write_xor_steps(chain, model, adam(model), anchor_every=None)
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
    writer = create_writer(chain, model, opt, kind="state.xor", batch_steps=2, store=store)
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


class Quirky(torch.optim.Optimizer):
    """An optimizer whose ``state_dict()`` holds what the optimizer structure (spec §8.2) keeps:
    per-parameter Python values (an int, ``None`` or a float, a tuple, a list holding a tensor),
    empty per-parameter states, a global state entry, a top-level entry holding a tensor (held
    in two places: stored once) and tensor- and dtype-valued hyperparameters."""

    def __init__(self, params: Any, lr: float = 2.0**-5) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.5, 0.25), "scale": torch.tensor(0.5),
                                  "dtype": torch.float32, "flag": True, "name": "q"})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        everything = cast("dict[Any, Any]", self.state)  # torch types its keys as parameters only
        everything["k"] = everything.get("k", 0) + 1  # global state, not a parameter's
        for group in self.param_groups:
            for j, p in enumerate(group["params"]):
                state = self.state[p]  # an empty per-parameter state for parameters left alone
                if j == 1 or p.grad is None:
                    continue
                if not state:
                    state["count"] = 0
                    state["comp"] = None
                    state["history"] = [torch.zeros_like(p), (1.5, False)]
                    state["ema"] = torch.zeros_like(p)
                state["count"] += 1
                state["ema"].mul_(group["betas"][0]).add_(p.grad, alpha=group["betas"][1])
                state["history"][0].add_(p.grad)
                state["comp"] = None if state["count"] % 2 else float(state["count"]) / 4
                p.add_(state["ema"].to(group["dtype"]).to(p.dtype), alpha=-group["lr"] * float(group["scale"]))

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        seen = int(cast("dict[Any, Any]", self.state).get("k", 0))
        norm = torch.tensor([float(seen), -0.0])
        sd["magma"] = {"seen": seen, "norm": norm, "again": (norm, None)}
        sd["w/x %"] = [torch.tensor([len(self.state)], dtype=torch.int64)]  # a key that is percent-encoded
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict.pop("magma", None)
        state_dict.pop("w/x %", None)
        super().load_state_dict(state_dict)


def quirky(model: GoldenNet) -> torch.optim.Optimizer:
    groups = param_groups(model)
    groups[1] = {"params": groups[1]["params"], "lr": 2.0**-6, "scale": torch.tensor([0.25]),
                 "dtype": torch.bfloat16}
    return Quirky(groups)


def make_state_xor_structure(chain: Path) -> dict[int, dict[str, Any]]:
    """The optimizer structure (spec §8.2) in anchors, xor steps, merged xor steps and
    compaction anchors: Quirky, anchors every 4 steps, 3 steps per batch; then compacted with
    keep_last=2, keep_every=3 and max_replay=1: steps 1, 2, 4, 5 (and anchor 4) are dropped, the
    xor deltas 0->3 are merged and step 6 becomes an anchor written by compaction."""
    torch.manual_seed(0)
    model = GoldenNet()
    live = write_xor_steps(chain, model, quirky(model), anchor_every=4)
    plan = ldformat.compact(chain, keep_last=2, keep_every=3, max_replay=1)
    if plan.merged_deltas != [(0, 3)] or plan.dropped_steps != [1, 2, 4, 5] or plan.new_anchors != [6]:
        raise AssertionError(f"unexpected compaction plan {plan.to_dict()}")
    for step in plan.dropped_steps:
        del live[step]
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
    "state.xor-structure": (make_state_xor_structure, "an optimizer structure (spec 8.2): per-parameter int, "
                            "None, float, tuple and a list holding a tensor, empty per-parameter states, global "
                            "state, top-level entries holding tensors (one held twice, one under a key with '/'), "
                            "tensor and dtype hyperparameters; compaction keep_last=2 keep_every=3 "
                            "max_replay=1 (merge 0->3, compaction anchor 6)"),
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
