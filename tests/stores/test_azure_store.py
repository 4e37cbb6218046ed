"""Chains on Azure Blob Storage (``az://``), against Azurite on loopback (tests/support/azurite.py):
the store contract, bit-exact materialize of every step in every kind through the API and
``ldtools``, a flipped byte named by its key, and two writers of which exactly one proceeds.
Skipped where Azurite is not installed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from clirun import invoke
from models import TinyNet, assert_state_bits_equal, snapshot, train_step
from store_openers import object_store_opener

import ldformat
from ldformat import ChainLockedError, ChainReader, ChainWriter, TopK
from ldformat.stores import ObjectStore, Store
from ldformat.testing.store_contract import StoreContract

pytest_plugins = ["azurite"]

KINDS = ["grad.dense", "grad.topk", "state.xor"]
STEPS = 8


class TestAzureObjectStore(StoreContract[ObjectStore]):
    process_start_method = "forkserver"  # obstore's runtime does not survive fork()

    @pytest.fixture
    def store(self, az_url: str) -> ObjectStore:
        return ObjectStore(az_url)

    def reopen(self, store: ObjectStore) -> Store:
        return ObjectStore(store.url)

    def process_opener(self, store: ObjectStore) -> Callable[[], Store]:
        return object_store_opener(store.url)


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_materializes_bit_exactly_from_azure(az_url: str, kind: str) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    topk = TopK(0.1) if kind == "grad.topk" else None
    truth = {0: snapshot(model, optimizer)}
    with ChainWriter.create(az_url, model, optimizer, kind=kind, compressor=topk, batch_steps=3,
                            anchor_every=5) as writer:
        for step in range(1, STEPS + 1):
            train_step(model, optimizer, step, compress=topk.compress_ if topk else None)
            writer.record_step(step)
            truth[step] = snapshot(model, optimizer)
    reader = ChainReader(az_url)
    assert reader.steps == list(range(STEPS + 1))
    for step, want in truth.items():
        assert_state_bits_equal(reader.materialize(step), want, f"{az_url} step {step}")
    assert ldformat.validate(az_url, deep=True).ok

    for args in (["validate", az_url], ["info", az_url], ["compact", az_url, "--max-replay", "2"]):
        invoke(*args)  # in this process: exit 0, no traceback
    assert_state_bits_equal(ChainReader(az_url).materialize(STEPS), truth[STEPS], f"{az_url} after compact")

    store = ObjectStore(az_url)
    victim = next(p for p in store.list("deltas") if "/c/" in p)
    data = bytearray(store.read(victim))
    data[len(data) // 2] ^= 0x01
    store.write(victim, data)
    report = ldformat.validate(az_url)
    assert not report.ok and any(f"{az_url}/{victim}" in str(p) for p in report.problems), report.problems


def test_a_second_writer_is_refused(az_url: str) -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ChainWriter.create(az_url, model, optimizer, kind="state.xor") as writer:
        train_step(model, optimizer, 1)
        writer.record_step(1)
        writer.commit()
        other = TinyNet()
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
        ChainReader(az_url).load_into(other, other_opt)
        with pytest.raises(ChainLockedError):
            ChainWriter.open(az_url, other, other_opt)
    assert ChainReader(az_url).steps == [0, 1]
