"""The reader reads every optimizer slot the writer records (spec §10.3 "Slots", the slot bounds).

An ``optimizer/…`` slot of a ``state.xor`` batch holds at most ``max(2^20, P^2)`` elements, P
being the schema's parameter elements together: a second-order statistic (a full-matrix
preconditioner, Kronecker factors, blocks of them) is indexed by pairs of parameter elements.
Readers up to 1.6's bounded these slots by P and refused every step of DASH, Shampoo, SOAP
and Kron on a model whose widest dimension squared exceeds P. The properties here run the
writer and check what it commits with the reader's own :func:`~ldformat.format.delta.check_slots`;
tests/capture/test_optimizer_matrix.py reads such chains back whole (``*@16`` entries), and
tests/format/test_limits.py keeps the bound's refusal of hostile shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_zoo import Entry, preconditioner_entries, train_step

from ldformat import ChainReader, ChainWriter, CorruptChainError
from ldformat.format.delta import check_slots, optimizer_slot_bound
from ldformat.format.manifest import SlotInfo
from ldformat.stores.memory import MemoryStore


def committed_slots(entry: Entry, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                    steps: int = 2) -> tuple[int, int]:
    """Record ``steps`` steps of ``optimizer`` with the writer, check every committed batch's
    slots as the reader does; (largest optimizer slot, P)."""
    store = MemoryStore()
    writer = ChainWriter.create("chain", model, optimizer, kind="state.xor", batch_steps=1, store=store)
    for step in range(1, steps + 1):
        train_step(model, optimizer, step, entry)
        writer.record_step(step)
    writer.close()
    reader = ChainReader("chain", store=store)
    largest = 0
    for delta in reader.state.delta_entries():
        check_slots(delta.slots, reader.root.schema, reader.kind, delta.path)  # raises what the reader would
        largest = max([largest, *(s.numel for s in delta.slots if s.name.startswith("optimizer/"))])
    return largest, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Tiny tensors: thread pools only cost time."""


@pytest.mark.parametrize("name", sorted(preconditioner_entries()))
def test_the_writer_commits_no_preconditioner_slot_the_reader_refuses(name: str) -> None:
    entry = preconditioner_entries()[name]
    model = entry.model()
    largest, total = committed_slots(entry, entry.make(model), model)
    assert largest > total, f"{name}: the largest optimizer slot ({largest}) is not above P = {total}"


@settings(max_examples=20, deadline=None)
@given(hidden=st.integers(1, 24), block_size=st.integers(1, 24), momentum=st.sampled_from([0.0, 0.9]))
def test_dash_slots_pass_the_readers_checks_for_any_widths_and_blocks(hidden: int, block_size: int,
                                                                       momentum: float) -> None:
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    dash: Any = pytorch_optimizer.load_optimizer("dash")
    entry = Entry("dash", "pytorch_optimizer", lambda m: dash(m.parameters()), hidden=hidden)
    model = entry.model()
    committed_slots(entry, dash(model.parameters(), block_size=block_size, momentum=momentum), model)


def _schema(shapes: dict[str, list[int]]) -> dict[str, Any]:
    return {"model": [{"name": n, "role": "parameter", "dtype": "float32", "shape": s, "alias_of": None}
                      for n, s in shapes.items()],
            "optimizer": {"class": "x.Shampoo", "params": list(shapes), "group_sizes": [len(shapes)]},
            "compressor": None}


def test_a_language_models_kronecker_factors_fit() -> None:
    """GPT-2's token embedding (50257 x 768): Shampoo's left factor alone has 2.5e9 elements, 60
    times all parameters of this 41M-parameter schema (which 1.6's readers refused)."""
    schema = _schema({"wte.weight": [50257, 768], "h.0.mlp.weight": [3072, 768], "h.0.proj.weight": [768, 3072]})
    total = 50257 * 768 + 2 * 3072 * 768
    assert optimizer_slot_bound(total) == total * total
    factor = SlotInfo(name="optimizer/0/pre_cond_0", dtype="float32", shape=(50257, 50257), encoding="sub")
    check_slots((factor,), schema, "state.xor", "b")
    too_big = SlotInfo(name="optimizer/ref/top/x", dtype="float32", shape=(total, total + 1), encoding="xor")
    with pytest.raises(CorruptChainError, match=f"more elements than the {total * total} "):
        check_slots((too_big,), schema, "state.xor", "b")


def test_state_that_does_not_grow_with_the_model_fits_a_tiny_one() -> None:
    """2^20 elements whatever P: e.g. a generator's 5056-byte state kept as optimizer state."""
    schema = _schema({"w": [3]})
    check_slots((SlotInfo(name="optimizer/0/rng", dtype="uint8", shape=(5056,), encoding="xor"),), schema,
                "state.xor", "b")
    with pytest.raises(CorruptChainError, match="more elements than the 1048576 "):
        check_slots((SlotInfo(name="optimizer/0/rng", dtype="uint8", shape=(1 << 20 | 1,), encoding="xor"),),
                    schema, "state.xor", "b")
