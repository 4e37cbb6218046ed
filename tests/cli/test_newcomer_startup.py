"""``ldtools --help`` starts at once, and replay picks its threads (issue "a newcomer's first hour", §3).

``import ldformat`` loads neither torch nor zarr: the public names are imported on first use
(PEP 562), and the command line imports torch only inside the commands that need it. The
commands that replay choose torch's intra-op threads from the cores this process may use,
leaving one to the replay's decoding thread (``ldtools.threads``).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from models import TinyNet, train_step

import ldformat
import ldtools.threads
from ldformat import ChainWriter
from ldtools.cli import cli
from ldtools.threads import replay_threads

HEAVY = ("torch", "zarr", "numcodecs", "safetensors", "numpy")


def modules_loaded_by(code: str) -> set[str]:
    """The heavy modules a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stderr.strip().splitlines()[-1].split()) if proc.stderr.strip() else set()


@pytest.mark.procs
def test_import_ldformat_loads_no_torch() -> None:
    assert modules_loaded_by("import ldformat; ldformat.__version__; ldformat.UsageError") == set()


@pytest.mark.procs
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["materialize", "--help"]])
def test_ldtools_help_and_version_load_no_torch(args: list[str]) -> None:
    code = ("from ldtools.cli import cli\n"
            f"try:\n    cli.main({args!r}, prog_name='ldtools')\nexcept SystemExit as e:\n    assert e.code == 0, e")
    assert modules_loaded_by(code) == set()


def test_every_public_name_resolves_to_its_home() -> None:
    for name in ldformat.__all__:
        value = getattr(ldformat, name)
        home = getattr(ldformat, "_LAZY", {}).get(name)
        if home is not None:
            assert value is getattr(sys.modules[f"ldformat{home}"], name), name
    namespace: dict[str, Any] = {}
    exec("from ldformat import *", namespace)
    assert set(ldformat.__all__) <= set(namespace)
    assert set(ldformat.__all__) <= set(dir(ldformat))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ldformat.nope  # type: ignore[attr-defined]  # noqa: B018


def test_a_submodule_import_keeps_the_function_of_its_name() -> None:
    import ldformat.compact
    import ldformat.validate  # noqa: F401

    for name in ("compact", "validate", "truncate", "sync"):
        assert callable(getattr(ldformat, name)) and not isinstance(getattr(ldformat, name), types.ModuleType)
    assert ldformat.compact is ldformat.api.compact and ldformat.validate is ldformat.api.validate


# -- replay threads ----------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("LDTOOLS_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("cores", "torch_default", "want"), [(2, 2, 1), (1, 1, 1), (16, 16, 15), (16, 8, 8)])
def test_replay_leaves_a_core_to_decoding(clean_env: pytest.MonkeyPatch, cores: int, torch_default: int,
                                          want: int) -> None:
    clean_env.setattr(ldtools.threads, "available_cores", lambda: cores)
    assert replay_threads(None, torch_default) == want


def test_replay_threads_knobs(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(ldtools.threads, "available_cores", lambda: 16)
    assert replay_threads(3, 8) == 3  # --threads
    clean_env.setenv("LDTOOLS_THREADS", "5")
    assert replay_threads(None, 8) == 5 and replay_threads(2, 8) == 2
    clean_env.delenv("LDTOOLS_THREADS")
    clean_env.setenv("OMP_NUM_THREADS", "4")
    assert replay_threads(None, 4) is None  # the user's OMP_NUM_THREADS: torch's setting stays
    clean_env.setenv("LDTOOLS_THREADS", "zero")
    with pytest.raises(ldformat.UsageError, match="LDTOOLS_THREADS"):
        replay_threads(None, 4)


def test_materialize_replays_on_the_chosen_threads(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with ChainWriter.create(tmp_path / "chain", model, opt, kind="grad.dense", batch_steps=2) as w:
        for step in (1, 2, 3):
            train_step(model, opt, step)
            w.record_step(step)
    seen: list[int] = []
    materialize = ldformat.ChainReader.materialize

    def spy(self: ldformat.ChainReader, *args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return materialize(self, *args, **kwargs)

    clean_env.setattr(ldformat.ChainReader, "materialize", spy)
    before = torch.get_num_threads()
    for i, extra in enumerate((["--threads", "1"], [])):
        result = CliRunner().invoke(cli, ["materialize", str(tmp_path / "chain"), "-o", str(tmp_path / f"{i}.pt"),
                                          *extra])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == before  # restored
    assert seen == [1, replay_threads(None, before)]
    result = CliRunner().invoke(cli, ["materialize", str(tmp_path / "chain"), "-o", str(tmp_path / "x.pt")],
                                env={"LDTOOLS_THREADS": "x"})
    assert result.exit_code == 2 and "LDTOOLS_THREADS" in result.output
