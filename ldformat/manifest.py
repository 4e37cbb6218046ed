"""Root metadata and commit records (spec §5 "Root metadata", §7.1-§7.3, §9.3, §10.3-§10.4).

This module parses and validates the root file and records, and folds records into a
:class:`ChainState`; it does no I/O and no tensor work. Reading them from storage, creating
them and everything else about committing lives in :mod:`ldformat.log`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from .errors import CorruptChainError, FormatError, NotAChainError, UnsupportedVersionError
from .jsonvalue import (
    JSON,
    MAX_RECORD_BYTES,
    MAX_ROOT_BYTES,
    JSONObject,
    canonical,
    crc32c_hex,
    parse_json,
    verify_checksum,
    with_checksum,
)
from .stores import check_relative_path

FORMAT_NAME = "ldformat"
FORMAT_VERSION = "1.2"  # what an ordinary chain is written as
#: The newest format this package reads and writes: 1.3 adds sharded chains (spec §20), whose
#: rank chains are written as 1.3 so that older writers refuse to touch one on its own.
NEWEST_VERSION = "1.3"
FORMAT_MAJOR = 1
Kind = Literal["grad.topk", "grad.dense", "state.xor"]
KINDS: tuple[Kind, ...] = get_args(Kind)
RecordType = Literal["append", "snapshot"]
RECORD_TYPES: tuple[RecordType, ...] = get_args(RecordType)
Encoding = Literal["sparse", "dense", "xor"]
"""How a delta batch stores a slot's values (spec §10.3)."""
ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)

_Scalar = TypeVar("_Scalar", int, str, bool)


def check_fields(doc: Mapping[str, JSON], known: set[str], where: str) -> None:
    for key, value in doc.items():
        if key in known:
            continue
        if isinstance(value, dict) and value.get("must_understand") is False:
            continue
        raise UnsupportedVersionError(
            f"{where}: unknown field {key!r} that must be understood; "
            "upgrade ldformat to read this chain"
        )


def _field(doc: Mapping[str, JSON], key: str, where: str) -> JSON:
    if key not in doc:
        raise CorruptChainError(f"{where}: missing field {key!r}")
    return doc[key]


def _wrong_type(key: str, where: str) -> CorruptChainError:
    return CorruptChainError(f"{where}: field {key!r} has the wrong type")


def require(doc: Mapping[str, JSON], key: str, typ: type[_Scalar], where: str) -> _Scalar:
    """Member ``key`` of ``doc``, an instance of ``typ`` (``True`` is not an int here)."""
    value = _field(doc, key, where)
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        raise _wrong_type(key, where)
    return value


def require_list(doc: Mapping[str, JSON], key: str, where: str) -> list[JSON]:
    value = _field(doc, key, where)
    if not isinstance(value, list):
        raise _wrong_type(key, where)
    return value


def require_object(doc: Mapping[str, JSON], key: str, where: str) -> JSONObject:
    value = _field(doc, key, where)
    if not isinstance(value, dict):
        raise _wrong_type(key, where)
    return value


def _optional_object(doc: Mapping[str, JSON], key: str, where: str) -> JSONObject | None:
    """An object member that may be absent (never ``null``: a canonical record omits it)."""
    if key not in doc:
        return None
    return require_object(doc, key, where)


def _safe_path(path: str, where: str) -> str:
    """``path`` if it is safe (spec §21.2); else corruption naming the record it came from."""
    try:
        return check_relative_path(path)
    except CorruptChainError as e:
        raise CorruptChainError(f"{where}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class ObjectRef:
    """A stored object with the size and crc32c a reader must verify."""

    path: str
    size: int
    crc32c: str

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c}

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> ObjectRef:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: object reference is not an object")
        check_fields(d, {"path", "size", "crc32c"}, where)
        path = _safe_path(require(d, "path", str, where), where)
        size = require(d, "size", int, where)
        crc = require(d, "crc32c", str, where)
        if size < 0 or not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise CorruptChainError(f"{where}: malformed size or crc32c for {path}")
        return cls(path=path, size=size, crc32c=crc)


