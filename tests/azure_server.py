"""Azure Blob Storage on loopback for the tests: Azurite (`npm install -g azurite`) in a subprocess.

Used as a pytest plugin (conftest's `pytest_plugins`), as `s3_server` is. Azurite binds a port it picks and says
which; adlfs reaches it through `AZURE_STORAGE_CONNECTION_STRING` with Azurite's well-known development account
(public, documented by Microsoft: not a secret). Without Azurite installed the tests that use it fail, naming the
command that installs it (CI's `.ci/run` installs it).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

import local_servers

ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_READY = re.compile(rb"listens on (http://127\.0\.0\.1:\d+)")


class AzureServer(local_servers.Store):
    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={self.endpoint}/{ACCOUNT};")

    def filesystem(self) -> Any:
        import adlfs  # only here: the plugin loads before the tests' imports

        return adlfs.AzureBlobFileSystem(connection_string=self.connection_string, skip_instance_cache=True)


@contextlib.contextmanager
def serve() -> Iterator[AzureServer]:
    """Azurite, started for the block (the tests' session fixture; the benchmarks)."""
    command = shutil.which("azurite-blob")
    if command is None:
        raise RuntimeError("Azurite is not installed: npm install -g azurite")
    with local_servers.running([command, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
                                "--skipApiVersionCheck", "--disableTelemetry"], _READY, "Azurite") as (process, url):
        yield AzureServer(url, process)


@pytest.fixture(scope="session")
def azure_server() -> Iterator[AzureServer]:
    with serve() as server:
        yield server


@pytest.fixture
def azure(azure_server: AzureServer, monkeypatch: pytest.MonkeyPatch) -> AzureServer:
    """Azurite, made this process's Azure account (and that of the processes it starts)."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string)
    return azure_server
