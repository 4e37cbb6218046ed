"""An S3 server for the tests: ``moto_server`` on 127.0.0.1, and a fault-injecting proxy.

:class:`MotoServer` runs moto's stand-alone server in a subprocess on a free port (nothing
leaves the machine); :class:`FaultProxy` sits in front of it and answers chosen requests
with an HTTP error (503 ``SlowDown``, 500, 429) or by resetting the connection, before or
after forwarding them, so that the retry policy of :class:`ldformat.stores.ObjectStore` can
be checked. The fixtures at the bottom start one server per test session, create a bucket
and point the standard AWS environment variables at it; tests that use them are skipped
when moto, boto3 or obstore are not installed.
"""

from __future__ import annotations

import contextlib
import http.client
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ports import free_port

BUCKET = "ldformat-test"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def _moto_server_command() -> list[str] | None:
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("moto_server")
    return [found] if found else None


class MotoServer:
    """``moto_server`` in a subprocess; :meth:`stop` ends it within :data:`STOP_TIMEOUT_S`."""

    def __init__(self) -> None:
        command = _moto_server_command()
        if command is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*command, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            self._wait_until_it_answers()
        except BaseException:
            self.stop()
            raise

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with status {self.proc.returncode} on start")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/moto-api/")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"moto_server did not answer on port {self.port} within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment variables that point an S3 client at this server (or ``endpoint``)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=name)

    def object_keys(self, bucket: str, prefix: str) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys


# -- the fault-injecting proxy ----------------------------------------------------------------
#: What the proxy does with one request: forward it, answer an HTTP status without
#: forwarding, reset the connection without forwarding, or forward it and then reset the
#: connection instead of relaying the answer (the request took effect; the client cannot tell),
#: or wait :attr:`FaultProxy.slow_s` seconds and then forward it ("slow").
Action = str  # "forward" | "503" | "500" | "429" | "reset" | "reset-after" | "slow"

_ERROR_BODIES = {
    "503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "429": (429, "Too Many Requests", "TooManyRequests", "Please reduce your request rate."),
}


@dataclass
class Request:
    method: str
    target: str
    action: Action
    range: str | None = None  # the Range header, if any
    at: float = 0.0  # when the request arrived (time.monotonic())


