"""A static web server on loopback for the tests, as object stores and CDNs serve files over http(s)://.

It serves a folder: an HTML index of links for a folder (what fsspec's HTTP filesystem lists), and for a file
its bytes with `Content-Length`, a strong `ETag` (a digest of the content, so a file replaced by one of the same
size and time is told apart), `Accept-Ranges: bytes`, `Range` requests (206, or 416 past the end) and `If-Match`
(412 when the file changed). Each request is recorded before it is answered, so once a client has its answer the
request is counted (`requests`), with no log to wait for. The `http_store` fixture for tests, `web_server` for the
benchmarks.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class StaticServer:
    root: Path
    url: str
    log: list[tuple[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def requests(self, method: str, path_part: str) -> int:
        """How many `method` requests whose path contains `path_part` the server has had."""
        with self._lock:
            return sum(1 for seen, path in self.log if seen == method and path_part in path)

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.log.append((method, path))


class LoopbackHandler(BaseHTTPRequestHandler):
    """What the tests' web servers share: HTTP/1.1 keep-alive, no log lines, each request recorded in the server's
    store before `answer` answers it (with or without a body: HEAD)."""

    protocol_version = "HTTP/1.1"   # keep-alive, as real servers answer
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._handle(body=False)

    def do_GET(self) -> None:
        self._handle(body=True)

    def do_POST(self) -> None:
        self._handle(body=True)

    def _handle(self, body: bool) -> None:
        self.server.store.record(self.command, self.path)
        self.answer(body)

    def answer(self, body: bool) -> None:
        raise NotImplementedError

    def send(self, status: int, content: bytes, body: bool, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if body:
            self.wfile.write(content)


class _StaticHandler(LoopbackHandler):
    def answer(self, body: bool) -> None:
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        target = (self.server.store.root / relative).resolve()
        if not target.is_relative_to(self.server.store.root.resolve()) or not target.exists():
            return self.send(404, b"not found", body)
        if target.is_dir():
            names = [child.name + ("/" if child.is_dir() else "") for child in sorted(target.iterdir())]
            links = "".join(f'<a href="{html.escape(name)}">{html.escape(name)}</a>\n' for name in names)
            return self.send(200, f"<html><body>\n{links}</body></html>\n".encode(), body,
                              {"Content-Type": "text/html"})
        content = target.read_bytes()
        etag = f'"{hashlib.sha256(content).hexdigest()[:32]}"'
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() not in ("*", etag):
            return self.send(412, b"precondition failed", body, {"ETag": etag})
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        status, part, extra = ranged(content, self.headers.get("Range"))
        self.send(status, part, body, {**headers, **extra})

def ranged(content: bytes, asked: str | None) -> tuple[int, bytes, dict[str, str]]:
    """What a server honouring `Range: bytes=A-B` answers for `content`: 206 and the range, 416 past its end, or
    200 and all of it (no range, or one it does not serve, as HTTP allows)."""
    match = _RANGE.match(asked.strip()) if asked is not None else None
    if match is None:
        return 200, content, {}
    first = int(match.group(1))
    last = min(int(match.group(2)) if match.group(2) else len(content) - 1, len(content) - 1)
    if first >= len(content):
        return 416, b"", {"Content-Range": f"bytes */{len(content)}"}
    return 206, content[first:last + 1], {"Content-Range": f"bytes {first}-{last}/{len(content)}"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: StaticServer


@contextlib.contextmanager
def serving(handler: type[LoopbackHandler], store: Callable[[str], StaticServer], name: str) -> Iterator[Any]:
    """A server on a port of loopback it picks, answering with `handler`, its store made by `store(url)`."""
    server = _Server(("127.0.0.1", 0), handler)
    server.store = store(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True, name=name)
    thread.start()
    try:
        yield server.store
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def web_server(root: Path) -> Iterator[StaticServer]:
    """A web server serving `root` at `.url` (no trailing slash) until the block ends."""
    with serving(_StaticHandler, lambda url: StaticServer(root, url), "http-store") as store:
        yield store


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[StaticServer]:
    """A web server serving a fresh folder (`.root`)."""
    root = tmp_path / "served"
    root.mkdir()
    with web_server(root) as store:
        yield store
