"""Running ``ldtools``: in this process through click's ``CliRunner`` (:func:`invoke`), or as a
real process (:func:`ldtools_cmd`, :func:`child_env`) where pipes, signals or the exit of a
separate process are the point.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from ldtools.cli import cli
from ldtools.progress import PROGRESS_ENV

REPO = Path(__file__).resolve().parents[2]


def invoke(*args: Any, code: int | None = 0, env: Mapping[str, str | None] | None = None,
           input: str | None = None) -> Result:
    """``ldtools ARGS`` in this process. A raw exception is a failure (``CliRunner`` would hide it
    as exit 1), so is a printed traceback; with ``code`` (not None), so is any other exit status.

    Example: ``invoke("validate", chain, code=1).stderr``
    """
    result = CliRunner().invoke(cli, [str(a) for a in args], env=env, input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"ldtools {args} raised {result.exception!r}\n{result.output}") from result.exception
    assert "Traceback" not in result.output, result.output
    if code is not None:
        assert result.exit_code == code, f"ldtools {args}: exit {result.exit_code}, output:\n{result.output}"
    return result


def ldtools_cmd(*args: Any) -> list[str]:
    """The command line of ``ldtools ARGS`` as a separate Python process."""
    return [sys.executable, "-m", "ldtools", *map(str, args)]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of an ``ldtools`` child: this checkout first on ``PYTHONPATH``, no
    ``LDTOOLS_DEBUG`` or progress setting inherited from the developer's shell, then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    for name in ("LDTOOLS_DEBUG", PROGRESS_ENV):
        env.pop(name, None)
    env.update(extra)
    return env
