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
from typing import Any, TypeAlias

import numpy as np
import torch

from ..errors import ChainError, CorruptChainError, LdformatError, NotAChainError
from ..format.checks import (
    OptimizerRules,
    Schema,
    TensorMeta,
    check_anchor,
    check_extra,
    check_hyper,
    check_param_groups,
    tensor_metas,
    xor_step_changes,
)
from ..format.jsonvalue import JSONObject
from ..format.manifest import ObjectRef, SlotInfo, ranges_of
from ..format.optstate import check_structure
from ..format.replay import ProxyReplayer, stand_in
from ..format.state import ParamGroup, bits_view
from ..stores import Store
from ..stores.crc32c import crc32c_hex
from .reader import ChainReader, open_store
from .records import ROOT_FILE, log_path, log_sequence_numbers

_Walker: TypeAlias = "dict[str, TensorMeta] | ProxyReplayer"


"""What the replay-path walk carries along a path: the tensors' (dtype, shape) for state.xor,
the optimizer on stand-ins for gradient kinds."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a chain, naming the object and step involved."""

    path: str
    step: int | None
    message: str

    def __str__(self) -> str:
        where = self.path + (f" (step {self.step})" if self.step is not None else "")
        return f"{where}: {self.message}"

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "step": self.step, "message": self.message}


@dataclass
class ValidationReport:
    path: str
    kind: str | None = None
    steps: int = 0
    anchors: list[int] = field(default_factory=list)
    latest_step: int | None = None
    problems: list[Problem] = field(default_factory=list)
    drift: list[JSONObject] = field(default_factory=list)
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> JSONObject:
        return {
            "path": self.path,
            "ok": self.ok,
            "kind": self.kind,
            "steps": self.steps,
            "anchors": list(self.anchors),
            "latest_step": self.latest_step,
            "deep": self.deep,
            "problems": [p.to_dict() for p in self.problems],
            "drift": list(self.drift),
        }


def problem_message(e: Exception) -> tuple[str, str]:
    text = str(e)
    head, sep, rest = text.partition(": ")
    if not sep:
        return "", text
    return re.sub(r" \(step -?\d+\)$", "", head), rest


#: Validations of one call: a validation that found a problem while the log moved (a
#: concurrent commit, compaction or truncation) starts again, at most this many times in all.
VALIDATE_ATTEMPTS = 10


@dataclass
class _Verified:
    """Objects that passed their checks in an earlier attempt of one call, so that a restart
    reads only what the moved log added. Objects are immutable under their names and the keys
    hold every field of a reference, so a hit is the same bytes, verified."""

    anchors: dict[tuple[ObjectRef, bool], tuple[dict[str, TensorMeta], dict[str, torch.Tensor],
                                                 dict[str, torch.Tensor] | None]] = field(default_factory=dict)
    batches: dict[tuple[str, tuple[ObjectRef, ...], tuple[SlotInfo, ...], int], np.ndarray] = field(
        default_factory=dict)


def validate(
    path: str | os.PathLike[str],
    deep: bool = False,
    *,
    store: Store | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ValidationReport:
    """Validate an ordinary chain; :func:`ldformat.validate` (which documents it) also validates sharded ones."""
    store = open_store(path, store, storage_options)
    report = ValidationReport(path=str(path), deep=deep)
    verified = _Verified()
    for attempt in range(VALIDATE_ATTEMPTS):
        head = log_head(store)
        report = _Validation(path, store, deep, progress, verified).run()
        if report.ok or attempt == VALIDATE_ATTEMPTS - 1:
            break
        if head is not None and log_head(store) == head:
            break  # the log did not move: the problems are the chain's own
    return report


def _step_list(steps: list[int]) -> str:
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges_of(steps))


def reraise_unless_problem(e: Exception) -> None:
    """I/O and memory errors are the caller's to handle; everything else is a problem of the chain."""
    if isinstance(e, (OSError, MemoryError)) and not isinstance(e, LdformatError):
        raise e


def log_head(store: Store) -> tuple[int, str] | None:
    """The newest record's number and the crc32c of its bytes; None while the log is changing."""
    try:
        seqs = log_sequence_numbers(store)
        if not seqs:
            return 0, ""
        data = store.read(log_path(seqs[-1]))
    except OSError:  # a record listed a moment ago vanished, or the log cannot be read now
        return None
    return seqs[-1], crc32c_hex(data)


