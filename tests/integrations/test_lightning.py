"""The Lightning integration: ``LdformatCheckpoint`` (ldformat/integrations/lightning.py).

What is checked, bit for bit (integer views) wherever a state is compared:

1. kill -9 and rerun: a script that trains with ``LdformatCheckpoint`` and
   ``trainer.fit(..., ckpt_path=cb.resume_checkpoint())`` SIGKILLs itself from a callback at a
   random step; the same script run again ends with the model and optimizer of an
   uninterrupted run, with dropout 0 and 0.3, across epoch boundaries, with validation and
   gradient accumulation, with the checkpointer's automatic commit policy, and with a plain
   ``DataLoader`` resumed at an epoch boundary (the recorded RNG gives the next epoch the
   same shuffle). The rerun's chain validates and its latest step is the rerun's final
   state. The runs live in ``lightning_train.py``, started once per module.
2. A fit stopped at ``max_steps`` and continued with a larger ``max_steps`` equals one fit.
3. ``resume_checkpoint()`` is None for a missing or empty directory.
4. The README snippet ("Use with Lightning"), run as written: trains, and run again resumes.
5. Misuse is refused with a message saying what to do: a chain with steps fitted without
   ``ckpt_path``; more than one optimizer step per batch.
6. A lost local chain resumes from its mirror.
7. ``import ldformat`` does not import Lightning; without Lightning the module's error names
   ``pip install 'ldformat[lightning]'``.
8. examples/lightning.py, killed and run again (``--verify``), ends bit-identical.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import lightning.pytorch as L  # noqa: E402
from lightning_train import TinyModule, dataset  # noqa: E402
from paths import REPO, SUPPORT
from torch.utils.data import TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import ldformat  # noqa: E402
from ldformat.capture.unwrap import unwrap_optimizer  # noqa: E402
from ldformat.integrations.lightning import LdformatCheckpoint  # noqa: E402

STEPS = 30  # 8 batches per epoch: the runs cross three epoch boundaries


def tensors(obj: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}")


def differing(a: object, b: object) -> list[str]:
    """Names of the tensors whose bits differ (compared as integers, so NaN and -0.0 count)."""
    ta, tb = dict(tensors(a)), dict(tensors(b))
    if ta.keys() != tb.keys():
        return sorted(ta.keys() ^ tb.keys())
    return [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(
        ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]


# -- 1. kill -9 and rerun ------------------------------------------------------------------------
# name: (options of the run, the kill step is drawn from this range, wait for the step before it
# to be durable). Without waiting, the rerun resumes from whatever the commit policy made durable
# (with "auto", batches of 4 steps at first).
SCENARIOS: dict[str, tuple[dict[str, Any], tuple[int, int], bool]] = {
    "dropout-0": ({"dropout": 0.0, "batch_steps": 1}, (3, STEPS - 3), True),
    "dropout-0.3": ({"dropout": 0.3, "batch_steps": 1}, (3, STEPS - 3), True),
    "validation-and-accumulation": ({"dropout": 0.3, "batch_steps": 1, "val": True, "accumulate": 2},
                                    (3, STEPS - 3), True),
    "auto-policy": ({"dropout": 0.3}, (10, STEPS - 3), False),
    # step 8 ends the first epoch: the rerun draws the second epoch's shuffle from the recorded RNG
    "plain-loader-epoch-boundary": ({"dropout": 0.3, "batch_steps": 1, "loader": "plain"}, (9, 9), True),
    # a tiny GPT-2 from a config (tied embeddings, dropout), as the HF Trainer test uses
    "gpt2-dropout-0.1": ({"dropout": 0.1, "batch_steps": 1, "model": "gpt2", "val": True}, (3, STEPS - 3), True),
}


def reference_name(options: dict[str, Any]) -> str:
    return "ref-" + json.dumps({k: v for k, v in sorted(options.items()) if k != "batch_steps"})


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lightning")
    rng = random.Random()
    runs: dict[str, dict[str, Any]] = {}
    kills: dict[str, int] = {}
    for name, (options, (low, high), wait) in SCENARIOS.items():
        ref = reference_name(options)
        runs.setdefault(ref, {"name": ref, "chain": str(work / ref), "out": str(work / f"{ref}.pt"),
                              "method": "ldformat", **options})
        kills[name] = rng.randint(low, high)
        rerun = {"name": f"{name}-rerun", "chain": str(work / name), "out": str(work / f"{name}.pt"),
                 "method": "ldformat", **options}
        runs[name] = {**rerun, "name": name, "out": str(work / f"{name}-killed.pt"), "kill_at": kills[name],
                      "wait": wait, "then": rerun}
    config = {"steps": STEPS, "runs": list(runs.values())}
    proc = subprocess.run([sys.executable, str(SUPPORT / "lightning_train.py"), json.dumps(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ended = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"work": work, "ended": ended, "kills": kills, "log": proc.stderr}


@pytest.mark.procs
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kill_and_rerun_is_bit_identical(killed_runs: dict[str, Any], name: str) -> None:
    options, _, wait = SCENARIOS[name]
    work, ended, kill_at = killed_runs["work"], killed_runs["ended"], killed_runs["kills"][name]
    where = f"{name}, killed at step {kill_at}"
    assert ended[name] == "signal 9", f"{where}: the run ended with {ended[name]}\n{killed_runs['log'][-3000:]}"
    assert ended[f"{name}-rerun"] == "exit 0", f"{where}: the rerun failed\n{killed_runs['log'][-3000:]}"
    ref = torch.load(work / f"{reference_name(options)}.pt", weights_only=True)
    rerun = torch.load(work / f"{name}.pt", weights_only=True)
    if wait:
        assert rerun["resumed_from"] == kill_at - 1, where
    assert rerun["global_step"] == ref["global_step"] == STEPS, where
    if options.get("model") == "gpt2":
        assert "net.transformer.h.1.attn.c_attn.weight" in ref["model"], sorted(ref["model"])[:5]
    bad = differing({"model": ref["model"], "optimizer": ref["optimizer"]},
                    {"model": rerun["model"], "optimizer": rerun["optimizer"]})
    assert not bad, f"{where}, resumed from {rerun['resumed_from']}: bits differ in {bad}"
    chain = work / name
    assert ldformat.validate(chain).ok, where
    latest = ldformat.ChainReader(chain).materialize()
    assert latest["step"] == STEPS
    assert not differing(latest["model"], rerun["model"]), f"{where}: the chain's latest step is not the final state"


# -- 2. continuing a finished fit -----------------------------------------------------------------
def fit(chain: Path, steps: int, model: L.LightningModule, **trainer_args: Any) -> LdformatCheckpoint:
    L.seed_everything(0, verbose=False)
    cb = LdformatCheckpoint(chain, batch_steps=1)
    trainer = L.Trainer(max_steps=steps, callbacks=[cb], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, **trainer_args)
    ckpt_path = cb.resume_checkpoint()
    trainer.fit(model, StatefulDataLoader(dataset(), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    assert ckpt_path is None or not Path(ckpt_path).exists()  # the temporary checkpoint is removed once loaded
    return cb


class LossKeeper(TinyModule):
    """TinyModule keeping the loss each training step returned."""

    def __init__(self, dropout: float) -> None:
        super().__init__(dropout)
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


def test_continuing_with_more_steps_equals_one_fit(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    once = LossKeeper(0.3)
    fit(tmp_path / "once", 14, once)
    # The flight recorder's scalars (spec §19.1), by default: the loss training_step returned and
    # the lr the step used (StepLR every 5 steps, gamma 0.7). xor's adaptive cadence may leave
    # steps uncaptured on a slow machine: every step the chain holds has its own loss, and its lr
    # unless it is the last one left uncaptured, which close() captures live (the runtime takes
    # the lr from the hyperparameters it captures at optimizer.step(), for captured steps only).
    reader = ldformat.ChainReader(tmp_path / "once")
    kept = reader.steps
    assert kept[0] == 0 and kept[-1] == 14 and len(once.losses) == 14
    for step in kept[1:]:
        scalars = reader.extra(step)["scalars"]
        assert scalars["loss"] == once.losses[step - 1], step
        if step != 14 or "lr" in scalars:
            assert scalars["lr"] == pytest.approx(1e-2 * 0.7 ** ((step - 1) // 5), rel=1e-12, abs=0), step
    L.seed_everything(0, verbose=False)
    fit(tmp_path / "twice", 5, TinyModule(0.3))  # stops inside the first epoch
    L.seed_everything(0, verbose=False)
    twice = TinyModule(0.3)
    fit(tmp_path / "twice", 14, twice)
    assert not differing(once.state_dict(), twice.state_dict())


# -- 3. nothing to resume ---------------------------------------------------------------------------
def test_resume_checkpoint_is_none_on_a_fresh_path(tmp_path: Path) -> None:
    assert LdformatCheckpoint(tmp_path / "missing").resume_checkpoint() is None
    (tmp_path / "empty").mkdir()
    assert LdformatCheckpoint(tmp_path / "empty").resume_checkpoint() is None


# -- 4. the README snippet ---------------------------------------------------------------------------
def readme_snippet(section: str) -> str:
    """The Python block of a README section, as written."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert section in text, f"the README lost its section {section!r}"
    block = text[text.index(section):].split("```python\n", 1)[1].split("```", 1)[0]
    return block


