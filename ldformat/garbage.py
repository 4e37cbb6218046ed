"""Removing objects no commit record references (spec §7.5, "Leftovers").

A crashed writer or compaction leaves objects under ``anchors/`` and ``deltas/`` and
temporary files under ``log/`` that no record references. Only the holder of the writer
lock removes them.
"""

from __future__ import annotations

from .manifest import LOG_DIR, ChainState, log_path, log_sequence_numbers
from .stores import Store


def unreferenced_objects(store: Store, state: ChainState) -> list[str]:
    referenced = state.referenced_objects()
    out = [p for prefix in ("anchors", "deltas") for p in store.list(prefix) if p not in referenced]
    out += [p for p in store.list(LOG_DIR) if p.split("/")[-1].startswith(".tmp-")]
    # Temporary files of an interrupted exclusive create at the root (lock, root metadata).
    out += [p for p in store.list("") if "/" not in p and p.startswith(".tmp-")]
    # Records superseded by the newest snapshot.
    out += [log_path(s) for s in log_sequence_numbers(store) if s < state.first_seq]
    return out


def remove_unreferenced(store: Store, state: ChainState) -> list[str]:
    paths = unreferenced_objects(store, state)
    for p in paths:
        store.delete(p)
    return paths