@dataclass(frozen=True, kw_only=True)
class AnchorEntry:
    """A full state at ``step``: one safetensors object plus the JSON parts."""

    step: int
    object: ObjectRef
    param_groups: JSON  # encoded (spec §6); an array of param groups
    extra: JSON  # encoded; an object
    optimizer: JSON = None  # the optimizer structure (spec §8.2), absent when it is empty

    def to_dict(self) -> JSONObject:
        d: JSONObject = {
            "step": self.step,
            "object": self.object.to_dict(),
            "param_groups": self.param_groups,
            "extra": self.extra,
        }
        if self.optimizer is not None:
            d["optimizer"] = self.optimizer
        return d

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> AnchorEntry:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: anchor entry is not an object")
        check_fields(d, {"step", "object", "param_groups", "extra", "optimizer"}, where)
        step = require(d, "step", int, where)
        ref = ObjectRef.from_dict(d.get("object"), f"{where} anchor {step}")
        if not ref.path.startswith("anchors/"):
            raise CorruptChainError(f"{where}: anchor {step} names {ref.path!r}, outside anchors/ (spec §4.2)")
        return cls(
            step=step,
            object=ref,
            param_groups=require_list(d, "param_groups", where),
            extra=require_object(d, "extra", where),
            optimizer=_optional_object(d, "optimizer", where),
        )


