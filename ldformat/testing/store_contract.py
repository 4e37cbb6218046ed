"""The store contract as a test suite (spec §7.4 "Commit protocol", §21.2 "Paths").

:class:`StoreContract` checks every primitive of :class:`ldformat.stores.Store` against the
contract written in :mod:`ldformat.stores.base`. A backend's tests subclass it once and
provide a ``store`` fixture; optional hooks add what only some backends can do (another
handle, another process, a simulated crash)::

    import pytest
    from ldformat.stores import LocalStore
    from ldformat.testing.store_contract import StoreContract

    class TestLocalStore(StoreContract[LocalStore]):
        @pytest.fixture
        def store(self, tmp_path):
            return LocalStore(tmp_path / "chain")

        def reopen(self, store):
            return LocalStore(store.root)

The class is not collected by itself (its name does not start with ``Test``). Each test
gets a fresh, empty store from the fixture.

It is one module although it is long: the suite is one contract, subclassed once per
backend, and a backend that took only part of it would pass without keeping the rest.
"""

from __future__ import annotations

import array
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import pytest

from ..errors import CorruptChainError
from ..stores.base import WRITEBACK_CHUNK, ObjectTooLargeError, Part, Store
from ..stores.crc32c import crc32c_extend
from ..stores.faults import FaultyStore

__all__ = ["UNSAFE_PATHS", "StoreContract"]

StoreT = TypeVar("StoreT", bound=Store)

#: Paths that every primitive refuses (spec §21.2), with why.
UNSAFE_PATHS: dict[str, str] = {
    "": "empty",
    "/etc/passwd": "absolute",
    "/": "the root",
    "..": "parent",
    "../escape": "parent first",
    "log/../../escape": "parent inside",
    ".": "current directory",
    "./log/x": "current directory first",
    "log/./x": "current directory inside",
    "log//x": "empty component",
    "log/": "trailing slash",
    "log\\x": "backslash",
    "..\\escape": "backslash parent",
    "log/x\x00y": "NUL",
}

#: Every primitive, as a call on ``(store, path)``.
PRIMITIVES: dict[str, Callable[[Store, str], object]] = {
    "write": lambda s, p: s.write(p, b"data"),
    "write_parts": lambda s, p: s.write_parts(p, [b"da", np.frombuffer(b"ta", np.uint8)]),
    "sync": lambda s, p: s.sync([p]),
    "create_exclusive": lambda s, p: s.create_exclusive(p, b"data"),
    "read": lambda s, p: s.read(p),
    "read_buffer": lambda s, p: s.read_buffer(p),
    "read_buffer_crc32c": lambda s, p: s.read_buffer_crc32c(p),
    "size": lambda s, p: s.size(p),
    "list": lambda s, p: s.list(p),
    "delete": lambda s, p: s.delete(p),
    "exists": lambda s, p: s.exists(p),
    "local_path": lambda s, p: s.local_path(p),
}

#: Threads (and processes) racing in the concurrency tests, and how many names they race on.
RACERS = 8
RACE_ROUNDS = 12


