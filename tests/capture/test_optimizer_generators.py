"""Generators an optimizer holds outside its ``state_dict()`` (spec §19.2 ``optimizer_rng``, §19.5).

timm's Adahessian draws its Hutchinson probes from a ``torch.Generator`` of its own: a run
resumed from an exact optimizer state still diverged, drawing other probes. The capture
runtime records the state of every generator the optimizer holds as an attribute (a
``torch.Generator``, ``random.Random``, ``numpy.random.RandomState``; those of an optimizer it
wraps too) with each step, and ``resume`` restores them. The resumed run must then equal an
uninterrupted one bit for bit (integer views of every parameter, buffer and optimizer tensor).
"""

from __future__ import annotations

import copy
import importlib
import logging
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bitwise import assert_same
from optimizer_zoo import Entry, NoisySGD, generator_entries, train_step

import ldformat
from ldformat import CorruptChainError
from ldformat.capture.rng import capture_optimizer_rng, optimizer_generators, restore_optimizer_rng

# Adahessian needs backward(create_graph=True), about which torch warns.
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")

RECORDED, MORE = 3, 3  # steps recorded before the interruption, steps trained after it
GENERATORS = {"probe-private-generators": {"generator", "coin", "legacy"}, "timm.Adahessian": {"generator"}}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Tiny tensors: thread pools only cost time."""


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def resumed_run(entry: Entry, chain: Path) -> dict[str, Any]:
    """Fresh objects, resumed from ``chain``, trained ``MORE`` steps."""
    model = entry.model()
    optimizer = entry.make(model)
    assert ldformat.resume(chain, model, optimizer) == RECORDED
    for step in range(RECORDED + 1, RECORDED + MORE + 1):
        train_step(model, optimizer, step, entry)
    return snapshot(model, optimizer)


@pytest.mark.parametrize("name", sorted(generator_entries()))
def test_resume_continues_the_optimizers_generators_bit_exactly(name: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    entry = generator_entries()[name]
    chain = tmp_path / "chain"
    model = entry.model()
    optimizer = entry.make(model)
    ck = ldformat.Checkpointer(chain, model, optimizer, mode="xor", anchor_every=2, batch_steps=1)
    for step in range(1, RECORDED + 1):
        train_step(model, optimizer, step, entry)
    ck.close()
    for step in range(RECORDED + 1, RECORDED + MORE + 1):  # the uninterrupted run goes on
        train_step(model, optimizer, step, entry)
    want = snapshot(model, optimizer)

    recorded = ldformat.ChainReader(chain).materialize(RECORDED)["extra"]["optimizer_rng"]
    assert set(recorded) == GENERATORS[name]
    assert_same(resumed_run(entry, chain), want, f"{name} resumed at step {RECORDED}")

    # Without the generators' states the same resume diverges: the comparison sees the defect.
    monkeypatch.setattr(importlib.import_module("ldformat.capture.resume"), "restore_optimizer_rng",
                        lambda *args: None)
    with pytest.raises(AssertionError, match="bits differ"):
        assert_same(resumed_run(entry, chain), want)


class Wrapper(torch.optim.Optimizer):
    """An optimizer that steps another, held as ``base_optimizer`` (like Lookahead)."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state
        self.shuffle = random.Random(3)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2, 3))]


def _draws(opt: Any) -> tuple[float, float, float, float]:
    base = opt.base_optimizer
    return (float(torch.rand(1, generator=base.generator)), base.coin.random(), float(base.legacy.random_sample()),
            opt.shuffle.random())


def test_generators_of_a_wrapped_optimizer_round_trip() -> None:
    live = Wrapper(NoisySGD(_params()))
    found, opaque = optimizer_generators(live)
    assert list(found) == ["base_optimizer.generator", "base_optimizer.coin", "base_optimizer.legacy", "shuffle"]
    assert opaque == []
    _draws(live)  # move every generator away from its seed
    state = capture_optimizer_rng(live)
    fresh = Wrapper(NoisySGD(_params()))
    restore_optimizer_rng(fresh, state, "chain (step 1)")
    assert _draws(fresh) == _draws(live)


def test_a_generator_whose_state_cannot_be_recorded_warns_once_at_construction(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = NoisySGD(model.parameters())
    optimizer.modern = np.random.default_rng(5)  # type: ignore[attr-defined]  # 128-bit PCG64 words
    with pytest.warns(RuntimeWarning, match=r"NoisySGD holds .*\(modern\).* will not continue them exactly"):
        ck = ldformat.Checkpointer(tmp_path / "chain", model, optimizer, mode="xor", anchor_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # once: not again at every step
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
        ck.close()
    recorded = ldformat.ChainReader(tmp_path / "chain").materialize(2)["extra"]["optimizer_rng"]
    assert set(recorded) == {"generator", "coin", "legacy"}  # the others are still recorded


def test_an_optimizer_without_generators_records_none(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    ck = ldformat.Checkpointer(tmp_path / "chain", model, torch.optim.SGD(model.parameters(), lr=0.1), mode="xor")
    ck.close()
    assert "optimizer_rng" not in ldformat.ChainReader(tmp_path / "chain").materialize(0)["extra"]


@pytest.mark.parametrize("state", [
    [1],
    {"generator": 5},
    {"generator": {"torch": torch.zeros(3, dtype=torch.uint8), "device": "cpu"}},  # not a CPU generator state
    {"coin": {"python": (3, (1, 2), None)}},
    {"legacy": {"numpy": {"name": "MT19937"}}},
])
def test_a_malformed_record_is_corruption_naming_the_step(state: Any) -> None:
    with pytest.raises(CorruptChainError, match=r"^chain \(step 3\): extra\.optimizer_rng"):
        restore_optimizer_rng(NoisySGD(_params()), state, "chain (step 3)")


def test_a_generator_the_live_optimizer_lacks_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    recorded = capture_optimizer_rng(NoisySGD(_params()))
    recorded["gone"] = recorded["generator"]
    if not torch.cuda.is_available():  # a CUDA generator's state, resumed on a machine without CUDA
        recorded["cuda_only"] = {"torch": torch.zeros(16, dtype=torch.uint8), "device": "cuda:0"}
    live = NoisySGD(_params())
    live.cuda_only = torch.Generator()  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="ldformat.capture"):
        restore_optimizer_rng(live, recorded, "chain (step 3)")
    assert "no generator gone like the recorded one" in caplog.text
    assert torch.cuda.is_available() or "generator cuda_only was recorded on cuda:0" in caplog.text
