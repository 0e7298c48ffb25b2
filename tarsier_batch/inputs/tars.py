"""WebDataset tar shards: brace patterns, a header-only listing of a shard (cached), and a reader
that streams a shard once.

A shard is a local path or an fsspec URL (s3://bucket/x.tar). fsspec is imported only when a URL is
used, so local runs never pay for it. Listing reads tar headers alone: `tarfile` mode "r:" seeks
past member data, so a shard of large videos is listed with a few small reads, and the index
(member offsets, sizes and the text of small sibling members) is cached per shard version, so a
re-run over unchanged shards reads no tar at all. Members are read later by `ShardReader`, which
keeps one sequential stream per shard instead of one request per member.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import string
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from .. import storage
from ..errors import printable
from ..media import media_type_of

SIBLING_LIMIT = 2**20        # bigger siblings are not carried as text: they are payloads, not captions or labels
REOPEN_GAP = 8 * 2**20       # reading through a gap this small costs less than a new request
CHUNK = 2**20                # the unit of reading, and how often a stop request is noticed
_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)   # a broken shard stream is reopened after each
LIST_BLOCK = 64 * 2**10      # a listing reads a header and seeks on: small reads waste little
STREAM_BLOCK = 8 * 2**20
_CACHE_FORMAT = 1

_WDS_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")   # webdataset's base_plus_ext, verbatim
_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
_ESCAPED = re.compile(r"\\(.)")


class ShardError(Exception):
    """A shard that cannot be listed or read as its index says: not a tar, cut short, or changed."""


class ReadStopped(Exception):
    """A read given up because its stop event was set (the run is shutting down)."""


@dataclass(frozen=True)
class TarMember:
    """One regular file of a shard: where its bytes start in the tar, how many, and its mtime in seconds."""

    name: str
    offset_data: int
    size: int
    mtime: int


@dataclass(frozen=True)
class ShardIndex:
    """The regular-file members of a shard in tar order, and the small text siblings of its media members.

    `version` identifies the content listed (local: size and mtime; URL: the ETag when the store
    has one), so a reader can refuse a shard that changed since, and the cache can tell a stale index.
    """

    shard: str
    version: str
    members: tuple[TarMember, ...]
    siblings: dict[str, dict[str, str]]
    # Why the listing stopped before the shard's end (cut short, a damaged header): the members before are listed,
    # and the one cut (if its header was read) fails when it is read. None: listed to its end.
    problem: str | None = None


# ------------------------------------------------------------------------------------------------
# Names: brace patterns, WebDataset keys, member paths


def expand_braces(pattern: str) -> list[str]:
    """The names a WebDataset shard pattern stands for, as `braceexpand` (which WebDataset uses) expands them.

    Shard lists are written for WebDataset, so they must mean here what they mean there: `{00000..00099}`
    (zero-padded to the wider bound when a bound starts with 0; negative bounds, an optional `..step`,
    descending ranges), `{a..e}`, `{a,b}` alternatives, nested groups, several groups (cartesian product,
    left to right); a backslash escapes the next character. A group that is neither a range nor has a
    comma, such as `{a}`, stays as braces around its expanded content. Unlike `braceexpand`, every
    unbalanced brace raises ValueError (it lets a `}` that precedes a `{` through): such a pattern is a typo.
    """
    return [_ESCAPED.sub(r"\1", text) for text in _expand(pattern, pattern)]


def _expand(text: str, pattern: str) -> list[str]:
    parts: list[list[str]] = []
    depth = start = 0
    for pos, char in _unescaped(text):
        if char == "{":
            if depth == 0:
                parts.append([text[start:pos]])
                start = pos
            depth += 1
        elif char == "}":
            if depth == 0:
                raise ValueError(f"unbalanced braces in {pattern!r}: the '}}' at character {pos + 1} closes nothing")
            depth -= 1
            if depth == 0:
                parts.append(_expand_group(text[start + 1:pos], pattern))
                start = pos + 1
    if depth:
        raise ValueError(f"unbalanced braces in {pattern!r}: the '{{' at character {start + 1} is never closed")
    parts.append([text[start:]])
    return ["".join(product) for product in itertools.product(*parts)]


def _unescaped(text: str) -> Iterator[tuple[int, str]]:
    """(position, character) of each character that is not escaped by a backslash, nor a backslash itself."""
    pos = 0
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
            continue
        yield pos, text[pos]
        pos += 1


def _expand_group(body: str, pattern: str) -> list[str]:
    if match := _INT_RANGE.match(body):
        first, last, step = match.groups()
        padded = any(bound.startswith(("0", "-0")) for bound in (first, last) if bound not in ("0", "-0"))
        width = max(len(first), len(last)) if padded else 0
        return [str(n).zfill(width) for n in _steps(int(first), int(last), step)]
    if match := _CHAR_RANGE.match(body):
        first, last, step = match.groups()
        return [_LETTERS[n] for n in _steps(_LETTERS.index(first), _LETTERS.index(last), step)]
    alternatives = _alternatives(body)
    if len(alternatives) == 1:
        return ["{" + text + "}" for text in _expand(body, pattern)]
    return [text for alternative in alternatives for text in _expand(alternative, pattern)]


def _steps(first: int, last: int, step: str | None) -> range:
    size = int(step or 1) or 1   # braceexpand reads a step of 0 as 1
    return range(first, last + 1, size) if first <= last else range(first, last - 1, -size)


def _alternatives(body: str) -> list[str]:
    """`body` split at its commas outside nested groups."""
    pieces = []
    depth = start = 0
    for pos, char in _unescaped(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces.append(body[start:pos])
            start = pos + 1
    return pieces + [body[start:]]


def wds_key(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name by WebDataset's rule: `a/b.c.mp4` is key `a/b`, extension `c.mp4`.

    The key is everything before the first dot of the last path component, so the members that make
    up one sample are grouped the way WebDataset groups them. None when the name has no such dot.
    """
    match = _WDS_KEY.match(name)
    return (match.group(1), match.group(2)) if match else None


