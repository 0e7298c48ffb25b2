"""Faults injected on purpose, to prove end to end that the isolation holds: the one seam tests use.

Two environment variables, read where the faults happen (worker processes and Ray actors start
with the environment of the process that made them). Never set them outside tests.

- `TARSIER_BATCH_FAULT`: comma-separated `kind:substring` entries; a decoding worker given an
  item whose path contains the substring `segfault`s (SIGSEGV), `abort`s (SIGABRT, as
  std::bad_alloc does), `hang`s (blocked for ever in native code, where no Python signal handler
  runs) or `oom`s (allocates until its memory limit stops it). Only isolated workers read it.
- `TARSIER_BATCH_RAY_FAULT=die-once:SUBSTRING:MARKER`: the Ray actor that gets an item whose path
  contains SUBSTRING exits at once (as a crash would), unless the file MARKER exists; it creates
  MARKER first, so the restarted actor carries on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from pathlib import Path

WORKER_FAULTS = "TARSIER_BATCH_FAULT"
WORKER_FAULT_KINDS = ("segfault", "abort", "hang", "oom")
RAY_FAULT = "TARSIER_BATCH_RAY_FAULT"


def worker_faults() -> tuple[tuple[str, str], ...]:
    """The (kind, path substring) pairs `TARSIER_BATCH_FAULT` asks for."""
    faults = []
    for entry in filter(None, (part.strip() for part in os.environ.get(WORKER_FAULTS, "").split(","))):
        kind, _, pattern = entry.partition(":")
        if kind not in WORKER_FAULT_KINDS or not pattern:
            raise ValueError(f"{WORKER_FAULTS}: {entry!r} is not kind:substring with kind one of "
                             f"{', '.join(WORKER_FAULT_KINDS)}")
        faults.append((kind, pattern))
    return tuple(faults)


def misbehave(kind: str, path: str) -> None:
    """Fail as a decoder of the file at `path` can: a crash, an abort, a hang, or running out of memory."""
    if kind == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "abort":
        os.abort()
    elif kind == "hang":
        with open(path, "rb"):  # like a decoder stuck reading it (tests see the worker holds the file)
            _hang_in_native_code()
    elif kind == "oom":
        hog: list[bytes] = []
        while True:  # untouched zero pages: the limit stops it, not the machine's memory
            hog.append(bytes(2**26))


def maybe_kill_ray_actor(paths: list[str]) -> None:
    """Exit this process (a Ray actor) as `TARSIER_BATCH_RAY_FAULT` asks, if one of `paths` matches."""
    fault = os.environ.get(RAY_FAULT)
    if not fault:
        return
    kind, substring, marker = fault.split(":", 2)
    assert kind == "die-once", fault
    if any(substring in path for path in paths) and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)


def _hang_in_native_code() -> None:
    """Block for ever in C, like a stuck decoder: lock a plain mutex twice (it never returns)."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: a default (non error-checking) mutex in glibc
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
    threading.Event().wait()  # where the second lock returned an error instead
