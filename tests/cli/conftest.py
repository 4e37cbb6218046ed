"""Fixtures of the CLI tests: the common chain, made once per session."""

import shutil
from pathlib import Path

import pytest


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