def member_path(shard: str, member: str) -> str:
    """The path that names one member of a shard in rows and messages."""
    return f"{shard}#{member}"


def split_member_path(path: str) -> tuple[str, str] | None:
    """(shard, member) of a `member_path`, or None if `path` names no tar member.

    The split is at the last `#` whose left part ends in `.tar`, so a file named `a#b.mp4` is not
    split, a shard whose path has a `#` is still found, and so is a member whose name has one.
    """
    pos = len(path)
    while (pos := path.rfind("#", 0, pos)) > 0:
        if path[:pos].lower().endswith(".tar") and pos + 1 < len(path):
            return path[:pos], path[pos + 1:]
    return None


# ------------------------------------------------------------------------------------------------
# Opening a shard and its version


def _local_version(facts: os.stat_result) -> str:
    return f"{facts.st_size}-{facts.st_mtime_ns}"


def shard_version(shard: str) -> str:
    """The shard's current version from one stat (local) or `fs.info` (URL), without reading the tar."""
    if not storage.is_url(shard):
        return _local_version(os.stat(shard))
    fs, path = storage.filesystem(shard)
    return storage.object_facts(storage.fresh_info(fs, path)).version


def _open_shard(shard: str, block_size: int) -> tuple[BinaryIO, str]:
    """An open binary file on the shard, and the version of the content that file reads."""
    if not storage.is_url(shard):
        stream: BinaryIO = open(shard, "rb")
        return stream, _local_version(os.fstat(stream.fileno()))
    fs, path = storage.filesystem(shard)
    stream = fs.open(path, "rb", block_size=block_size, cache_type="readahead")
    try:
        # A buffered fsspec file keeps the info it was opened with, and s3fs sends every read of it
        # with If-Match on that ETag: taking the version from it ties the version to the bytes read.
        details = getattr(stream, "details", None) or fs.info(path)
        return stream, storage.object_facts(details).version
    except BaseException:
        stream.close()
        raise


# ------------------------------------------------------------------------------------------------
# Listing, and the index cache


def default_cache_dir() -> Path:
    """Where shard indexes are cached: `tar-index` in the tool's cache (`storage.cache_home`)."""
    return storage.cache_home() / "tar-index"


def list_shard(shard: str, cache_dir: Path | None = None) -> ShardIndex:
    """The index of a shard, read from headers only, or from `cache_dir` when the shard is unchanged.

    Raises FileNotFoundError for a missing shard and ShardError for one that is not a tar at all; a shard cut
    short or damaged after its first member gives the members before (`ShardIndex.problem` says why), never cached.
    """
    version = shard_version(shard) if cache_dir is not None else storage.UNVERSIONED
    if version.startswith(storage.UNVERSIONED):   # a replaced shard of the same size would look unchanged
        return _read_index(shard)
    cached = _load_index(_cache_file(cache_dir, shard, version), shard, version)
    if cached is not None:
        return cached
    index = _read_index(shard)
    if index.problem is None:
        _store_index(_cache_file(cache_dir, shard, index.version), index)
    return index