README_SNIPPET = readme_snippet("## Use with Lightning")


def test_readme_snippet_trains_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(640, 6, generator=g), torch.randn(640, 1, generator=g))
    first: dict[str, Any] = {"model": TinyModule(0.1), "dataset": data}
    exec(README_SNIPPET, first)
    assert unwrap_optimizer(first["model"].optimizers()) is first["trainer"].optimizers[0]  # LightningOptimizer
    reader = ldformat.ChainReader(tmp_path / "runs" / "chain")
    assert reader.latest_step == 200 and ldformat.validate(reader.path).ok
    again: dict[str, Any] = {"model": TinyModule(0.1), "dataset": data}
    exec(README_SNIPPET, again)  # resumes at step 200: nothing left to train
    assert again["trainer"].global_step == 200
    assert not differing(first["model"].state_dict(), again["model"].state_dict())
    assert ldformat.ChainReader(tmp_path / "runs" / "chain").latest_step == 200


# -- 5. misuse --------------------------------------------------------------------------------------
def test_fit_without_resuming_an_existing_chain_is_refused(tmp_path: Path) -> None:
    fit(tmp_path / "chain", 3, TinyModule(0.0))
    cb = LdformatCheckpoint(tmp_path / "chain")
    trainer = L.Trainer(max_steps=6, callbacks=[cb], accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ldformat.UsageError, match=r"ckpt_path=cb\.resume_checkpoint\(\)"):
        trainer.fit(TinyModule(0.0), StatefulDataLoader(dataset(), batch_size=8))
    assert ldformat.ChainReader(tmp_path / "chain").latest_step == 3  # untouched


