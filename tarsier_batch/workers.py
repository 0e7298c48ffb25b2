"""Decode and preprocess media in worker processes that can crash, hang or run out of memory alone.

decord and FFmpeg are native code: a corrupt file can segfault them, a FIFO or a broken stream
can block them for ever, a hostile file can make them allocate without bound, and they print
their own log lines on stderr. Here each item is decoded in a worker process: a worker that
dies, or runs past `timeout_s`, is killed and replaced by the pool (pebble), and the item comes
back as an error; workers write to /dev/null, not the terminal.

Workers are started through a fork server: the parent holds torch threads (and maybe CUDA),
which a plain fork would copy in an undefined state, while spawning would re-import torch and
transformers for every replacement worker. The server imports the decoding modules once, then
forks a fresh worker in milliseconds.

Test hook: `TARSIER_BATCH_FAULT` makes a worker misbehave on chosen items, to prove the isolation
end to end. It holds comma-separated `kind:substring` entries; an item whose path contains the
substring makes the worker `segfault` (SIGSEGV), `hang` (block for ever) or `oom` (allocate until
the memory limit stops it). It is read when a pool is created.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pebble import ProcessExpired, ProcessPool

from .families.base import ProcessedPrompt, Processor
from .media import Media
from .sources import MediaItem
from .text import one_line

FAULT_VARIABLE = "TARSIER_BATCH_FAULT"
MAX_DEFAULT_WORKERS = 4  # beyond this, decoding outpaces even a GPU's prefill of the frames


@dataclass(frozen=True)
class DecodeJob:
    """What every item of a run is decoded with; sent once to each worker."""

    processor: Processor
    frames: int
    instruction: str | None  # the run's prompt; an item's own prompt replaces it


@dataclass
class Decoded:
    """One item after decoding and preprocessing, or the error that stopped it."""

    index: int
    item: MediaItem
    seconds: float
    media: Media | None = None        # facts about the file; its frames are dropped (the prompt holds the pixels)
    prompt: ProcessedPrompt | None = None
    error: str | None = None


def default_workers() -> int:
    """One core for the model's own threads, the rest (at most MAX_DEFAULT_WORKERS) for decoding."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_WORKERS, cores - 1))


def decode_item(job: DecodeJob, index: int, item: MediaItem) -> Decoded:
    """Decode, sample and preprocess one item; any failure is this item's error."""
    start = time.perf_counter()
    try:
        # Each frame is preprocessed as soon as it is decoded, so only its pixels are kept.
        media = job.processor.load_media(item.path, item.media_type, job.frames)
        prompt = job.processor.process(media, item.prompt or job.instruction)
    except MemoryError:
        raise  # in a worker, the pool reports it with the memory limit; in threads, it is the whole run's
    except Exception as error:  # any decoder failure is this item's problem only
        return Decoded(index, item, time.perf_counter() - start, error=one_line(error))
    return Decoded(index, item, time.perf_counter() - start, replace(media, frames=[]), prompt)


