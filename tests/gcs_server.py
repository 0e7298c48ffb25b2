"""A Google Cloud Storage JSON API on loopback for the tests: gcp-storage-emulator in a subprocess.

Used as a pytest plugin (conftest's `pytest_plugins`), as `s3_server` is. The emulator binds a port it picks and
the small script below prints it, so there is no race for a free port. gcsfs finds it through
`STORAGE_EMULATOR_HOST` (and then sends no credentials). What the emulator lacks, against the real service:
preconditions (`ifGenerationMatch`: a create-only write overwrites), so the output lock's conditional writes are not
tested here.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import local_servers

# gcsfs first asks, over gRPC, whether a bucket is hierarchical or zonal; an emulator has no gRPC endpoint and each
# call would wait out a 60 s timeout. Set before any fork server starts (its children keep its environment).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# The emulator's command line does not say which port it took when given 0: this asks its server object.
_SERVE = """
import time
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", 0, in_memory=True)
server.start()
print("http://127.0.0.1:%d" % server._api._httpd.server_address[1], flush=True)
while True:
    time.sleep(3600)
"""
_READY = re.compile(rb"^(http://127\.0\.0\.1:\d+)$")


class GCSServer(local_servers.Store):
    def filesystem(self) -> Any:
        import gcsfs  # only here: the plugin loads before the tests' imports

        return gcsfs.GCSFileSystem(endpoint_url=self.endpoint, token="anon", skip_instance_cache=True)


@contextlib.contextmanager
def serve() -> Iterator[GCSServer]:
    """The emulator, started for the block (the tests' session fixture; the benchmarks)."""
    with local_servers.running([sys.executable, "-c", _SERVE], _READY, "gcp-storage-emulator") as (process, url):
        yield GCSServer(url, process)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    with serve() as server:
        yield server


@pytest.fixture
def gcs(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> GCSServer:
    """The local GCS emulator, made this process's endpoint (and that of the processes it starts)."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return gcs_server
