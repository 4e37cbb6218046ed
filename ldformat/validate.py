"""Validation of a chain (spec §18): every record, every object, every step.

``validate(path)`` checks what a reader would check on every read, for the whole chain:
record checksums and sequence, object sizes and crc32c, anchor and delta decoding, and that
every committed step is reachable. ``deep=True`` also replays the deltas between
consecutive anchors and compares the result with the stored anchor, bit for bit, reporting
drift in ULPs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ChainError, NotAChainError
from .reader import ChainReader
from .state import bits_view
from .stores import Store


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a chain, naming the object and step involved."""

    path: str
    step: int | None
    message: str

    def __str__(self) -> str:
        where = self.path + (f" (step {self.step})" if self.step is not None else "")
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "message": self.message}


@dataclass
class ValidationReport:
    path: str
    kind: str | None = None
    steps: int = 0
    anchors: list[int] = field(default_factory=list)
    latest_step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    drift: list[dict[str, Any]] = field(default_factory=list)
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "kind": self.kind,
            "steps": self.steps,
            "anchors": self.anchors,
            "latest_step": self.latest_step,
            "deep": self.deep,
            "problems": [p.to_dict() for p in self.problems],
            "drift": self.drift,
        }


def _message(e: Exception) -> tuple[str, str]:
    text = str(e)
    head, sep, rest = text.partition(": ")
    if not sep:
        return "", text
    return re.sub(r" \(step -?\d+\)$", "", head), rest


def validate(
    path: str | os.PathLike[str],
    deep: bool = False,
    *,
    store: Store | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> ValidationReport:
    """Check a chain and return a report (``report.ok``, ``report.problems``).

    Raises:
        NotAChainError: ``path`` is not a chain at all (nothing to validate).
    """
    report = ValidationReport(path=str(path), deep=deep)
    try:
        reader = ChainReader(path, store=store)
    except NotAChainError:
        raise
    except ChainError as e:
        where, msg = _message(e)
        report.problems.append(Problem(where or str(path), None, msg))
        return report
    state = reader.state
    report.kind = reader.kind
    report.steps = len(state.steps)
    report.anchors = reader.anchors
    report.latest_step = reader.latest_step

    model_names = {f"model/{e['name']}" for e in reader.root.schema["model"] if e["alias_of"] is None}
    anchors: dict[int, dict[str, torch.Tensor]] = {}
    total = len(state.anchors) + len(state.delta_entries())
    done = 0
    for step, entry in sorted(state.anchors.items()):
        try:
            tensors = reader.load_anchor_tensors(step)
            missing = model_names - set(tensors)
            if missing:
                report.problems.append(Problem(f"{reader.path}/{entry.object.path}", step,
                                               f"anchor lacks {sorted(missing)[0]}"))
            elif deep:
                anchors[step] = tensors
        except ChainError as e:
            report.problems.append(Problem(_message(e)[0] or entry.object.path, step, _message(e)[1]))
        done += 1
        if progress:
            progress("objects", done, total)
    for d in state.delta_entries():
        first = min(s.step for s in d.steps) if d.steps else None
        try:
            reader.load_batch(d, first)
        except ChainError as e:
            report.problems.append(Problem(_message(e)[0] or d.path, first, _message(e)[1]))
        done += 1
        if progress:
            progress("objects", done, total)
    for step in state.steps:
        try:
            state.replay_path(step)
        except ChainError as e:
            report.problems.append(Problem(reader.path, step, _message(e)[1]))
    if deep and report.ok:
        _deep_check(reader, anchors, report, progress)
    return report


def _deep_check(reader: ChainReader, anchors: dict[int, dict[str, torch.Tensor]], report: ValidationReport,
                progress: Callable[[str, int, int], None] | None) -> None:
    state = reader.state
    steps = sorted(anchors)
    pairs = []
    for b in steps:
        path: list[int] = []
        s = b
        while s in state.deltas:
            path.append(s)
            s = state.deltas[s][1].base
            if s in state.anchors:
                pairs.append((s, b, list(reversed(path))))
                break
    for n, (a, b, path) in enumerate(pairs, 1):
        where = f"{reader.path}/{state.anchors[b].object.path}"
        try:
            replayer = reader.start_replay(a)
            reader.replay_steps(replayer, path)
            replayer.sync_optimizer_tensors()
        except ChainError as e:
            report.problems.append(Problem(_message(e)[0] or where, b, _message(e)[1]))
            continue
        stored = anchors[b]
        worst = 0
        worst_name = None
        for name, expected in stored.items():
            if name.startswith("compressor"):
                continue
            got = replayer.tensors.get(name)
            if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
                report.problems.append(Problem(where, b, f"replay from anchor {a} lacks or reshapes {name}"))
                worst = -1
                break
            ulps = _max_ulps(got, expected)
            if ulps > worst:
                worst, worst_name = ulps, name
        if worst >= 0:
            report.drift.append({"from_anchor": a, "anchor": b, "max_ulps": worst, "tensor": worst_name})
            if worst > 0:
                report.problems.append(Problem(where, b, f"replay from anchor {a} drifts by up to {worst} ULPs "
                                               f"in {worst_name} (replay environment differs?)"))
        if progress:
            progress("replay", n, len(pairs))


def _max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    ia = bits_view(a.contiguous()).reshape(-1).to(torch.int64)
    ib = bits_view(b.contiguous()).reshape(-1).to(torch.int64)
    if a.dtype.is_floating_point:
        # Map sign-magnitude bits to a monotone integer line so the difference counts ULPs.
        width = a.element_size() * 8
        magnitude = (1 << (width - 1)) - 1

        def line(i: torch.Tensor) -> torch.Tensor:
            negative = i < 0 if width == 64 else (i & (1 << (width - 1))) != 0
            m = i & magnitude
            return torch.where(negative, -m - 1, m)  # -0.0 sits one step below +0.0

        ia, ib = line(ia), line(ib)
    return int((ia - ib).abs().max())
