"""An HTTP proxy in front of the local S3 server that fails on purpose: the transient faults of a real store.

Each request is passed on to the server unchanged, except the first `times` GETs whose path contains
`path_part`, which get the fault: "slow-down" answers 503 SlowDown (S3's throttling), "cut" sends the
headers and half the body, then drops the connection. `gets` records every GET seen (path, Range).
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class Fault:
    kind: str            # "slow-down" or "cut"
    path_part: str
    times: int = 1
    gets: list[tuple[str, str | None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def strikes(self, method: str, path: str, range_header: str | None) -> bool:
        """Record a GET; whether this request gets the fault."""
        if method != "GET":
            return False
        with self._lock:
            self.gets.append((path, range_header))
            if self.path_part in path and self.times > 0:
                self.times -= 1
                return True
        return False


@contextmanager
def flaky_proxy(upstream: str, fault: Fault) -> Iterator[str]:
    """A proxy to `upstream` (http://host:port) on a free loopback port, failing as `fault` says; yields its URL."""
    target = urlsplit(upstream)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:   # quiet
            pass

        def do_GET(self) -> None:
            self._relay()

        do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            struck = fault.strikes(self.command, self.path, self.headers.get("Range"))
            if struck and fault.kind == "slow-down":
                error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)
                return
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            try:
                headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                data = answer.read()
            finally:
                connection.close()
            self.send_response(answer.status)
            head = self.command == "HEAD"   # its Content-Length is the object's, with no body
            for name, value in answer.getheaders():
                if name.lower() not in _HOP_BY_HOP and (head or name.lower() != "content-length"):
                    self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if head:
                return
            if struck and fault.kind == "cut":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True   # the body ends early: the client sees a broken transfer
                return
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="flaky-proxy")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
