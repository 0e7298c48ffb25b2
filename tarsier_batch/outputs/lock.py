"""One run at a time per output: an advisory lock file beside `--out`, or a leased lock object beside a URL."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from ..errors import Worded
from ..storage import filesystem, redact, with_retries

LEASE_ENV = "TARSIER_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0
MIN_LEASE_S = 1.0
_ATTEMPTS = 3   # to take a lock whose object changes under us (its holder finishing, another run taking it over)
_JOIN_TIMEOUT_S = 10.0
_READER_WAIT_S = 0.001   # a reader holds the lock for two system calls: a run meeting one tries again this soon
# The locks this process holds, by lock file. On NFS, Linux emulates flock with POSIX locks, which belong to the
# process: a shared lock taken and dropped here on another descriptor would drop this process's own lock.
_HELD_HERE: set[Path] = set()


class OutputLockedError(Exception):
    """Another live run holds the lock of this output."""


class OutputLock:
    """An exclusive `flock` on `.<out>.lock`, holding who took it (for the message a second run shows).

    The kernel drops the lock when its process dies, however it dies (even `kill -9`), so a
    lock file left by a dead run is simply taken over: no pid guessing. On NFS, Linux maps
    `flock` to NFS locks, which the server releases when a dead client's lease expires, so a
    lock left by a crashed host is taken over once its lease has run out.
    """

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if _only_readers(fd):   # a reader asking `holder` this instant, not a run: its lock is gone at once
                    os.close(fd)
                    time.sleep(_READER_WAIT_S)
                    continue
                holder = _named_holder(fd)
                os.close(fd)
                raise OutputLockedError(Worded("another run is writing {path} ({holder}); wait for it to finish or "
                                               "use another {out}", path=self.out, holder=holder)) from None
            if _same_file(fd, self.path):
                break
            # The holder finished and removed the file between our open and our lock: the lock we
            # hold is on a deleted file that a newer run cannot see. Start over on the path.
            os.close(fd)
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        self._fd = fd
        _HELD_HERE.add(self.path.resolve())

    def holder(self) -> str | None:
        """The live run holding this lock, as it named itself; None if no process holds it. Read without creating
        the lock file and without waiting: a shared lock taken and dropped at once (a run taking the lock in that
        instant waits it out, see `acquire`). This process's own lock is named without touching it."""
        if self.path.resolve() in _HELD_HERE:
            return f"pid {os.getpid()} on {socket.gethostname()} (this process)"
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _named_holder(fd)
        finally:
            os.close(fd)   # drops the shared lock, if taken
        return None

    def release(self) -> None:
        """Remove the lock file while still holding it, so that no run can lock a deleted file."""
        if self._fd is None:
            return
        _HELD_HERE.discard(self.path.resolve())
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def _named_holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"


