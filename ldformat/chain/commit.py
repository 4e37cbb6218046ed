"""Committing (spec §7.4 "Commit protocol", §7.5 "Leftovers and garbage"): commit records created
exclusively and fenced by the lock generation, and garbage removal that never deletes what a
newer record may use.

The protocol needs only *create exclusively*, *read*, *list* and *delete* from storage: no
rename, no shared clock.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ..errors import (
    ChainError,
    LdformatError,
    LockLostError,
)
from ..format.fold import ChainState, is_fence
from ..format.jsonvalue import MAX_RECORD_BYTES, canonical
from ..format.manifest import AnchorEntry, DeltaEntry, Record, SegmentRef
from ..stores import ObjectTooLargeError, Store
from .lock import WriterLock, read_lock
from .records import (
    LEGACY_LOCK_FILE,
    LOCK_DIR,
    LOG_DIR,
    ROOT_FILE,
    SEGMENT_DIR,
    TMP_NAME,
    RecordType,
    create_or_lose,
    io_error,
    log_path,
    log_sequence_numbers,
    now,
    read_log,
    writer_name,
)


# -- committing ------------------------------------------------------------------------------
def commit_record(
    store: Store,
    where: str,
    state: ChainState,
    lock: WriterLock | None,
    *,
    type: RecordType,
    reason: str,
    anchors: Sequence[AnchorEntry] = (),
    deltas: Sequence[DeltaEntry] = (),
    segments: Sequence[SegmentRef] = (),
) -> Record:
    """Create the next record exclusively and fold it into ``state`` (spec §7.4 steps 3-5).

    The data objects it references must already be durable. ``lock`` is None only while a
    chain is being created (the creator holds generation 1 and nobody can see the chain yet).
    """
    if lock is not None:
        lock.renew_if_due()
        lock.check()
    record = Record(
        seq=state.last_seq + 1,
        type=type,
        prev=state.last_checksum,
        time=now(),
        writer=writer_name(),
        reason=reason,
        anchors=tuple(sorted(anchors, key=lambda a: a.step)) if type == "snapshot" else tuple(anchors),
        deltas=tuple(deltas),
        segments=tuple(segments),
    )
    doc = record.to_dict()
    data = canonical(doc) + b"\n"
    path = log_path(record.seq)
    if len(data) > MAX_RECORD_BYTES:
        raise ChainError(
            f"{where}/{path}: the record would be {len(data)} bytes, more than the {MAX_RECORD_BYTES} readers "
            "accept (spec §6.4); commit fewer steps per record, or compact with keep_last to shorten the chain"
        )
    create_or_lose(store, path, data, where, "another writer committed this record",
                   "cannot create the commit record, which may or may not exist now (the next open "
                   f"of the chain decides); nothing after record {record.seq - 1} is known to be durable")
    # The bytes are this call's own canonical serialization: the record as built, with the
    # checksum computed over them; it is not parsed back (a snapshot can be large).
    record = dataclasses.replace(record, checksum=str(doc["checksum"]))
    state.apply(record, len(data))
    return record


def delete_superseded(store: Store, where: str, lock: WriterLock, seqs: range, state: ChainState) -> None:
    """Delete the records ``seqs``, which a snapshot committed by the holder of ``lock``
    supersedes (garbage, spec §7.5), except fence records; a record already gone is skipped.

    The names are known without listing, so the lock is checked once, before the first
    deletion: a newer holder may have written records since, but never under these numbers.
    """
    doomed = [seq for seq in seqs if not _keeps_fence(store, seq, state)]
    if not doomed:
        return
    lock.check()
    for seq in doomed:
        try:
            store.delete(log_path(seq))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise io_error(f"{where}/{log_path(seq)}: cannot remove a superseded record", e) from None


#: Fence attempts before a taker gives up: each failed one means the old holder committed
#: once more, into the chain, and the taker folds again.
FENCE_ATTEMPTS = 8


def fence(store: Store, where: str, state: ChainState, lock: WriterLock) -> None:
    """After taking over a held lock, commit an empty record so that the old holder, should it
    still run, can never commit again: its next record number now exists, and fence records
    are never deleted (spec §15.3). If the old holder created that number first, its record
    is part of the chain: fold again and fence after it."""
    if not lock.took_over or lock.fenced:
        return
    for attempt in range(FENCE_ATTEMPTS):
        try:
            commit_record(store, where, state, lock, type="append", reason="takeover")
        except LockLostError:
            lock.check()  # superseded ourselves: stop; else the old holder committed meanwhile
            if attempt == FENCE_ATTEMPTS - 1:
                raise
            _, state = read_log(store, where)
            continue
        lock.fenced = True
        return


def open_log_for_write(store: Store, where: str, lock: WriterLock) -> tuple[list[Record], ChainState]:
    """Fold the log as the new lock holder, fencing it if the lock was taken over."""
    records, state = read_log(store, where)
    if lock.took_over and not lock.fenced:
        fence(store, where, state, lock)
        records, state = read_log(store, where)
    return records, state


#: A fence record is a few hundred bytes: a larger record below a fold's start is no fence and
#: is not read whole to tell.
MAX_FENCE_BYTES = 4096


def _keeps_fence(store: Store, seq: int, state: ChainState) -> bool:
    """Whether record ``seq``, below the fold's start, is a fence record and must stay (spec §7.5).

    Records this process folded are known; others are read, at most :data:`MAX_FENCE_BYTES`
    of them. One that is gone, too large or unparseable is no fence.
    """
    known = state.fences.get(seq)
    if known is not None:
        return known
    path = log_path(seq)
    try:
        data = store.read_buffer(path, max_size=MAX_FENCE_BYTES).tobytes()
        record = Record.from_bytes(data, path)
    except (ObjectTooLargeError, FileNotFoundError, LdformatError):
        return False
    except OSError as e:
        raise io_error(f"{state.where or path}: cannot read superseded record {path}", e) from None
    state.fences[seq] = keep = record.seq == seq and is_fence(record)
    return keep


# -- garbage ----------------------------------------------------------------------------------
def garbage(store: Store, state: ChainState, lock: WriterLock | None = None) -> list[str]:
    """Paths that no record at or before ``state.last_seq`` references and no live writer uses.

    Temporary files are garbage only when their exclusive create is settled: a record's below
    the next sequence number, a lock generation's below ours, the root's once the root exists.
    """
    referenced = state.referenced_objects()
    out = [p for prefix in ("anchors", "deltas", SEGMENT_DIR) for p in store.list(prefix) if p not in referenced]
    for p in store.list(LOG_DIR):
        name = p.split("/", 1)[1]
        m = TMP_NAME.match(name)
        if m and (seq := _seq_of(m.group(1))) is not None and seq <= state.last_seq:
            out.append(p)
    if lock is not None:
        for p in store.list(LOCK_DIR):
            name = p.split("/", 1)[1]
            m = TMP_NAME.match(name)
            if m:
                g = _seq_of(m.group(1))
                if g is not None and g < lock.generation:
                    out.append(p)
            elif (g := _seq_of(name)) is not None and g < lock.generation and not _keeps_generation(store, g):
                out.append(p)
        if store.exists(LEGACY_LOCK_FILE):
            out.append(LEGACY_LOCK_FILE)
    if store.exists(ROOT_FILE):
        out += [p for p in store.list("") if "/" not in p and p.startswith(f".tmp-{ROOT_FILE}-")]
    out += [log_path(s) for s in log_sequence_numbers(store) if s < state.first_seq
            and not _keeps_fence(store, s, state)]
    return out


def _keeps_generation(store: Store, generation: int) -> bool:
    """Whether lock generation ``generation`` must stay (spec §7.5): one that took the lock over
    from another holder, whose holder checks for it; or a held one that does not say (an older
    writer's). Released generations, renewals and unparseable files (which no holder wrote)
    go."""
    try:
        owner = read_lock(store, generation, "")
    except FileNotFoundError:
        return False
    return owner.state == "held" and owner.host is not None and owner.takeover is not False


def _check_log_ends(store: Store, state: ChainState, where: str) -> None:
    """Refuse to delete on a fold that is not the newest: record ``last + 1`` exists (spec §7.5).

    Read by name, which no stale listing can hide: the fold may have come from a listing that
    lagged behind the log, and what such a fold does not reference is not garbage.
    """
    nxt = log_path(state.last_seq + 1)
    try:
        newer = store.exists(nxt)
    except OSError as e:
        raise io_error(f"{where}/{nxt}: cannot check the end of the log", e) from None
    if newer:
        raise LockLostError(
            f"{where}/{nxt}: the log has a record after this writer's fold (record {state.last_seq}); "
            "the listing it folded was stale, or another process committed. This process stops and "
            "deletes nothing; re-open the chain to continue")


def _seq_of(name: str) -> int | None:
    m = re.fullmatch(r"(\d{12})\.json", name)
    return int(m.group(1)) if m else None


def collect_garbage(store: Store, state: ChainState, lock: WriterLock, where: str) -> list[str]:
    """Delete :func:`garbage`, as the lock holder. Spec §7.5.

    The generation is checked after listing: an object a newer writer wrote before that
    listing implies a newer generation, which the check sees; one written after it is not in
    the list. So nothing a newer record may reference is deleted.
    """
    paths = garbage(store, state, lock)
    lock.check()
    _check_log_ends(store, state, where)
    for p in paths:
        try:
            store.delete(p)
        except OSError as e:
            raise io_error(f"{where}/{p}: cannot remove garbage", e) from None
    return paths
