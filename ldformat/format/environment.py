"""The replay environment recorded with a chain (spec §13).

Gradient replay is bit-exact only with the same torch build, device type, CPU instruction
set that torch dispatches to, and optimizer kernel path. The chain records them; readers
warn when they replay elsewhere, and ``validate --deep`` measures the resulting drift.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

import torch

from .jsonvalue import JSON, JSONObject


def cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older builds
        return "unknown"


def current_environment(device: str = "cpu") -> JSONObject:
    return {
        "torch": torch.__version__,
        "device": device,
        "cpu_capability": cpu_capability(),
        "machine": platform.machine(),
    }


def differences(recorded: Mapping[str, JSON], device: str = "cpu") -> list[str]:
    """Human-readable differences between the recorded environment and replay on ``device``
    (a device type) here."""
    now = current_environment(device)
    out = []
    if recorded.get("device", "cpu") != device:
        out.append(f"device: recorded on {recorded.get('device', 'cpu')!r}, replayed on {device!r}")
    # The CPU's instruction set matters only to replay on the CPU.
    for key in ("torch", "cpu_capability", "machine") if device == "cpu" else ("torch",):
        if key in recorded and recorded[key] != now[key]:
            out.append(f"{key}: recorded {recorded[key]!r}, here {now[key]!r}")
    return out
