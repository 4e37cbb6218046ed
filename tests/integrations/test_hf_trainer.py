"""``ldformat.integrations.transformers``: checkpointing a Hugging Face ``Trainer`` run.

1. kill -9 and rerun: ``hf_train.py`` runs the README's snippet and SIGKILLs itself from a
   callback at a (seeded) random step; the same command run again resumes from the chain and
   ends with weights bit-identical (integer views) to an uninterrupted run without any
   checkpointing, with dropout 0 and with dropout 0.1 plus evaluations that draw random
   numbers between steps.
2. The checkpoint directory written from the chain equals the one the Trainer saves itself
   at the same step of the same run (weights, optimizer, scheduler, RNG states, state).
3. ``resume_checkpoint()`` is None without a chain; the callback forwards Checkpointer
   arguments and refuses the ones it sets itself, or a chain it does not continue.
4. ``import ldformat`` does not import transformers; without transformers the module says
   which extra to install.
5. The README's snippet is the one the crash test runs and the example uses.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_train import SNIPPET  # noqa: E402
from paths import REPO, SUPPORT
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import ldformat  # noqa: E402
from ldformat import ChainReader, UsageError  # noqa: E402
from ldformat.integrations.transformers import LdformatCallback, write_trainer_checkpoint  # noqa: E402

ROOT = REPO
RUN_TIMEOUT_S = 180

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or not torch.equal(_int_view(a[k]), _int_view(b[k]))]
    assert not differ, f"{what}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def _run(workdir: Path, *options: str) -> subprocess.Popen[bytes]:
    log = open(workdir.with_suffix(".log"), "ab")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(SUPPORT / "hf_train.py"), str(workdir), *options],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(proc: subprocess.Popen[bytes], workdir: Path) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"hf_train.py timed out; log: {workdir.with_suffix('.log')}") from None


# -- 1. kill -9 and rerun ------------------------------------------------------------------------------
@pytest.mark.procs
@pytest.mark.parametrize("case", ["dropout0", "dropout0.1-eval"])
def test_sigkill_and_rerun_is_bit_identical(tmp_path: Path, case: str) -> None:
    """``dropout0``: the README's snippet as it stands (the policy chooses the batch size).
    ``dropout0.1-eval``: evaluations every 3 steps draw random numbers between steps, and
    ``batch_steps=3`` makes the rerun resume from one of those steps."""
    kill_at = random.Random(f"ldformat-hf-{case}").randint(10, 22)  # random, the same in every run
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    if case == "dropout0":
        options, durable_before_kill = [], 4
    else:
        options, durable_before_kill = ["--dropout", "0.1", "--eval", "--kwargs", '{"batch_steps": 3}'], kill_at - 3
    ref, run = tmp_path / "ref", tmp_path / "run"
    procs = [_run(ref, "--plain", *options),
             _run(run, "--snippet", str(snippet), "--kill-at", str(kill_at), "--durable", str(durable_before_kill),
                  *options)]
    assert _wait(procs[0], ref) == 0, (ref.with_suffix(".log")).read_text()[-3000:]
    assert _wait(procs[1], run) == -9, f"the run was to kill itself at step {kill_at}"
    assert not (run / "final.safetensors").exists()
    durable = ChainReader(run / "runs/hf-chain").latest_step
    assert durable is not None and durable_before_kill <= durable < kill_at

    rerun = _run(run, "--snippet", str(snippet), *options)  # the same command, without the kill
    assert _wait(rerun, run) == 0, (run.with_suffix(".log")).read_text()[-3000:]
    resumed = json.loads((run / "begin.json").read_text())["global_step"]
    assert resumed == durable, f"killed at {kill_at}: resumed from Trainer step {resumed}, chain had {durable}"
    assert_bits_equal(load_file(run / "final.safetensors"), load_file(ref / "final.safetensors"),
                      f"killed at step {kill_at}, resumed from {resumed}, vs uninterrupted")
    assert not (run / "out/ldformat-resume").exists()  # the resume directory was removed
    reader = ChainReader(run / "runs/hf-chain")
    assert reader.steps == list(range(26))
    assert ldformat.validate(run / "runs/hf-chain").ok


# -- in-process runs -----------------------------------------------------------------------------------
class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 24, seed: int = 1) -> None:
        self.ids = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(out: Path, cb: LdformatCallback | None, steps: int = 8, **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
    settings: dict[str, Any] = dict(save_strategy="no", logging_steps=2, learning_rate=1e-3, warmup_steps=2)
    settings.update(args)
    targs = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, report_to=[],
                              use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **settings)
    return Trainer(model=model, args=targs, train_dataset=TokenDataset(), callbacks=[cb] if cb else None)


def test_directory_equals_the_trainers_own_checkpoint(tmp_path: Path) -> None:
    """One run, saved both ways: the Trainer's checkpoint-6 and the chain's step 6 written as one."""
    cb = LdformatCallback(tmp_path / "chain", batch_steps=1)
    trainer = _trainer(tmp_path / "out", cb, steps=8, save_strategy="steps", save_steps=6)
    trainer.train()
    hf = tmp_path / "out" / "checkpoint-6"
    ours = Path(write_trainer_checkpoint(tmp_path / "chain", tmp_path / "written", step=6, model=trainer.model,
                                         args=trainer.args))
    assert ours.name == "checkpoint-6"
    assert {p.name for p in hf.iterdir()} <= {p.name for p in ours.iterdir()}

    assert_bits_equal(load_file(ours / "model.safetensors"), load_file(hf / "model.safetensors"), "weights")
    optimizer = [torch.load(d / "optimizer.pt", weights_only=True) for d in (ours, hf)]
    assert optimizer[0]["param_groups"] == optimizer[1]["param_groups"]
    for i, state in optimizer[1]["state"].items():
        assert_bits_equal(optimizer[0]["state"][i], state, f"optimizer state {i}")
    scheduler = [torch.load(d / "scheduler.pt", weights_only=True) for d in (ours, hf)]
    assert scheduler[0] == scheduler[1]
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # type: ignore[no-untyped-call]
        rng = [torch.load(d / "rng_state.pth", weights_only=True) for d in (ours, hf)]
    assert rng[0]["python"] == rng[1]["python"]
    assert torch.equal(rng[0]["cpu"], rng[1]["cpu"])
    assert [type(x) for x in rng[0]["numpy"]] == [type(x) for x in rng[1]["numpy"]]
    assert rng[0]["numpy"][0] == rng[1]["numpy"][0] and (rng[0]["numpy"][1] == rng[1]["numpy"][1]).all()
    assert rng[0]["numpy"][2:] == rng[1]["numpy"][2:]
    state = [json.loads((d / "trainer_state.json").read_text()) for d in (ours, hf)]
    assert state[0] == state[1]


def test_resume_checkpoint_is_none_without_a_chain(tmp_path: Path) -> None:
    cb = LdformatCallback(tmp_path / "chain")
    assert cb.resume_checkpoint() is None
    assert not (tmp_path / "chain").exists()


def test_forwards_checkpointer_arguments(tmp_path: Path) -> None:
    cb = LdformatCallback(tmp_path / "chain", mode="lowdiff+", anchor_every=3, batch_steps=2, extra={"run": "a"})
    first = _trainer(tmp_path / "out", cb, steps=7)
    first.train()
    reader = ChainReader(tmp_path / "chain")
    assert reader.kind == "grad.dense"
    assert reader.steps == list(range(8)) and reader.anchors == [0, 3, 6]
    extra = reader.materialize(7)["extra"]
    assert extra["user"]["run"] == "a" and extra["user"]["hf_trainer"]["state"]["global_step"] == 7
    assert extra["policy"]["batch_steps"] == 2
    assert cb.checkpointer is None  # closed at the end of training

    # The flight recorder's scalars (spec §19.1), by default: the loss and grad_norm of the
    # Trainer's log entries (every logging_steps=2 steps), and the lr every step used (linear
    # schedule, 2 warmup steps, 7 steps in all: step k used 1e-3 * lambda(k - 1)) of the Trainer's
    # two param groups (with and without weight decay): lr and lr/1.
    logged = {e["step"]: e for e in first.state.log_history if "loss" in e}
    assert sorted(logged) == [2, 4, 6]
    for step in range(1, 8):
        scalars = reader.extra(step)["scalars"]
        k = step - 1
        lr = pytest.approx(1e-3 * (k / 2 if k < 2 else (7 - k) / 5), rel=1e-12, abs=0)
        assert (scalars.pop("lr"), scalars.pop("lr/1")) == (lr, lr), step
        if step in logged:
            assert scalars == {"loss": logged[step]["loss"], "grad_norm": logged[step]["grad_norm"]}, step
        else:
            assert scalars == {}, step

    # Resumed from the chain: the Checkpointer re-opens it at the step the Trainer resumed from.
    cb2 = LdformatCallback(tmp_path / "chain", mode="lowdiff+", anchor_every=3, batch_steps=2)
    trainer = _trainer(tmp_path / "out", cb2, steps=9)
    checkpoint = cb2.resume_checkpoint()
    assert checkpoint is not None and Path(checkpoint).name == "checkpoint-7"
    trainer.train(resume_from_checkpoint=checkpoint)
    assert ChainReader(tmp_path / "chain").steps == list(range(10))
    assert not Path(checkpoint).exists()


def test_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    for bad in ({"step": 3}, {"scheduler": None}, {"model": None}):
        with pytest.raises(UsageError, match="sets"):
            LdformatCallback(tmp_path / "c", **bad)
    with pytest.raises(UsageError, match="Checkpointer"):
        LdformatCallback(tmp_path / "c", anchor_evry=3)
    with pytest.raises(UsageError, match="hf_trainer"):
        LdformatCallback(tmp_path / "c", extra={"hf_trainer": 1})
    _trainer(tmp_path / "out", LdformatCallback(tmp_path / "chain"), steps=2).train()
    # Training from scratch into an existing chain, without resuming from it, is refused.
    with pytest.raises(UsageError, match="resume_checkpoint"):
        _trainer(tmp_path / "out", LdformatCallback(tmp_path / "chain"), steps=2).train()
    assert ChainReader(tmp_path / "chain").steps == [0, 1, 2]


# -- 4. imports ----------------------------------------------------------------------------------------
@pytest.mark.procs
def test_import_is_lazy_and_names_the_extra() -> None:
    code = (
        "import sys, ldformat, ldformat.integrations\n"
        "assert 'transformers' not in sys.modules, 'import ldformat imported transformers'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    import ldformat.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'ldformat[hf]'" in out.stdout


# -- 5. the README's snippet ---------------------------------------------------------------------------
def test_readme_snippet_is_the_tested_one() -> None:
    example = (ROOT / "examples" / "hf_trainer.py").read_text()
    lines = [line.strip() for line in SNIPPET.splitlines() if line.strip()]
    assert all(line in example for line in lines), "examples/hf_trainer.py no longer runs the snippet"
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Use with Hugging Face Trainer\n(.*?)(?=^## )", readme, re.S | re.M)
    if section is None:
        pytest.skip("README.md has no 'Use with Hugging Face Trainer' section")
    block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert block is not None, "the README section has no python block"
    code = [line for line in block.group(1).splitlines() if line.strip() and not line.startswith(("from ", "import "))]
    assert [line.split("#")[0].rstrip() for line in code] == lines
