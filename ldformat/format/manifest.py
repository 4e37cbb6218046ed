"""Root metadata, commit records and segments (spec §5 "Root metadata", §7.1-§7.3, §7.9, §9.3,
§10.3-§10.4).

This module parses and validates the root file, records and segment objects; it does no I/O
and no tensor work. Folding records is :mod:`ldformat.format.fold`. Reading them from storage, creating
them and everything else about committing lives in :mod:`ldformat.chain.records`.

It is one module: the root, a record, its entries and its segments are one document model,
parsed by the same field validators and nested in one another (a record holds entries and
segment references, a segment holds entries).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal, TypeVar, get_args

from ..errors import CorruptChainError, FormatError, NotAChainError, UnsupportedVersionError
from ..stores import check_relative_path
from ..stores.crc32c import crc32c_hex
from .checksum import verify_checksum, with_checksum
from .jsonvalue import JSON, MAX_RECORD_BYTES, MAX_ROOT_BYTES, JSONObject, canonical, parse_json

FORMAT_NAME = "ldformat"
#: What an ordinary chain (and a rank chain of a sharded chain) is written as: 1.6 adds the
#: ``sub``, ``adam.v`` and ``adam.w`` slot encodings of ``state.xor`` (spec §11.3), which older
#: readers refuse.
FORMAT_VERSION = "1.6"
#: The newest format this package reads and writes. 1.3 added sharded chains (spec §20), 1.4
#: copy ranks in their roots, 1.5 segments, 1.6 difference-coded state deltas.
NEWEST_VERSION = "1.6"
SEGMENTS_VERSION = "1.5"  # the first version whose chains may hold segments
SUB_VERSION = "1.6"  # the first version whose state.xor chains may hold sub, adam.* and predict/ slots


def minor_version(version: str) -> int:
    """The MINOR of a ``MAJOR.MINOR`` format version (MAJOR is checked when a root is read)."""
    return int(version.split(".")[1])


def refuse_newer(format_version: str, where: str, doing: str) -> None:
    """Raise UnsupportedVersionError for a chain of a newer MINOR than this package writes:
    its writers, compaction and truncation follow a protocol this one does not know (spec
    §3.1). ``doing``: e.g. ``"append to it"``."""
    if minor_version(format_version) > minor_version(NEWEST_VERSION):
        raise UnsupportedVersionError(
            f"{where}: the chain is format {format_version}; this ldformat writes {NEWEST_VERSION} and may read "
            f"it but not {doing} (spec §3.1): upgrade ldformat")


def state_delta_encoding(format_version: str) -> Encoding:
    """The slot encoding a writer gives ``state.xor`` slots in a chain of this version (where no
    Adam prediction applies): ``sub`` from 1.6 on (spec §11.3; 4.7% fewer bytes than ``xor`` on
    AdamW state, same CPU), ``xor`` in older chains, whose readers refuse ``sub`` (spec §3.1)."""
    return "sub" if minor_version(format_version) >= minor_version(SUB_VERSION) else "xor"
FORMAT_MAJOR = 1
Kind = Literal["grad.topk", "grad.dense", "state.xor"]
KINDS: tuple[Kind, ...] = get_args(Kind)
RecordType = Literal["append", "snapshot"]
RECORD_TYPES: tuple[RecordType, ...] = get_args(RecordType)
Encoding = Literal["sparse", "dense", "xor", "sub", "adam.v", "adam.w"]
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
    encoding: str  # an Encoding (checked when read)

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


#: A set of steps as maximal inclusive ranges ``(first, last)``, ascending (spec §7.9).
Ranges = tuple[tuple[int, int], ...]
#: Every entry of a segment takes more than this many bytes of JSON, so a reference can list at
#: most ``size // SEGMENT_BYTES_PER_STEP`` steps (spec §21.4).
SEGMENT_BYTES_PER_STEP = 64
#: The references of one record list at most this many steps in all (spec §21.4).
MAX_LISTED_STEPS = 1 << 24


def ranges_of(steps: Iterable[int]) -> Ranges:
    """The maximal ranges of ``steps``."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return tuple(out)


def range_count(ranges: Ranges) -> int:
    return sum(last - first + 1 for first, last in ranges)


def expand(ranges: Ranges) -> list[int]:
    return [s for first, last in ranges for s in range(first, last + 1)]


def _ranges(doc: Mapping[str, JSON], key: str, where: str) -> Ranges:
    out: list[tuple[int, int]] = []
    for r in require_list(doc, key, where):
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in r)):
            raise CorruptChainError(f"{where}: {key} holds {r!r}, not a range [first, last] (spec §7.9)")
        first, last = r[0], r[1]
        assert isinstance(first, int) and isinstance(last, int)
        if not 0 <= first <= last or (out and first <= out[-1][1] + 1):
            raise CorruptChainError(
                f"{where}: {key} is not an ascending list of maximal ranges at {r!r} (spec §7.9)")
        out.append((first, last))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class SegmentRef:
    """A segment object and the steps it contributes to a snapshot's fold (spec §7.9)."""

    object: ObjectRef
    anchor_steps: Ranges
    delta_steps: Ranges

    @property
    def listed(self) -> int:
        return range_count(self.anchor_steps) + range_count(self.delta_steps)

    def to_dict(self) -> JSONObject:
        return {**self.object.to_dict(), "anchor_steps": [list(r) for r in self.anchor_steps],
                "delta_steps": [list(r) for r in self.delta_steps]}

    @classmethod
    def from_dict(cls, d: JSON, where: str) -> SegmentRef:
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: segment reference is not an object")
        check_fields(d, {"path", "size", "crc32c", "anchor_steps", "delta_steps"}, where)
        ref = ObjectRef.from_dict({k: d.get(k) for k in ("path", "size", "crc32c") if k in d}, where)
        if not ref.path.startswith("segments/"):
            raise CorruptChainError(f"{where}: segment reference names {ref.path!r}, outside segments/ (spec §7.9)")
        w = f"{where} segment {ref.path}"
        if ref.size > MAX_RECORD_BYTES:
            raise CorruptChainError(f"{w}: {ref.size} bytes, more than the {MAX_RECORD_BYTES} a segment may hold "
                                    "(spec §21.4)")
        seg = cls(object=ref, anchor_steps=_ranges(d, "anchor_steps", w), delta_steps=_ranges(d, "delta_steps", w))
        # Bound what the ranges claim before anything expands them (spec §21.4).
        if seg.listed == 0 or seg.listed > ref.size // SEGMENT_BYTES_PER_STEP:
            raise CorruptChainError(
                f"{w}: lists {seg.listed} steps, which a segment of {ref.size} bytes cannot hold (spec §7.9, §21.4)")
        return seg


