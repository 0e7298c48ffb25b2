"""The Hugging Face Hub's HTTP API on loopback for the tests: a folder served as one dataset repository.

Used as a pytest plugin (conftest's `pytest_plugins`). It answers what `huggingface_hub.HfFileSystem` asks of the
Hub to list and read a dataset (`hf://datasets/NS/NAME/...`): the repository at a revision
(`/api/datasets/NS/NAME[/revision/REV]`), a folder's tree (`/api/datasets/NS/NAME/tree/REV/PATH`, recursive or not),
paths' information (`POST .../paths-info/REV`) and a file's bytes (`/datasets/NS/NAME/resolve/REV/PATH`, with
`Range`, an `ETag` of its git blob id and the commit in `X-Repo-Commit`). Files are plain git blobs (no LFS or Xet
hash), so every read goes through `resolve`. A process reaches it through `HF_ENDPOINT`, which huggingface_hub reads
when it is imported: the tests run the command in a process of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from http_server import LoopbackHandler, StaticServer, ranged, serving

COMMIT = "c0ffee" + "0" * 34
_API = re.compile(r"^/api/datasets/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class HubServer(StaticServer):
    repo: str = "local/captions-test"   # "NS/NAME": `root` is this dataset repository's files

    def entry(self, relative: str) -> dict | None:
        """A path's tree entry as the Hub gives it, or None if the repository has no such path."""
        target = self.root / relative if relative else self.root
        if not target.exists():
            return None
        if target.is_dir():
            return {"type": "directory", "oid": hashlib.sha1(relative.encode()).hexdigest(), "path": relative}
        content = target.read_bytes()
        return {"type": "file", "oid": blob_id(content), "size": len(content), "path": relative}

    def children(self, relative: str, recursive: bool) -> list[dict]:
        folder = self.root / relative if relative else self.root
        found = folder.rglob("*") if recursive else folder.iterdir()
        return [self.entry(path.relative_to(self.root).as_posix()) for path in sorted(found)]


def blob_id(content: bytes) -> str:
    """What git names a file's content (the Hub's `oid` and `ETag` of a file not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class _HubHandler(LoopbackHandler):
    def answer(self, body: bool) -> None:
        hub = self.server.store
        parts = urlsplit(self.path)
        if (api := _API.match(parts.path)) is not None:
            repo, kind, _, path = api.groups()
            if repo != hub.repo:
                return self._json(404, {"error": "Repository not found"}, body, {"X-Error-Code": "RepoNotFound"})
            relative = unquote((path or "").lstrip("/"))
            if kind in (None, "revision"):   # the repository (at its default revision)
                files = sorted(p.relative_to(hub.root).as_posix() for p in hub.root.rglob("*") if p.is_file())
                return self._json(200, {"id": repo, "sha": COMMIT, "private": False,
                                        "siblings": [{"rfilename": name} for name in files]}, body)
            if kind == "tree":
                folder = hub.entry(relative)
                if folder is None or folder["type"] != "directory":
                    return self._json(404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
                recursive = parse_qs(parts.query).get("recursive", ["false"])[0].lower() in ("true", "1")
                return self._json(200, hub.children(relative, recursive), body)
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            entries = [hub.entry(unquote(path)) for path in form.get("paths", [])]
            return self._json(200, [entry for entry in entries if entry is not None], body)
        if (resolve := _RESOLVE.match(parts.path)) is not None and resolve.group(1) == hub.repo:
            target = hub.root / unquote(resolve.group(3))
            if not target.is_file():
                return self._json(404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
            return self._file(target.read_bytes(), body)
        self._json(404, {"error": "not found"}, body)

    def _file(self, content: bytes, body: bool) -> None:
        headers = {"ETag": f'"{blob_id(content)}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        status, part, extra = ranged(content, self.headers.get("Range"))
        self.send(status, part, body, {**headers, **extra})

    def _json(self, status: int, value: object, body: bool, headers: dict[str, str] | None = None) -> None:
        self.send(status, json.dumps(value).encode(), body, {"Content-Type": "application/json", **(headers or {})})


@contextlib.contextmanager
def hub_server(root: Path, repo: str = "local/captions-test") -> Iterator[HubServer]:
    """`root` served as the dataset repository `repo` at `.url` (an `HF_ENDPOINT`) until the block ends."""
    with serving(_HubHandler, lambda url: HubServer(root, url, repo=repo), "hf-hub") as hub:
        yield hub


@pytest.fixture
def hf_hub(tmp_path: Path) -> Iterator[HubServer]:
    """A Hub serving a fresh folder (`.root`) as one dataset repository."""
    root = tmp_path / "repo"
    root.mkdir()
    with hub_server(root) as hub:
        yield hub