def _only_readers(fd: int) -> bool:
    """Whether the lock `fd` could not take exclusively is held shared only (by `holder`'s readers): a run holds
    it exclusively, so a shared lock is refused then. The shared lock taken here is dropped with `fd`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


class RemoteLock:
    """One run at a time per output at a URL: an object `.<name>.tarsier.lock` beside it, created only if absent.

    No store lock dies with its process, so the object carries a lease: its body (JSON) names the
    holder and when the lease ends, and a daemon thread renews it every third of the lease. A run
    that dies (even by `kill -9`) stops renewing, and the next run takes the lock over once the lease
    has run out. Creating is create-only (S3 `If-None-Match: *`) and every later write is conditional on
    the ETag last seen (S3 `If-Match`, Azure's ETag condition), so of two runs that find the same expired
    lease only one takes it, and a holder whose lease was taken over while it was paused learns it
    (`check`) instead of overwriting the new holder's work. gcsfs has no conditional replace: there each
    write looks at the version first (`_look_then_write`, best effort). Expiry is judged on this host's
    clock against the holder's: keep clocks in sync (NTP).
    """

    def __init__(self, url: str, lease_s: float | None = None):
        self.fs, path = filesystem(url)
        parent, _, name = path.rstrip("/").rpartition("/")
        self.path = f"{parent}/.{name}.tarsier.lock"
        self.shown = redact(url)
        # At least a second: renewing every third of it must not spin.
        self.lease_s = max(MIN_LEASE_S, lease_s or float(os.environ.get(LEASE_ENV) or DEFAULT_LEASE_S))
        self.taken_over: str | None = None   # the holder whose expired lease this lock took over
        self.lost: str | None = None         # why the lock is no longer ours (taken over while we held it)
        self._etag: str | None = None
        self._since = ""
        self._token = ""   # what tells our lock body from any other (set when acquiring)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise OutputLockedError naming the live holder."""
        self._since = time.strftime("%Y-%m-%d %H:%M:%S")
        self._token = uuid.uuid4().hex
        for _ in range(_ATTEMPTS):
            try:
                self._etag = self._write(create=True)
                break
            except FileExistsError:
                pass
            try:
                body, etag = self._read()
            except FileNotFoundError:   # released between our create and our read
                continue
            if self._is_ours(body):   # our create had landed, its answer was lost and the retry was refused
                self._etag = etag
                break
            if float(body.get("lease_until", 0)) > time.time():
                raise OutputLockedError(f"another run is writing {self.shown} ({_holder(body)}); wait for it to "
                                        f"finish or use another output")
            try:
                self._etag = self._write(if_match=etag)
            except Exception as error:  # noqa: BLE001 - each backend's own error type: only a lost race goes on
                if not _lost_race(error):
                    raise
                continue   # another run took it over first: look again
            self.taken_over = _holder(body)
            break
        else:
            raise OutputLockedError(f"another run is taking {self.shown}; try again")
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="tarsier-lock-lease")
        self._renewer.start()

    def check(self) -> None:
        """Raise OutputLockedError if another run took the lock over (our lease ran out unrenewed)."""
        if self.lost is not None:
            raise OutputLockedError(self.lost)

    def release(self) -> None:
        """Stop renewing and delete the object (unless another run holds it now)."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join(_JOIN_TIMEOUT_S)
        self._renewer = None
        if self.lost is None:
            # Only our own lock: if the lease was taken over since the last renewal, the object is the new holder's.
            try:
                body, _ = self._read()
            except FileNotFoundError:
                return
            if self._is_ours(body):
                with_retries(lambda: self.fs.rm_file(self.path))

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._etag = self._write(if_match=self._etag)
                continue
            except Exception as error:  # noqa: BLE001 - this thread must outlive a failed request
                if not _lost_race(error) and not _gone(error):
                    continue   # a store that failed to answer: the next renewal may, well within the lease
            try:
                body, etag = self._read()
            except FileNotFoundError:
                body, etag = {}, ""
            except Exception:  # noqa: BLE001
                continue
            if self._is_ours(body):   # a retried write that had landed: the lease is ours, at its new ETag
                self._etag = etag
                continue
            self.lost = (f"the lock of {self.shown} was taken over by {_holder(body) if body else 'another run'} "
                         f"(this run's lease of {self.lease_s:g} s ran out unrenewed); the output was not written")
            return

    def _write(self, create: bool = False, if_match: str | None = None) -> str:
        """Write our body: only if there is no lock (`create`), or only over the version `if_match`; the new ETag."""
        body = {"pid": os.getpid(), "host": socket.gethostname(), "since": self._since, "token": self._token,
                "lease_s": self.lease_s, "lease_until": time.time() + self.lease_s}
        data = json.dumps(body).encode()
        if not _writes_conditionally(self.fs):
            return self._look_then_write(data, create, if_match)
        condition = {"mode": "create"} if create else _if_match(self.fs, if_match or "")
        answer = with_retries(lambda: self.fs.pipe_file(self.path, data, **condition))
        return _etag(answer or {})

    def _look_then_write(self, data: bytes, create: bool, if_match: str | None) -> str:
        """`_write` where the store's library offers no conditional replace (gcsfs): the object's version is looked
        at, then written over if it is the one expected. Best effort: two runs that look within the same moment
        could both write; a holder's renewals still find a successor's lock and give up."""
        try:
            current: str | None = _etag(with_retries(lambda: self.fs.info(self.path, refresh=True)))
        except FileNotFoundError:
            current = None
        if (current is not None) if create else (current != if_match):
            raise FileExistsError(self.path)
        with_retries(lambda: self.fs.pipe_file(self.path, data))
        return _etag(with_retries(lambda: self.fs.info(self.path, refresh=True)))

    def _is_ours(self, body: dict[str, Any]) -> bool:
        return body.get("token") == self._token   # not pid and time: two locks of one process may share them

    def _read(self) -> tuple[dict[str, Any], str]:
        """The lock's body and ETag. The ETag is read first: the body is then as new as it or newer, and a
        newer body is a fresh lease (every write renews), so an expired body is never paired with a later ETag."""
        info = with_retries(lambda: self.fs.info(self.path, refresh=True))
        data = with_retries(lambda: self.fs.cat_file(self.path))
        try:
            body = json.loads(data)
        except ValueError:
            body = {}   # not a lock this tool wrote: treated as expired, and taken over with a warning
        return body if isinstance(body, dict) else {}, _etag(info)

    def __enter__(self) -> RemoteLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def _holder(body: dict[str, Any]) -> str:
    return f"pid {body.get('pid', '?')} on {body.get('host', 'an unknown host')}, since {body.get('since', '?')}"


def _writes_conditionally(fs: Any) -> bool:
    """Whether `fs.pipe_file` can write only if absent and only over a version: s3fs and adlfs, not gcsfs."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return any(protocol in ("s3", "s3a", "abfs", "az") for protocol in protocols)


def _if_match(fs: Any, etag: str) -> dict[str, Any]:
    """The keywords of `fs.pipe_file` that write only over the object at version `etag`: S3's If-Match through
    s3fs, Azure's ETag condition through adlfs (which hands them to the blob client)."""
    if "abfs" in fs.protocol or "az" in fs.protocol:
        from azure.core import MatchConditions

        return {"etag": etag, "match_condition": MatchConditions.IfNotModified}
    return {"IfMatch": etag}


def _etag(answer: dict[str, Any]) -> str:
    """The ETag of a write's answer or an `info()` (S3 names it ETag, Azure etag)."""
    return str(answer.get("ETag") or answer.get("etag") or "")


def _gone(error: Exception) -> bool:
    """Whether a write failed for want of the object (s3fs: FileNotFoundError; Azure's client: 404)."""
    return isinstance(error, FileNotFoundError) or getattr(error, "status_code", None) == 404


def _lost_race(error: Exception) -> bool:
    """Whether a conditional write failed on its condition: 412 Precondition Failed (s3fs raises EINVAL, Azure's
    client ResourceModifiedError), or a create-only write over an object."""
    if isinstance(error, FileExistsError) or getattr(error, "status_code", None) == 412:
        return True
    return isinstance(error, OSError) and error.errno == errno.EINVAL
