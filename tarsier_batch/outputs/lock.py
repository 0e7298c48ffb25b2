"""One run at a time per output: an advisory lock file beside `--out`."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType


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
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"
                os.close(fd)
                raise OutputLockedError(f"another run is writing {self.out} "
                                        f"({holder}); wait for it to finish or use another --out") from None
            if _same_file(fd, self.path):
                break
            # The holder finished and removed the file between our open and our lock: the lock we
            # hold is on a deleted file that a newer run cannot see. Start over on the path.
            os.close(fd)
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file while still holding it, so that no run can lock a deleted file."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)
