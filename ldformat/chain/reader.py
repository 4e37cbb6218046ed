"""Reading and materializing a chain (spec §7.6 "Reading objects", §11 "Delta kinds and replay").

A reader never trusts what it reads: every object's size and crc32c are checked against
the commit record before it is parsed, and nothing stored is ever unpickled.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import (
    CorruptChainError,
    EmptyChainError,
    LdformatError,
    MissingObjectError,
    NotAChainError,
    ReplayEnvironmentWarning,
    StepNotFoundError,
)
from ..format.anchor import decode_anchor
from ..format.checks import check_anchor, check_extra, residual_rank, tensor_metas
from ..format.delta import DecodedBatch, RowDecoder, check_slots, decode_batch
from ..format.environment import differences
from ..format.jsonvalue import JSON
from ..format.manifest import DeltaEntry, ObjectRef, Record, RootMetadata, StepEntry
from ..format.replay import Replayer
from ..stores import Store, open_existing_store, parse_location
from .records import read_log, read_root, read_verified

T = TypeVar("T")


#: The store of an existing chain (:func:`ldformat.stores.open_existing_store`), by the name
#: the chain modules import it under.
open_store = open_existing_store


#: The root file of a sharded chain (``ldformat.chain.sharded_probe.SHARDED_ROOT``, spec §20), named here
#: because that module builds on this one.
SHARDED_ROOT_FILE = "sharded.json"


def _holds_sharded_root(store: Store) -> bool:
    try:
        return store.exists(SHARDED_ROOT_FILE)
    except OSError:
        return False


def chain_name(path: str | os.PathLike[str], store: Store | None) -> str:
    """How messages name the chain: ``path`` as given (a label when ``store`` is given), a URL
    without its trailing ``/``."""
    return str(path) if store is not None else parse_location(path).name


class ChainReader:
    """Read-only access to a chain; safe alongside a writer and a compaction.

    Args:
        path: the chain: a directory, or a URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
            ``memory://name``, ...; see :func:`ldformat.stores.open_store`).
        store: an explicit :class:`~ldformat.stores.Store` (``path`` then only names the chain).
        storage_options: settings of an object store, overriding its environment variables
            (see :class:`~ldformat.stores.ObjectStore`).
        replay_device: where gradient deltas are replayed (default the CPU). Gradient replay is
            bit-exact on the device type the chain was recorded on (spec §11.8): give
            ``"cuda"`` for a chain recorded on a GPU. Results are CPU tensors either way;
            ``state.xor`` chains are exact anywhere and ignore it.

    Example:
        >>> reader = ChainReader("runs/chain")                     # doctest: +SKIP
        >>> state = reader.materialize(reader.latest_step)          # doctest: +SKIP
        >>> model.load_state_dict(state["model"])                   # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, store: Store | None = None,
                 storage_options: dict[str, Any] | None = None,
                 replay_device: torch.device | str | None = None) -> None:
        self.path = chain_name(path, store)
        self.replay_device = torch.device(replay_device) if replay_device is not None else torch.device("cpu")
        self.store = open_store(path, store, storage_options)
        try:
            self.root: RootMetadata = read_root(self.store, self.path)
        except NotAChainError:
            if _holds_sharded_root(self.store):
                raise NotAChainError(
                    f"{self.path}: a sharded chain (spec §20: {SHARDED_ROOT_FILE}, one chain per rank), which "
                    "ChainReader does not read; open it with ldformat.open_reader(path), which reads both kinds, "
                    "or read one rank's chain with ChainReader(path + '/ranks/00000')") from None
            raise
        self._warned_env = False
        self.refresh()

    def refresh(self) -> None:
        """Re-read the log to see commits made since the reader was opened."""
        self.records: list[Record]
        self.records, self.state = read_log(self.store, self.path)

    @property
    def kind(self) -> str:
        return self.root.kind

    @property
    def steps(self) -> list[int]:
        return self.state.steps

    @property
    def anchors(self) -> list[int]:
        return sorted(self.state.anchors)

    @property
    def latest_step(self) -> int | None:
        return self.state.latest_step

    # -- objects -----------------------------------------------------------------------
    def read_object(self, ref: ObjectRef, step: int | None = None, prefix: str = "") -> np.ndarray:
        """Read an object and verify its size and crc32c against the log (a writable uint8 array)."""
        path = f"{prefix}/{ref.path}" if prefix else ref.path
        where = f"{self.path}/{path}" + (f" (step {step})" if step is not None else "")
        return read_verified(self.store, path, ref, where)

    def load_anchor_tensors(self, step: int) -> dict[str, torch.Tensor]:
        entry = self.state.anchors[step]
        data = self.read_object(entry.object, step)
        return decode_anchor(data, step, f"{self.path}/{entry.object.path}")

    def load_batch(self, entry: DeltaEntry, step: int | None = None, rows: range | None = None) -> DecodedBatch:
        """Read, verify and decode a batch; with ``rows``, only the objects those rows need."""
        check_slots(entry.slots, self.root.schema, self.root.kind, f"{self.path}/{entry.path}")  # spec §10.3
        objects = _VerifiedObjects(self, entry, step)
        if rows is None:
            for key in objects:
                objects[key]  # verify every object, even one decoding would not need
        return decode_batch(objects, entry.slots, entry.rows, f"{self.path}/{entry.path}", rows)

    def row_decoder(self, entry: DeltaEntry, step: int | None, rows: range,
                    follows: RowDecoder | None = None) -> RowDecoder:
        """A :class:`~ldformat.format.delta.RowDecoder` of ``rows`` of a batch (checked as :meth:`load_batch`
        checks it), reading and verifying each object when a row first needs it; ``follows``:
        the previous batch's decoder, whose buffers it reuses."""
        check_slots(entry.slots, self.root.schema, self.root.kind, f"{self.path}/{entry.path}")  # spec §10.3
        objects = _VerifiedObjects(self, entry, step)
        return RowDecoder(objects, entry.slots, entry.rows, f"{self.path}/{entry.path}", rows, follows=follows)

    # -- materialize -------------------------------------------------------------------
    def _check_step(self, step: int | None) -> int:
        latest = self.latest_step
        if latest is None:
            raise EmptyChainError(f"{self.path}: the chain has no committed step yet")
        if step is None:
            return latest
        if step not in self.state.anchors and step not in self.state.deltas:
            raise step_not_found(self.path, step, self.steps)
        return step

    def retrying(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again on a re-read log when it meets a missing object or segment.

        A compaction, truncation or writer snapshot may delete objects this reader's view
        still references: re-read the log and try again, as long as the log moved (spec
        §17.4); an object missing from the newest log is missing. ``fn`` reads
        :attr:`state` afresh on every call."""
        for _attempt in range(RETRIES_WHILE_THE_LOG_MOVES):
            seen = self.records[-1].seq if self.records else 0
            try:
                return fn()
            except MissingObjectError:
                self.refresh()
                if (self.records[-1].seq if self.records else 0) == seen:
                    raise
        return fn()

    def materialize(
        self, step: int | None = None, *, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Return the state after ``step`` (default: the latest committed step).

        Returns:
            ``{"model": state_dict, "optimizer": optimizer_state_dict, "step": int,
            "extra": dict}``, plus ``"compressor"`` (top-k residuals by parameter name)
            when ``step`` is an anchor of a ``grad.topk`` chain.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            CorruptChainError: an object fails its checksum or cannot be decoded.
        """
        try:
            return self.retrying(lambda: self._materialize(self._check_step(step), progress))
        except (LdformatError, OSError, MemoryError):
            raise
        except Exception as e:
            # Last line of defence: the checks of ldformat.format.checks should leave nothing that
            # fails further down; anything that still does is reported as corruption of the step.
            raise _unexpected(f"{self.path} (step {self.latest_step if step is None else step})", e) from e

    def _materialize(self, step: int, progress: Callable[[int, int], None] | None) -> dict[str, Any]:
        anchor_step, path = self.state.replay_path(step)
        if path and self.kind.startswith("grad."):
            self._warn_environment()
        # The first batch loads in the background while the anchor is read.
        batches = Prefetcher(self, path)
        try:
            replayer = self.start_replay(anchor_step)
            self.replay_steps(replayer, path, progress, batches)
        finally:
            batches.close()
        where = f"{self.path} (step {step})"
        result = replayer.result(step, where)
        if not path and self.kind == "grad.topk":
            # Rank 0's residuals as `compressor`; when any rank r >= 1 has residuals, every rank's
            # as `compressor_ranks` (rank 0 included, possibly empty; spec §11.7, §14.1).
            ranks = residuals_by_rank(replayer.tensors, where)
            if any(r > 0 for r in ranks):
                result["compressor_ranks"] = {0: ranks.get(0, {}), **dict(sorted(ranks.items()))}
            result["compressor"] = ranks.get(0, {})
        return result

    def extra(self, step: int | None = None) -> dict[Any, Any]:
        """The ``extra`` of ``step`` (spec §19), from its entry: no anchor or batch is read, at
        most the segment holding the entry (spec §7.9)."""
        step = self._check_step(step)

        def encoded() -> JSON:
            self._check_step(step)  # again after a re-fold: a compaction may have dropped it
            anchor = self.state.anchors.get(step)
            return anchor.extra if anchor is not None else self.state.deltas[step][1].extra

        return check_extra(self.retrying(encoded), f"{self.path} (step {step})")

    def stored_tensors(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``step``'s state under their stored names (spec §8), as replay holds
        them: what a writer appending to a ``state.xor`` chain XORs against."""
        def replayed(s: int) -> dict[str, torch.Tensor]:
            anchor_step, path = self.state.replay_path(s)
            replayer = self.start_replay(anchor_step)
            self.replay_steps(replayer, path)
            replayer.sync_optimizer_tensors()
            return replayer.tensors

        return self.retrying(lambda: replayed(self._check_step(step)))

    def start_replay(self, anchor_step: int) -> Replayer:
        """A replayer holding the state of anchor ``anchor_step``, checked (spec §9, §18)."""
        entry = self.state.anchors[anchor_step]
        where = f"{self.path}/{entry.object.path} (step {anchor_step})"
        tensors = self.load_anchor_tensors(anchor_step)
        with unexpected_as_corrupt(where):
            replayer = Replayer(self.root, tensors, entry.param_groups, entry.extra, optimizer=entry.optimizer,
                                chain=self.path, device=self.replay_device)
            check_anchor(replayer.schema, entry, tensor_metas(tensors), where)
        return replayer

    def replay_steps(
        self, replayer: Replayer, steps: list[int], progress: Callable[[int, int], None] | None = None,
        prefetch: Prefetcher | None = None,
    ) -> None:
        """Apply the deltas of ``steps`` (consecutive, in order) to ``replayer``."""
        own = prefetch is None
        batches = Prefetcher(self, steps) if prefetch is None else prefetch
        try:
            done = 0
            for entry, batch, items in batches:
                slots = {slot.name: slot for slot in entry.slots}
                for s, step_entry in items:
                    where = f"{self.path}/{entry.path} (step {s})"
                    with unexpected_as_corrupt(where):
                        if self.kind == "state.xor":
                            replayer.apply_xor_step(step_entry, batch.row(step_entry.row), slots, where)
                        else:
                            replayer.apply_grad_step(step_entry, batch.row(step_entry.row), slots, where)
                    done += 1
                    if progress is not None:
                        progress(done, len(steps))
                del batch  # before the next one is taken: at most two batches in memory
        finally:
            if own:
                batches.close()

    def _warn_environment(self) -> None:
        diffs = differences(self.root.environment, self.replay_device.type)
        if diffs and not self._warned_env:
            self._warned_env = True
            recorded = self.root.environment.get("device")
            hint = (f" Replay on the recording device with ChainReader(..., replay_device={recorded!r}) "
                    f"(ldtools materialize --replay-device {recorded})." if isinstance(recorded, str)
                    and recorded != self.replay_device.type else "")
            warnings.warn(
                f"{self.path}: replaying in a different environment ({'; '.join(diffs)}); "
                f"results may differ in the last bits.{hint} Run `ldtools validate --deep` to measure it.",
                ReplayEnvironmentWarning,
                stacklevel=3,
            )

    def load_into(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        *,
        compressor: Any = None,
    ) -> dict[str, Any]:
        """Materialize ``step`` and load it into live objects; returns the extra state.

        ``compressor`` (an :class:`ldformat.TopK`) receives the residuals when ``step`` is an
        anchor of a ``grad.topk`` chain; otherwise its residuals are reset to zero.
        """
        state = self.materialize(step)
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if compressor is not None:
            compressor.load_residuals(state.get("compressor", {}))
        return {"step": state["step"], "extra": state["extra"]}

    # -- sizes -------------------------------------------------------------------------
    def bytes_on_disk(self) -> int:
        """The bytes of the objects, segments and log records the chain references."""
        return self.retrying(self._bytes_on_disk)

    def _bytes_on_disk(self) -> int:
        total = sum(a.object.size for a in self.state.anchors.values())
        total += sum(o.size for d in self.state.delta_entries() for o in d.objects)
        total += sum(g.object.size for g in self.state.segments)
        for p in self.store.list("log"):
            try:
                total += self.store.size(p)
            except FileNotFoundError:
                pass
        return total


def residuals_by_rank(tensors: dict[str, torch.Tensor], where: str = "anchor") -> dict[int, dict[str, torch.Tensor]]:
    """Top-k residuals of every rank: ``compressor/<name>`` is rank 0, ``compressor@<r>/<name>`` rank r."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for n, t in tensors.items():
        try:
            found = residual_rank(n)
        except CorruptChainError as e:
            raise CorruptChainError(f"{where}: {e}") from None
        if found is not None:
            out.setdefault(found[0], {})[found[1]] = t
    return out


def _unexpected(where: str, e: Exception) -> CorruptChainError:
    return CorruptChainError(f"{where}: replay failed on something the chain holds ({type(e).__name__}: {e}); "
                             "run `ldtools validate` on the chain, and restore or truncate it before this step")


@contextlib.contextmanager
def unexpected_as_corrupt(where: str) -> Iterator[None]:
    """Turn an exception that is not ldformat's (nor an I/O or memory error) into
    CorruptChainError naming ``where``: replay checks what it uses (ldformat.format.checks), so this
    only catches what those checks missed."""
    try:
        yield
    except (LdformatError, OSError, MemoryError):
        raise
    except Exception as e:
        raise _unexpected(where, e) from e


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    out = []
    start = prev = steps[0]
    following: list[int | None] = [*steps[1:], None]
    for s in following:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(out)


#: Times a read starts again because a compaction or truncation moved the log under it.
RETRIES_WHILE_THE_LOG_MOVES = 5
#: Objects of one batch fetched at the same time from an object store.
FETCH_CONCURRENCY = 8
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(name: str, workers: Callable[[], int]) -> ThreadPoolExecutor:
    """The process-wide thread pool ``name``, made with ``workers()`` threads when first used."""
    with _pools_lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix=f"ldformat-{name}")
        return pool


def _fetcher() -> ThreadPoolExecutor:
    """The threads that fetch a batch's objects from an object store concurrently."""
    return shared_pool("fetch", lambda: FETCH_CONCURRENCY)


def decode_pool() -> ThreadPoolExecutor:
    """The threads the chunks of a row decompress on (numcodecs releases the GIL): as many as
    torch's intra-op threads when first used."""
    return shared_pool("decode", lambda: max(1, torch.get_num_threads()))


def _remote(store: Store) -> bool:
    """Whether each read of ``store`` costs a round trip (an object store), so that the objects
    of a batch are better fetched concurrently than one after another as decoding asks."""
    return store.is_remote


class _VerifiedObjects(Mapping[str, np.ndarray]):
    """The objects of a batch by key, each read and verified on first access; from an object
    store, all of them are fetched concurrently from the start (spec §10.5 lets a reader
    read more than the wanted rows need)."""

    def __init__(self, reader: ChainReader, entry: DeltaEntry, step: int | None) -> None:
        self._reader, self._entry, self._step = reader, entry, step
        self._refs = {o.path: o for o in entry.objects}
        self._data: dict[str, np.ndarray] = {}
        self._fetching: dict[str, Future[np.ndarray]] = {}
        if len(self._refs) > 1 and _remote(reader.store):
            pool = _fetcher()
            self._fetching = {key: pool.submit(reader.read_object, ref, step, entry.path)
                              for key, ref in self._refs.items()}

    def __getitem__(self, key: str) -> np.ndarray:
        data = self._data.get(key)
        if data is None:
            fetching = self._fetching.pop(key, None)
            if fetching is not None:
                data = fetching.result()
            else:
                data = self._reader.read_object(self._refs[key], self._step, self._entry.path)
            self._data[key] = data
        return data

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


class Prefetcher:
    """Yields, one step at a time, the decoded rows a replay of ``steps`` needs, decoding the
    next step's row in a background thread while the current one is replayed (decode
    overlaps optimizer steps or XOR). Each batch's objects are read and verified as its rows
    need them, each chunk is decompressed once, into buffers reused from row to row and from
    batch to batch (:class:`~ldformat.format.delta.RowDecoder`): at most two decoded rows are in memory."""

    def __init__(self, reader: ChainReader, steps: list[int]) -> None:
        self._plan: list[tuple[DeltaEntry, int, StepEntry]] = []
        for s in steps:
            entry, step_entry = reader.state.deltas[s]
            self._plan.append((entry, s, step_entry))
        self._reader = reader
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ldformat-prefetch")
        self._decoder: RowDecoder | None = None  # of the batch being replayed
        self._next: Future[DecodedBatch] | None = self._submit(0)

    def _submit(self, i: int) -> Future[DecodedBatch] | None:
        if i >= len(self._plan):
            return None
        return self._pool.submit(self._load, i)

    def _load(self, i: int) -> DecodedBatch:
        entry, step, step_entry = self._plan[i]
        try:
            if i == 0 or self._plan[i - 1][0].path != entry.path:  # the first step of a batch
                used = [e.row for e_, _, e in self._plan[i:] if e_.path == entry.path]
                # The previous batch's objects go first; its row buffers are reused (fresh
                # memory costs a page fault per page).
                previous, self._decoder = self._decoder, None
                self._decoder = self._reader.row_decoder(entry, step, range(min(used), max(used) + 1), previous)
                del previous
            assert self._decoder is not None
            # XOR (numpy, one thread) leaves cores to decode on; an optimizer step runs torch's
            # intra-op threads, which a second decoding thread would only slow down.
            pool = decode_pool() if self._reader.kind == "state.xor" else None
            return self._decoder.row(step_entry.row, pool)
        except CorruptChainError as e:
            # Name the step being replayed where the batch's own error names only the batch.
            where = f"{self._reader.path}/{entry.path}"
            text = str(e)
            if text.startswith(f"{where}: "):
                raise type(e)(f"{where} (step {step}): {text[len(where) + 2:]}") from None
            raise

    def __iter__(self) -> Iterator[tuple[DeltaEntry, DecodedBatch, list[tuple[int, StepEntry]]]]:
        for i, (entry, s, step_entry) in enumerate(self._plan):
            assert self._next is not None
            batch = self._next.result()
            # The row after next is decoded into this row's buffers only once this one is replayed.
            self._next = self._submit(i + 1)
            yield entry, batch, [(s, step_entry)]
            del batch

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self._pool.shutdown(wait=True)
        self._decoder = None


def step_not_found(path: str, step: int, steps: list[int]) -> StepNotFoundError:
    """The error for a ``step`` the chain does not hold, naming the nearest committed steps."""
    before = max((s for s in steps if s < step), default=None)
    after = min((s for s in steps if s > step), default=None)
    nearest = " and ".join(f"{s}" for s in (before, after) if s is not None)
    return StepNotFoundError(
        f"{path}: step {step} is not in the chain (committed steps: {_ranges(steps)})"
        f"{f'; the nearest committed steps are {nearest}' if nearest else ''}. A chain holds the steps its writer "
        "captured (the capture runtime may capture only every k-th step, docs/capture-runtime.md \"Bounded cost\"), "
        "and compaction may drop steps: pick a committed one")
