"""Objects at URLs (s3://, gs://, az://, hf://, http(s)://) through fsspec: naming, listing, reading, retrying.

This is the only module that talks to fsspec, and it imports it lazily: a run over local files
never pays for it. Credentials come from where each backend looks (environment, profiles,
instance roles) and are never part of what we store or print: every URL we show or keep goes
through `redact`, and filesystems are rebuilt from the URL in each process, never pickled (a
pickled filesystem built with a key carries the key).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import io
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .version import install_extra_command

T = TypeVar("T")

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
READ_ONLY_SCHEMES = frozenset({"http", "https", "hf"})
# The optional extra that brings each scheme's fsspec backend (hf:// needs none: huggingface_hub is a dependency).
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "http": "http", "https": "http"}
# Query parameters that carry a signature or a token (S3/GCS presigned URLs, Azure SAS, generic tokens).
# Query parameters of a signature or a token (S3 and GCS presigned URLs, an Azure SAS, generic tokens and keys), and
# the ones that change each time a URL is signed again (dates, expiry), so that a row's path stays the same. Names
# that merely contain "key" (an object id) are not among them: two objects must not share a row.
_SECRET_PARAMETER = re.compile(r"^(x-amz-.*|x-goog-.*|awsaccesskeyid|signature|sig|se|st|skoid|sktid|skt|ske|sks|skv|"
                               r"expires|policy|key-pair-id|.*token|.*secret|.*password|.*credential|api_?key|"
                               r"access_?key|auth|authorization)$", re.IGNORECASE)
# Store configuration that is not secret (endpoints, regions), which other machines of a cluster may be given.
_SHARED_ENVIRONMENT = re.compile(r"^(AWS_ENDPOINT_URL(_[A-Z0-9_]+)?|AWS_REGION|AWS_DEFAULT_REGION|HF_ENDPOINT|"
                                 r"STORAGE_EMULATOR_HOST)$")
# Every variable the stores' libraries read, credentials included: what this process's own children must see. They
# come from a fork server that keeps the environment it started with, so a variable set later (by a program using
# the Python API, or a test's local server) is passed on explicitly, through a pipe, never stored or printed.
_STORE_ENVIRONMENT = re.compile(r"^(AWS_|AZURE_|GOOGLE_|GCSFS_|HF_|STORAGE_EMULATOR_HOST$)")
_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
_INFO_REQUESTS = 8   # objects asked for their facts at once, where a listing lacks them
# Store answers worth another try: throttling and server-side failures (HTTP 5xx, 429, timeouts).
_TRANSIENT_CODES = frozenset({"500", "502", "503", "504", "429", "InternalError", "ServiceUnavailable", "SlowDown",
                              "RequestTimeout", "RequestTimeTooSkewed", "Throttling", "ThrottlingException",
                              "TooManyRequests"})
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                               errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN})
_TRANSIENT_TYPES = ("ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
                    "ServerTimeoutError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteRead", "ProtocolError")
UNVERSIONED = "unversioned-size-"   # a version that cannot tell two contents of the same size apart
_MTIME_KEYS = ("LastModified", "last_modified", "mtime", "updated", "created")   # as fsspec backends name it
SPILL_TO_DISK_BYTES = int(os.environ.get("TARSIER_SPOOL_BYTES", 512 * 2**20))


class StorageError(Exception):
    """A URL that cannot be used as asked: an unknown scheme, a backend not installed, a read-only store."""


@dataclass(frozen=True)
class ObjectFacts:
    """What identifies an object's content across runs: its size and a version (the ETag, or else the mtime)."""

    size_bytes: int | None
    version: str
    mtime_ns: int | None = None


