"""A real S3 API on loopback for the tests: moto's server in a subprocess, on a port it picks itself.

Used as a pytest plugin (conftest's `pytest_plugins`). The server prints the port it bound on
stderr, so there is no race for a free port; its request log is drained by a thread (so the pipe
never fills) and kept, so that tests can count the requests a run made.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import pytest

import local_servers

# Static credentials for the local server, set before any fork server starts (its children keep the
# environment it started with). They are fake: moto accepts any.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key-id")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret-key")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

_READY = re.compile(rb"Running on (http://127\.0\.0\.1:\d+)")
_REQUEST = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")   # werkzeug colours some log lines (206, 404)


@dataclass
class S3Server(local_servers.Store):
    log: list[str] = field(default_factory=list)
    _logged: threading.Condition = field(default_factory=threading.Condition)

    def filesystem(self) -> Any:
        """A client of its own, with no listing cache: it sees what the runs wrote."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True, use_listings_cache=False)

    def new_bucket(self) -> str:
        """A fresh, empty bucket (one per test, so tests do not see each other's objects)."""
        import boto3

        name = f"test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name

    def requests(self, method: str, path_part: str) -> int:
        """How many `method` requests the server has answered whose path contains `path_part`.

        The server logs a request after answering it, on its own thread: a marker request sent now
        and seen in the log means the requests answered before it are logged too.
        """
        marker = f"/log-marker-{uuid.uuid4().hex}"
        with contextlib.suppress(urllib.error.URLError):
            urllib.request.urlopen(self.endpoint + marker, timeout=30).close()
        with self._logged:
            if not self._logged.wait_for(lambda: any(marker in line for line in self.log), timeout=30):
                raise AssertionError(f"the S3 server did not log {marker} within 30 s")
            lines = list(self.log)
        return sum(1 for line in lines for match in [_REQUEST.search(line)]
                   if match and match.group(1) == method and path_part in match.group(2))

    def _drain(self, log: IO[bytes]) -> None:
        for raw in log:
            with self._logged:
                self.log.append(_COLOUR.sub("", raw.decode("utf-8", "replace")))
                self._logged.notify_all()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    process, endpoint, log = local_servers.start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                                 _READY, "moto's S3 server", stream="stderr")
    server = S3Server(endpoint, process)
    threading.Thread(target=server._drain, args=(log,), daemon=True, name="moto-log").start()
    try:
        yield server
    finally:
        local_servers.stop(process)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The local S3 server, made this process's endpoint (and that of the processes it starts)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    return s3_server