def _read_index(shard: str) -> ShardIndex:
    # The version as `ShardReader` will ask for it (a store's HEAD and its file object may not agree: an http
    # server sends an ETag with one and not the other).
    stream, _ = _open_shard(shard, LIST_BLOCK)
    version = shard_version(shard)
    members: list[TarMember] = []
    texts: dict[str, dict[str, str]] = {}
    problem = None
    with stream:
        try:
            with tarfile.open(fileobj=stream, mode="r:") as tar:
                try:
                    _scan(tar, members, texts)
                except tarfile.TarError as error:
                    if not members:
                        raise
                    problem = f"cut short or damaged after member {printable(members[-1].name)!r} ({error})"
                end = tar.offset
        except tarfile.TarError as error:
            raise ShardError(f"{printable(shard)}: not a tar file, or cut short ({error})") from error
        if problem is None:
            problem = _damaged_end(stream, end)
    if problem is not None and not members:
        raise ShardError(f"{printable(shard)}: {problem}")
    return ShardIndex(shard, version, tuple(members), _siblings_of_media(members, texts), problem)


def _scan(tar: tarfile.TarFile, members: list[TarMember], texts: dict[str, dict[str, str]]) -> None:
    """Add the regular-file members in tar order to `members`, and the text of every small non-media member by key
    to `texts` (as they come: what came before a damaged header stays)."""
    for info in tar:
        # The data of a GNU sparse member is not the file's bytes, so it cannot be read by offset.
        if not info.isreg() or info.issparse():
            continue
        members.append(TarMember(info.name, info.offset_data, info.size, int(info.mtime)))
        key = wds_key(info.name)
        if key and media_type_of(info.name) is None and info.size <= SIBLING_LIMIT:
            text = _text_of(tar, info)
            if text is not None:
                texts.setdefault(key[0], {})[key[1]] = text


def _text_of(tar: tarfile.TarFile, info: tarfile.TarInfo) -> str | None:
    """The member as text, or None if it is binary (a NUL byte: no text file has one; npy, pickles do)."""
    reader = tar.extractfile(info)
    assert reader is not None, "a regular member always has data"
    data = reader.read()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def _damaged_end(stream: BinaryIO, end: int) -> str | None:
    """Why the listing stopped before the shard's end, if it did (None: a proper end).

    `tarfile` ends its iteration quietly at a bad header after the first one, which would drop the
    remaining members without a word. A proper end is the end of the file or zero blocks.
    """
    stream.seek(end)
    return f"a damaged or cut tar header at byte {end}" if stream.read(tarfile.BLOCKSIZE).strip(b"\0") else None


