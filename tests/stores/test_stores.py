"""Stores (spec §7.4, §21.2): the contract suite for every backend, then what only one has.

:class:`~ldformat.testing.store_contract.StoreContract` runs against :class:`LocalStore`,
:class:`MemoryStore`, and :class:`FaultyStore` wrapping each with no fault configured. The
local store adds symbolic links and races between processes; the memory store, crashes;
the fault-injecting wrapper, its rules. Last, the suite itself is shown to catch stores
that break the contract.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ldformat.errors import CorruptChainError, UsageError
from ldformat.stores import WRITES, Fault, FaultyStore, LocalStore, MemoryStore, Part, Store, byte_view
from ldformat.stores import local as local_module
from ldformat.testing.store_contract import PRIMITIVES, UNSAFE_PATHS, StoreContract


# -- the contract, once per backend ----------------------------------------------------------
class TestLocalStore(StoreContract[LocalStore]):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "chain")

    def reopen(self, store: LocalStore) -> Store:
        return LocalStore(store.root)

    def process_opener(self, store: LocalStore) -> Callable[[], Store]:
        return functools.partial(LocalStore, store.root)


class TestMemoryStore(StoreContract[MemoryStore]):
    @pytest.fixture
    def store(self) -> MemoryStore:
        return MemoryStore()

    def reopen(self, store: MemoryStore) -> Store:
        return store.reopen()

    def crash(self, store: MemoryStore) -> None:
        store.crash()


def _faulty_local(root: Path) -> FaultyStore:
    return FaultyStore(LocalStore(root))


class TestFaultyLocalStore(StoreContract[FaultyStore]):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FaultyStore:
        return _faulty_local(tmp_path / "chain")

    def reopen(self, store: FaultyStore) -> Store:
        assert isinstance(store.inner, LocalStore)
        return _faulty_local(store.inner.root)

    def process_opener(self, store: FaultyStore) -> Callable[[], Store]:
        assert isinstance(store.inner, LocalStore)
        return functools.partial(_faulty_local, store.inner.root)


class TestFaultyMemoryStore(StoreContract[FaultyStore]):
    @pytest.fixture
    def store(self) -> FaultyStore:
        return FaultyStore(MemoryStore())

    def reopen(self, store: FaultyStore) -> Store:
        assert isinstance(store.inner, MemoryStore)
        return FaultyStore(store.inner.reopen())

    def crash(self, store: FaultyStore) -> None:
        assert isinstance(store.inner, MemoryStore)
        store.inner.crash()


# -- LocalStore only ------------------------------------------------------------------------------
@pytest.fixture
def chain_dir(tmp_path: Path) -> Path:
    path = tmp_path / "chain"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the chain, with a file, that no store call may touch."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_bytes(b"outside the chain")
    return path


def _tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (None if p.is_dir() or p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


ALL_PRIMITIVES = PRIMITIVES


@pytest.mark.parametrize("primitive", sorted(ALL_PRIMITIVES))
def test_local_symbolic_links_are_refused_by_every_primitive(chain_dir: Path, outside: Path, primitive: str) -> None:
    (chain_dir / "log").mkdir()
    (chain_dir / "log" / "000000000001.json").symlink_to(outside / "secret")  # the final name
    (chain_dir / "anchors").symlink_to(outside, target_is_directory=True)  # a directory on the way
    (chain_dir / "log" / "dangling").symlink_to(outside / "missing")
    before, before_outside = _tree(chain_dir), _tree(outside)
    store = LocalStore(chain_dir)
    for path in ("log/000000000001.json", "anchors/secret", "anchors/new", "anchors", "log/dangling",
                 "log/dangling/x"):
        if primitive == "list" and path != "anchors":
            continue  # a listed prefix that is a link is refused; one below it too
        with pytest.raises(CorruptChainError, match="symbolic links are not allowed"):
            ALL_PRIMITIVES[primitive](store, path)
    assert _tree(chain_dir) == before
    assert _tree(outside) == before_outside
    assert not (outside / "missing").exists()


def test_local_list_does_not_follow_links(chain_dir: Path, outside: Path) -> None:
    store = LocalStore(chain_dir)
    store.write("log/000000000001.json", b"{}")
    (chain_dir / "log" / "000000000002.json").symlink_to(outside / "secret")
    (chain_dir / "log" / "sub").symlink_to(outside, target_is_directory=True)
    (chain_dir / "link-at-root").symlink_to(outside / "secret")
    assert store.list("log") == ["log/000000000001.json"]
    assert store.list("") == ["log/000000000001.json"]
    with pytest.raises(CorruptChainError):
        store.list("log/sub")


def test_local_root_may_be_a_symbolic_link(tmp_path: Path, chain_dir: Path) -> None:
    (tmp_path / "via-link").symlink_to(chain_dir, target_is_directory=True)
    store = LocalStore(tmp_path / "via-link")
    store.create_exclusive("log/000000000001.json", b"{}")
    assert (chain_dir / "log" / "000000000001.json").read_bytes() == b"{}"
    assert store.list("") == ["log/000000000001.json"]


@pytest.mark.parametrize("primitive", sorted(ALL_PRIMITIVES))
def test_local_unsafe_paths_reach_nothing_outside(tmp_path: Path, chain_dir: Path, outside: Path,
                                                  primitive: str) -> None:
    store = LocalStore(chain_dir)
    before = _tree(tmp_path)
    for path in UNSAFE_PATHS:
        if primitive == "list" and path == "":
            continue
        with pytest.raises(CorruptChainError):
            ALL_PRIMITIVES[primitive](store, path)
    for path in ("../outside/secret", "../escape", str(outside / "secret")):
        with pytest.raises(CorruptChainError):
            ALL_PRIMITIVES[primitive](store, path)
    assert _tree(tmp_path) == before


def test_local_root_is_created_by_the_first_write(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "new" / "chain")
    assert store.list("") == [] and not store.exists("ldformat.json")
    store.create_exclusive("ldformat.json", b"{}")
    assert (tmp_path / "new" / "chain" / "ldformat.json").read_bytes() == b"{}"


def test_local_delete_removes_the_directories_it_empties(chain_dir: Path) -> None:
    store = LocalStore(chain_dir)
    store.write("deltas/1-1-0123abcd/c/0/0", b"")
    store.write("deltas/2-2-0123abcd/zarr.json", b"")
    store.delete("deltas/1-1-0123abcd/c/0/0")
    assert sorted(p.relative_to(chain_dir).as_posix() for p in chain_dir.rglob("*")) == [
        "deltas", "deltas/2-2-0123abcd", "deltas/2-2-0123abcd/zarr.json"]
    assert chain_dir.is_dir(), "the chain root itself stays"


def test_local_write_survives_a_delete_emptying_its_directory(chain_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Deterministic form of the race in the contract's thread test: a concurrent delete()
    # removes the directory a write has just made, before the write opens its file there.
    store = LocalStore(chain_dir)
    real_makedirs = os.makedirs
    lose_once = {chain_dir / "deltas" / "1-1-0123abcd" / "c", chain_dir / "log"}
    raced: list[Path] = []

    def makedirs_then_lose_the_race(name: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        real_makedirs(name, *args, **kwargs)  # type: ignore[arg-type]
        if Path(name) in lose_once:
            lose_once.remove(Path(name))
            raced.append(Path(name))
            os.rmdir(name)

    monkeypatch.setattr(os, "makedirs", makedirs_then_lose_the_race)
    store.write("deltas/1-1-0123abcd/c/0", b"written")
    store.create_exclusive("log/000000000001.json", b"created")
    monkeypatch.undo()
    assert raced == [chain_dir / "deltas" / "1-1-0123abcd" / "c", chain_dir / "log"]
    assert store.read("deltas/1-1-0123abcd/c/0") == b"written"
    assert store.read("log/000000000001.json") == b"created"
    assert store.list("") == ["deltas/1-1-0123abcd/c/0", "log/000000000001.json"]


def test_local_temporary_name_taken_is_not_a_lost_race(chain_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A leftover temporary file (or a concurrent call drawing the same 32 bits) has the name
    # the next create_exclusive draws: it must draw again, not report that the record exists.
    (chain_dir / "log").mkdir()
    (chain_dir / "log" / ".tmp-000000000001.json-00000000").write_bytes(b"leftover")
    tokens = iter(["00000000", "00000000", "11111111"])
    monkeypatch.setattr(local_module, "secrets", SimpleNamespace(token_hex=lambda n: next(tokens)))
    store = LocalStore(chain_dir)
    store.create_exclusive("log/000000000001.json", b"record 1")
    assert store.read("log/000000000001.json") == b"record 1"
    assert store.list("log") == ["log/.tmp-000000000001.json-00000000", "log/000000000001.json"]
    assert (chain_dir / "log" / ".tmp-000000000001.json-00000000").read_bytes() == b"leftover"


def test_local_create_exclusive_over_a_directory_is_not_file_exists(chain_dir: Path) -> None:
    (chain_dir / "log" / "000000000001.json").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        LocalStore(chain_dir).create_exclusive("log/000000000001.json", b"{}")
    assert LocalStore(chain_dir).list("log") == []


class _FailingTempFileStore(LocalStore):
    """Fails the temporary file of create_exclusive: half-written (ENOSPC) or its fsync (EIO)."""

    def __init__(self, root: Path, hook: str) -> None:
        super().__init__(root)
        self.hook = hook
        self.creating = False

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.creating = True
        try:
            super().create_exclusive(path, data)
        finally:
            self.creating = False

    def _write_fd(self, fd: int, data: memoryview) -> None:
        if self.creating and self.hook == "write":
            super()._write_fd(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super()._write_fd(fd, data)

    def _fsync_fd(self, fd: int) -> None:
        if self.creating and self.hook == "fsync":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super()._fsync_fd(fd)


@pytest.mark.parametrize("hook", ["write", "fsync"])
def test_local_failed_create_exclusive_leaves_nothing(chain_dir: Path, hook: str) -> None:
    # The temporary file of a failed exclusive create is removed, and the name stays free.
    store = _FailingTempFileStore(chain_dir, hook)
    with pytest.raises(OSError) as info:
        store.create_exclusive("log/000000000001.json", b"{}" * 1000)
    assert not isinstance(info.value, FileExistsError)
    assert store.list("") == []
    LocalStore(chain_dir).create_exclusive("log/000000000001.json", b"{}")
    assert store.list("") == ["log/000000000001.json"]


def test_local_path_names_the_file(chain_dir: Path) -> None:
    store = LocalStore(chain_dir)
    store.write("anchors/0-0123abcd.safetensors", b"x")
    assert store.local_path("anchors/0-0123abcd.safetensors") == chain_dir / "anchors" / "0-0123abcd.safetensors"


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/fd").is_dir(),
                    reason="needs posix_fadvise and /proc/self/fd")
@pytest.mark.parametrize("drop_cache", [True, False])
def test_local_sync_drops_large_objects_from_the_page_cache_once_durable(
        chain_dir: Path, monkeypatch: pytest.MonkeyPatch, drop_cache: bool) -> None:
    """A large object leaves the page cache right after its fsync (a whole-file DONTNEED);
    small ones (metadata, records) stay cached, and ``drop_cache=False`` keeps everything."""
    events: list[tuple[str, str]] = []
    fadvise, fsync = os.posix_fadvise, LocalStore._fsync_fd

    def name(fd: int) -> str:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name

    def spy_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED and (offset, length) == (0, 0):
            events.append(("drop", name(fd)))
        fadvise(fd, offset, length, advice)

    def spy_fsync(self: LocalStore, fd: int) -> None:
        events.append(("fsync", name(fd)))
        fsync(self, fd)

    monkeypatch.setattr(os, "posix_fadvise", spy_fadvise)
    monkeypatch.setattr(LocalStore, "_fsync_fd", spy_fsync)
    store = LocalStore(chain_dir, drop_cache=drop_cache)
    big = np.arange(local_module.DROP_CACHE_MIN_BYTES // 4, dtype=np.uint32)
    store.write("deltas/1-1-0123abcd/c/0", big)
    store.write("deltas/1-1-0123abcd/zarr.json", b"{}")
    assert events == []  # writing alone drops nothing
    store.sync(["deltas/1-1-0123abcd/c/0", "deltas/1-1-0123abcd/zarr.json"])
    files = [e for e in events if e[1] in ("0", "zarr.json")]
    if drop_cache:
        assert files == [("fsync", "0"), ("drop", "0"), ("fsync", "zarr.json")]
    else:
        assert files == [("fsync", "0"), ("fsync", "zarr.json")]
    assert store.read("deltas/1-1-0123abcd/c/0") == big.tobytes()


# -- MemoryStore only ---------------------------------------------------------------------------------
def test_memory_crash_drops_exactly_what_was_not_synced() -> None:
    store = MemoryStore()
    store.write("anchors/0-0123abcd.safetensors", b"synced")
    store.sync(["anchors/0-0123abcd.safetensors"])
    store.write("deltas/1-1-0123abcd/c/0", b"written only")
    store.write_parts("deltas/1-1-0123abcd/c/1", [b"written ", b"only"])
    store.create_exclusive("log/000000000001.json", b"created")
    store.write("ldformat.json", b"v1")
    store.sync(["ldformat.json"])
    store.write("ldformat.json", b"v2, rewritten after the sync")
    store.write("gone/before/crash", b"")
    store.delete("gone/before/crash")
    assert store.unsynced() == ["deltas/1-1-0123abcd/c/0", "deltas/1-1-0123abcd/c/1", "ldformat.json"]
    other = store.reopen()
    other.crash()
    assert store.list("") == ["anchors/0-0123abcd.safetensors", "log/000000000001.json"]
    assert store.read("anchors/0-0123abcd.safetensors") == b"synced"
    assert store.unsynced() == []
    store.crash()  # nothing more to lose
    assert store.list("") == ["anchors/0-0123abcd.safetensors", "log/000000000001.json"]


def test_memory_sync_of_a_missing_object_syncs_nothing() -> None:
    store = MemoryStore()
    store.write("a", b"")
    with pytest.raises(FileNotFoundError):
        store.sync(["a", "b"])
    assert store.unsynced() == ["a"]
    with pytest.raises(CorruptChainError):
        store.sync(["a", "../b"])
    assert store.unsynced() == ["a"]


def test_memory_handles_share_objects_not_state() -> None:
    first = MemoryStore()
    second = first.reopen()
    third = MemoryStore()
    first.write("x", b"1")
    assert second.read("x") == b"1"
    assert not third.exists("x")


# -- FaultyStore rules ---------------------------------------------------------------------------------
def test_faulty_fails_after_n_calls_and_keeps_failing() -> None:
    store = FaultyStore(MemoryStore())
    fault = store.fail("create_exclusive", errno.EACCES, path="log/*", after=2)
    store.create_exclusive("ldformat.json", b"")  # another path: not counted
    store.create_exclusive("log/1", b"")
    store.create_exclusive("log/2", b"")
    for seq in (3, 4):
        with pytest.raises(PermissionError) as info:
            store.create_exclusive(f"log/{seq}", b"")
        assert info.value.errno == errno.EACCES
        assert info.value.filename == f"log/{seq}"
        assert os.strerror(errno.EACCES) in str(info.value)
    assert (fault.calls, fault.fired, store.failures) == (4, 2, 2)
    assert store.inner.list("") == ["ldformat.json", "log/1", "log/2"]


def test_faulty_times_limits_the_failures() -> None:
    store = FaultyStore(MemoryStore())
    store.fail("sync", errno.EIO, times=1)
    store.write("a", b"")
    with pytest.raises(OSError) as info:
        store.sync(["a"])
    assert info.value.errno == errno.EIO
    store.sync(["a"])
    assert store.failures == 1


def test_faulty_errno_picks_the_builtin_exception() -> None:
    # EEXIST fakes another writer winning the race; ENOENT a vanished object.
    store = FaultyStore(MemoryStore())
    store.fail("create_exclusive", errno.EEXIST, path="writer.lock")
    store.fail(("read", "read_buffer"), errno.ENOENT, path="anchors/*")
    store.write("anchors/0-0123abcd.safetensors", b"x")
    with pytest.raises(FileExistsError):
        store.create_exclusive("writer.lock", b"")
    with pytest.raises(FileNotFoundError):
        store.read("anchors/0-0123abcd.safetensors")
    with pytest.raises(FileNotFoundError):
        store.read_buffer("anchors/0-0123abcd.safetensors")
    assert not store.inner.exists("writer.lock")
    assert store.size("anchors/0-0123abcd.safetensors") == 1


@pytest.mark.parametrize("torn", [0.5, 3, 0, 1.0])
@pytest.mark.parametrize("op", WRITES)
def test_faulty_torn_write_keeps_a_prefix(torn: int | float, op: str) -> None:
    store = FaultyStore(MemoryStore())
    fault = store.fail(WRITES, errno.ENOSPC, path="anchors/*", after=1, torn=torn)
    data = b"0123456789"
    parts: Sequence[Part] = [b"012", np.frombuffer(b"3456", np.uint8), memoryview(b"789")]

    def write(path: str) -> None:
        if op == "write":
            store.write(path, data)
        else:
            store.write_parts(path, parts)

    write("anchors/0-0123abcd.safetensors")
    write("deltas/1-1-0123abcd/c/0")
    with pytest.raises(OSError) as info:
        write("anchors/5-0123abcd.safetensors")
    assert info.value.errno == errno.ENOSPC
    keep = int(len(data) * torn) if isinstance(torn, float) else torn
    assert store.inner.read("anchors/5-0123abcd.safetensors") == data[:keep]
    assert store.inner.read("anchors/0-0123abcd.safetensors") == data
    assert store.inner.read("deltas/1-1-0123abcd/c/0") == data
    assert fault.calls == 2 and fault.fired == 1


def test_faulty_torn_write_on_a_local_store_leaves_a_partial_file(chain_dir: Path) -> None:
    store = FaultyStore(LocalStore(chain_dir))
    big = np.frombuffer(bytes(range(256)) * 40_000, np.uint8)
    store.fail("write_parts", errno.EFBIG, torn=1_000_001)
    with pytest.raises(OSError) as info:
        store.write_parts("anchors/0-0123abcd.safetensors", [b"head", big])
    assert info.value.errno == errno.EFBIG
    on_disk = (chain_dir / "anchors" / "0-0123abcd.safetensors").read_bytes()
    assert on_disk == (b"head" + big.tobytes())[:1_000_001]


def test_faulty_after_the_call_keeps_its_effect() -> None:
    # Like syncing log/ failing once the record was linked: the record exists all the same.
    store = FaultyStore(MemoryStore())
    store.fail("create_exclusive", errno.EIO, path="log/*", when="after")
    with pytest.raises(OSError):
        store.create_exclusive("log/000000000001.json", b"record")
    assert store.inner.read("log/000000000001.json") == b"record"
    with pytest.raises(FileExistsError):
        store.inner.create_exclusive("log/000000000001.json", b"again")


def test_faulty_sync_matches_any_of_its_paths_and_list_its_prefix() -> None:
    store = FaultyStore(MemoryStore())
    store.fail("sync", errno.EIO, path="anchors/*")
    store.fail("list", errno.EIO, path="log")
    store.write("deltas/x", b"")
    store.write("anchors/y", b"")
    store.sync(["deltas/x"])
    with pytest.raises(OSError) as info:
        store.sync(["deltas/x", "anchors/y"])
    assert info.value.filename == "anchors/y"
    assert store.list("deltas") == ["deltas/x"]
    assert store.list("") == ["anchors/y", "deltas/x"]
    with pytest.raises(OSError):
        store.list("log")


def test_faulty_stall_sleeps_only_where_asked() -> None:
    store = FaultyStore(MemoryStore(), stall={"create_exclusive": 0.2})
    slow_read = store.stall("read", 0.2, path="writer.lock", when="after", times=1)
    started = time.perf_counter()
    store.create_exclusive("writer.lock", b"")
    created = time.perf_counter()
    store.write("other", b"")
    store.read("other")
    fast = time.perf_counter()
    store.read("writer.lock")
    read = time.perf_counter()
    store.read("writer.lock")
    assert created - started >= 0.2
    assert fast - created < 0.15
    assert read - fast >= 0.2
    assert slow_read.fired == 1 and store.failures == 0


def test_faulty_stall_widens_a_race_window() -> None:
    # What lock-race tests use it for: a check-then-write (a broken lock) is won by every
    # racer once the time between the check and the write grows, while create_exclusive
    # still has one winner however it is slowed down.
    store = FaultyStore(MemoryStore(), stall={"create_exclusive": 0.01})
    store.stall("exists", 0.1, when="after")
    ready = threading.Barrier(4)
    broken: list[int] = []
    exclusive: list[int] = []

    def race(i: int) -> None:
        ready.wait(timeout=30)
        if not store.exists("writer.lock"):
            store.write("writer.lock", str(i).encode())
            broken.append(i)
        ready.wait(timeout=30)
        try:
            store.create_exclusive("log/000000000001.json", b"")
            exclusive.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(broken) == 4, "the stall did not widen the check-then-write window"
    assert len(exclusive) == 1


def test_faulty_counts_only_while_armed() -> None:
    store = FaultyStore(MemoryStore(), armed=False)
    fault = store.fail("write", errno.ENOSPC, after=1)
    store.write("a", b"")
    store.write("b", b"")
    assert fault.calls == 0
    store.arm()
    store.write("c", b"")
    with pytest.raises(OSError):
        store.write("d", b"")
    store.disarm()
    store.write("e", b"")
    assert (fault.calls, fault.fired) == (2, 1)
    store.clear()
    store.arm()
    store.write("d", b"")
    assert store.inner.list("") == ["a", "b", "c", "d", "e"]


def test_faulty_checks_paths_before_faults() -> None:
    store = FaultyStore(MemoryStore())
    fault = store.fail(("write", "read", "create_exclusive", "list"), errno.EIO)
    for call in (lambda: store.write("../x", b""), lambda: store.read("/x"),
                 lambda: store.create_exclusive("a//b", b""), lambda: store.list("a/")):
        with pytest.raises(CorruptChainError):
            call()
    assert fault.calls == 0 and store.failures == 0


@pytest.mark.parametrize("rule", [
    dict(ops=("rename",)),
    dict(ops=()),
    dict(ops=("write",), after=-1),
    dict(ops=("write",), error=None),
    dict(ops=("read",), torn=0.5),
    dict(ops=("write",), torn=0.5, when="after"),
    dict(ops=("write",), torn=1.5),
    dict(ops=("write",), torn=True),
    dict(ops=("write",), when="during"),
])
def test_faulty_refuses_rules_that_mean_nothing(rule: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        Fault(**rule)  # type: ignore[arg-type]


def test_faulty_without_rules_passes_everything_through(chain_dir: Path) -> None:
    store = FaultyStore(LocalStore(chain_dir), [Fault(ops=("read",), path="nothing/*")])
    store.write_parts("x", [b"a", np.zeros(3, np.uint8)])
    assert store.local_path("x") == chain_dir / "x"
    assert store.read_buffer("x").tobytes() == b"a\0\0\0"
    assert store.faults[0].calls == 0


# -- the suite catches broken stores ---------------------------------------------------------------------
class _Broken(MemoryStore):
    """A MemoryStore with one defect, chosen by name."""

    def __init__(self, defect: str) -> None:
        super().__init__()
        self.defect = defect

    def reopen(self) -> _Broken:
        other = super().reopen()
        broken = _Broken.__new__(_Broken)
        broken.__dict__.update(other.__dict__, defect=self.defect)
        return broken

    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        if self.defect == "write keeps a reference" and isinstance(data, bytearray):
            self._put(path, data)  # type: ignore[arg-type]
            return
        super().write(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        if self.defect == "create is check-then-write":
            if self.exists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            time.sleep(0.001)
            self._put(path, b"")  # visible, empty, before its content
            time.sleep(0.001)
            self._put(path, bytes(data))
            return
        super().create_exclusive(path, data)

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        if self.defect == "read_buffer is read-only":
            return np.frombuffer(self.read(path), np.uint8)
        return super().read_buffer(path, max_size)

    def list(self, prefix: str) -> list[str]:
        found = super().list(prefix)
        if self.defect == "list by string prefix":
            return sorted(p for p in super().list("") if p.startswith(prefix))
        if self.defect == "list unsorted":
            return sorted(found, reverse=True)
        if self.defect == "list shows directories":
            return sorted({*found, *(p.rsplit("/", 1)[0] for p in found if "/" in p)})
        return found

    def delete(self, path: str) -> None:
        if self.defect == "delete of a missing object raises" and not self.exists(path):
            raise FileNotFoundError(errno.ENOENT, "missing", path)
        super().delete(path)

    def exists(self, path: str) -> bool:
        if self.defect == "exists trusts the path":
            return path in self._volume.objects
        return super().exists(path)

    def crash(self) -> None:
        if self.defect == "crash loses synced objects":
            with self._volume.lock:
                self._volume.objects.clear()
            return
        super().crash()


class _SuiteOnBroken(TestMemoryStore):
    """The memory store's suite, called directly on broken stores (not collected)."""


