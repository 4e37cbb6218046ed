"""Validation of a sharded chain (spec §20.7): the sharded root, every rank chain (spec §18) and
their agreement with the root.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..chain.reader import ChainReader, chain_name, open_store
from ..chain.records import ROOT_FILE
from ..chain.sharded_probe import SHARDED_ROOT, rank_location
from ..chain.validate import (
    VALIDATE_ATTEMPTS,
    Problem,
    ValidationReport,
    log_head,
    problem_message,
    reraise_unless_problem,
    validate,
)
from ..errors import CorruptChainError, LdformatError, NotAChainError
from ..stores import Store
from .chain import (
    COMMITS_DIR,
    Commit,
    ShardedRoot,
    commit_numbers,
    commit_path,
    read_commits,
    read_sharded_root,
    replica_problems,
)


def validate_sharded(path: str | os.PathLike[str], store: Store, deep: bool,
                      progress: Callable[[str, int, int], None] | None,
                      storage_options: dict[str, Any] | None) -> ValidationReport:
    """Spec §20.7: the sharded root, every rank chain (§18) and its agreement with the root
    and rank chain 0, the commit records, and replicated copies at every committed anchor
    (``deep``: at every committed step). A validation that found a problem while the newest
    commit record or a rank chain's log moved starts again (at most VALIDATE_ATTEMPTS)."""
    report = ValidationReport(path=chain_name(path, None), deep=deep)
    for attempt in range(VALIDATE_ATTEMPTS):
        heads = _sharded_heads(path, store, storage_options)
        report = _validate_sharded_once(path, store, deep, progress, storage_options)
        if report.ok or attempt == VALIDATE_ATTEMPTS - 1:
            break
        if heads is not None and _sharded_heads(path, store, storage_options) == heads:
            break
    return report


def _sharded_heads(path: str | os.PathLike[str], store: Store,
                   storage_options: dict[str, Any] | None) -> list[object] | None:
    """The newest commit record's number and every rank chain's log head; None while changing."""
    try:
        root = read_sharded_root(store, chain_name(path, None))
        heads: list[object] = [commit_numbers(store)[-1:]]
        for r in root.chain_ranks:
            heads.append(log_head(open_store(rank_location(path, r), None, storage_options)))
        return heads
    except (OSError, LdformatError):
        return None


def _validate_sharded_once(path: str | os.PathLike[str], store: Store, deep: bool,
                           progress: Callable[[str, int, int], None] | None,
                           storage_options: dict[str, Any] | None) -> ValidationReport:
    where = chain_name(path, None)
    report = ValidationReport(path=where, deep=deep)

    def problem(default: str, step: int | None, e: Exception) -> None:
        reraise_unless_problem(e)
        head, msg = problem_message(e)
        report.problems.append(Problem(head or default, step, msg))

    try:
        root = read_sharded_root(store, where)
        if store.exists(ROOT_FILE):
            raise CorruptChainError(f"{where}: holds both {SHARDED_ROOT} and {ROOT_FILE} (spec §20.1)")
    except NotAChainError:
        raise
    except Exception as e:
        problem(f"{where}/{SHARDED_ROOT}", None, e)
        return report
    report.kind = root.kind
    commits: list[Commit] = []
    try:
        commits = read_commits(store, where)
        if not commits:
            raise CorruptChainError(f"{where}/{COMMITS_DIR}: no commit record, so no committed step (an "
                                    "unfinished creation, spec §20.3.3); a writer of the same layout continues it")
    except Exception as e:
        problem(f"{where}/{COMMITS_DIR}", None, e)
    readers: dict[int, ChainReader | None] = {}
    for r in root.chain_ranks:  # copy ranks have no chain (spec §20.2 ``copies``)
        location = rank_location(path, r)
        try:
            sub = validate(location, deep=deep, progress=progress, storage_options=storage_options)
            report.problems.extend(sub.problems)
            report.drift.extend(sub.drift)
            reader = ChainReader(location, storage_options=storage_options)
            if reader.kind != root.kind:
                raise CorruptChainError(f"{location}: rank {r}'s chain has kind {reader.kind}, "
                                        f"the sharded chain {root.kind}")
            readers[r] = reader
        except NotAChainError as e:
            if commits:  # an unfinished creation (reported above) may lack rank chains still being created
                why = problem_message(e)[1]
                report.problems.append(Problem(location, None, f"rank {r}'s chain is missing ({why})"))
            readers[r] = None
        except Exception as e:
            problem(location, None, e)
            readers[r] = None
    _check_layout(root, {r: None if x is None else x.root.schema for r, x in readers.items()}, where, report)
    if any(x is None for x in readers.values()) or not commits:
        return report
    ranks = {r: x for r, x in readers.items() if x is not None}
    newest = commits[-1].step
    committed = sorted(s for s in set.intersection(*(set(x.steps) for x in ranks.values())) if s <= newest)
    if newest not in committed:
        lacking = [r for r, x in ranks.items() if newest not in x.steps]
        report.problems.append(Problem(f"{where}/{commit_path(commits[-1].seq)}", newest,
                                       f"the committed step is missing from the chain of rank(s) {lacking}"))
    report.steps = len(committed)
    report.latest_step = committed[-1] if committed else None
    report.anchors = sorted(set(committed).intersection(*(set(x.anchors) for x in ranks.values())))
    if not report.ok:
        return report
    compared = committed if deep else report.anchors
    schema = ranks[0].root.schema
    for n, step in enumerate(compared, 1):
        try:
            if step in report.anchors:
                stored = {r: x.load_anchor_tensors(step) for r, x in ranks.items()}
            else:
                stored = {r: x.stored_tensors(step) for r, x in ranks.items()}
            for message in replica_problems(root, schema, stored):
                report.problems.append(Problem(where, step, message))
        except Exception as e:
            problem(where, step, e)
        if progress:
            progress("replicas", n, len(compared))
    return report


def _check_layout(root: ShardedRoot, schemas: Mapping[int, dict[str, Any] | None], where: str,
                  report: ValidationReport) -> None:
    """Each rank chain stores every split tensor with the shape and dtype the layout gives it."""
    first: list[str] | None = None
    first_names: list[object] | None = None
    for r, schema in schemas.items():
        if schema is None:
            continue
        entries = {e.get("name"): e for e in schema.get("model", []) if isinstance(e, dict)}
        params = schema.get("optimizer", {}).get("params")
        if first is None:
            first = params
        elif params != first:
            report.problems.append(Problem(f"{where}/{SHARDED_ROOT}", None,
                                           f"rank {r}'s optimizer parameters differ from rank 0's"))
        for name, layout in root.tensors.items():
            shard = layout.of_rank(r)
            e = entries.get(name[len("model/"):])
            if shard is None:
                continue
            if e is None or e.get("alias_of") is not None or e.get("dtype") != layout.dtype or (
                    tuple(e.get("shape", ())) != shard.lengths):
                report.problems.append(Problem(f"{where}/{SHARDED_ROOT}", None,
                                               f"rank {r}'s chain does not store {name} as the layout says "
                                               f"({layout.dtype} {list(shard.lengths)})"))
        names = sorted(entries, key=str)
        if first_names is None:
            first_names = names
        elif names != first_names:
            report.problems.append(Problem(f"{where}/{SHARDED_ROOT}", None,
                                           f"rank {r}'s chain stores other model tensors than rank 0's"))
