"""Azure Blob Storage on loopback for the tests: Azurite (`npm install -g azurite`) in a subprocess.

Used as a pytest plugin (conftest's `pytest_plugins`), as `s3_server` is. Azurite binds a port it picks and says
which; adlfs reaches it through `AZURE_STORAGE_CONNECTION_STRING` with Azurite's well-known development account
(public, documented by Microsoft: not a secret). Without Azurite installed the tests that use it fail, naming the
command that installs it (CI's `.ci/run` installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_READY = re.compile(rb"listens on (http://127\.0\.0\.1:\d+)")
_START_TIMEOUT_S = 60


@dataclass
class AzureServer:
    endpoint: str
    process: subprocess.Popen

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={self.endpoint}/{ACCOUNT};")

    def new_bucket(self) -> str:
        """A fresh, empty container (one per test)."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def upload(self, container: str, key: str, body: bytes) -> None:
        self.filesystem().pipe_file(f"{container}/{key}", body)

    def filesystem(self):  # noqa: ANN201 - adlfs is imported only here
        import adlfs

        return adlfs.AzureBlobFileSystem(connection_string=self.connection_string, skip_instance_cache=True)


@pytest.fixture(scope="session")
def azure_server() -> Iterator[AzureServer]:
    command = shutil.which("azurite-blob")
    if command is None:
        raise RuntimeError("Azurite is not installed: npm install -g azurite")
    process = subprocess.Popen([command, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
                                "--skipApiVersionCheck", "--disableTelemetry"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    timer = threading.Timer(_START_TIMEOUT_S, process.kill)
    timer.start()
    seen = b""
    endpoint = None
    try:
        for line in process.stdout:
            seen += line
            match = _READY.search(line)
            if match:
                endpoint = match.group(1).decode()
                break
    finally:
        timer.cancel()
    if endpoint is None:
        raise RuntimeError(f"Azurite did not start: {seen.decode('utf-8', 'replace')[-2000:]}")
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True, name="azurite-log").start()
    try:
        yield AzureServer(endpoint, process)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def azure(azure_server: AzureServer, monkeypatch: pytest.MonkeyPatch) -> AzureServer:
    """Azurite, made this process's Azure account (and that of the processes it starts)."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string)
    return azure_server