BROKEN: dict[str, str] = {
    "write keeps a reference": "test_write_copies_the_data",
    "create is check-then-write": "test_create_exclusive_race_between_threads_has_one_winner",
    "read_buffer is read-only": "test_read_buffer_is_a_writable_uint8_array_the_caller_owns",
    "list by string prefix": "test_list_matches_whole_components",
    "list unsorted": "test_list_is_recursive_sorted_and_holds_only_objects",
    "list shows directories": "test_list_is_recursive_sorted_and_holds_only_objects",
    "delete of a missing object raises": "test_delete_of_a_missing_object_is_fine",
    "exists trusts the path": "test_unsafe_paths_are_refused",
    "crash loses synced objects": "test_synced_and_created_objects_survive_a_crash",
}


@pytest.mark.parametrize("defect", sorted(BROKEN))
def test_the_suite_catches_a_broken_store(defect: str) -> None:
    suite = _SuiteOnBroken()
    test: Callable[..., None] = getattr(suite, BROKEN[defect])
    args: dict[str, object] = {"primitive": "exists"} if defect == "exists trusts the path" else {}
    with pytest.raises((AssertionError, pytest.fail.Exception, FileNotFoundError)):
        test(_Broken(defect), **args)
    test(MemoryStore(), **args)  # and the same test passes on the sound store


