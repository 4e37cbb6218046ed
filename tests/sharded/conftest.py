"""Fixtures of the sharded tests: the world-2 FSDP2 chain, made once per session."""

from pathlib import Path

import pytest


# -- the sharded tests' common chain ------------------------------------------------------------
@pytest.fixture(scope="session")
def fsdp_chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 FSDP2 xor chain of 7 steps (anchors every 3 steps, batches of 2), made once per
    session by ``sharded_chain_maker.py``. Read only: copy it to change it."""
    from make_sharded import FSDP_STEPS, FSDP_WORLD, finish, run_maker
    from ports import gloo_env

    out = tmp_path_factory.mktemp("fsdp-chain")
    env = gloo_env()
    finish([run_maker(["make", str(r), str(FSDP_WORLD), str(out), str(FSDP_STEPS)], env)
            for r in range(FSDP_WORLD)])
    import ldformat

    assert ldformat.open_reader(out / "chain").steps == list(range(FSDP_STEPS + 1))
    return out / "chain"