def payload(seed: int, size: int) -> bytes:
    """``size`` pseudo-random bytes, different for each ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class StoreContract(Generic[StoreT]):
    """The contract of :class:`~ldformat.stores.Store`; subclass it once per backend.

    Provide:
        store: a pytest fixture returning a fresh, empty store.

    Optionally override:
        reopen: another handle on the same storage (another process would open this).
            The default returns the same handle, which weakens the tests of consistency
            across handles and of races to one handle.
        process_opener: a picklable callable that opens the same storage, for racing
            :meth:`~Store.create_exclusive` from several processes; ``None`` (the default)
            skips that test. Children start with :attr:`process_start_method`.
        crash: simulate a crash of the machine (only what is durable survives); the
            default skips the tests that need one.
        sync_reports_missing: ``False`` for backends whose :meth:`~Store.sync` is a no-op
            and cannot tell that an object is missing.
    """

    sync_reports_missing: ClassVar[bool] = True
    process_start_method: ClassVar[str] = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"

    @pytest.fixture
    def store(self) -> StoreT:
        raise NotImplementedError(f"{type(self).__name__}: define a `store` fixture returning a fresh, empty store")

    def reopen(self, store: StoreT) -> Store:
        return store

    def process_opener(self, store: StoreT) -> Callable[[], Store] | None:
        return None

    def crash(self, store: StoreT) -> None:
        pytest.skip(f"{type(self).__name__} cannot simulate a crash")

    # -- write and read ----------------------------------------------------------------------
    @pytest.mark.parametrize("size", [0, 1, 4097])
    def test_write_then_read_round_trips(self, store: StoreT, size: int) -> None:
        data = payload(size, size)
        store.write("anchors/0-0123abcd.safetensors", data)
        assert store.read("anchors/0-0123abcd.safetensors") == data
        assert store.read_buffer("anchors/0-0123abcd.safetensors").tobytes() == data
        assert store.size("anchors/0-0123abcd.safetensors") == size
        assert store.exists("anchors/0-0123abcd.safetensors")

    def test_write_accepts_every_bytes_like(self, store: StoreT) -> None:
        ints = array.array("i", [1, -2, 3])
        cases: dict[str, bytes | bytearray | memoryview] = {
            "bytes": b"abc",
            "bytearray": bytearray(b"def"),
            "memoryview": memoryview(b"0123456789")[2:7],
            "memoryview-of-ints": memoryview(ints),
            "memoryview-2d": np.arange(6, dtype=np.uint16).reshape(2, 3).data,
        }
        for name, data in cases.items():
            store.write(f"x/{name}", data)
        for name, data in cases.items():
            assert store.read(f"x/{name}") == bytes(memoryview(data).cast("B")), name

    def test_write_copies_the_data(self, store: StoreT) -> None:
        data = bytearray(b"before")
        store.write("x/obj", data)
        data[:] = b"after!"
        arr = np.frombuffer(bytearray(b"parts!"), np.uint8)
        store.write_parts("x/parts", [arr])
        arr[:] = 0
        assert store.read("x/obj") == b"before"
        assert store.read("x/parts") == b"parts!"

    def test_write_replaces_a_leftover(self, store: StoreT) -> None:
        store.write("deltas/1-2-0123abcd/c/0", b"a longer leftover of a crashed writer")
        store.write("deltas/1-2-0123abcd/c/0", b"short")
        assert store.read("deltas/1-2-0123abcd/c/0") == b"short"
        assert store.size("deltas/1-2-0123abcd/c/0") == 5
        store.write_parts("deltas/1-2-0123abcd/c/0", [b"s", b"horter"])
        assert store.read("deltas/1-2-0123abcd/c/0") == b"shorter"
        store.write_parts("deltas/1-2-0123abcd/c/0", [])
        assert store.read("deltas/1-2-0123abcd/c/0") == b""
        store.create_exclusive("x/created", b"exclusive")
        store.write("x/created", b"replaced")
        assert store.read("x/created") == b"replaced"
        assert store.list("") == ["deltas/1-2-0123abcd/c/0", "x/created"]

    def test_write_parts_streams_large_mixed_parts(self, store: StoreT) -> None:
        big = np.frombuffer(payload(1, WRITEBACK_CHUNK + 5), np.uint8)  # more than one writeback chunk
        other = bytearray(payload(2, WRITEBACK_CHUNK + 3))
        floats = np.arange(12, dtype=np.float32).reshape(3, 4)
        parts: list[Part] = [b"header", big, memoryview(other)[3:], b"", floats, bytearray(b"tail")]
        expected = b"header" + big.tobytes() + bytes(other[3:]) + floats.tobytes() + b"tail"
        store.write_parts("anchors/7-0123abcd.safetensors", parts)
        assert store.size("anchors/7-0123abcd.safetensors") == len(expected)
        assert store.read("anchors/7-0123abcd.safetensors") == expected
        assert np.array_equal(store.read_buffer("anchors/7-0123abcd.safetensors"), np.frombuffer(expected, np.uint8))

    def test_write_parts_takes_arrays_of_any_dtype_and_shape(self, store: StoreT) -> None:
        arrays = [
            np.array(3.5),  # 0-d
            np.zeros((0, 3), np.int64),  # zero-size, 2-d
            np.arange(6, dtype=">u4").reshape(2, 3),  # big-endian: raw bytes as they are
            np.array([True, False, True]),
            np.arange(4, dtype=np.float16),
            np.asfortranarray(np.ones((1, 3), np.int8)),  # one row: C-contiguous as well
            np.array(["2024-01-01"], dtype="datetime64[s]"),
        ]
        store.write_parts("x/arrays", arrays)
        assert store.read("x/arrays") == b"".join(a.tobytes() for a in arrays)
        store.write_parts("x/nothing", [])
        assert store.read("x/nothing") == b"" and store.size("x/nothing") == 0

    def test_write_parts_refuses_parts_that_are_not_contiguous(self, store: StoreT) -> None:
        grid = np.arange(16, dtype=np.uint8).reshape(4, 4)
        for part in (grid[:, :2], grid.T, memoryview(b"abcdef")[::2]):
            with pytest.raises(TypeError, match="contiguous"):
                store.write_parts("x/strided", [b"ok", part])

    def test_paths_need_no_directories(self, store: StoreT) -> None:
        store.write("a/b/c/d/e", b"deep")
        store.create_exclusive("f/g/h/i", b"exclusive and deep")
        assert store.read("a/b/c/d/e") == b"deep"
        assert store.read("f/g/h/i") == b"exclusive and deep"
        assert store.list("") == ["a/b/c/d/e", "f/g/h/i"]

    def test_read_buffer_is_a_writable_uint8_array_the_caller_owns(self, store: StoreT) -> None:
        data = payload(3, 1000)
        store.write("anchors/1-0123abcd.safetensors", data)
        first = store.read_buffer("anchors/1-0123abcd.safetensors")
        second = store.read_buffer("anchors/1-0123abcd.safetensors")
        assert isinstance(first, np.ndarray)
        assert first.dtype == np.uint8 and first.ndim == 1 and first.shape == (1000,)
        assert first.flags.writeable
        assert not np.shares_memory(first, second)
        first[:] = 0
        first[0] = 1
        assert second.tobytes() == data, "changing one buffer changed another read"
        assert store.read("anchors/1-0123abcd.safetensors") == data, "changing the buffer changed the object"
        assert store.read_buffer("anchors/1-0123abcd.safetensors").tobytes() == data
        store.write("x/empty", b"")
        empty = store.read_buffer("x/empty")
        assert empty.dtype == np.uint8 and empty.shape == (0,)

    def test_read_buffer_refuses_an_object_larger_than_max_size(self, store: StoreT) -> None:
        data = payload(5, 1000)
        store.write("anchors/2-0123abcd.safetensors", data)
        assert store.read_buffer("anchors/2-0123abcd.safetensors", max_size=1000).tobytes() == data
        with pytest.raises(ObjectTooLargeError) as caught:
            store.read_buffer("anchors/2-0123abcd.safetensors", max_size=999)
        assert caught.value.size == 1000 and caught.value.max_size == 999
        with pytest.raises(FileNotFoundError):
            store.read_buffer("anchors/missing", max_size=10)

    @pytest.mark.parametrize("size", [0, 1000, 17 << 20])
    def test_read_buffer_crc32c_is_read_buffer_and_its_checksum(self, store: StoreT, size: int) -> None:
        # 17 MiB: LocalStore checksums objects of 16 MiB or more piece by piece as it reads them
        data, path, seed = payload(9, size), "anchors/9-0123abcd.safetensors", crc32c_extend(0, b"a seed")
        store.write(path, data)
        got, crc = store.read_buffer_crc32c(path, max_size=size, seed=seed)
        assert got.dtype == np.uint8 and got.flags.writeable and got.tobytes() == data
        assert crc == crc32c_extend(seed, data) and store.read_buffer_crc32c(path)[1] == crc32c_extend(0, data)
        if size:
            with pytest.raises(ObjectTooLargeError):
                store.read_buffer_crc32c(path, max_size=size - 1)
        with pytest.raises(FileNotFoundError):
            store.read_buffer_crc32c("anchors/missing", max_size=10)

    def test_size_follows_the_content(self, store: StoreT) -> None:
        store.write("x/obj", b"12345")
        assert store.size("x/obj") == 5
        store.write("x/obj", b"")
        assert store.size("x/obj") == 0
        store.create_exclusive("x/record", b"123")
        assert store.size("x/record") == 3

    def test_exists(self, store: StoreT) -> None:
        assert not store.exists("x/obj")
        store.write("x/obj", b"")
        assert store.exists("x/obj")
        assert not store.exists("x"), "a directory is not an object"
        assert not store.exists("x/obj/below")
        store.delete("x/obj")
        assert not store.exists("x/obj")

    # -- missing objects and directories -----------------------------------------------------
    @pytest.mark.parametrize("path", ["missing", "log/000000000001.json", "no/such/dir/object"])
    def test_missing_objects_raise_file_not_found(self, store: StoreT, path: str) -> None:
        store.write("log/other", b"")
        for name in ("read", "read_buffer", "read_buffer_crc32c", "size"):
            with pytest.raises(FileNotFoundError):
                PRIMITIVES[name](store, path)
        assert not store.exists(path)
        store.delete(path)
        assert store.list("") == ["log/other"]

    def test_a_directory_is_a_missing_object(self, store: StoreT) -> None:
        store.write("deltas/1-2-0123abcd/zarr.json", b"{}")
        for path in ("deltas", "deltas/1-2-0123abcd"):
            for name in ("read", "read_buffer", "read_buffer_crc32c", "size"):
                with pytest.raises(FileNotFoundError):
                    PRIMITIVES[name](store, path)
            assert not store.exists(path)
            store.delete(path)
            assert store.read("deltas/1-2-0123abcd/zarr.json") == b"{}", f"delete({path!r}) removed an object below"

    def test_a_path_below_an_object_is_a_missing_object(self, store: StoreT) -> None:
        store.write("ldformat.json", b"{}")
        for path in ("ldformat.json/x", "ldformat.json/x/y"):
            for name in ("read", "read_buffer", "read_buffer_crc32c", "size"):
                with pytest.raises(FileNotFoundError):
                    PRIMITIVES[name](store, path)
            assert not store.exists(path)
            store.delete(path)
            assert store.list(path) == []
        assert store.read("ldformat.json") == b"{}"

    def test_an_object_and_one_below_it_never_look_like_a_lost_race(self, store: StoreT) -> None:
        # A store may refuse to hold `a` and `a/b` at once, but never with FileExistsError:
        # that would tell a writer that another one committed.
        store.write("log/x", b"file")
        store.write("d/e/f", b"file")
        attempts: list[tuple[str, Callable[[], None]]] = [
            ("write below an object", lambda: store.write("log/x/y", b"")),
            ("create below an object", lambda: store.create_exclusive("log/x/z", b"")),
            ("write over a directory", lambda: store.write("d/e", b"")),
            ("create over a directory", lambda: store.create_exclusive("d", b"")),
        ]
        for what, attempt in attempts:
            try:
                attempt()
            except FileExistsError as e:
                pytest.fail(f"{what}: FileExistsError ({e}) where no object of that name exists")
            except OSError:
                pass
        assert store.read("log/x") == b"file" and store.read("d/e/f") == b"file"

    # -- list --------------------------------------------------------------------------------
    def test_list_of_an_empty_store_is_empty(self, store: StoreT) -> None:
        assert store.list("") == []
        assert store.list("log") == []

    def test_list_is_recursive_sorted_and_holds_only_objects(self, store: StoreT) -> None:
        paths = ["log/000000000002.json", "ldformat.json", "a-b", "a.b", "a/b/c", "a/b-c", "a_b", "aB", "A",
                 "log/000000000001.json", "deltas/1-2-0123abcd/counts/c/0/0", "deltas/1-2-0123abcd/zarr.json",
                 "a0", "log/.tmp-000000000003.json-0123abcd"]
        for i, p in enumerate(paths):
            store.write(p, bytes([i]))
        assert store.list("") == sorted(paths)
        assert store.list("log") == ["log/.tmp-000000000003.json-0123abcd", "log/000000000001.json",
                                     "log/000000000002.json"]
        assert store.list("a") == ["a/b-c", "a/b/c"]
        assert store.list("a/b") == ["a/b/c"]
        assert store.list("deltas") == ["deltas/1-2-0123abcd/counts/c/0/0", "deltas/1-2-0123abcd/zarr.json"]
        assert store.list("deltas/1-2-0123abcd/counts") == ["deltas/1-2-0123abcd/counts/c/0/0"]

    def test_list_matches_whole_components(self, store: StoreT) -> None:
        for p in ("log/1", "logs/2", "log2", "lo/g", "log-x/3"):
            store.write(p, b"")
        assert store.list("log") == ["log/1"]
        assert store.list("lo") == ["lo/g"]
        assert store.list("l") == []

    def test_list_of_a_missing_prefix_or_an_object_is_empty(self, store: StoreT) -> None:
        store.write("anchors/0-0123abcd.safetensors", b"x")
        assert store.list("deltas") == []
        assert store.list("no/such/prefix") == []
        assert store.list("anchors/0-0123abcd.safetensors") == []
        assert store.list("anchors/0-0123abcd.safetensors/below") == []

    def test_list_follows_deletes_and_writes(self, store: StoreT) -> None:
        store.write("deltas/1-1-0123abcd/zarr.json", b"")
        store.write("deltas/1-1-0123abcd/c/0", b"")
        store.delete("deltas/1-1-0123abcd/c/0")
        assert store.list("deltas") == ["deltas/1-1-0123abcd/zarr.json"]
        store.delete("deltas/1-1-0123abcd/zarr.json")
        assert store.list("deltas") == [] and store.list("") == []
        store.write("deltas/1-1-0123abcd/c/0", b"again")  # into directories a delete emptied
        assert store.list("") == ["deltas/1-1-0123abcd/c/0"]

    # -- delete ------------------------------------------------------------------------------
    def test_delete_removes_that_object_only(self, store: StoreT) -> None:
        for p in ("log/1", "log/2", "log/2x", "anchors/1"):
            store.write(p, p.encode())
        store.delete("log/2")
        assert store.list("") == ["anchors/1", "log/1", "log/2x"]
        assert store.read("log/2x") == b"log/2x"
        with pytest.raises(FileNotFoundError):
            store.read("log/2")

    def test_delete_of_a_missing_object_is_fine(self, store: StoreT) -> None:
        store.delete("writer.lock")
        store.write("writer.lock", b"{}")
        store.delete("writer.lock")
        store.delete("writer.lock")
        store.delete("no/such/dir/writer.lock")
        assert store.list("") == []

    def test_a_deleted_object_can_be_created_exclusively_again(self, store: StoreT) -> None:
        store.create_exclusive("writer.lock", b"first")
        store.delete("writer.lock")
        store.create_exclusive("writer.lock", b"second")
        assert store.read("writer.lock") == b"second"

    # -- create_exclusive ----------------------------------------------------------------------
    @pytest.mark.parametrize("size", [0, 100, 300_000])
    def test_create_exclusive_creates(self, store: StoreT, size: int) -> None:
        data = payload(size, size)
        store.create_exclusive("log/000000000001.json", data)
        assert store.read("log/000000000001.json") == data
        assert store.size("log/000000000001.json") == size
        assert store.exists("log/000000000001.json")

    def test_create_exclusive_refuses_an_existing_object(self, store: StoreT) -> None:
        store.create_exclusive("log/000000000001.json", b"first writer")
        store.write("writer.lock", b"written, not created")
        other = self.reopen(store)
        for s in (store, other):
            with pytest.raises(FileExistsError):
                s.create_exclusive("log/000000000001.json", b"second writer")
            with pytest.raises(FileExistsError):
                s.create_exclusive("writer.lock", b"")
        assert store.read("log/000000000001.json") == b"first writer"
        assert store.read("writer.lock") == b"written, not created"

    def test_create_exclusive_leaves_nothing_else_behind(self, store: StoreT) -> None:
        store.create_exclusive("log/000000000001.json", b"record 1")
        with pytest.raises(FileExistsError):
            store.create_exclusive("log/000000000001.json", b"again")
        store.create_exclusive("ldformat.json", b"root")
        with pytest.raises(FileExistsError):
            store.create_exclusive("ldformat.json", b"again")
        assert store.list("") == ["ldformat.json", "log/000000000001.json"]

    def test_create_exclusive_race_between_threads_has_one_winner(self, store: StoreT) -> None:
        # RACERS threads, each with its own handle, create the same names at the same time
        # while a reader polls them: one wins each name, and the reader only ever sees the
        # winner's whole content (never a part, never an empty object).
        handles = [self.reopen(store) for _ in range(RACERS)]
        names = [f"log/{seq:012d}.json" for seq in range(1, RACE_ROUNDS + 1)]
        contents = {(name, i): payload(RACERS * k + i, 64 * 1024 + i) for k, name in enumerate(names)
                    for i in range(RACERS)}
        start = threading.Barrier(RACERS + 1)
        outcome: dict[tuple[str, int], str] = {}
        seen: dict[str, set[bytes]] = {name: set() for name in names}
        done = threading.Event()
        errors: list[BaseException] = []

        def racer(i: int) -> None:
            try:
                for name in names:
                    start.wait(timeout=30)
                    try:
                        handles[i].create_exclusive(name, contents[name, i])
                        outcome[name, i] = "won"
                    except FileExistsError:
                        outcome[name, i] = "lost"
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        def reader() -> None:
            poll = self.reopen(store)
            try:
                while not done.is_set():
                    for name in names:
                        try:
                            seen[name].add(poll.read(name))
                        except FileNotFoundError:
                            pass
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(RACERS)]
        polling = threading.Thread(target=reader)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # interleave the threads finely
        try:
            polling.start()
            for t in threads:
                t.start()
            for _ in names:
                start.wait(timeout=30)
            for t in threads:
                t.join(timeout=60)
        finally:
            done.set()
            polling.join(timeout=60)
            sys.setswitchinterval(switch)
        if errors:
            raise errors[0]
        for name in names:
            winners = [i for i in range(RACERS) if outcome.get((name, i)) == "won"]
            assert len(winners) == 1, f"{name}: {len(winners)} winners ({winners}); exactly one may create it"
            assert all(outcome.get((name, i)) == "lost" for i in range(RACERS) if i != winners[0])
            whole = contents[name, winners[0]]
            assert store.read(name) == whole
            assert seen[name] <= {whole}, f"{name}: a reader saw a partial or foreign content"
        assert store.list("") == names, "a racing create left another object behind"

    def test_create_exclusive_race_between_processes_has_one_winner(self, store: StoreT) -> None:
        opener = self.process_opener(store)
        if opener is None:
            pytest.skip(f"{type(self).__name__} does not open its storage from other processes")
        # Any: typeshed's BaseContext lacks the Process, Barrier and Queue every context has.
        ctx: Any = multiprocessing.get_context(self.process_start_method)
        names = [f"locks/{k:03d}.lock" for k in range(RACE_ROUNDS)]
        start = ctx.Barrier(RACERS)
        results = ctx.Queue()
        procs = [ctx.Process(target=_race_in_child, args=(opener, i, names, start, results)) for i in range(RACERS)]
        for p in procs:
            p.start()
        try:
            reports = [results.get(timeout=120) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        failed = [r for r in reports if isinstance(r, str)]
        assert not failed, failed[0] if failed else ""
        won: dict[str, list[int]] = {name: [] for name in names}
        for child, outcomes in reports:
            for name, result in zip(names, outcomes, strict=True):
                assert result in ("won", "lost"), f"child {child}, {name}: {result}"
                if result == "won":
                    won[name].append(child)
        for name in names:
            assert len(won[name]) == 1, f"{name}: {len(won[name])} processes created it; exactly one may"
            assert store.read(name) == _child_content(won[name][0], name)
        assert store.list("") == names

    # -- sync and durability ----------------------------------------------------------------------
    def test_sync_accepts_written_objects_in_any_iterable(self, store: StoreT) -> None:
        store.write("anchors/0-0123abcd.safetensors", b"anchor")
        store.write_parts("deltas/1-1-0123abcd/c/0", [b"delta"])
        store.create_exclusive("log/000000000001.json", b"record")
        store.sync([])
        store.sync(["anchors/0-0123abcd.safetensors", "deltas/1-1-0123abcd/c/0", "log/000000000001.json"])
        store.sync(p for p in ("deltas/1-1-0123abcd/c/0",))
        assert store.read("anchors/0-0123abcd.safetensors") == b"anchor"
        assert store.read("deltas/1-1-0123abcd/c/0") == b"delta"

    def test_sync_of_a_missing_object_raises(self, store: StoreT) -> None:
        if not self.sync_reports_missing:
            pytest.skip(f"{type(self).__name__}.sync cannot tell that an object is missing")
        store.write("deltas/1-1-0123abcd/c/0", b"delta")
        store.write("deltas/1-1-0123abcd/c/1", b"delta")
        for missing in ("deltas/1-1-0123abcd/c/2", "deltas/1-1-0123abcd/c", "deltas/1-1-0123abcd/c/0/x"):
            with pytest.raises(FileNotFoundError):
                store.sync(["deltas/1-1-0123abcd/c/0", missing])

    def test_synced_and_created_objects_survive_a_crash(self, store: StoreT) -> None:
        store.write("anchors/0-0123abcd.safetensors", b"v1")
        store.sync(["anchors/0-0123abcd.safetensors"])
        store.write("anchors/0-0123abcd.safetensors", b"v2")  # rewritten, synced again
        store.write_parts("deltas/1-1-0123abcd/c/0", [b"del", b"ta"])
        store.sync(["anchors/0-0123abcd.safetensors", "deltas/1-1-0123abcd/c/0"])
        store.create_exclusive("log/000000000001.json", b"record, durable without sync")
        store.write("deltas/2-2-0123abcd/c/0", b"not synced")
        self.crash(store)
        after = self.reopen(store)
        assert after.read("anchors/0-0123abcd.safetensors") == b"v2"
        assert after.read("deltas/1-1-0123abcd/c/0") == b"delta"
        assert after.read("log/000000000001.json") == b"record, durable without sync"
        assert set(after.list("")) >= {"anchors/0-0123abcd.safetensors", "deltas/1-1-0123abcd/c/0",
                                       "log/000000000001.json"}

    # -- handles and threads ----------------------------------------------------------------------
    def test_other_handles_see_every_completed_call(self, store: StoreT) -> None:
        other = self.reopen(store)
        store.write("anchors/0-0123abcd.safetensors", b"anchor")
        assert other.read("anchors/0-0123abcd.safetensors") == b"anchor"
        assert other.size("anchors/0-0123abcd.safetensors") == 6
        assert other.exists("anchors/0-0123abcd.safetensors")
        assert other.list("anchors") == ["anchors/0-0123abcd.safetensors"]
        other.create_exclusive("log/000000000001.json", b"record")
        assert store.read("log/000000000001.json") == b"record"
        other.delete("anchors/0-0123abcd.safetensors")
        assert not store.exists("anchors/0-0123abcd.safetensors")
        assert store.list("") == ["log/000000000001.json"]

    def test_threads_working_on_different_paths_do_not_interfere(self, store: StoreT) -> None:
        # Writers, exclusive creators and deleters share one directory, which deletes keep
        # emptying: a store that removes empty directories must not fail a concurrent write.
        errors: list[BaseException] = []

        def churn(i: int) -> None:
            try:
                for k in range(60):
                    path = f"deltas/shared/{i}-{k}"
                    data = f"{i}:{k}".encode()
                    if k % 3 == 0:
                        store.create_exclusive(path, data)
                    elif k % 3 == 1:
                        store.write(path, data)
                    else:
                        store.write_parts(path, [data[:1], data[1:]])
                    if store.read(path) != data:
                        raise AssertionError(f"{path}: read back other bytes")
                    store.delete(path)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=churn, args=(i,)) for i in range(RACERS)]
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        finally:
            sys.setswitchinterval(switch)
        if errors:
            raise errors[0]
        assert store.list("") == []

    # -- paths ----------------------------------------------------------------------------------
    @pytest.mark.parametrize("primitive", sorted(PRIMITIVES))
    def test_unsafe_paths_are_refused(self, store: StoreT, primitive: str) -> None:
        store.write("log/x", b"")
        call = PRIMITIVES[primitive]
        for path, why in UNSAFE_PATHS.items():
            if primitive == "list" and path == "":
                continue  # the whole store
            with pytest.raises(CorruptChainError):
                call(store, path)
                pytest.fail(f"{primitive}({path!r}) ({why}) did not raise CorruptChainError")
        assert store.list("") == ["log/x"], f"a refused {primitive} changed the store"
        assert store.read("log/x") == b""

    def test_unsafe_paths_are_refused_by_sync_among_safe_ones(self, store: StoreT) -> None:
        store.write("log/x", b"")
        for path in UNSAFE_PATHS:
            with pytest.raises(CorruptChainError):
                store.sync(["log/x", path])

    def test_local_path_when_given_holds_the_object(self, store: StoreT) -> None:
        store.write("anchors/0-0123abcd.safetensors", b"zero-copy")
        local = store.local_path("anchors/0-0123abcd.safetensors")
        if local is None:
            return  # the backend has no local files: nothing more to check
        assert isinstance(local, Path)
        assert local.read_bytes() == b"zero-copy"

    # -- identity ----------------------------------------------------------------------------
    def test_a_store_knows_its_location(self, store: StoreT) -> None:
        """A store is the same location as itself (``==``, :func:`hash`), and so is a wrapper
        that passes its calls through; it has a name for messages and says whether it is remote."""
        wrapped = FaultyStore(store)
        assert store == store and hash(store) == hash(store)
        assert wrapped == store and store == wrapped and hash(wrapped) == hash(store)
        assert store != object()
        name = store.describe()
        assert isinstance(name, str) and name and wrapped.describe() == name
        assert isinstance(store.is_remote, bool) and wrapped.is_remote == store.is_remote


def _child_content(child: int, name: str) -> bytes:
    return f"{name} created by child {child}; ".encode() * 1000


def _race_in_child(opener: Callable[[], Store], child: int, names: list[str],
                   start: multiprocessing.synchronize.Barrier,
                   results: multiprocessing.queues.Queue[tuple[int, list[str]] | str]) -> None:
    """One racer of the process race: create every name as soon as all racers are ready."""
    try:
        store = opener()
        outcomes = []
        for name in names:
            start.wait(timeout=60)
            try:
                store.create_exclusive(name, _child_content(child, name))
                outcomes.append("won")
            except FileExistsError:
                outcomes.append("lost")
        results.put((child, outcomes))
    except BaseException as e:  # the parent reports it
        results.put(f"child {child}: {type(e).__name__}: {e}")