def test_byte_view_sees_every_part_without_a_copy() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = byte_view(arr)
    assert view.format == "B" and view.ndim == 1 and len(view) == 24
    arr[0, 0] = 7
    assert bytes(view[:4]) == np.float32(7).tobytes()
    assert len(byte_view(np.zeros((0, 3)))) == 0
    assert len(byte_view(np.zeros((0, 3)).data)) == 0
    assert bytes(byte_view(bytearray(b"ab"))) == b"ab"
    with pytest.raises(TypeError):
        byte_view(np.zeros((3, 3))[:, 1])
    with pytest.raises(TypeError):
        byte_view(np.array([object()]))


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = threading.active_count()
    yield
    assert threading.active_count() <= before, "a test left threads running"


@pytest.mark.parametrize("size", [1000, (16 << 20) + 12345])
def test_read_verified_catches_one_flipped_byte_in_any_piece(tmp_path: Path, size: int) -> None:
    """An object of 16 MiB or more is checksummed piece by piece while it is read (on a helper
    thread); a flipped byte in the first piece, a middle one or the tail still fails it."""
    from ldformat.chain.records import read_verified
    from ldformat.format.checksum import object_checksum
    from ldformat.format.manifest import ObjectRef

    path = "anchors/0-0123abcd.safetensors"
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    ref = ObjectRef(path=path, size=size, crc32c=object_checksum(path, data))
    store = LocalStore(tmp_path)
    store.write(path, data.tobytes())
    assert read_verified(store, path, ref, "here").tobytes() == data.tobytes()
    for offset in (5, min(size - 2, (8 << 20) + 7), size - 1):
        damaged = data.copy()
        damaged[offset] ^= 1
        (tmp_path / path).write_bytes(damaged.tobytes())
        with pytest.raises(CorruptChainError, match="crc32c mismatch"):
            read_verified(store, path, ref, "here")
    # a store wrapped for fault injection reads through the same path, and its faults fire
    (tmp_path / path).write_bytes(data.tobytes())
    faulty = FaultyStore(store)
    assert read_verified(faulty, path, ref, "here").tobytes() == data.tobytes()
    faulty.fail("read_buffer")
    with pytest.raises(OSError):
        read_verified(faulty, path, ref, "here")


def test_a_local_store_subclass_that_overrides_read_buffer_sees_every_verified_read(tmp_path: Path) -> None:
    from ldformat.chain.records import read_verified
    from ldformat.format.checksum import object_checksum
    from ldformat.format.manifest import ObjectRef

    class Counting(LocalStore):
        reads: list[str] = []

        def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
            self.reads.append(path)
            return super().read_buffer(path, max_size)

    path, data = "anchors/0-0123abcd.safetensors", np.arange((16 << 20) + 5, dtype=np.uint8)
    store = Counting(tmp_path)
    store.write(path, data.tobytes())
    got = read_verified(store, path, ObjectRef(path=path, size=data.shape[0], crc32c=object_checksum(path, data)), "x")
    assert np.array_equal(got, data) and store.reads == [path]
