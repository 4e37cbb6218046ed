"""Small statistics and formatting helpers (no scipy needed)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bootstrap_ci(xs: Sequence[float], stat: Callable[[Sequence[float]], float] = median, *, level: float = 0.95,
                 n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``stat`` (default: the median)."""
    xs = list(xs)
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    values = sorted(stat([rng.choice(xs) for _ in xs]) for _ in range(n))
    lo = values[int((1 - level) / 2 * n)]
    hi = values[min(n - 1, int((1 + level) / 2 * n))]
    return lo, hi


def t_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean (two-sided; table for small n)."""
    xs = list(xs)
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
             15: 2.13, 20: 2.09, 30: 2.04}
    df = len(xs) - 1
    t = table.get(df) or next((v for k, v in sorted(table.items()) if k >= df), 1.96)
    m = statistics.fmean(xs)
    half = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return m - half, m + half


def summary(xs: Sequence[float]) -> dict[str, Any]:
    lo, hi = bootstrap_ci(xs)
    return {"median": median(xs), "ci95": [lo, hi], "n": len(xs), "values": list(xs)}


def fmt_ci(s: dict[str, Any], scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    m = s["median"] * scale
    lo, hi = (v * scale for v in s["ci95"])
    if math.isnan(lo):
        return f"{m:.{digits}f}{suffix}"
    return f"{m:.{digits}f}{suffix} [{lo:.{digits}f}, {hi:.{digits}f}]"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    cells = [[str(c) for c in row] for row in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(out)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**NOT met**")


def public_command(module: str, argv: Sequence[str]) -> str:
    """``python -m <module> <args>`` as the results record it: without where ``--out`` and
    ``--workdir`` were, which name the measuring machine's directories, not the measurement."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--workdir"):
            skip = True
        elif not a.startswith(("--out=", "--workdir=")):
            out.append(a)
    return " ".join([f"python -m {module}", *out])
