"""Fixtures shared by the whole suite, the markers, and the import path of the helper modules.

Layout: one folder per concept of the library (format/, chain/, sharded/, stores/, capture/,
cli/, integrations/), each test module named for what it checks (basenames are unique across
folders: pytest imports them by basename); golden/ holds the reference chains the spec names;
support/ holds the helper modules and the worker scripts that tests start by path. A folder's
conftest.py holds the fixtures only its tests use (cli/: the common grad.dense chain;
sharded/: the FSDP2 chain).

The helper modules are imported by their plain names (``import s3server``,
``from models import TinyNet``): support/ is put on ``sys.path`` below, and a worker script
started by path finds its siblings through its own directory. Plain helpers that fixtures,
retry loops and other helpers call too are functions there, not fixtures: ``ports.free_port`` /
``ports.gloo_env``, ``clirun.invoke`` (``ldtools`` in this process through click's
``CliRunner``), ``clirun.ldtools_cmd`` / ``clirun.child_env`` (``ldtools`` as a process) and
``paths`` (REPO, TESTS, SUPPORT, GOLDEN).

Markers (registered in pyproject.toml): ``procs`` (the test starts OS processes), ``server``
(it starts moto_server or Azurite), ``slow`` (soak and race runs, deselected by default). A
fast loop: ``python -m pytest -q -m "not slow and not procs and not server"``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))


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
