"""An Azure Blob Storage emulator (Azurite, from npm) on 127.0.0.1 for the tests of ``az://`` chains.

Azurite is found as ``azurite-blob`` on ``PATH`` (``npm install -g azurite``, or
``npm install --prefix DIR azurite`` with ``DIR/node_modules/.bin`` on ``PATH``); without it
the Azure tests are skipped. The fixtures start one server per test session on a free port,
create a container, and point obstore's environment at it: ``AZURE_STORAGE_USE_EMULATOR``,
``AZURITE_BLOB_STORAGE_URL`` and the emulator's well-known account.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
from ports import free_port

#: Azurite's fixed development account (public, documented by Microsoft).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "ldformat-tests"
START_TIMEOUT_S = 30.0


class Azurite:
    """An ``azurite-blob`` process on a free loopback port, with its own data directory."""

    def __init__(self, command: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="azurite-")
        self._proc = subprocess.Popen(
            [command, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self._dir,
             "--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"azurite did not start on port {self.port}") from None
                time.sleep(0.1)

    def create_container(self, name: str) -> None:
        """Create a container, signed with the account key (obstore never creates one)."""
        date = email.utils.formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06", "Content-Length": "0"}
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
        to_sign = "PUT\n" + "\n" * 11 + canonical_headers + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        signature = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest())
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{signature.decode()}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("PUT", f"/{ACCOUNT}/{name}?restype=container", headers=headers)
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status not in (201, 409):
            raise RuntimeError(f"azurite: creating container {name} failed: {response.status} {body[:200]!r}")

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.url,
                "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": KEY}

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


def azurite_command() -> str | None:
    return os.environ.get("LDFORMAT_AZURITE") or shutil.which("azurite-blob")


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    command = azurite_command()
    if command is None:
        pytest.skip("azurite-blob is not installed (npm install -g azurite)")
    server = Azurite(command)
    try:
        server.create_container(CONTAINER)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def az_env(azurite: Azurite) -> Iterator[Azurite]:
    """The Azure environment variables point at Azurite for a module's tests (and subprocesses)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in azurite.env().items():
            mp.setenv(name, value)
        yield azurite


@pytest.fixture
def az_url(az_env: Azurite) -> str:
    """A fresh, empty prefix in the test container, as a URL."""
    return f"az://{CONTAINER}/t-{secrets.token_hex(6)}"


__all__ = ["ACCOUNT", "CONTAINER", "Azurite", "az_env", "az_url", "azurite", "azurite_command"]
