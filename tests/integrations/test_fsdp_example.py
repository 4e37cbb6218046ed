"""examples/fsdp.py and the README's sharded section: train at world size 2, resume at 4 (spec §20)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import REPO

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.procs,
]


def test_fsdp_example_resumes_at_another_world_size(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(REPO / "examples" / "fsdp.py"), "--out", str(tmp_path),
                          "--steps", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "restored state equals the chain's bit for bit: True" in run.stdout
    assert "chain: ok, 9 committed steps, latest 8" in run.stdout
    assert "chain-w4: ok, 5 committed steps, latest 12" in run.stdout
    assert "Traceback" not in run.stderr