def _disjoint(lists: Iterable[Ranges], inline: Iterable[int], what: str, where: str) -> None:
    """Spec §7.9 S1: the ranges of a record's references, and its own entries' steps, never overlap."""
    spans = sorted([r for rs in lists for r in rs] + [(s, s) for s in inline])
    for (_, last), (first, _) in pairwise(spans):
        if first <= last:
            raise CorruptChainError(f"{where}: step {first} is listed twice among the snapshot's {what} (spec §7.9)")


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A segment object: restated anchor and delta entries (spec §7.9)."""

    anchors: tuple[AnchorEntry, ...]
    deltas: tuple[DeltaEntry, ...]

    def to_bytes(self) -> bytes:
        return canonical({"anchors": [a.to_dict() for a in self.anchors],
                          "deltas": [d.to_dict() for d in self.deltas]}) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Segment:
        """Parse a segment whose size and crc32c were verified (spec §7.6)."""
        d: JSON = parse_json(data, where, max_bytes=MAX_RECORD_BYTES)
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: segment is not a JSON object")
        if canonical(d) + b"\n" != bytes(data):
            raise FormatError(f"{where}: the segment is not in canonical form followed by one LF (spec §7.9)")
        check_fields(d, {"anchors", "deltas"}, where)
        seg = cls(anchors=tuple(AnchorEntry.from_dict(a, where) for a in require_list(d, "anchors", where)),
                  deltas=tuple(DeltaEntry.from_dict(x, where) for x in require_list(d, "deltas", where)))
        steps = [a.step for a in seg.anchors]
        if len(set(steps)) != len(steps):
            raise CorruptChainError(f"{where}: two anchor entries of one step (spec §7.9)")
        steps = [s.step for x in seg.deltas for s in x.steps]
        if len(set(steps)) != len(steps):
            raise CorruptChainError(f"{where}: two step entries of one step (spec §7.9)")
        return seg


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
    #: Snapshot records of 1.5 chains: segments holding restated entries (spec §7.9).
    segments: tuple[SegmentRef, ...] = ()

    def to_dict(self) -> JSONObject:
        d: JSONObject = {
            "seq": self.seq,
            "type": self.type,
            "prev": self.prev,
            "time": self.time,
            "writer": self.writer,
            "reason": self.reason,
            "anchors": [a.to_dict() for a in self.anchors],
            "deltas": [d.to_dict() for d in self.deltas],
        }
        if self.segments:
            d["segments"] = [g.to_dict() for g in self.segments]
        return with_checksum(d)

    def to_bytes(self) -> bytes:
        return canonical(self.to_dict()) + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Record:
        d: JSON = parse_json(data, where, max_bytes=MAX_RECORD_BYTES)
        if not isinstance(d, dict):
            raise CorruptChainError(f"{where}: record is not a JSON object")
        _verify_record_bytes(d, bytes(data), where)
        check_fields(d, {"seq", "type", "prev", "time", "writer", "reason", "anchors", "deltas", "checksum",
                         "segments"}, where)
        rtype = require(d, "type", str, where)
        if rtype not in RECORD_TYPES:
            raise UnsupportedVersionError(f"{where}: unknown record type {rtype!r}")
        prev = d.get("prev")
        if prev is not None and not isinstance(prev, str):
            raise CorruptChainError(f"{where}: malformed prev")
        segments: tuple[SegmentRef, ...] = ()
        if "segments" in d:
            if rtype != "snapshot":
                raise CorruptChainError(f"{where}: an {rtype} record with segments (spec §7.9: snapshots only)")
            listed = require_list(d, "segments", where)
            if not listed:
                raise CorruptChainError(f"{where}: an empty segments list (spec §7.9: absent when empty)")
            segments = tuple(SegmentRef.from_dict(g, where) for g in listed)
            if sum(g.listed for g in segments) > MAX_LISTED_STEPS:
                raise CorruptChainError(f"{where}: the segments list more than {MAX_LISTED_STEPS} steps (spec §21.4)")
        record = cls(
            seq=require(d, "seq", int, where),
            type=rtype,
            prev=prev,
            time=require(d, "time", str, where),
            writer=require(d, "writer", str, where),
            reason=require(d, "reason", str, where),
            anchors=tuple(AnchorEntry.from_dict(a, where) for a in require_list(d, "anchors", where)),
            deltas=tuple(DeltaEntry.from_dict(x, where) for x in require_list(d, "deltas", where)),
            checksum=require(d, "checksum", str, where),
            segments=segments,
        )
        if segments:
            _disjoint([g.anchor_steps for g in segments], [a.step for a in record.anchors], "anchors", where)
            _disjoint([g.delta_steps for g in segments], [s.step for x in record.deltas for s in x.steps],
                      "delta steps", where)
        return record


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