@dataclass
class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` that injects faults.

    ``plan(method, target, n)`` decides the :data:`Action` for the ``n``-th request (from 0);
    the default forwards everything. :attr:`seen` records every request and what was done.
    """

    upstream_port: int
    plan: Callable[[str, str, int], Action] = lambda method, target, n: "forward"
    seen: list[Request] = field(default_factory=list)
    #: Bytes per second each connection may send to the client (None: no limit), as a cloud
    #: store limits each connection: what concurrent ranged GETs are for.
    bandwidth: float | None = None
    #: Seconds a "slow" request waits before it is forwarded.
    slow_s: float = 0.3

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()

    def fail_first(self, n: int, action: Action, *, methods: tuple[str, ...] | None = None) -> None:
        """Inject ``action`` into the first ``n`` requests (of ``methods``, if given)."""
        count = [0]

        def plan(method: str, target: str, _: int) -> Action:  # called holding self._lock
            if methods is not None and method not in methods:
                return "forward"
            count[0] += 1
            return action if count[0] <= n else "forward"

        with self._lock:
            self.plan = plan
            self.seen.clear()

    def fail_after(self, n: int, action: Action, *, methods: tuple[str, ...] | None = None,
                   target: str | None = None) -> None:
        """Forward the first ``n`` requests (of ``methods``, whose target contains ``target``, if
        given), then inject ``action`` into every later one: a store that goes down mid-way."""
        self._count_plan(action, methods, target, lambda count: count > n)

    def affect(self, action: Action, *, methods: tuple[str, ...] | None = None, target: str | None = None) -> None:
        """Inject ``action`` into every request (of ``methods``, whose target contains ``target``)."""
        self._count_plan(action, methods, target, lambda count: True)

    def set_plan(self, plan: Callable[[str, str, int], Action]) -> None:
        """Decide each request's action with ``plan(method, target, n)`` from now on."""
        with self._lock:
            self.plan = plan
            self.seen.clear()

    def forward_all(self) -> None:
        """Forward everything from now on (the store is back)."""
        self.fail_first(0, "forward")

    def _count_plan(self, action: Action, methods: tuple[str, ...] | None, target: str | None,
                    hit: Callable[[int], bool]) -> None:
        count = [0]

        def plan(method: str, request_target: str, _: int) -> Action:  # called holding self._lock
            if methods is not None and method not in methods:
                return "forward"
            if target is not None and target not in request_target:
                return "forward"
            count[0] += 1
            return action if hit(count[0]) else "forward"

        with self._lock:
            self.plan = plan
            self.seen.clear()

    def faults(self) -> int:
        return sum(r.action not in ("forward", "slow") for r in self.seen)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STOP_TIMEOUT_S)
        self._sock.close()

    # -- serving ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                request_line, headers = head
                method, target, _ = request_line.split(" ", 2)
                body = _read_body(reader, headers)
                with self._lock:
                    n = len(self.seen)
                    action = self.plan(method, target, n)
                    ranged = next((v for k, v in headers if k.lower() == "range"), None)
                    self.seen.append(Request(method, target, action, ranged, time.monotonic()))
                if action == "reset":
                    _reset(conn)
                    return
                if action in _ERROR_BODIES:
                    conn.sendall(_error_response(action, method))
                    continue
                if action == "slow":
                    self._stop.wait(self.slow_s)
                response = self._forward(method, target, headers, body)
                if action == "reset-after":
                    _reset(conn)
                    return
                self._send(conn, response)
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                reader.close()
                conn.close()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        if self.bandwidth is None:
            conn.sendall(data)
            return
        started, view, piece = time.monotonic(), memoryview(data), 256 * 1024
        for sent in range(0, len(view), piece):
            conn.sendall(view[sent:sent + piece])
            ahead = (sent + piece) / self.bandwidth - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)

    def _forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    upstream.putheader(name, value)
            upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body)
            resp = upstream.getresponse()
            data = resp.read()
            lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
            for name, value in resp.getheaders():
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    lines.append(f"{name}: {value}")
            if method != "HEAD":
                lines.append(f"Content-Length: {len(data)}")
            else:
                length = resp.getheader("Content-Length")
                if length is not None:
                    lines.append(f"Content-Length: {length}")
            return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if method == "HEAD" else data)
        finally:
            upstream.close()


def _read_head(reader: object) -> tuple[str, list[tuple[str, str]]] | None:
    readline = reader.readline  # type: ignore[attr-defined]
    line = readline(65537)
    if not line:
        return None
    request_line = line.decode("latin-1").rstrip("\r\n")
    headers: list[tuple[str, str]] = []
    while True:
        line = readline(65537)
        if not line or line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return request_line, headers


def _read_body(reader: object, headers: list[tuple[str, str]]) -> bytes:
    read, readline = reader.read, reader.readline  # type: ignore[attr-defined]
    values = {k.lower(): v for k, v in headers}
    if values.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(readline(1024).split(b";")[0].strip(), 16)
            if size == 0:
                while readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += read(size)
            readline(1024)
    length = int(values.get("content-length", "0") or 0)
    data: bytes = read(length) if length else b""
    return data


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): what the client sees of a dropped connection."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _error_response(action: Action, method: str) -> bytes:
    status, reason, code, message = _ERROR_BODIES[action]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>{secrets.token_hex(8)}</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            + ("Retry-After: 0\r\n" if status == 429 else "") + "\r\n").encode()
    return head + (b"" if method == "HEAD" else body)


# -- fixtures -----------------------------------------------------------------------------------
def needs_s3() -> None:
    """Skip the calling test unless obstore, boto3 and moto's server are installed."""
    pytest.importorskip("obstore", reason="the s3 extra is not installed (pip install 'ldformat[s3]')")
    pytest.importorskip("boto3", reason="moto[server] is not installed")
    pytest.importorskip("moto", reason="moto[server] is not installed")
    if _moto_server_command() is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """One moto server for the session, with the bucket :data:`BUCKET`."""
    needs_s3()
    server = MotoServer()
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_env(moto: MotoServer) -> Iterator[MotoServer]:
    """The AWS environment variables point at the moto server for the tests of a module
    (subprocesses inherit them)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE",
                     "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(name, raising=False)
        for name, value in moto.env().items():
            mp.setenv(name, value)
        yield moto


@pytest.fixture
def s3_url(s3_env: MotoServer) -> str:
    """A fresh, empty prefix in the test bucket, as a URL."""
    return f"s3://{BUCKET}/t-{secrets.token_hex(6)}"


@pytest.fixture
def fault_proxy(s3_env: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the moto server, with the environment pointing at it."""
    proxy = FaultProxy(s3_env.port)
    for name, value in s3_env.env(proxy.url).items():
        monkeypatch.setenv(name, value)
    try:
        yield proxy
    finally:
        proxy.close()


__all__ = ["BUCKET", "FaultProxy", "MotoServer", "Request", "fault_proxy", "free_port", "moto", "needs_s3",
           "s3_env", "s3_url"]