def _siblings_of_media(members: list[TarMember], texts: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The texts of keys that have a media member: only those become item columns, so only those are kept."""
    keys = {key[0] for member in members
            if media_type_of(member.name) is not None and (key := wds_key(member.name)) is not None}
    return {key: extensions for key, extensions in texts.items() if key in keys}


def _cache_file(cache_dir: Path, shard: str, version: str) -> Path:
    return cache_dir / f"{_sha256(shard)[:16]}-{_sha256(version)[:16]}.json"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _load_index(path: Path, shard: str, version: str) -> ShardIndex | None:
    """The cached index of this version, or None if there is none or it is unreadable (it is then rewritten)."""
    try:
        data = json.loads(path.read_text("utf-8"))
        if data["format"] != _CACHE_FORMAT or data["version"] != version:
            return None
        members = tuple(_member_from_json(row) for row in data["members"])
        siblings = {_string(key): _strings(extensions) for key, extensions in data["siblings"].items()}
        return ShardIndex(shard, version, members, siblings)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _member_from_json(row: Any) -> TarMember:
    name, offset_data, size, mtime = row
    if not all(type(number) is int for number in (offset_data, size, mtime)):
        raise TypeError(f"a cached member with a non-integer number: {row!r}")
    return TarMember(_string(name), offset_data, size, mtime)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a cached value is not a string: {value!r}")
    return value


def _strings(mapping: Any) -> dict[str, str]:
    return {_string(key): _string(value) for key, value in mapping.items()}


def _store_index(path: Path, index: ShardIndex) -> None:
    """Cache `index`. The shard's name is not stored (only its hash), as a URL may carry a credential.

    The cache only saves time, so a cache directory that cannot be written does not fail the listing.
    """
    data = {"format": _CACHE_FORMAT, "version": index.version,
            "members": [[m.name, m.offset_data, m.size, m.mtime] for m in index.members],
            "siblings": index.siblings}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, json.dumps(data))


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file renamed over `path`, so no reader sees a half-written index.

    No fsync: a file cut by a crash fails to load, and is listed and written again.
    """
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


# ------------------------------------------------------------------------------------------------
# Reading members


class ShardReader:
    """Reads members of one shard through one sequential stream, for members asked in tar order.

    A store charges per request and serves a long read far faster than many short ones, so members
    close behind each other are read through (the gap discarded), and only a member more than
    `REOPEN_GAP` ahead, or behind the stream, costs a new stream opened at its offset. `opens` counts
    the streams opened. Not thread-safe: one reader belongs to one thread.
    """

    def __init__(self, shard: str, version: str | None = None, stop: threading.Event | None = None) -> None:
        self.shard = shard
        self.version = version
        self.opens = 0
        self._stop = stop
        self._stream: BinaryIO | None = None
        self._position = 0

    def copy_to(self, member: TarMember, write: Callable[[memoryview], object]) -> None:
        """The member's bytes handed to `write` a chunk at a time (never all in this process's memory at once).
        Raises ReadStopped once `stop` is set, ShardError if the shard ends early or changed."""
        gap = member.offset_data - self._position
        if self._stream is None or not 0 <= gap <= REOPEN_GAP:
            self._reopen(member.offset_data)
        self._take(member.offset_data - self._position, member, None)
        self._take(member.size, member, write)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _reopen(self, offset: int) -> None:
        self.close()
        if storage.is_url(self.shard):
            # One streamed read from `offset` (for S3 a single GET, pinned to the version by If-Match,
            # so a shard replaced mid-read fails instead of mixing two versions' bytes).
            version = shard_version(self.shard)
            self._check_version(version)
            stream = storage.open_stream(self.shard, offset, version, STREAM_BLOCK)
        else:
            stream, version = _open_shard(self.shard, STREAM_BLOCK)
            try:
                self._check_version(version)
            except ShardError:
                stream.close()
                raise
            stream.seek(offset)
        self.opens += 1
        self._stream, self._position = stream, offset

    def _read_into(self, buffer: memoryview) -> int:
        """Read into `buffer`; a stream from a store that breaks (a dropped connection, a cut transfer) is opened
        again where it broke, after a pause, a few times."""
        for delay in _RETRY_DELAYS_S:
            assert self._stream is not None
            try:
                return self._stream.readinto(buffer)
            except Exception as error:  # noqa: BLE001 - only a transient error is tried again
                if not (storage.is_url(self.shard) and storage.is_transient(error)):
                    raise
            time.sleep(delay)   # backoff before asking the store again, not synchronisation
            self._reopen(self._position)
        assert self._stream is not None
        return self._stream.readinto(buffer)

    def _check_version(self, version: str) -> None:
        if self.version is not None and version != self.version:
            raise ShardError(f"{printable(self.shard)}: the shard changed since it was listed "
                             f"(version {self.version}, now {version}); list it again")

    def _take(self, count: int, member: TarMember, write: Callable[[memoryview], object] | None) -> None:
        """Read `count` bytes in chunks, checking `stop` before each, handing each to `write` (None: skip them)."""
        assert self._stream is not None
        view = memoryview(bytearray(min(CHUNK, count)))
        done = 0
        while done < count:
            if self._stop is not None and self._stop.is_set():
                raise ReadStopped(f"{printable(member_path(self.shard, member.name))}: read stopped")
            read = self._read_into(view[:min(CHUNK, count - done)])
            if not read:
                raise ShardError(f"{printable(self.shard)}: the shard ends at byte {self._position}, before the end "
                                 f"of member {printable(member.name)!r}; it was cut or changed since it was listed")
            if write is not None:
                write(view[:read])
            self._position += read
            done += read