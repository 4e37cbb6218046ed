"""``materialize``, ``ldtools info`` and ``ldtools log`` overlapping a maintainer (spec §17.4).

The maintainer of tests/chain/test_validate_concurrent.py appends, truncates and compacts the chain
in another process; every state it leaves is valid. A reader opened at any moment must then
either return the whole state of the step it asked for or say that the step is no longer
committed (a truncation removed it); it must never report a missing object, a missing record
or corruption, and the CLI must exit 0. (The maintainer re-trains truncated steps from other
seeds, so the bits of a step change over time; exactness is tested elsewhere.)
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from click.testing import CliRunner
from models import TinyNet
from test_validate_concurrent import TIME_LIMIT_S, SlowStore, maintained_chain

import ldformat
from ldformat import ChainReader
from ldtools.cli import cli

READS = 40  # materialize runs overlapping the maintainer, per kind


def _run(tmp_path: Path, kind: str) -> None:
    runner = CliRunner()
    rng = random.Random(0)
    problems: list[str] = []
    reads = gone = cli_runs = 0
    names = set(TinyNet().state_dict())
    with maintained_chain(tmp_path, kind) as (path, cycles):
        store = SlowStore(path)
        started = time.monotonic()
        while (reads < READS or cycles.value < 3) and time.monotonic() - started < TIME_LIMIT_S:
            reader = ChainReader(path, store=store)
            step = rng.choice(reader.steps)
            try:
                state = reader.materialize(step)
            except ldformat.StepNotFoundError:
                gone += 1  # truncated after this reader opened the chain: a correct answer
            except ldformat.LdformatError as e:
                problems.append(f"materialize step {step}: {type(e).__name__}: {e}")
            else:
                reads += 1
                if state["step"] != step or set(state["model"]) != names or not state["optimizer"]["state"]:
                    problems.append(f"materialize step {step}: an incomplete state for step {state['step']}")
            for args in (["info", str(path)], ["log", str(path)]):
                result = runner.invoke(cli, args)
                cli_runs += 1
                if result.exit_code != 0:
                    problems.append(f"ldtools {args[0]}: exit {result.exit_code}: {result.output.strip()[-300:]}")
    assert reads >= READS and cycles.value >= 3, f"too little overlap: {reads} reads, {cycles.value} cycles"
    assert not problems, f"{len(problems)} false reports in {reads + gone} reads and {cli_runs} CLI runs:\n" + \
        "\n".join(problems[:5])


def test_readers_overlapping_writer_truncate_compact_xor(tmp_path: Path) -> None:
    _run(tmp_path, "state.xor")


def test_readers_overlapping_writer_truncate_compact_grad(tmp_path: Path) -> None:
    _run(tmp_path, "grad.dense")
