"""A chain in an object store: S3, Google Cloud Storage, Azure Blob Storage, HTTP (spec §7.4, §21.2).

:class:`ObjectStore` implements the :class:`~ldformat.stores.Store` contract over `obstore
<https://developmentseed.org/obstore/>`_, an optional dependency (``pip install
'ldformat[s3]'``). The commit protocol needs nothing an object store lacks: an exclusive
create is a PUT with ``If-None-Match: *`` (atomic on S3, GCS and Azure), there is no rename,
and a PUT is durable when it returns, so :meth:`ObjectStore.sync` sends no request.

Configuration comes from each cloud's standard environment variables, read by obstore
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_ALLOW_HTTP``, ...; ``GOOGLE_SERVICE_ACCOUNT``, ...; ``AZURE_STORAGE_ACCOUNT_NAME``,
...), and from ``storage_options``, which override them. ldformat never creates a bucket.

**Retries.** Transient failures are retried with bounded exponential backoff
(:class:`RetryPolicy`: 5 tries, at most 30 s, by default). obstore's own retry covers
HTTP 5xx (S3 ``SlowDown`` is a 503), 429, connection errors, and timeouts and dropped
connections of idempotent requests (GET, HEAD, LIST, PUT); it is configured from the same
policy. ldformat adds a retry around what obstore does not retry: an exclusive create (sent
with obstore's retry off, see below), a delete (a POST that obstore does not resend), and a
response body cut off while it is read. Nothing is retried twice over: an error obstore has
already retried is reported as it is. What a failure means, and the policy, are :mod:`.retry`.

An exclusive create whose outcome is unknown (the connection dropped, or the server failed,
after the request was sent) is sent again; if the object then exists, it is read back, and
holding exactly the bytes this call wrote means the earlier attempt created it: success.
Another writer does not create the same bytes: a lock generation carries a random token,
the root a random chain id, and a record its writer (host and pid), its time to the
millisecond and the randomly named objects it commits.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import UsageError
from .base import Part, Store, byte_view, check_relative_path, refuse_larger
from .retry import RETRY_OPTION_KEYS, Failure, ObjectStoreError, RetryPolicy, classify_failure, first_line, retry_policy

if TYPE_CHECKING:
    from obstore import GetOptions

__all__ = ["CLIENT_OPTION_KEYS", "ObjectStore", "ObjectStoreError", "RetryPolicy", "require_obstore"]

T = TypeVar("T")

#: Objects up to this size are written with one PUT; larger ones as a multipart upload of
#: parts of :attr:`ObjectStore.part_size`, several in flight at once.
MULTIPART_THRESHOLD = 16 << 20
#: The part size of multipart uploads and of ranged reads.
PART_SIZE = 8 << 20
#: Parts uploaded, or ranges read, at the same time for one object.
CONCURRENCY = 8

#: ``storage_options`` keys that configure obstore's HTTP client (``ClientConfig``) rather than
#: the store. obstore replaces every client option when any is passed, so the ones set in the
#: environment (``AWS_ALLOW_HTTP``, ...) are passed along with them.
CLIENT_OPTION_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type", "default_headers",
    "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle",
    "http2_only", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate",
    "proxy_excludes", "randomize_addresses", "read_timeout", "root_certificate", "timeout", "user_agent",
})

#: The environment variable prefix of each cloud's client options (``AWS_ALLOW_HTTP``, ...).
_ENV_PREFIX = {"s3": "AWS_", "s3a": "AWS_", "gs": "GOOGLE_", "az": "AZURE_", "azure": "AZURE_",
               "abfs": "AZURE_", "abfss": "AZURE_", "adl": "AZURE_"}

def require_obstore() -> Any:
    """Import obstore, or raise :class:`UsageError` saying how to install it."""
    try:
        import obstore
    except ImportError:
        raise UsageError(
            "object store URLs (s3://, gs://, az://, http(s)://) need the optional obstore package: "
            "pip install 'ldformat[s3]'"
        ) from None
    return obstore


class ObjectStore(Store):
    """A chain below a URL prefix of an object store; the :class:`Store` contract over obstore.

    Args:
        url: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix`` (the
            account from ``AZURE_STORAGE_ACCOUNT_NAME`` or ``storage_options``; also
            ``abfs(s)://container@account.dfs.core.windows.net/prefix``, ``azure://``,
            ``adl://``, ``s3a://``) or
            ``http(s)://host/prefix`` (a WebDAV-like server; it must honour ``If-None-Match``).
        storage_options: obstore settings that override the environment: store settings
            (``endpoint``, ``region``, ``access_key_id``, ``skip_signature``, ...; see obstore's
            ``S3Config``/``GCSConfig``/``AzureConfig``), HTTP client settings (the keys of
            :data:`CLIENT_OPTION_KEYS`: ``timeout``, ``connect_timeout``, ``allow_http``, ...)
            and the retry policy (``max_retries``, ``retry_timeout``, ``retry_init_backoff``,
            ``retry_max_backoff``; seconds).
        retry: the retry policy; overridden by the environment variables
            ``LDFORMAT_MAX_RETRIES``, ``LDFORMAT_RETRY_TIMEOUT``, ``LDFORMAT_RETRY_INIT_BACKOFF``
            and ``LDFORMAT_RETRY_MAX_BACKOFF`` (for the command line), and those by the retry
            keys of ``storage_options``.
        part_size: bytes per part of a multipart upload and per ranged read (at least 5 MiB,
            S3's smallest part).
        concurrency: parts uploaded, or ranges read, at the same time for one object.
        range_threshold: objects larger than this are read as concurrent ranged GETs of
            ``part_size`` bytes (default: 16 MiB); smaller ones with one GET. Per-connection
            bandwidth is what limits a GET on S3, GCS and Azure; a server that reads a whole
            object for every ranged GET (moto does) is faster with one GET: pass a huge value.

    Attributes:
        url: the chain's URL, without a trailing ``/``.
        requests: HTTP requests sent, by store primitive (``write``, ``read_buffer``, ...),
            retries by ldformat included; obstore's own retries are not visible here.
        retries: requests ldformat sent again after a transient failure, by primitive.

    A handle is thread-safe but does not survive ``fork()`` (obstore's I/O threads do not):
    a child process opens its own store, started with the ``spawn`` or ``forkserver`` method.

    Raises:
        UsageError: obstore is not installed, the URL is not one obstore can open, or a
            ``storage_options`` key or value is invalid.

    Example:
        >>> store = ObjectStore("s3://my-bucket/runs/chain")               # doctest: +SKIP
        >>> store.create_exclusive("log/000000000001.json", record)       # doctest: +SKIP
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None, part_size: int = PART_SIZE,
                 concurrency: int = CONCURRENCY, range_threshold: int | None = None) -> None:
        obstore = require_obstore()
        if part_size < 5 << 20:
            raise UsageError(f"ObjectStore: part_size must be at least 5 MiB (S3's smallest part), got {part_size}")
        if concurrency < 1:
            raise UsageError(f"ObjectStore: concurrency must be >= 1, got {concurrency}")
        self.url = url.rstrip("/")
        self.part_size = part_size
        self.multipart_threshold = max(MULTIPART_THRESHOLD, part_size)
        self.range_threshold = self.multipart_threshold if range_threshold is None else range_threshold
        self.concurrency = concurrency
        self.requests: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        scheme = self.url.split("://", 1)[0].lower()
        options = dict(storage_options or {})
        env = {k: os.environ[f"LDFORMAT_{k.upper()}"] for k in RETRY_OPTION_KEYS
               if f"LDFORMAT_{k.upper()}" in os.environ}
        self.retry = retry_policy(retry_policy(retry or RetryPolicy(), env, "environment"), options, self.url)
        client = {k: options.pop(k) for k in list(options) if k in CLIENT_OPTION_KEYS}
        if client:  # obstore replaces the client options read from the environment: keep them
            prefix = _ENV_PREFIX.get(scheme)
            for key in CLIENT_OPTION_KEYS - client.keys():
                value = os.environ.get(f"{prefix}{key.upper()}") if prefix else None
                if value is not None:
                    client[key] = value
        kwargs: dict[str, Any] = {"client_options": client or None}
        if options:
            kwargs["config"] = options
        self._endpoint = _endpoint(scheme, self.url, options)
        no_retry = {**self.retry.obstore_config(), "max_retries": 0}
        try:
            self._store = obstore.store.from_url(self.url, retry_config=self.retry.obstore_config(), **kwargs)
            # Exclusive creates go through a second client without obstore's retry, so that
            # ldformat knows of every attempt whose outcome is unknown (see the module doc).
            self._create_store = obstore.store.from_url(self.url, retry_config=no_retry, **kwargs)
        except Exception as e:
            raise UsageError(f"{self.url}: cannot open this object store URL: {first_line(e)}") from None
        self._lock = threading.Lock()
        self._unsynced: set[str] = set()  # written by this handle, sync not yet asked for
        self._pool: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def describe(self) -> str:
        return self.url

    @property
    def is_remote(self) -> bool:
        return True

    def _identity(self) -> Hashable:
        return ("object", self.url)

    def url_of(self, path: str) -> str:
        """The URL of the object ``path`` (for messages)."""
        return f"{self.url}/{path}"

    # -- the retry loop and the mapping of errors ---------------------------------------------------
    def _count(self, op: str, n: int = 1) -> None:
        with self._lock:
            self.requests[op] += n

    def _attempts(self, op: str, path: str, attempt: Callable[[int], T], *, what: str | None = None) -> T:
        """Run ``attempt(i)`` (i = 0, 1, ...) until it succeeds or fails for good.

        A transient failure that obstore has not retried itself is tried again, within the
        :class:`RetryPolicy`; anything else is raised as the contract wants it (see
        :meth:`_error`).
        """
        start = time.monotonic()
        i = 0
        while True:
            try:
                return attempt(i)
            except Exception as e:
                failure = classify_failure(e)
                if failure is None:
                    raise
                i += 1
                elapsed = time.monotonic() - start
                wait = self.retry.backoff(i)
                if (not failure.transient or failure.retried_inside or i >= self.retry.tries
                        or elapsed + wait > self.retry.total):
                    raise self._error(op, path, failure, i, elapsed, what) from None
                with self._lock:
                    self.retries[op] += 1
                time.sleep(wait)

    def _error(self, op: str, path: str, f: Failure, tries: int, elapsed: float, what: str | None) -> OSError:
        e = f.error
        url = self.url_of(path) if path else self.url
        verb = what or op
        if isinstance(e, FileNotFoundError) and "NoSuchBucket" not in str(e):
            return FileNotFoundError(errno.ENOENT, "no such object", url)
        if f.errno == errno.ENOENT:  # the bucket (or container) itself is missing
            return ObjectStoreError(errno.ENOENT, f"{verb} failed: {f.summary}; create it first (ldformat never "
                                                  "creates buckets) or fix the URL", url)
        if f.builder and self._endpoint is not None and self._endpoint.lower().startswith("http://"):
            prefix = _ENV_PREFIX.get(self.url.split("://", 1)[0].lower(), "AWS_")
            return ObjectStoreError(errno.EINVAL, f"{verb} failed: the endpoint {self._endpoint} is plain http://, "
                                                  f"which is refused unless allowed: set {prefix}ALLOW_HTTP=true (or "
                                                  "storage_options allow_http=True), or use an https:// endpoint", url)
        if f.builder:
            return ObjectStoreError(errno.EINVAL, f"{verb} failed: {f.summary}: the HTTP client could not be set up "
                                                  "from these settings; a plain http:// endpoint needs "
                                                  "AWS_ALLOW_HTTP=true (storage_options allow_http=True)", url)
        if f.errno == errno.EACCES:
            return PermissionError(errno.EACCES, f"{verb} refused: {f.summary}; check the credentials "
                                                 "(environment variables or storage_options)", url)
        if f.transient:
            retried = f" after {max(tries, f.retried_inside + 1)} tries in {elapsed:.1f} s"
            return ObjectStoreError(f.errno, f"{verb} failed: {f.summary}{retried}; the store is unreachable, "
                                             "failing or throttling: retry later, or allow more retries "
                                             "(storage_options max_retries/retry_timeout, or LDFORMAT_MAX_RETRIES/"
                                             "LDFORMAT_RETRY_TIMEOUT)", url)
        return ObjectStoreError(f.errno, f"{verb} failed: {f.summary}", url)

    # -- the Store primitives -------------------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self._write("write", path, (data,))

    def write_parts(self, path: str, parts: Sequence[Part]) -> None:
        self._write("write_parts", path, parts)

    def _write(self, op: str, path: str, parts: Sequence[Part]) -> None:
        import obstore

        key = check_relative_path(path)
        views = [byte_view(p) for p in parts]  # TypeError for a strided part, before any request
        total = sum(len(v) for v in views)

        def attempt(_: int) -> None:
            if total <= self.multipart_threshold:
                self._count(op)
                payload = views[0] if len(views) == 1 else b"".join(views)
                obstore.put(self._store, key, payload, use_multipart=False)
            else:
                # A multipart upload streamed from the parts, part_size bytes per request and
                # `concurrency` requests in flight: the object is never joined in memory.
                self._count(op, -(-total // self.part_size) + 2)  # create + parts + complete
                obstore.put(self._store, key, _pieces(views, self.part_size), use_multipart=True,
                            chunk_size=self.part_size, max_concurrency=self.concurrency)

        self._attempts(op, key, attempt)
        with self._lock:
            self._unsynced.add(key)

    def sync(self, paths: Iterable[str]) -> None:
        # A PUT is durable when it returns: only a path this handle did not write is asked for.
        wanted = [check_relative_path(p) for p in paths]
        with self._lock:
            unknown = [p for p in wanted if p not in self._unsynced]
            self._unsynced.difference_update(wanted)
        for key in unknown:
            if not self._head("sync", key):
                raise FileNotFoundError(errno.ENOENT, "no such object", self.url_of(key))

    def create_exclusive(self, path: str, data: bytes) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = check_relative_path(path)
        content = bytes(data)
        unknown_outcome = [False]

        def attempt(i: int) -> None:
            if i:
                unknown_outcome[0] = True  # an earlier attempt may have created the object
            self._count("create_exclusive")
            try:
                obstore.put(self._create_store, key, content, mode="create")
            except (AlreadyExistsError, PreconditionError):
                if unknown_outcome[0] and self._holds(key, content):
                    return  # our earlier attempt created it
                raise FileExistsError(errno.EEXIST, "object exists (another writer created it first)",
                                      self.url_of(key)) from None

        self._attempts("create_exclusive", key, attempt, what="exclusive create")

    def _holds(self, key: str, content: bytes) -> bool:
        try:
            return self._get_bytes("create_exclusive", key) == content
        except FileNotFoundError:
            return False

    def read(self, path: str) -> bytes:
        key = check_relative_path(path)
        return self._attempts("read", key, lambda _: self._get_bytes("read", key))

    def _get_bytes(self, op: str, key: str) -> bytes:
        import obstore

        self._count(op)
        result = obstore.get(self._store, key)
        if result.meta["size"] > self.range_threshold:
            return self._get_large(op, key, result).tobytes()
        data: bytes = result.bytes().to_bytes()
        return data

    def read_buffer(self, path: str, max_size: int | None = None) -> np.ndarray:
        import obstore

        key = check_relative_path(path)

        def attempt(_: int) -> np.ndarray:
            self._count("read_buffer")
            result = obstore.get(self._store, key)
            refuse_larger(result.meta["size"], max_size)  # before the body is read: one request, bounded
            if result.meta["size"] > self.range_threshold:
                return self._get_large("read_buffer", key, result)
            return np.frombuffer(memoryview(result.bytes()), np.uint8).copy()

        return self._attempts("read_buffer", key, attempt)

    def _get_large(self, op: str, key: str, first: Any) -> np.ndarray:
        """A large object into one preallocated buffer: its first part from the GET already
        answering, the rest as concurrent ranged GETs pinned to the same version (If-Match)."""
        import obstore

        meta = first.meta
        size: int = meta["size"]
        etag: str | None = meta.get("e_tag")
        buf = np.empty(size, np.uint8)
        head = min(self.part_size, size)
        starts = list(range(head, size, self.part_size))
        self._count(op, len(starts))

        def fetch(start: int) -> None:
            end = min(start + self.part_size, size)
            options: GetOptions = {"range": (start, end)}
            if etag:
                options["if_match"] = etag
            data = memoryview(obstore.get(self._store, key, options=options).bytes())
            if len(data) != end - start:
                raise ConnectionError(f"short ranged read: {len(data)} of {end - start} bytes")
            buf[start:end] = np.frombuffer(data, np.uint8)

        futures = [self._executor().submit(fetch, s) for s in starts]
        try:
            got = 0
            for chunk in first.stream(min_chunk_size=1 << 20):
                n = min(len(chunk), head - got)
                buf[got:got + n] = np.frombuffer(chunk, np.uint8, n)
                got += n
                if got >= head:
                    break
            del first  # drops the rest of the first response
            if got < head:
                raise ConnectionError(f"the response ended after {got} of {head} bytes")
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return buf

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="ldformat-ranges")
            return self._pool

    def size(self, path: str) -> int:
        import obstore

        key = check_relative_path(path)

        def attempt(_: int) -> int:
            self._count("size")
            size: int = obstore.head(self._store, key)["size"]
            return size

        return self._attempts("size", key, attempt)

    def _head(self, op: str, key: str) -> bool:
        import obstore

        def attempt(_: int) -> bool:
            self._count(op)
            try:
                obstore.head(self._store, key)
            except FileNotFoundError as e:
                if "NoSuchBucket" in str(e):
                    raise
                return False
            return True

        return self._attempts(op, key, attempt)

    def list(self, prefix: str) -> list[str]:
        import obstore

        if prefix:
            check_relative_path(prefix)

        def attempt(_: int) -> list[str]:
            out: list[str] = []
            pages = 0
            try:
                for chunk in obstore.list(self._store, prefix or None, chunk_size=1000):
                    out += [meta["path"] for meta in chunk]
                    pages += 1
            finally:
                self._count("list", max(pages, 1))
            return out

        # obstore matches the prefix component by component (`log` lists `log/...` only), but
        # shows a "directory marker" key `log/` (made by some tools) as `log`: not an object.
        below = prefix + "/" if prefix else ""
        return sorted(p for p in self._attempts("list", prefix, attempt) if p.startswith(below))

    def delete(self, path: str) -> None:
        import obstore

        key = check_relative_path(path)

        def attempt(_: int) -> None:
            self._count("delete")
            try:
                obstore.delete(self._store, key)
            except FileNotFoundError as e:  # GCS, Azure and HTTP report a missing object
                if "NoSuchBucket" in str(e):
                    raise

        self._attempts("delete", key, attempt)
        with self._lock:
            self._unsynced.discard(key)

    def exists(self, path: str) -> bool:
        return self._head("exists", check_relative_path(path))


def _pieces(views: list[memoryview], size: int) -> Iterator[memoryview]:
    """The parts as slices of at most ``size`` bytes (obstore copies each into its upload buffer)."""
    for view in views:
        for start in range(0, len(view), size):
            yield view[start:start + size]


#: ``storage_options`` keys and environment variables that set an object store's endpoint.
_ENDPOINT_KEYS = ("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url", "azure_storage_endpoint",
                  "google_service_endpoint")
_ENDPOINT_ENV = {"AWS_": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"), "AZURE_": ("AZURE_STORAGE_ENDPOINT",)}


def _endpoint(scheme: str, url: str, options: Mapping[str, Any]) -> str | None:
    """The endpoint requests go to, when known: the URL of an ``http(s)://`` store, else the
    endpoint ``storage_options`` or the environment set (messages only)."""
    if scheme in ("http", "https"):
        return url
    for key in _ENDPOINT_KEYS:
        if isinstance(options.get(key), str):
            return str(options[key])
    for name in _ENDPOINT_ENV.get(_ENV_PREFIX.get(scheme, ""), ()):
        if os.environ.get(name):
            return os.environ[name]
    return None