class TwoStepsPerBatch(TinyModule):
    def __init__(self) -> None:
        super().__init__(0.0)
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        for _ in range(2):
            loss = super().training_step(batch, batch_idx)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss


def test_more_than_one_step_per_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ldformat.UsageError, match="one optimizer step per batch"):
        fit(tmp_path / "chain", 4, TwoStepsPerBatch())


# -- 6. mirror ----------------------------------------------------------------------------------------
def test_lost_local_chain_resumes_from_the_mirror(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    cb = LdformatCheckpoint(tmp_path / "local", batch_steps=1, mirror=tmp_path / "mirror")
    trainer = L.Trainer(max_steps=6, callbacks=[cb], accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModule(0.0), StatefulDataLoader(dataset(), batch_size=8))
    shutil.rmtree(tmp_path / "local")
    ckpt = LdformatCheckpoint(tmp_path / "local", mirror=tmp_path / "mirror").resume_checkpoint(tmp_path / "r.ckpt")
    assert ckpt == str(tmp_path / "r.ckpt")
    assert torch.load(ckpt, weights_only=True)["global_step"] == 6
    assert ldformat.ChainReader(tmp_path / "local").latest_step == 6


# -- 7. imports -----------------------------------------------------------------------------------------
@pytest.mark.procs
def test_ldformat_does_not_import_lightning_and_says_how_to_install_it() -> None:
    code = textwrap.dedent("""\
        import sys
        import ldformat, ldformat.integrations
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")))
        sys.modules["lightning"] = sys.modules["lightning.pytorch"] = None
        try:
            import ldformat.integrations.lightning
        except ImportError as e:
            print(e)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported, message = proc.stdout.splitlines()[:2]
    assert imported == "[]"
    assert "pip install 'ldformat[lightning]'" in message


# -- 8. the example ----------------------------------------------------------------------------------------
@pytest.mark.procs
def test_example_killed_and_rerun_is_bit_identical(tmp_path: Path) -> None:
    example = [sys.executable, str(REPO / "examples" / "lightning.py"), "--out", str(tmp_path), "--steps", "24"]
    killed = subprocess.run([*example, "--kill-at", "13"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    rerun = subprocess.run([*example, "--verify"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "-- resuming from" in rerun.stdout
    assert "bit-identical to an uninterrupted run" in rerun.stdout
