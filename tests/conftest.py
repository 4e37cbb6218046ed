"""Fixtures shared by the whole suite, and the import path of the helper modules.

The helper modules and worker scripts live in ``tests/support/`` and are imported by their
plain names (``import s3server``, ``from models import TinyNet``); a worker script started by
path finds its siblings through its own directory. Plain helpers that fixtures, retry loops and
other helpers call too are functions there, not fixtures: ``ports.free_port`` /
``ports.gloo_env``, ``clirun.invoke`` (``ldtools`` in this process through click's
``CliRunner``) and ``clirun.ldtools_cmd`` / ``clirun.child_env`` (``ldtools`` as a process).

Markers (registered in pyproject.toml): ``procs`` (the test starts OS processes), ``server``
(it starts moto_server or Azurite), ``slow`` (soak and race runs, deselected by default).
"""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402  (after the path set-up above)
import torch  # noqa: E402

# -- markers -------------------------------------------------------------------------------------
#: Fixtures that start a server (moto_server, Azurite): a test that uses one, directly or through
#: another fixture, is marked ``server``.
SERVER_FIXTURES = frozenset({"moto", "azurite"})
#: Fixtures that start OS processes: a test that uses one is marked ``procs``.
PROCS_FIXTURES = frozenset({"fsdp_chain"})
#: Tests of the store contract (ldformat.testing.store_contract) that start processes.
CONTRACT_PROCS_TESTS = frozenset({"test_create_exclusive_race_between_processes_has_one_winner"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests whose processes or servers come from shared fixtures or the store contract;
    the tests that start their own are marked where they are defined."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)
        if used & PROCS_FIXTURES or getattr(item, "originalname", None) in CONTRACT_PROCS_TESTS:
            item.add_marker(pytest.mark.procs)


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread for a module: the tests' subprocesses and a second pool would only
    compete for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def close_leftover_checkpointers():  # type: ignore[no-untyped-def]
    """A failed test must not leave hooks, writer threads or locks behind for the next."""
    from ldformat.capture.hooks import open_at_exit

    yield
    for ck in list(open_at_exit):
        try:
            ck.close()
        except Exception:
            pass


# -- the CLI tests' common chain ----------------------------------------------------------------
@pytest.fixture(scope="session")
def grad_chain_pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-step grad.dense chain of TinyNet + AdamW (anchors at 0 and 10, batches of 4 steps),
    made once per session. Never modified: tests that change a chain take ``chain``."""
    from models import build_grad_chain

    return Path(build_grad_chain(tmp_path_factory.mktemp("grad-chain") / "chain"))


@pytest.fixture
def chain(grad_chain_pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the 12-step grad.dense chain (anchors at 0 and 10, batches of 4 steps)."""
    return Path(shutil.copytree(grad_chain_pristine, tmp_path / "chain"))


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
