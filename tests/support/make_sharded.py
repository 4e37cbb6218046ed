"""Running ``sharded_chain_maker.py make`` as a world of gloo workers (the sharded CLI and sync
tests' FSDP2 chain, a mirrored job, a job refused by a held lock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MAKER = Path(__file__).with_name("sharded_chain_maker.py")
TIMEOUT_S = 180
#: The shared chain of the ``fsdp_chain`` fixture (tests/conftest.py): world 2, 7 steps.
FSDP_WORLD = 2
FSDP_STEPS = 7


def run_maker(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(MAKER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for every process (at most TIMEOUT_S each); kill all on a time-out; their outputs.
    Every process must exit 0."""
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs.append(p.communicate()[0] + f"\n(killed after {TIMEOUT_S} s)")
    assert [p.returncode for p in procs] == [0] * len(procs), "\n---\n".join(outputs)
    return outputs