def cache_home() -> Path:
    """Where every cache of the tool lives (built-in models, shard indexes, staged outputs, scene cuts):
    $TARSIER_BATCH_CACHE, else $XDG_CACHE_HOME/tarsier-batch (an absolute one, as the XDG spec asks), else
    ~/.cache/tarsier-batch."""
    explicit = os.environ.get("TARSIER_BATCH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base and os.path.isabs(base) else Path.home() / ".cache") / "tarsier-batch"


def is_url(text: str) -> bool:
    """Whether `text` names an object in a store rather than a local path (file:// is a local path)."""
    match = _SCHEME.match(text)
    return match is not None and match.group(1).lower() != "file"


def scheme(url: str) -> str:
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def redact(url: str) -> str:
    """`url` without what grants access: user:password@ and signature or token query parameters.

    Signed values are replaced, not dropped, so the URL still shows they were there; the result
    stays the same when a URL is signed again, so a resumed run recognises its rows.
    """
    if not is_url(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = parts.query
    if query and scheme(url) in ("http", "https"):
        query = urlencode([(name, "REDACTED" if _SECRET_PARAMETER.match(name) else value)
                           for name, value in parse_qsl(query, keep_blank_values=True)], safe="/:")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """`text` (an error message) with every URL in it redacted."""
    return re.sub(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+", lambda match: redact(match.group(0)), text)


def url_name(url: str) -> str:
    """The object's name: the last path component, without query or fragment."""
    return urlsplit(url).path.rstrip("/").rpartition("/")[2]


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem that serves `url` and the path within it.

    A scheme whose backend is not installed raises StorageError naming the extra to install.
    """
    import fsspec.core

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as error:
        extra = EXTRAS.get(scheme(url))
        hint = f": {install_extra_command(extra)}" if extra else ""
        raise StorageError(f"{scheme(url)}:// needs a storage backend that is not installed{hint}") from error
    except ValueError as error:
        raise StorageError(f"{redact(url)}: {error}") from error


def environment(credentials: bool = False) -> dict[str, str]:
    """The store settings of this process that other processes must see: endpoints and regions, for other machines;
    with `credentials`, everything the stores' libraries read, for this process's own children on this machine."""
    pattern = _STORE_ENVIRONMENT if credentials else _SHARED_ENVIRONMENT
    return {name: value for name, value in os.environ.items() if pattern.match(name)}


def is_transient(error: BaseException) -> bool:
    """Whether trying again may succeed: a dropped connection, a timeout, throttling or a server-side failure."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        if type(current).__name__ in _TRANSIENT_TYPES:
            return True
        response = getattr(current, "response", None)   # botocore's ClientError
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _TRANSIENT_CODES or status in _TRANSIENT_CODES:
                return True
        status = getattr(current, "status", None)   # aiohttp (http(s)://)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        current = current.__cause__ or current.__context__
    return False


def with_retries(call: Callable[[], T], delays_s: tuple[float, ...] = _RETRY_DELAYS_S) -> T:
    """`call()`, tried again after each delay while it fails with a transient error."""
    for delay in delays_s:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - anything not transient is raised at once
            if not is_transient(error):
                raise
        time.sleep(delay)   # backoff between tries of a real store, not synchronisation
    return call()


def object_facts(info: dict[str, Any]) -> ObjectFacts:
    """Size and version from an fsspec `info()`/`find(detail=True)` entry (backends name them differently)."""
    size = info.get("size")
    # The store's content id: S3's and Azure's ETag, GCS's MD5 (its ETag also changes with metadata), the Hub's LFS
    # hash or git blob id.
    lfs = info.get("lfs") if isinstance(info.get("lfs"), dict) else {}
    etag = info.get("md5Hash") or info.get("ETag") or info.get("etag") or lfs.get("sha256") or info.get("blob_id")
    modified = next((info[key] for key in _MTIME_KEYS if info.get(key) is not None), None)
    mtime_ns = None
    if hasattr(modified, "timestamp"):
        mtime_ns = round(modified.timestamp() * 1e9)
    elif isinstance(modified, (int, float)):
        mtime_ns = round(modified * 1e9)
    # The content id (quotes stripped, as S3 quotes an ETag) or, from a store without one, size and mtime; with
    # neither id nor mtime (some web servers), nothing that would tell a replaced object of the same size.
    if etag:
        version = str(etag).strip('"')
    else:
        version = f"{size}-{mtime_ns}" if mtime_ns is not None else f"{UNVERSIONED}{size}"
    return ObjectFacts(int(size) if size is not None else None, version, mtime_ns)


def stat_url(url: str) -> ObjectFacts | None:
    """The facts of the object at `url`; None if there is none (a folder-like prefix is not an object, nor is a
    web folder: an http(s) URL whose path ends in '/', which answers with its index page)."""
    if scheme(url) in ("http", "https") and urlsplit(url).path.endswith("/"):
        return None
    fs, path = filesystem(url)
    try:
        info = with_retries(lambda: fresh_info(fs, path))
    except FileNotFoundError:
        return None
    if info.get("type") == "directory":
        return None
    return object_facts(info)


def fresh_info(fs: Any, path: str) -> dict[str, Any]:
    """`fs.info(path)` asked of the store, not of the filesystem's listing cache (which never expires: a long-lived
    process would keep an object's old version)."""
    fs.invalidate_cache(path)
    return fs.info(path)


def list_objects(url: str, recursive: bool = True) -> list[tuple[str, ObjectFacts]] | None:
    """The objects under the prefix `url`, as (url, facts), sorted; None if `url` lists nothing.

    A prefix behaves like a folder: it matches whole path components only (`clips` lists
    `clips/a.mp4`, not `clips2/b.mp4`), and objects whose path below it has a component that
    starts with '.' are hidden, as hidden files are in a local folder. Glob patterns
    (`s3://b/**/*.mp4`) list what they match.
    """
    import fsspec.core

    fs, path = filesystem(url)
    protocol = scheme(url)
    if fsspec.core.has_magic(path):
        found = with_retries(lambda: fs.glob(path, detail=True))
        base = path[:re.search(r"[*?\[]", path).start()].rpartition("/")[0]
    else:
        base = path.rstrip("/")
        found = with_retries(lambda: fs.find(base, detail=True, maxdepth=None if recursive else 1))
    kept = {}
    for key, info in found.items():
        if info.get("type") == "directory" or key.endswith("/"):
            continue
        below = key[len(base):].lstrip("/") if key.startswith(base) else key
        if any(part.startswith(".") for part in below.split("/")):
            continue
        kept[key] = info
    # A web folder's index page names its files, not their sizes or ETags: each is asked for them (HEAD), several
    # at a time, so that a resumed run can tell a replaced file from the one it captioned.
    unsized = [key for key, info in kept.items() if info.get("size") is None]
    if unsized:
        with concurrent.futures.ThreadPoolExecutor(_INFO_REQUESTS) as pool:
            kept.update(zip(unsized, pool.map(lambda key: with_retries(lambda: fresh_info(fs, key)), unsized)))
    return sorted((_url_of(fs, protocol, key), object_facts(info)) for key, info in kept.items()) or None


def _url_of(fs: Any, protocol: str, path: str) -> str:
    unstripped = fs.unstrip_protocol(path)
    return unstripped if unstripped.startswith(protocol + "://") else f"{protocol}://{path}"


class _S3Stream(io.RawIOBase):
    """One GET of an S3 object from an offset, read as the bytes arrive (s3fs's own files send a ranged GET per
    block instead). Pinned to `etag` with If-Match: a changed object fails rather than mixing two versions."""

    def __init__(self, fs: Any, path: str, start: int, etag: str | None):
        import fsspec.asyn

        self._sync = fsspec.asyn.sync
        self._fs = fs
        bucket, key, version_id = fs.split_path(path)
        request: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-"}
        if etag:
            request["IfMatch"] = f'"{etag}"'
        if version_id:
            request["VersionId"] = version_id
        response = self._sync(fs.loop, fs._call_s3, "get_object", **request)
        self._body = response["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._sync(self._fs.loop, self._body.read, len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            # On fsspec's event loop, where the connection lives (aiohttp is not thread-safe).
            with contextlib.suppress(Exception):
                self._sync(self._fs.loop, self._body.aclose)
        super().close()


def open_stream(url: str, start: int = 0, version: str | None = None, block_bytes: int = 8 * 2**20) -> BinaryIO:
    """The object at `url` from byte `start`, read front to back: for S3 one streamed GET (pinned to `version`, its
    ETag, when given); for other stores fsspec's file with `block_bytes` of read-ahead (a ranged read per block)."""
    fs, path = filesystem(url)
    if scheme(url) in ("s3", "s3a") and hasattr(fs, "_call_s3"):
        return io.BufferedReader(_S3Stream(fs, path, start, version), buffer_size=2**20)
    stream = fs.open(path, "rb", block_size=block_bytes, cache_type="readahead")
    stream.seek(start)
    return stream


class Spooled:
    """An unnamed file holding an object's bytes, open as a path (`/proc/PID/fd/N`) that decoders can open.

    Small objects live in memory (`memfd_create`), bigger ones in an unnamed file on disk
    (`O_TMPFILE` in $TMPDIR). Neither has a name on disk, so the kernel frees it when the last
    descriptor closes, also when the process is killed: nothing is left to clean up.
    """

    def __init__(self, size_hint: int | None, name: str = "tarsier-object"):
        self.fd = _unnamed_file(size_hint, name)
        # By process id, not /proc/self: a child process (a decoder under a timeout) can open it too.
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def truncate(self) -> None:
        """Empty it (a retried download starts again)."""
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Spooled":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _unnamed_file(size_hint: int | None, name: str) -> int:
    if (size_hint or 0) <= SPILL_TO_DISK_BYTES and hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    directory = tempfile.gettempdir()
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):   # no O_TMPFILE (this filesystem or platform): unlink at once instead
        descriptor, path = tempfile.mkstemp(prefix=".tarsier-", dir=directory)
        os.unlink(path)
        return descriptor


def fetch(url: str, size_hint: int | None = None, chunk_bytes: int = 4 * 2**20) -> Spooled:
    """The object at `url`, downloaded (one streaming read, tried again on transient errors) into a `Spooled`.

    A missing object raises FileNotFoundError; any other failure the backend's error.
    """
    fs, path = filesystem(url)
    spooled = Spooled(size_hint, url_name(url)[:200] or "tarsier-object")

    def download() -> None:
        spooled.truncate()
        with fs.open(path, "rb", block_size=chunk_bytes, cache_type="none") as remote:
            while chunk := remote.read(chunk_bytes):
                spooled.write(chunk)

    try:
        with_retries(download)
    except BaseException:
        spooled.close()
        raise
    return spooled
