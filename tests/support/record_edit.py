"""Editing a chain's commit records in tests: crafted records that still carry valid checksums
and ``prev`` links, so that only the change under test is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ldformat.format.checksum import with_checksum
from ldformat.format.jsonvalue import canonical


def record_paths(chain: Path) -> list[Path]:
    return sorted(p for p in (chain / "log").glob("*.json") if len(p.stem) == 12 and p.stem.isdigit())


def edit_records(chain: Path, change: Callable[[list[dict[str, Any]]], None]) -> None:
    """Apply ``change`` to the records (in sequence order), then give every changed record a
    valid checksum and re-link the ``prev`` of every record after the first changed one."""
    paths = record_paths(chain)
    docs = [json.loads(p.read_bytes()) for p in paths]
    before = [canonical(d) for d in docs]
    change(docs)
    relink = False
    prev: str | None = None
    for path, doc, old in zip(paths, docs, before, strict=True):
        if relink and doc.get("type") != "snapshot":
            doc["prev"] = prev
        if relink or canonical(doc) != old:
            relink = True
            doc = with_checksum(doc)
            path.write_bytes(canonical(doc) + b"\n")
        prev = doc.get("checksum")