@dataclass(frozen=True, kw_only=True)
class SlotInfo:
    """One tensor carried by a delta batch (spec §10.3)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str  # an Encoding: "sparse" | "dense" | "xor" (checked when read)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> JSONObject:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding}

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> SlotInfo:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: slot is not an object")
        check_fields(d, {"name", "dtype", "shape", "encoding"}, where)
        enc = require(d, "encoding", str, where)
        if enc not in ENCODINGS:
            raise UnsupportedVersionError(f"{where}: unknown slot encoding {enc!r}")
        shape = require_list(d, "shape", where)
        dims = [s for s in shape if isinstance(s, int) and s >= 0]
        if len(dims) != len(shape):
            raise CorruptChainError(f"{where}: malformed shape")
        return cls(name=require(d, "name", str, where), dtype=require(d, "dtype", str, where),
                   shape=tuple(dims), encoding=enc)


@dataclass(frozen=True, kw_only=True)
class StepEntry:
    """What a reader needs to apply the delta of one step (spec §10.4)."""

    step: int
    base: int
    row: int
    stepped: bool
    hyper: JSON  # encoded (spec §6); null or an array of param groups without params
    param_groups: JSON  # encoded; an array of param groups
    extra: JSON  # encoded; an object
    optimizer: JSON = None  # state.xor: the optimizer structure (spec §8.2), absent when empty

    def to_dict(self) -> JSONObject:
        d: JSONObject = {
            "step": self.step,
            "base": self.base,
            "row": self.row,
            "stepped": self.stepped,
            "hyper": self.hyper,
            "param_groups": self.param_groups,
            "extra": self.extra,
        }
        if self.optimizer is not None:
            d["optimizer"] = self.optimizer
        return d

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> StepEntry:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: step entry is not an object")
        check_fields(d, {"step", "base", "row", "stepped", "hyper", "param_groups", "extra", "optimizer"}, where)
        step = require(d, "step", int, where)
        base = require(d, "base", int, where)
        if not 0 <= base < step:
            raise CorruptChainError(f"{where}: step {step} has invalid base {base}")
        hyper = d.get("hyper")
        if hyper is not None and not isinstance(hyper, list):
            raise CorruptChainError(f"{where}: step {step} has malformed hyper")
        return cls(
            step=step,
            base=base,
            row=require(d, "row", int, where),
            stepped=require(d, "stepped", bool, where),
            hyper=hyper,
            param_groups=require_list(d, "param_groups", where),
            extra=require_object(d, "extra", where),
            optimizer=_optional_object(d, "optimizer", where),
        )


@dataclass(frozen=True, kw_only=True)
class DeltaEntry:
    """One Zarr group holding a batch of step deltas."""

    path: str
    objects: tuple[ObjectRef, ...]
    slots: tuple[SlotInfo, ...]
    rows: int
    steps: tuple[StepEntry, ...]

    def to_dict(self) -> JSONObject:
        return {
            "path": self.path,
            "objects": [o.to_dict() for o in self.objects],
            "slots": [s.to_dict() for s in self.slots],
            "rows": self.rows,
            "steps": [s.to_dict() for s in self.steps],
        }

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> DeltaEntry:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: delta entry is not an object")
        check_fields(d, {"path", "objects", "slots", "rows", "steps"}, where)
        path = _safe_path(require(d, "path", str, where), where)
        if not path.startswith("deltas/"):
            raise CorruptChainError(f"{where}: delta entry names {path!r}, outside deltas/ (spec §4.2)")
        w = f"{where} delta {path}"
        rows = require(d, "rows", int, w)
        steps = tuple(StepEntry.from_dict(s, w) for s in require_list(d, "steps", w))
        for s in steps:
            if not 0 <= s.row < rows:
                raise CorruptChainError(f"{w}: step {s.step} points at row {s.row} of {rows}")
        return cls(
            path=path,
            objects=tuple(ObjectRef.from_dict(o, w) for o in require_list(d, "objects", w)),
            slots=tuple(SlotInfo.from_dict(s, w) for s in require_list(d, "slots", w)),
            rows=rows,
            steps=steps,
        )


@dataclass(frozen=True, kw_only=True)
class Record:
    """One commit record. ``append`` adds entries; ``snapshot`` states the whole chain."""

    seq: int
    type: RecordType
    prev: str | None
    time: str
    writer: str
    reason: str
    anchors: tuple[AnchorEntry, ...]
    deltas: tuple[DeltaEntry, ...]
    checksum: str = ""

    def to_dict(self) -> JSONObject:
        return with_checksum(
            {
                "seq": self.seq,
                "type": self.type,
                "prev": self.prev,
                "time": self.time,
                "writer": self.writer,
                "reason": self.reason,
                "anchors": [a.to_dict() for a in self.anchors],
                "deltas": [d.to_dict() for d in self.deltas],
            }
        )

    def to_bytes(self) -> bytes:
        return canonical(self.to_dict()) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Record:
        d: JSON = parse_json(data, where, max_bytes=MAX_RECORD_BYTES)
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: record is not a JSON object")
        _verify_record_bytes(d, bytes(data), where)
        check_fields(d, {"seq", "type", "prev", "time", "writer", "reason", "anchors", "deltas", "checksum"}, where)
        rtype = require(d, "type", str, where)
        if rtype not in RECORD_TYPES:
            raise UnsupportedVersionError(f"{where}: unknown record type {rtype!r}")
        prev = d.get("prev")
        if prev is not None and not isinstance(prev, str):
            raise CorruptChainError(f"{where}: malformed prev")
        return cls(
            seq=require(d, "seq", int, where),
            type=rtype,
            prev=prev,
            time=require(d, "time", str, where),
            writer=require(d, "writer", str, where),
            reason=require(d, "reason", str, where),
            anchors=tuple(AnchorEntry.from_dict(a, where) for a in require_list(d, "anchors", where)),
            deltas=tuple(DeltaEntry.from_dict(x, where) for x in require_list(d, "deltas", where)),
            checksum=require(d, "checksum", str, where),
        )


def _verify_record_bytes(d: JSONObject, data: bytes, where: str) -> None:
    """The record's checksum and canonical form (spec §6.3, §7.1), serializing it once.

    A canonical record is ``{"anchors":[...],"checksum":"<hex>",...}`` + LF, so the canonical
    form of the record without ``checksum`` is its own bytes without that member: once the
    bytes are known to be canonical, the checksum is computed over them, not over a second
    serialization (spec §6.3, note). Anything else takes the general path, which reports
    the checksum first.
    """
    text = canonical(d)
    checksum, anchors = d.get("checksum"), d.get("anchors")
    if text + b"\n" == data and isinstance(checksum, str) and isinstance(anchors, list) and text.startswith(
            b'{"anchors":'):
        head = len(b'{"anchors":') + len(canonical(anchors))
        member = b',"checksum":' + canonical(checksum)
        if text[head:head + len(member)] == member:
            if crc32c_hex(text[:head] + text[head + len(member):]) != checksum:
                raise CorruptChainError(f"{where}: checksum mismatch (the file was modified or damaged)")
            return
    verify_checksum(d, where)
    if text + b"\n" != data:
        raise FormatError(
            f"{where}: the record is not in canonical form followed by one LF (spec §7.1), although its "
            "checksum matches; records are never rewritten: restore it from a copy"
        )


@dataclass(frozen=True, kw_only=True)
class RootMetadata:
    """``ldformat.json``: written once when the chain is created."""

    format_version: str
    chain_id: str
    created: str
    kind: str  # a Kind (checked when read)
    # Any: unchecked JSON until checks.Schema.of parses it; a writer indexes the schema it built.
    schema: dict[str, Any]
    environment: JSONObject

    def to_dict(self) -> JSONObject:
        return with_checksum(
            {
                "format": FORMAT_NAME,
                "format_version": self.format_version,
                "chain_id": self.chain_id,
                "created": self.created,
                "kind": self.kind,
                "schema": self.schema,
                "environment": self.environment,
            }
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RootMetadata:
        d: JSON = parse_json(data, where, max_bytes=MAX_ROOT_BYTES)
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise NotAChainError(f"{where}: not an ldformat root metadata file")
        version = d.get("format_version")
        m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
        if m is None:
            raise CorruptChainError(f"{where}: malformed format_version {version!r}")
        if int(m.group(1)) != FORMAT_MAJOR:
            raise UnsupportedVersionError(
                f"{where}: format version {version} is not supported by this reader "
                f"(it reads {FORMAT_MAJOR}.x); use an ldformat release that supports it"
            )
        verify_checksum(d, where)
        check_fields(d, {"format", "format_version", "chain_id", "created", "kind", "schema",
                          "environment", "checksum"}, where)
        kind = require(d, "kind", str, where)
        if kind not in KINDS:
            raise UnsupportedVersionError(f"{where}: unknown delta kind {kind!r}")
        return cls(
            format_version=str(version),
            chain_id=require(d, "chain_id", str, where),
            created=require(d, "created", str, where),
            kind=kind,
            schema=require_object(d, "schema", where),
            environment=require_object(d, "environment", where),
        )


@dataclass
class ChainState:
    """The visible content of a chain after folding the log."""

    anchors: dict[int, AnchorEntry] = field(default_factory=dict)
    deltas: dict[int, tuple[DeltaEntry, StepEntry]] = field(default_factory=dict)
    last_seq: int = 0
    last_checksum: str | None = None
    first_seq: int = 1
    #: Bytes of the record the fold starts at, when it is a snapshot (0 otherwise), and the
    #: number and bytes of the records folded after it: what the next open reads (spec §7.3).
    #: Only records folded with their size count (:func:`ldformat.log.read_log` and
    #: :func:`ldformat.log.commit_record` pass it); a writer uses them to decide when to write
    #: a snapshot (spec §7.8).
    start_bytes: int = 0
    tail_records: int = 0
    tail_bytes: int = 0

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.anchors) | set(self.deltas))

    @property
    def latest_step(self) -> int | None:
        steps = self.steps
        return steps[-1] if steps else None

    def restated_deltas(self, steps: Iterable[int]) -> list[DeltaEntry]:
        """Delta entries that restate the committed ``steps`` (delta steps of this state), each
        batch with exactly those of its step entries, unchanged: what a snapshot record lists
        for the deltas it keeps (spec §7.8, §16, §17.3)."""
        by_path: dict[str, tuple[DeltaEntry, list[StepEntry]]] = {}
        for s in sorted(steps):
            entry, step_entry = self.deltas[s]
            by_path.setdefault(entry.path, (entry, []))[1].append(step_entry)
        return [DeltaEntry(path=e.path, objects=e.objects, slots=e.slots, rows=e.rows, steps=tuple(kept))
                for e, kept in by_path.values()]

    def apply(self, record: Record, size: int = 0) -> None:
        """Fold ``record`` (spec §7.3 step 4); ``size``: its length in bytes, if known."""
        if record.type == "snapshot":
            self.anchors.clear()
            self.deltas.clear()
            self.first_seq = record.seq  # every earlier record is superseded (spec §7.3 step 2)
            self.start_bytes, self.tail_records, self.tail_bytes = size, 0, 0
        else:
            self.tail_records += 1
            self.tail_bytes += size
        for a in record.anchors:
            self.anchors[a.step] = a
        for d in record.deltas:
            for s in d.steps:
                self.deltas[s.step] = (d, s)
        self.last_seq = record.seq
        self.last_checksum = record.checksum

    def referenced_objects(self) -> set[str]:
        refs = {a.object.path for a in self.anchors.values()}
        for d, _ in self.deltas.values():
            refs.update(f"{d.path}/{o.path}" for o in d.objects)
        return refs

    def referenced_bytes(self) -> int:
        """The bytes of every object the chain references (their sizes as recorded)."""
        total = sum(a.object.size for a in self.anchors.values())
        return total + sum(o.size for d in self.delta_entries() for o in d.objects)

    def delta_entries(self) -> list[DeltaEntry]:
        seen: dict[str, DeltaEntry] = {}
        for d, _ in self.deltas.values():
            seen.setdefault(d.path, d)
        return list(seen.values())

    def replay_path(self, step: int) -> tuple[int, list[int]]:
        """Return (anchor step, delta steps to apply in order) that materialize ``step``."""
        chain: list[int] = []
        s = step
        while s not in self.anchors:
            entry = self.deltas.get(s)
            if entry is None:
                raise CorruptChainError(f"step {step} is not reachable: no anchor or delta for step {s}")
            chain.append(s)
            s = entry[1].base
        chain.reverse()
        return s, chain