class DecodePool:
    """Decodes items in worker processes (or threads, with `isolate=False`); futures never raise.

    A crashed, timed-out or killed worker turns into a `Decoded` with an error naming the cause,
    and the pool starts a replacement. Without isolation there is no timeout and no memory
    limit: a native crash or hang takes the process with it (for benchmarks, and for callers
    that isolate already, like a Ray worker).
    """

    def __init__(self, job: DecodeJob, workers: int, timeout_s: float | None = None,
                 memory_limit_bytes: int | None = None, isolate: bool = True):
        self.job, self.timeout_s, self.memory_limit_bytes = job, timeout_s, memory_limit_bytes
        self._threads: ThreadPoolExecutor | None = None
        self._processes: ProcessPool | None = None
        self._pending: dict[Future[Decoded], tuple[int, MediaItem]] = {}
        self._lock = threading.Lock()
        if isolate:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__, type(job.processor).__module__])
            _start_quiet_fork_server()
            self._processes = ProcessPool(workers, initializer=_start_worker, context=context,
                                          initargs=(job, memory_limit_bytes, _faults_from_environment()))
        else:
            self._threads = ThreadPoolExecutor(workers, thread_name_prefix="tarsier-decode")

    def submit(self, index: int, item: MediaItem) -> Future[Decoded]:
        if self._threads is not None:
            return self._threads.submit(decode_item, self.job, index, item)
        assert self._processes is not None
        started = time.perf_counter()
        decoded: Future[Decoded] = Future()
        self._pending[decoded] = (index, item)
        task = self._processes.schedule(_decode_in_worker, (index, item), timeout=self.timeout_s)
        task.add_done_callback(lambda done: self._settle(decoded, lambda: self._outcome(done, index, item, started)))
        return decoded

    def shutdown(self) -> None:
        """Drop queued items and stop the workers at once (hung ones are killed); idempotent.

        Items not decoded by then come back as errors, so that no future is left waiting.
        """
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
        if self._processes is not None:
            self._processes.stop()
            self._processes.join()
            for decoded, (index, item) in list(self._pending.items()):
                self._settle(decoded, lambda: Decoded(index, item, 0.0, error="stopped before it was decoded"))

    def _settle(self, decoded: Future[Decoded], outcome: Callable[[], Decoded]) -> None:
        """Resolve `decoded` once (the pool's callback thread and shutdown may both try)."""
        with self._lock:
            if self._pending.pop(decoded, None) is not None:
                decoded.set_result(outcome())

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _outcome(self, task: Future[Decoded], index: int, item: MediaItem, started: float) -> Decoded:
        if task.cancelled():
            return Decoded(index, item, 0.0, error="stopped before it was decoded")
        error = task.exception()
        if error is None:
            return pickle.loads(task.result())
        seconds = time.perf_counter() - started
        if isinstance(error, (FutureTimeout, TimeoutError)):
            message = f"decoding took longer than {self.timeout_s:g} s (--decode-timeout); the worker was stopped"
        elif isinstance(error, MemoryError):
            message = f"decoding ran out of memory ({self._limit_text()})"
        elif isinstance(error, ProcessExpired):
            message = f"the decoder crashed ({_death(error.exitcode)})"
            if error.exitcode == -signal.SIGABRT and self.memory_limit_bytes:  # C++ aborts when an allocation fails
                message += f", probably out of memory ({self._limit_text()})"
        else:
            message = one_line(error)
        return Decoded(index, item, seconds, error=message)

    def _limit_text(self) -> str:
        if not self.memory_limit_bytes:
            return "no limit set"
        return f"limit {self.memory_limit_bytes / 2**30:g} GiB per worker, --decode-memory-gb"


def _start_quiet_fork_server() -> None:
    """Start the fork server (once per process) with its stdout and stderr on /dev/null.

    Workers inherit them from the server, so nothing a worker prints reaches the terminal, even
    before its own set-up runs (a worker forked while the pool stops can fail to unpickle its
    start-up state and print a traceback). Our descriptors are swapped only while the server is
    launched, which does not wait for its imports.
    """
    from multiprocessing import forkserver

    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        forkserver.ensure_running()
    finally:
        for descriptor, original in zip((1, 2), saved):
            os.dup2(original, descriptor)
            os.close(original)
        os.close(devnull)


# --- inside a worker process -----------------------------------------------------------------

_job: DecodeJob | None = None
_faults: list[tuple[str, str]] = []


def _start_worker(job: DecodeJob, memory_limit_bytes: int | None, faults: list[tuple[str, str]]) -> None:
    global _job, _faults
    _job, _faults = job, faults
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # decord and FFmpeg log from native code: keep it off the terminal
    os.dup2(devnull, 2)
    os.close(devnull)
    import torch

    torch.set_num_threads(1)  # the cores belong to the model and the other workers
    if memory_limit_bytes:
        # RLIMIT_DATA bounds the heap and private mappings (what decoders allocate), not the
        # address space that libraries reserve without using; an allocation beyond it fails.
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = memory_limit_bytes if hard == resource.RLIM_INFINITY else min(memory_limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _decode_in_worker(index: int, item: MediaItem) -> bytes:
    """The item decoded, pickled here by value.

    Returned as is, its tensors would travel through torch's shared-memory reducer, which needs
    room in /dev/shm (64 MB in a default Docker container: a few 16-frame items) and fails when
    a file-size limit is set. Pickled bytes go through the pool's pipe like any result.
    """
    assert _job is not None, "worker not initialised"
    for kind, pattern in _faults:
        if pattern in item.path:
            _misbehave(kind)
    return pickle.dumps(decode_item(_job, index, item), protocol=pickle.HIGHEST_PROTOCOL)


def _misbehave(kind: str) -> None:
    if kind == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "hang":
        threading.Event().wait()
    elif kind == "oom":
        hog: list[bytes] = []
        while True:
            hog.append(bytes(2**28))


def _faults_from_environment() -> list[tuple[str, str]]:
    entries = [entry.split(":", 1) for entry in os.environ.get(FAULT_VARIABLE, "").split(",") if ":" in entry]
    return [(kind, pattern) for kind, pattern in entries if kind in ("segfault", "hang", "oom")]


def _death(exitcode: Any) -> str:
    if isinstance(exitcode, int) and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
