"""Decode and preprocess media in worker processes that can crash, hang or run out of memory alone.

decord and FFmpeg are native code: a corrupt file can segfault them, a broken stream can block
them for ever, a hostile file can make them allocate without bound, and they print their own
log lines on stderr. `DecodePool` runs "decode + preprocess one item" (`decode_item`) in worker
processes: a worker that dies, or runs past `timeout_s`, is killed and replaced (pebble's
`ProcessPool`), and the item comes back as a `Decoded` whose `error` names the cause. Workers
write to /dev/null, never to the terminal. Their futures never raise.

Workers start through a fork server. The parent holds torch threads (and maybe CUDA), which a
plain fork would copy in an undefined state; spawning would import torch and transformers again
for every worker, including each replacement. The server imports the decoding modules once
(about 3.5 s, when the first pool is created), then forks a ready worker in under 0.1 s.

Memory: each worker's data segment is limited with RLIMIT_DATA (heap and private writable
mappings: what a decoder allocates), not RLIMIT_AS (which also counts the shared libraries
and address space reserved but never used: a worker maps about 1.2 GiB before it decodes
anything, but holds about 0.45 GiB of data; decoding 16 frames of a 1920 x 800 clip needs
0.1-0.2 GiB more). Past the limit, Python code gets a MemoryError or torch.OutOfMemoryError
(reported with the limit), C++ code usually aborts on std::bad_alloc (SIGABRT, reported as a
crash that was probably out of memory), and FFmpeg reports ENOMEM (its error, with the limit).
RLIMIT_DATA counts mmap'ed memory since Linux 4.7; on older kernels it bounds only the heap.

Without isolation (`isolate=False`), the same `decode_item` runs in threads of this process:
no timeout, no memory limit and no crash protection (a native crash or hang takes the process
with it). That is for benchmarks comparing the two, and for callers that isolate already (a
Ray worker).

Faults can be injected into workers by tests to prove the isolation end to end (`faults`).
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
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from pebble import ProcessExpired, ProcessPool

from .. import storage
from ..errors import CRASHED, INTERNAL, NOT_FOUND, OUT_OF_MEMORY, TIMEOUT, UNREADABLE, ItemError, plain_message
from ..families.base import ProcessedPrompt, Processor
from ..families.temporal import drop_static_vision
from ..inputs.copies import readable_copy
from ..inputs.prompt_sets import Question
from ..inputs.sources import MediaItem
from ..media import MAX_IMAGE_PIXELS, FrameCount, Media
from .faults import misbehave, worker_faults
from .fork_server import quiet_worker, start_decoding_server
from .member_lane import MemberLane

STOPPED = "stopped before it was decoded"
# Errors whose text says an allocation failed (ENOMEM, C++ bad_alloc, a library that could not map).
_NO_MEMORY_WORDS = ("cannot allocate memory", "bad_alloc", "out of memory", "failed to map segment")


@dataclass(frozen=True)
class DecodeJob:
    """What every item of a run is decoded with; pickled once and sent to each worker."""

    processor: Processor
    frames: FrameCount   # per clip: a count, or a rate
    instruction: str | None  # the run's prompt; an item's own prompt replaces it
    max_image_pixels: int | None = MAX_IMAGE_PIXELS   # larger images fail undecoded
    temporal_pruning: float = 0.0   # the share of vision vectors dropped for repeating the previous frame
    prompt_set: tuple[Question, ...] = ()   # several questions per item instead of one instruction
    # The object-store settings and credentials of the process that made the job (`storage.environment`): a worker
    # comes from a fork server that kept the environment of when it started. Never in a repr.
    storage_environment: dict[str, str] = field(default_factory=lambda: storage.environment(credentials=True),
                                                repr=False)


@dataclass
class Decoded:
    """One item after decoding and preprocessing, or the error (one line) that stopped it and its kind (`errors`)."""

    index: int
    item: MediaItem
    seconds: float                    # decoding time; for a failed worker, the time since submission
    media: Media | None = None        # facts about the file; its frames are dropped (the prompts hold the pixels)
    prompts: list[ProcessedPrompt] = field(default_factory=list)   # one, or one per question asked (sharing pixels)
    error: str | None = None
    error_kind: str | None = None
    questions: tuple[str, ...] = ()   # with a prompt set: the question of each prompt

    @property
    def prompt(self) -> ProcessedPrompt | None:
        """The first (without a prompt set, the only) prompt."""
        return self.prompts[0] if self.prompts else None


def decode_item(job: DecodeJob, index: int, item: MediaItem) -> Decoded:
    """Decode, sample and preprocess one item; any failure is this item's error.

    Except running out of memory, which raises (MemoryError, torch.OutOfMemoryError): the
    caller knows which limit was hit (`DecodePool` reports it as this item's error).
    """
    start = time.perf_counter()
    try:
        # Each frame is preprocessed as soon as it is decoded, so only its pixels are kept.
        with readable_copy(item) as path:
            media = job.processor.load_media(path, item.media_type, job.frames, job.max_image_pixels, item.span)
        questions = [question for question in (item.prompt_set if item.prompt_set is not None else job.prompt_set)
                     if item.questions is None or question.name in item.questions]
        texts = [question.text for question in questions] or [item.prompt or job.instruction]
        prompts = _prompts(job, media, texts)
    except Exception as error:  # any decoder failure is this item's problem only
        if _is_out_of_memory(error):
            raise
        return Decoded(index, _as_listed(item), time.perf_counter() - start,
                       error=storage.redact_text(plain_message(error)), error_kind=_kind_of(error))
    return Decoded(index, _as_listed(item), time.perf_counter() - start, replace(media, frames=[]), prompts,
                   questions=tuple(question.name for question in questions))


def _kind_of(error: Exception) -> str:
    """The kind of a failure to decode an item: the one it carries, else told by its type (a file's read failing
    under the decoder, a store's own errors); anything else is a bug of ours, not a property of the file."""
    if isinstance(error, ItemError):
        return error.kind
    if isinstance(error, FileNotFoundError):
        return NOT_FOUND
    if isinstance(error, OSError):
        return UNREADABLE
    return INTERNAL


def _as_listed(item: MediaItem) -> MediaItem:
    """`item` without the local copy of its bytes it may have been given (closed once it is decoded)."""
    return item if item.local_copy is None else replace(item, local_copy=None)


def _prompts(job: DecodeJob, media: Media, texts: list[str | None]) -> list[ProcessedPrompt]:
    """One prompt per instruction over the item's frames, all holding the first's pixels (and, pruned, the
    same surviving vision vectors: the scores depend on the pixels only)."""
    first = job.processor.process(media, texts[0])
    first.digest_pixels()   # here, not in the engine's loop
    changes = job.processor.vision_changes(first) if job.temporal_pruning else None
    prompts = []
    for text in texts:
        prompt = first if text == texts[0] else replace(job.processor.process(media, text),
                                                         pixel_values=first.pixel_values,
                                                         pixel_digests=first.pixel_digests)
        if changes is not None:
            prompt = drop_static_vision(prompt, changes, job.temporal_pruning)
        prompts.append(prompt)
    return prompts


class DecodePool:
    """Decodes items in worker processes (or threads, with `isolate=False`).

    `submit` returns a future that never raises and cannot be cancelled: a crashed, timed-out
    or out-of-memory worker, or the pool being shut down, gives a `Decoded` with an error that
    names the cause, and a replacement worker takes the next item. `timeout_s` bounds each
    item's decoding from the moment a worker takes it; `memory_limit_bytes` bounds each
    worker's data segment. Both need isolation; threads ignore them.

    Results travel back as pickled bytes through the pool's pipe. For the 16 x 3 x 336 x 336
    float32 pixels of a 16-frame Tarsier item (20.7 MiB): 15 ms to pickle in the worker, then
    50-90 ms until unpickled here, of which about 45 ms of this process's CPU (in pebble's
    receiving thread); decoding such a clip takes a worker 1-2 s.
    """

    def __init__(self, job: DecodeJob, workers: int, timeout_s: float | None = None,
                 memory_limit_bytes: int | None = None, isolate: bool = True):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("the decoding timeout must be positive")
        if memory_limit_bytes is not None and memory_limit_bytes <= 0:
            raise ValueError("the memory limit must be positive")
        self.job, self.workers, self.isolate = job, workers, isolate
        self.timeout_s = timeout_s if isolate else None
        self.memory_limit_bytes = memory_limit_bytes if isolate else None
        self._lock = threading.Lock()          # guards _pending and _closed (taken on pebble's threads too)
        self._pool_lock = threading.Lock()     # guards replacing the process pool
        self._pending: dict[Future[Decoded], tuple[int, MediaItem, float]] = {}
        self._closed = False
        self._threads: ThreadPoolExecutor | None = None
        self._processes: ProcessPool | None = None
        self._members: MemberLane | None = None   # reads shard members, started by the first one
        if isolate:
            # Pickled here, once: an unpicklable processor fails now, in the caller, and torch's
            # multiprocessing reducers (shared memory for tensors) never see the job.
            self._initargs = (pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL), self.memory_limit_bytes,
                              worker_faults())
            start_decoding_server()
            self._processes = self._new_process_pool()
            # Start the workers now: the first start waits for the server's imports (about 3 s).
            self._live_processes()
        else:
            self._threads = ThreadPoolExecutor(workers, thread_name_prefix="tarsier-decode")

    def submit(self, index: int, item: MediaItem) -> Future[Decoded]:
        """Queue `item` (`index` comes back in its `Decoded`); raises only if the pool is shut down."""
        decoded: Future[Decoded] = Future()
        decoded.set_running_or_notify_cancel()  # the pool settles it; callers stop work with shutdown()
        started = time.perf_counter()
        with self._lock:
            if self._closed:
                raise RuntimeError("the decoding pool is shut down")
            self._pending[decoded] = (index, item, started)
            if item.member is not None and item.local_copy is None:
                if self._members is None:
                    self._members = MemberLane(self._member_read, self._member_failed)
                self._members.read(item, decoded)
                return decoded
        try:
            self._start(decoded, index, item)
        except BaseException:
            with self._lock:
                self._pending.pop(decoded, None)
            raise
        return decoded

    def _start(self, decoded: Future[Decoded], index: int, item: MediaItem) -> None:
        self._schedule(index, item).add_done_callback(partial(self._task_done, decoded))

    def _member_read(self, item: MediaItem, decoded: Future[Decoded]) -> None:
        """A shard member's bytes arrived (on the lane's thread): decode it. Never raises: whatever stops it is
        the item's error, so the lane goes on and no future is left waiting."""
        with self._lock:
            entry = self._pending.get(decoded)
        if entry is None:   # shut down meanwhile
            self._members.release(decoded)
            return
        try:
            self._start(decoded, entry[0], item)
        except BaseException as error:   # shut down meanwhile, or no worker could be started
            self._members.release(decoded)
            message = STOPPED if self._closed else \
                f"it could not be given to a decoding worker ({plain_message(error)})"
            self._settle(decoded, Decoded(entry[0], entry[1], 0.0, error=message, error_kind=INTERNAL))

    def _member_failed(self, item: MediaItem, decoded: Future[Decoded], message: str) -> None:
        with self._lock:
            entry = self._pending.get(decoded)
        if entry is not None:
            self._settle(decoded, Decoded(entry[0], entry[1], time.perf_counter() - entry[2], error=message,
                                          error_kind=UNREADABLE))   # the lane only fails to read it

    def shutdown(self) -> None:
        """Drop queued items and stop the workers at once, killing busy or hung ones; idempotent.

        With threads, waits for the items being decoded (a thread cannot be stopped). Items not
        decoded by then come back as errors, so that no future is left waiting.
        """
        with self._lock:
            self._closed = True
        if self._members is not None:
            self._members.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
        if self._processes is not None:
            with self._pool_lock:  # after a replacement under way, if any
                self._processes.stop()  # a worker's SIGTERM is fatal at once (see _start_worker)
                self._processes.join()
        with self._lock:
            left, self._pending = self._pending, {}
        for decoded, (index, item, _) in left.items():
            decoded.set_result(Decoded(index, item, 0.0, error=STOPPED, error_kind=INTERNAL))

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- in this process -------------------------------------------------------------------

    def _new_process_pool(self) -> ProcessPool:
        return ProcessPool(self.workers, initializer=_start_worker, initargs=self._initargs,
                           context=multiprocessing.get_context("forkserver"))

    def _schedule(self, index: int, item: MediaItem) -> Future[bytes] | Future[Decoded]:
        if self._threads is not None:
            return self._threads.submit(_decode_here, self.job, index, item)
        try:
            return self._live_processes().schedule(_decode_in_worker, (index, item), timeout=self.timeout_s)
        except RuntimeError:  # it broke between the check and the call
            return self._live_processes().schedule(_decode_in_worker, (index, item), timeout=self.timeout_s)

    def _live_processes(self) -> ProcessPool:
        """The process pool, replaced first if pebble gave up on it.

        pebble abandons a pool when a worker dies while no task is known to be running on it
        (killed while idle, or a crash it could not attribute yet); its tasks then fail with
        BrokenProcessPool. A fresh pool takes the items that follow.
        """
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("the decoding pool is shut down")
            assert self._processes is not None
            if not self._processes.active:  # (a pool not started yet starts here)
                broken, self._processes = self._processes, self._new_process_pool()
                broken.stop()
                broken.join()
            return self._processes

    def _task_done(self, decoded: Future[Decoded], task: Future[bytes] | Future[Decoded]) -> None:
        """Settle `decoded` from its task (on the pool's thread); shutdown may have settled it first."""
        with self._lock:
            entry = self._pending.get(decoded)
        if entry is None:
            return
        index, item, started = entry
        if item.member is not None and self._members is not None:
            self._members.release(decoded)
        try:
            outcome = self._outcome(task, index, item, started)
        except BaseException as error:  # never leave a future waiting (e.g. a result that cannot be unpickled)
            outcome = Decoded(index, item, time.perf_counter() - started, error_kind=INTERNAL,
                              error=f"the decoded item could not be received ({plain_message(error)})")
        self._settle(decoded, outcome)

    def _settle(self, decoded: Future[Decoded], outcome: Decoded) -> None:
        """Give `decoded` its outcome, unless shutdown settled it first."""
        with self._lock:
            if self._pending.pop(decoded, None) is None:
                return
        decoded.set_result(outcome)

    def _outcome(self, task: Future[bytes] | Future[Decoded], index: int, item: MediaItem,
                 started: float) -> Decoded:
        if task.cancelled():
            return Decoded(index, item, 0.0, error=STOPPED, error_kind=INTERNAL)
        error = task.exception()
        if error is None:
            result = task.result()
            return pickle.loads(result) if isinstance(result, bytes) else result
        seconds = time.perf_counter() - started
        if self._closed:  # pebble fails what it held when it stops (BrokenProcessPool)
            return Decoded(index, item, seconds, error=STOPPED, error_kind=INTERNAL)
        if isinstance(error, (FutureTimeout, TimeoutError)):  # pebble raises the former (the same class from 3.11)
            kind = TIMEOUT
            message = f"decoding took longer than decode_timeout_s ({self.timeout_s:g} s); the worker was stopped"
        elif _is_out_of_memory(error):
            kind, message = OUT_OF_MEMORY, _out_of_memory(self.memory_limit_bytes, self.isolate)
        elif isinstance(error, ProcessExpired):
            kind, message = _crash(error.exitcode, self.memory_limit_bytes)
        elif isinstance(error, WorkerNotReady):
            kind, message = INTERNAL, str(error)
        elif isinstance(error, BrokenProcessPool):   # a worker died in a way pebble could not pin on one item
            cause = str(error) or (plain_message(error.__cause__) if error.__cause__ else "their channel broke")
            kind, message = CRASHED, f"the decoding workers failed ({cause}); they were restarted for the next items"
        else:
            kind, message = INTERNAL, plain_message(error)
        return Decoded(index, item, seconds, error=message, error_kind=kind)


class DecodingOutOfMemory(MemoryError):
    """A worker ran out of memory decoding an item (its memory is freed before the next item)."""


class WorkerNotReady(Exception):
    """A worker could not set itself up (its message says why); every item it takes fails with it."""


def _decode_here(job: DecodeJob, index: int, item: MediaItem) -> Decoded:
    return decode_item(job, index, item)  # looked up at call time (tests replace decode_item)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError)))


def _out_of_memory(limit: int | None, isolated: bool = True) -> str:
    if limit:
        return f"decoding ran out of memory (decode_memory_gb: {limit / 2**30:g} GiB per worker)"
    return "decoding ran out of memory" + ("" if isolated else " (in this process: no per-worker limit)")


def _crash(exitcode: object, limit: int | None) -> tuple[str, str]:
    """The kind and message of a worker that died with `exitcode`."""
    if not isinstance(exitcode, int) or exitcode >= 0:
        return CRASHED, f"the decoder exited unexpectedly (exit code {exitcode})"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if exitcode == -signal.SIGKILL:  # never sent by the pool to a worker it still counts on
        return OUT_OF_MEMORY, "the decoder was killed (SIGKILL), probably by the system running out of memory"
    if exitcode == -signal.SIGABRT and limit:  # C++ aborts when an allocation fails (std::bad_alloc)
        return OUT_OF_MEMORY, (f"the decoder crashed ({name}), probably out of memory "
                               f"(decode_memory_gb: {limit / 2**30:g} GiB per worker)")
    return CRASHED, f"the decoder crashed ({name})"


# --- inside a worker process -----------------------------------------------------------------

_job: DecodeJob | None = None
_memory_limit: int | None = None
_faults: tuple[tuple[str, str], ...] = ()
_start_error: str | None = None


def _start_worker(job: bytes, memory_limit_bytes: int | None, faults: tuple[tuple[str, str], ...]) -> None:
    """pebble's initializer. Never raises: a worker that fails here would break the whole pool,
    so the failure is kept and becomes every item's error instead."""
    global _job, _memory_limit, _faults, _start_error
    quiet_worker()
    _memory_limit, _faults = memory_limit_bytes, faults
    try:
        torch.set_num_threads(1)  # the cores belong to the model and the other workers
        _job = pickle.loads(job)
        os.environ.update(_job.storage_environment)
        if memory_limit_bytes:
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            limit = memory_limit_bytes if hard == resource.RLIM_INFINITY else min(memory_limit_bytes, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except Exception as error:
        _start_error = f"the decoding worker could not start ({plain_message(error)})"


def _decode_in_worker(index: int, item: MediaItem) -> bytes:
    """The item decoded, pickled here by value.

    Returned as is, its tensors would travel through torch's shared-memory reducer, which needs
    room in /dev/shm (64 MB in a default Docker container: a few 16-frame items) and fails when
    a file-size limit is set. Pickled bytes go through the pool's pipe like any result.
    """
    if _start_error is not None or _job is None:
        raise WorkerNotReady(_start_error or "the decoding worker was not initialised")
    out_of_memory = False
    try:
        for kind, pattern in _faults:
            if pattern in item.path:
                misbehave(kind, item.path)
        decoded = decode_item(_job, index, item)
    except Exception as error:
        if not _is_out_of_memory(error):
            raise
        out_of_memory = True
    if out_of_memory:
        # Raised here, outside the handler: the error that ran out holds the frames that hold the memory,
        # and the worker keeps it (until a garbage collection) while it decodes its next item.
        raise DecodingOutOfMemory()
    if decoded.error is not None and _memory_limit and any(word in decoded.error.lower()
                                                           for word in _NO_MEMORY_WORDS):
        # FFmpeg's ENOMEM reaches us as the decoder's words only: the limit is why.
        decoded.error, decoded.error_kind = f"{_out_of_memory(_memory_limit)}: {decoded.error}", OUT_OF_MEMORY
    return pickle.dumps(decoded, protocol=pickle.HIGHEST_PROTOCOL)
