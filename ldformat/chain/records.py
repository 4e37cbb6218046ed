"""The commit path (spec §5 "Root metadata", §7 "Commit log and commit protocol", §15 "Writer lock").

Everything that decides what a chain *is* lives here, and every other module goes through it:

- the root file (:func:`read_root`, :func:`create_root`);
- folding the log from the newest snapshot (:func:`read_log`);
- creating a commit record exclusively (:func:`commit_record`), fenced by the lock generation;
- object names (:func:`anchor_object_path`, :func:`batch_group_path`);
- the writer lock as a sequence of exclusively created generations (:class:`WriterLock`);
- garbage removal (:func:`collect_garbage`), which never deletes what a newer record may use.

The protocol needs only *create exclusively*, *read*, *list* and *delete* from storage: no
rename, no shared clock, and pids only to tell a dead local writer from a live one.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import secrets
import socket
from typing import Literal

import numpy as np

from ..errors import CorruptChainError, FormatError, LockLostError, MissingObjectError, NotAChainError, WriterIOError
from ..format.checksum import object_checksum_seed
from ..format.fold import ChainState, SegmentReader
from ..format.jsonvalue import MAX_RECORD_BYTES, MAX_ROOT_BYTES
from ..format.manifest import ObjectRef, Record, RootMetadata, Segment, SegmentRef
from ..stores import ObjectTooLargeError, Store

ROOT_FILE = "ldformat.json"


LOG_DIR = "log"


LOCK_DIR = "lock"


SEGMENT_DIR = "segments"


LEGACY_LOCK_FILE = "writer.lock"  # format 1.0 writers' lock (spec §15.5)


LOG_NAME = re.compile(r"^log/(\d{12})\.json$")


LOCK_NAME = re.compile(r"^lock/(\d{12})\.json$")


TMP_NAME = re.compile(r"^\.tmp-(.+)-[0-9a-f]+$")


#: Folds attempted before a record that keeps vanishing is reported (spec §7.3).
FOLD_ATTEMPTS = 5


RecordType = Literal["append", "snapshot"]


def now() -> str:
    """The current UTC time as spec §5.4 writes it (millisecond precision, ``Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def writer_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- names ---------------------------------------------------------------------------------
def log_path(seq: int) -> str:
    return f"{LOG_DIR}/{seq:012d}.json"


def lock_path(generation: int) -> str:
    return f"{LOCK_DIR}/{generation:012d}.json"


def anchor_object_path(step: int) -> str:
    """A fresh name for the anchor of ``step`` (spec §4.1)."""
    return f"anchors/{step}-{secrets.token_hex(4)}.safetensors"


def batch_group_path(first: int, last: int) -> str:
    """A fresh name for a batch holding steps ``first``..``last`` (spec §4.1)."""
    return f"deltas/{first}-{last}-{secrets.token_hex(4)}"


def numbered(store: Store, prefix: str, pattern: re.Pattern[str]) -> list[int]:
    out = []
    for p in store.list(prefix):
        m = pattern.match(p)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def log_sequence_numbers(store: Store) -> list[int]:
    return numbered(store, LOG_DIR, LOG_NAME)


def read_bounded(store: Store, path: str, limit: int, where: str) -> bytes:
    """Read a metadata file, refusing one larger than ``limit`` before reading it (spec §6.4)."""
    try:
        return store.read_buffer(path, max_size=limit).tobytes()
    except ObjectTooLargeError as e:
        raise FormatError(f"{where}: {e.size} bytes, more than the {limit} a reader accepts (spec §6.4)") from None


# -- root ----------------------------------------------------------------------------------
def read_root(store: Store, where: str) -> RootMetadata:
    data = read_root_file(store, ROOT_FILE, MAX_ROOT_BYTES, where, "an ldformat chain")
    return RootMetadata.from_bytes(data, f"{where}/{ROOT_FILE}")


def read_root_file(store: Store, name: str, limit: int, where: str, what: str) -> bytes:
    """The bytes of a root file (``ldformat.json``, ``sharded.json``); NotAChainError without one."""
    try:
        return read_bounded(store, name, limit, f"{where}/{name}")
    except FileNotFoundError:
        raise NotAChainError(f"{where}: not {what} (no {name}); check the path") from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise NotAChainError(f"{where}: cannot read {name}: {e.strerror}") from None


def create_root(store: Store, root: RootMetadata, where: str) -> None:
    """Create the root file exclusively: the last act of creating a chain (spec §7.4)."""
    create_root_file(store, ROOT_FILE, root.to_bytes(), where, "chain")


def create_root_file(store: Store, name: str, data: bytes, where: str, what: str) -> None:
    """Create a root file exclusively; another process's means a concurrent creation."""
    try:
        store.create_exclusive(name, data)
    except FileExistsError:
        from ..errors import ChainExistsError

        raise ChainExistsError(f"{where}: another process created a {what} here concurrently") from None
    except OSError as e:
        raise io_error(f"{where}/{name}: cannot create the {what}", e) from None


def io_error(what: str, e: OSError) -> WriterIOError:
    err = WriterIOError(f"{what}: {e.strerror or e} (errno {e.errno})")
    err.errno = e.errno
    return err


# -- folding the log -------------------------------------------------------------------------
class MissingLogRecord(CorruptChainError):
    """A listed record vanished before it was read (a compaction removed it); fold again."""


def read_log(store: Store, where: str) -> tuple[list[Record], ChainState]:
    """Read, verify and fold the log from its newest snapshot (spec §7.3).

    A chain without any record is corrupt: its log was lost, or its creation never finished.
    A compaction may delete superseded records between listing and reading: re-list then.
    """
    for attempt in range(FOLD_ATTEMPTS):
        try:
            return _read_log_once(store, where)
        except MissingLogRecord:
            if attempt == FOLD_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _read_log_once(store: Store, where: str) -> tuple[list[Record], ChainState]:
    seqs = log_sequence_numbers(store)
    if not seqs:
        raise CorruptChainError(
            f"{where}/{LOG_DIR}: the chain has no commit record (the log is missing or empty, "
            "or the chain's creation never finished); nothing in it is readable. Restore log/ "
            "from a copy, or delete the chain and start a new one"
        )
    records: dict[int, Record] = {}
    sizes: dict[int, int] = {}
    # Records created after the listing (or that a lagging listing left out) are found by
    # name: the log is contiguous at its end, and a name read is never stale (spec §7.3).
    while True:
        try:
            records[seqs[-1] + 1], sizes[seqs[-1] + 1] = _read_record_sized(store, seqs[-1] + 1, where)
        except MissingLogRecord:
            break
        seqs.append(seqs[-1] + 1)
    # Find the newest snapshot by reading from the end; records before it are superseded.
    start_index = 0
    for i in range(len(seqs) - 1, -1, -1):
        if seqs[i] not in records:
            records[seqs[i]], sizes[seqs[i]] = _read_record_sized(store, seqs[i], where)
        rec = records[seqs[i]]
        if rec.type == "snapshot":
            start_index = i
            break
    used = seqs[start_index:]
    if records[used[0]].type != "snapshot" and used[0] != 1:
        raise CorruptChainError(f"{where}/{log_path(1)}: the log does not start at record 1 and has no snapshot")
    state = ChainState(first_seq=used[0], read_segment=segment_reader(store, where), where=where)
    out = []
    prev: str | None = None
    for expected, seq in enumerate(used, start=used[0]):
        if seq != expected:
            raise CorruptChainError(f"{where}/{log_path(expected)}: commit record missing (log jumps to {seq})")
        rec = records[seq]
        if rec.seq != seq:
            raise CorruptChainError(f"{where}/{log_path(seq)}: record says seq {rec.seq}")
        if seq != used[0] and rec.prev != prev:
            raise CorruptChainError(f"{where}/{log_path(seq)}: prev checksum does not match record {seq - 1}")
        state.apply(rec, sizes[seq])
        prev = rec.checksum
        out.append(rec)
    return out, state


def read_verified(store: Store, path: str, ref: ObjectRef, where: str, what: str = "object",
                  missing: str = "`ldtools truncate` the chain before the step that needs it") -> np.ndarray:
    """Read a referenced object and verify its size and crc32c before anyone parses it (spec
    §7.6); ``where`` names it in errors, ``missing`` says what to do when it is gone."""
    try:
        # An object larger than its reference says is never read into memory; the checksum
        # (object_checksum's) runs while the object is read.
        data, crc = store.read_buffer_crc32c(path, max_size=ref.size, seed=object_checksum_seed(path))
    except ObjectTooLargeError as e:
        raise CorruptChainError(f"{where}: size {e.size} differs from the committed {ref.size}") from None
    except FileNotFoundError:
        raise MissingObjectError(
            f"{where}: {what} is missing (deleted or never synced); restore it from a copy, or {missing}") from None
    except (IsADirectoryError, NotADirectoryError):
        raise CorruptChainError(f"{where}: expected a file, found a directory") from None
    if len(data) != ref.size:
        raise CorruptChainError(f"{where}: size {len(data)} differs from the committed {ref.size} (truncated?)")
    if f"{crc:08x}" != ref.crc32c:
        raise CorruptChainError(f"{where}: crc32c mismatch (the {what} was modified or damaged)")
    return data


def segment_reader(store: Store, where: str) -> SegmentReader:
    """Reads a segment a fold references: verified before it is parsed (spec §7.6, §7.9)."""

    def read(ref: SegmentRef) -> Segment:
        w = f"{where}/{ref.object.path}"
        data = read_verified(store, ref.object.path, ref.object, w, "segment",
                             "truncate the chain before the steps it holds")
        return Segment.from_bytes(data.tobytes(), w)

    return read


def read_record(store: Store, seq: int, where: str) -> Record:
    return _read_record_sized(store, seq, where)[0]


def _read_record_sized(store: Store, seq: int, where: str) -> tuple[Record, int]:
    """Record ``seq`` and its size in bytes."""
    path = log_path(seq)
    try:
        data = read_bounded(store, path, MAX_RECORD_BYTES, f"{where}/{path}")
    except FileNotFoundError:
        raise MissingLogRecord(f"{where}/{path}: commit record vanished while reading") from None
    return Record.from_bytes(data, f"{where}/{path}"), len(data)


def create_or_lose(store: Store, path: str, data: bytes, where: str, lost: str, failed: str) -> None:
    """Create ``path`` exclusively; an existing one means this writer lost the chain (spec §7.4 step 5)."""
    try:
        store.create_exclusive(path, data)
    except FileExistsError:
        raise LockLostError(
            f"{where}/{path}: {lost}; this writer stops and deletes nothing (re-open the chain to continue)"
        ) from None
    except OSError as e:
        raise io_error(f"{where}/{path}: {failed}", e) from None
