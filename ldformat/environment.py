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
    """Human-readable differences between the recorded and the current environment."""
    recorded_device = recorded.get("device", device)
    now = current_environment(recorded_device if isinstance(recorded_device, str) else device)
    out = []
    if recorded.get("device", "cpu") != "cpu":
        out.append(f"device: recorded on {recorded['device']!r}, replayed on 'cpu'")
    for key in ("torch", "cpu_capability", "machine"):
        if key in recorded and recorded[key] != now[key]:
            out.append(f"{key}: recorded {recorded[key]!r}, here {now[key]!r}")
    return out
