"""Starting and stopping the tests' local store servers: subprocesses on loopback that pick their own port and say
which (so there is no race for a free port), each in its own session so that stopping it stops its children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

_START_TIMEOUT_S = 60


@dataclass
class Store:
    """A store server the tests reach through fsspec: a fresh bucket per test, objects put in it."""

    endpoint: str
    process: subprocess.Popen

    def filesystem(self) -> Any:
        """A new fsspec filesystem of the server (not fsspec's cached instance, which may hold another's settings)."""
        raise NotImplementedError

    def new_bucket(self) -> str:
        """A fresh, empty bucket or container (one per test, so tests do not see each other's objects)."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def upload(self, bucket: str, key: str, body: bytes) -> None:
        self.filesystem().pipe_file(f"{bucket}/{key}", body)


def start(command: list[str], ready: re.Pattern[bytes], name: str, stream: str = "stdout"
          ) -> tuple[subprocess.Popen, str, IO[bytes]]:
    """Run `command` and wait (a minute at most) for a line of its `stream` ("stdout", with stderr merged into it,
    or "stderr") matching `ready`, whose first group is the server's URL. Returns the process, the URL and the
    stream, which the caller must keep draining (`discard`) so that the server never blocks on a full pipe."""
    outputs = ({"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if stream == "stdout"
               else {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE})
    process = subprocess.Popen(command, start_new_session=True, **outputs)
    pipe = process.stdout if stream == "stdout" else process.stderr
    timer = threading.Timer(_START_TIMEOUT_S, process.kill)
    timer.start()
    seen = b""
    try:
        for line in pipe:
            seen += line
            match = ready.search(line)
            if match:
                return process, match.group(1).decode(), pipe
    finally:
        timer.cancel()
    raise RuntimeError(f"{name} did not start: {seen.decode('utf-8', 'replace')[-2000:]}")


def discard(pipe: IO[bytes], name: str) -> None:
    """Drain what a server writes from now on, on a daemon thread."""
    threading.Thread(target=lambda: [None for _ in pipe], daemon=True, name=f"{name}-log").start()


def stop(process: subprocess.Popen) -> None:
    """Stop the server and its children: SIGTERM to its session, SIGKILL if it has not gone within 10 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def running(command: list[str], ready: re.Pattern[bytes], name: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`start`ed (its output discarded) for the block, then `stop`ped: the process and the server's URL."""
    process, url, log = start(command, ready, name)
    discard(log, name)
    try:
        yield process, url
    finally:
        stop(process)