class _Validation:
    """One pass over a chain as one fold of its log shows it."""

    def __init__(self, path: str | os.PathLike[str], store: Store, deep: bool,
                 progress: Callable[[str, int, int], None] | None, verified: _Verified) -> None:
        self.path, self.store, self.deep, self.progress = path, store, deep, progress
        self.verified = verified
        self.report = ValidationReport(path=str(path), deep=deep)
        # What the replay-path walk needs from the object checks:
        self.roots: dict[int, dict[str, torch.Tensor]] = {}  # anchor -> its optimizer/... tensors (stand-ins)
        self.metas: dict[int, dict[str, TensorMeta]] = {}  # anchor -> (dtype, shape) of its tensors
        self.presence: dict[str, np.ndarray] = {}  # batch path -> counts >= 0, [rows, slots]
        self.hyper: dict[int, list[ParamGroup] | None] = {}  # step -> decoded hyper (steps that passed)
        self.stored: dict[int, dict[str, torch.Tensor]] = {}  # deep: anchor -> its tensors
        self.schema: Schema | None = None
        self.rules: OptimizerRules | None = None  # gradient kinds: the optimizer class and its group members
        self.children: dict[int, list[int]] = {}  # step -> the steps whose delta is based on it

    def problem(self, where: str, step: int | None, e: BaseException | str) -> None:
        if isinstance(e, BaseException):
            if isinstance(e, LdformatError):
                head, msg = problem_message(e)
            else:  # a check that failed unexpectedly is still a problem of this chain
                head, msg = "", f"{type(e).__name__}: {e}"
            where = head or where
        else:
            msg = e
        self.report.problems.append(Problem(where, step, msg))

    def run(self) -> ValidationReport:
        report = self.report
        try:
            reader = ChainReader(self.path, store=self.store)
        except NotAChainError:
            raise
        except Exception as e:
            reraise_unless_problem(e)
            self.problem(str(self.path), None, e)
            return report
        self.reader = reader
        state = reader.state
        report.kind = reader.kind
        report.steps = len(state.steps)
        report.anchors = reader.anchors
        report.latest_step = reader.latest_step
        self.check_segments()
        root_where = f"{reader.path}/{ROOT_FILE}"
        schema: Schema | None = None
        try:
            schema = Schema.of(reader.root, reader.path)
            if schema.gradient:
                self.rules = OptimizerRules.of(schema, reader.root, root_where)
        except Exception as e:
            reraise_unless_problem(e)
            self.problem(root_where, None, e)
        self.schema = schema
        self.check_objects()
        if schema is not None:
            self.check_entries(schema)
        for step in state.steps:
            try:
                state.replay_path(step)
            except ChainError as e:
                self.problem(reader.path, step, e)
        if schema is not None and (self.rules is not None or not schema.gradient):
            self.walk(schema)
        if self.deep and report.ok:
            _deep_check(reader, self.stored, report, self.progress)
        return report

    # -- segments (spec §7.9) -------------------------------------------------------------------
    def check_segments(self) -> None:
        """Read and verify every segment the fold references; the steps of one that fails are
        reported and left out of the remaining checks."""
        state = self.reader.state
        for index, ref in enumerate(state.segments):
            try:
                state.load_segment(index)
            except Exception as e:
                reraise_unless_problem(e)
                listed = state.listed_steps(index)
                where = f"{self.reader.path}/{ref.object.path}"
                self.problem(where, listed[0] if listed else None, e)
                self.problem(where, None, f"steps {_step_list(listed)} cannot be materialized: their entries are in "
                             f"this segment, which {log_path(state.first_seq)} references")
                state.drop_segment(index)

    # -- objects (spec §18 checks 3-5) -------------------------------------------------------
    def check_objects(self) -> None:
        reader, state, schema = self.reader, self.reader.state, self.schema
        total = len(state.anchors) + len(state.delta_entries())
        done = 0
        for step, entry in sorted(state.anchors.items()):
            where = f"{reader.path}/{entry.object.path}"
            try:
                key = (entry.object, self.deep)
                if key not in self.verified.anchors:
                    tensors = reader.load_anchor_tensors(step)
                    roots = {n: stand_in(t) for n, t in tensors.items() if n.startswith("optimizer/")}
                    self.verified.anchors[key] = (tensor_metas(tensors), roots, tensors if self.deep else None)
                metas, roots, stored = self.verified.anchors[key]
                if schema is not None:
                    check_anchor(schema, entry, metas, where, self.rules)
                else:
                    model = {f"model/{e['name']}" for e in reader.root.schema.get("model", [])
                             if isinstance(e, dict) and e.get("alias_of") is None}
                    if model - set(metas):
                        raise CorruptChainError(f"{where}: anchor lacks {sorted(model - set(metas))[0]}")
                self.metas[step] = metas
                self.roots[step] = roots
                if stored is not None:
                    self.stored[step] = stored
            except Exception as e:
                reraise_unless_problem(e)
                self.problem(where, step, e)
            done += 1
            if self.progress:
                self.progress("objects", done, total)
        for d in state.delta_entries():
            first = min(s.step for s in d.steps) if d.steps else None
            try:
                batch_key = (d.path, d.objects, d.slots, d.rows)
                if batch_key not in self.verified.batches:
                    self.verified.batches[batch_key] = reader.load_batch(d, first).counts >= 0
                self.presence[d.path] = self.verified.batches[batch_key]
            except Exception as e:
                reraise_unless_problem(e)
                self.problem(d.path, first, e)
            done += 1
            if self.progress:
                self.progress("objects", done, total)

    # -- JSON parts of every step entry (spec §18 check 6) -------------------------------------
    def check_entries(self, schema: Schema) -> None:
        for step, (d, e) in sorted(self.reader.state.deltas.items()):
            where = f"{self.reader.path}/{d.path}"
            try:
                self.hyper[step] = check_hyper(schema, e, where, self.rules)
                check_param_groups(schema, e.param_groups, where, self.rules)
                check_extra(e.extra, where)
            except Exception as err:
                reraise_unless_problem(err)
                self.problem(where, step, err)

    # -- replay paths (spec §18 check 8) ---------------------------------------------------------
    def walk(self, schema: Schema) -> None:
        """Follow every replay path from every anchor that passed its checks, doing what replay
        does to the set of tensors (state.xor) or to the optimizer on stand-ins (gradient kinds)."""
        state = self.reader.state
        children: dict[int, list[int]] = {}
        for t, (_, e) in state.deltas.items():
            children.setdefault(e.base, []).append(t)
        self.children = children
        for a in sorted(self.roots):
            try:
                start = self.start(schema, a)
            except Exception as e:
                reraise_unless_problem(e)
                self.problem(f"{self.reader.path}/{state.anchors[a].object.path}", a, e)
                continue
            stack: list[tuple[int, _Walker]] = [(a, start)]
            while stack:
                node, current = stack.pop()
                kids = sorted(children.get(node, ()))
                for k, c in enumerate(kids):
                    # The last child continues with this state; the others get copies, taken before it changes.
                    mine = current if k == len(kids) - 1 else self.copy(current)
                    if self.apply(mine, c) and c not in state.anchors:
                        stack.append((c, mine))

    def start(self, schema: Schema, anchor: int) -> _Walker:
        entry = self.reader.state.anchors[anchor]
        if self.rules is None:  # state.xor: the tensors' names, dtypes and shapes
            return dict(self.metas[anchor])
        where = f"{self.reader.path}/{entry.object.path}"
        return ProxyReplayer(schema, self.rules, self.roots[anchor], entry.param_groups, where, entry.optimizer)

    @staticmethod
    def copy(current: _Walker) -> _Walker:
        return current.copy() if isinstance(current, (dict, ProxyReplayer)) else current

    def apply(self, current: _Walker, step: int) -> bool:
        """Apply the delta of ``step`` to ``current``; False (and a problem) if replay could not."""
        d, e = self.reader.state.deltas[step]
        where = f"{self.reader.path}/{d.path}"
        present = self.presence.get(d.path)
        if present is None or step not in self.hyper:
            return False  # its batch or entry has a problem already
        row = [slot for j, slot in enumerate(d.slots) if present[e.row, j]]
        try:
            if isinstance(current, ProxyReplayer):
                grads = {int(slot.name[len("grad/"):]) for slot in row if slot.name.startswith("grad/")}
                current.apply(e, self.hyper[step], grads, where)
            else:
                params = self.schema.params if self.schema is not None else ()
                removed, added = xor_step_changes(current, row, step, where, params)
                for name in removed:
                    del current[name]
                for slot in added:
                    current[slot.name] = (slot.dtype, slot.shape)
                if self.schema is not None:
                    check_structure(e.optimizer, current, len(self.schema.params), where)
        except Exception as err:
            reraise_unless_problem(err)
            later = self.dependents(step)
            if later:
                at, why = problem_message(err)
                err = CorruptChainError(f"{at or where}: {why} ({later} later step(s) replay through this one)")
            self.problem(where, step, err)
            return False
        return True

    def dependents(self, step: int) -> int:
        """How many committed steps replay through ``step``."""
        anchors, n, todo = self.reader.state.anchors, 0, [step]
        while todo:
            for c in self.children.get(todo.pop(), ()):
                if c not in anchors:
                    n += 1
                    todo.append(c)
        return n


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
        except LdformatError as e:
            report.problems.append(Problem(problem_message(e)[0] or where, b, problem_message(e)[1]))
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
