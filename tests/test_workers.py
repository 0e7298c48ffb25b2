"""Decoding in worker processes: the same results as in-process, and every failure stays one item's error.

Faults come from the TARSIER_BATCH_FAULT test hook. Nothing here waits a fixed time: a test
that needs a worker to be inside a hang waits until the worker holds the item's file open.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
import torch

from conftest import SAMPLE_DATA
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.inputs.sources import MediaItem
from tarsier_batch.media import MediaType, Span
from tarsier_batch.workers import pool as workers
from tarsier_batch.workers import sizing
from tarsier_batch.workers.faults import WORKER_FAULTS as FAULT_VARIABLE
from tarsier_batch.workers.pool import (
    Decoded,
    DecodeJob,
    DecodePool,
    decode_item,
)
from tarsier_batch.workers.sizing import default_workers

GiB = 2**30
T = TypeVar("T")


@pytest.fixture(scope="module")
def job(tiny_model) -> DecodeJob:
    return DecodeJob(tiny_model.processor, 8, None)


@pytest.fixture(scope="module")
def tarsier2_job(tmp_path_factory: pytest.TempPathFactory) -> DecodeJob:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-tarsier2"), "tiny", seed=0, family="tarsier2")
    model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    return DecodeJob(model.processor, 6, "Describe it briefly.")


def media_items(shared_media: Path) -> list[MediaItem]:
    return [MediaItem(str(shared_media / "demo_test.mp4"), MediaType.VIDEO),
            MediaItem(str(shared_media / "demo_test_8frames.gif"), MediaType.GIF),
            MediaItem(str(shared_media / "tarsier_logo.jpg"), MediaType.IMAGE, prompt="Name the logo."),
            MediaItem(str(SAMPLE_DATA / "ball_h264.mp4"), MediaType.VIDEO),
            MediaItem(str(SAMPLE_DATA / "ball.gif"), MediaType.GIF),
            MediaItem(str(SAMPLE_DATA / "still.png"), MediaType.IMAGE)]


def assert_same(decoded: Decoded, expected: Decoded) -> None:
    assert decoded.error is None and expected.error is None, (decoded.error, expected.error)
    assert (decoded.index, decoded.item) == (expected.index, expected.item)
    assert decoded.media == expected.media and decoded.media is not None and decoded.media.frames == []
    got, want = decoded.prompt, expected.prompt
    assert got is not None and want is not None
    for name in ("token_ids", "positions", "pixel_values"):
        assert getattr(got, name).dtype == getattr(want, name).dtype
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.instruction, got.next_position, got.vision_blocks) == \
        (want.instruction, want.next_position, want.vision_blocks)


@pytest.mark.parametrize(("family", "isolate"), [("tarsier", True), ("tarsier2", True), ("tarsier", False)],
                         ids=["tarsier-processes", "tarsier2-processes", "tarsier-threads"])
def test_pool_gives_exactly_the_in_process_results(family: str, isolate: bool, request: pytest.FixtureRequest,
                                                   shared_media: Path) -> None:
    job: DecodeJob = request.getfixturevalue("job" if family == "tarsier" else "tarsier2_job")
    items = media_items(shared_media)
    if not isolate:  # the same function in threads: skip the one slow clip (1.6 s)
        items = items[1:]
    with DecodePool(job, workers=2, timeout_s=60, memory_limit_bytes=4 * GiB, isolate=isolate) as pool:
        futures = [pool.submit(index, item) for index, item in enumerate(items)]
        results = [future.result() for future in futures]
    for index, (item, decoded) in enumerate(zip(items, results)):
        assert_same(decoded, decode_item(job, index, item))
    logo = next(decoded for decoded in results if decoded.item.prompt)
    assert logo.prompt is not None and logo.prompt.instruction == "Name the logo."


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch, shared_media: Path, tmp_path: Path) -> dict[str, MediaItem]:
    """Copies of one GIF named after the fault each triggers (the hook matches a substring of the path)."""
    monkeypatch.setenv(FAULT_VARIABLE, "segfault:crash-me,abort:abort-me,hang:hang-me,oom:eat-me")
    made = {}
    for name in ["crash-me", "abort-me", "hang-me", "eat-me", "fine"]:
        shutil.copy(shared_media / "clip_5f.gif", tmp_path / f"{name}.gif")
        made[name] = MediaItem(str(tmp_path / f"{name}.gif"), MediaType.GIF)
    return made


def pool_workers() -> list[psutil.Process]:
    """The pool's workers: children of the fork server, so grandchildren of this process.

    (A worker is forked from the server without exec: its command line is the server's.)
    """
    me = os.getpid()
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.ppid() != me:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for(condition: Callable[[], T | None], what: str, within_s: float = 60) -> T:
    """Poll a condition (not a fixed sleep): what a test waits for happens in another process."""
    deadline = time.monotonic() + within_s
    while (result := condition()) is None or result is False:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)
    return result


def holds(worker: psutil.Process, item: MediaItem) -> bool:
    try:
        return any(opened.path == os.path.realpath(item.path) for opened in worker.open_files())
    except psutil.NoSuchProcess:
        return False


def worker_inside(item: MediaItem) -> psutil.Process:
    """The worker hanging on `item` (the hang hook opens the file, like a decoder, before it blocks)."""
    def holder() -> psutil.Process | None:
        return next((process for process in pool_workers() if holds(process, item)), None)
    return wait_for(holder, f"a worker to hang on {item.path}")


def test_a_crash_costs_one_item_and_a_fresh_worker_takes_the_next(job: DecodeJob,
                                                                  faulty: dict[str, MediaItem]) -> None:
    with DecodePool(job, workers=1, timeout_s=60, memory_limit_bytes=2 * GiB) as pool:
        results = [pool.submit(index, faulty[name])
                   for index, name in enumerate(["crash-me", "fine", "abort-me", "fine"])]
        crash, after_crash, abort, after_abort = [future.result() for future in results]
    assert crash.error == "the decoder crashed (SIGSEGV)" and crash.prompt is None and crash.media is None
    assert crash.error_kind == "crashed"
    # std::bad_alloc aborts: with a memory limit, the likely cause is named.
    assert abort.error == ("the decoder crashed (SIGABRT), probably out of memory "
                           "(decode_memory_gb: 2 GiB per worker)")
    assert abort.error_kind == "out_of_memory"
    for fine, index in ((after_crash, 1), (after_abort, 3)):
        assert fine.error is None and fine.error_kind is None and fine.prompt is not None and fine.index == index


def test_a_hang_times_out_and_the_next_item_decodes(job: DecodeJob, faulty: dict[str, MediaItem]) -> None:
    with DecodePool(job, workers=1, timeout_s=1.5) as pool:
        hang, after = pool.submit(0, faulty["hang-me"]), pool.submit(1, faulty["fine"])
        assert hang.result().error == "decoding took longer than decode_timeout_s (1.5 s); the worker was stopped"
        assert hang.result().error_kind == "timeout"
        assert after.result().error is None and after.result().prompt is not None


def test_running_out_of_memory_costs_one_item(job: DecodeJob, faulty: dict[str, MediaItem]) -> None:
    with DecodePool(job, workers=1, timeout_s=60, memory_limit_bytes=1 * GiB) as pool:
        oom, after = pool.submit(0, faulty["eat-me"]).result(), pool.submit(1, faulty["fine"]).result()
    assert oom.error == "decoding ran out of memory (decode_memory_gb: 1 GiB per worker)"
    assert oom.error_kind == "out_of_memory"
    assert after.error is None and after.prompt is not None


def test_a_worker_that_ran_out_of_memory_holds_none_of_it_for_the_next_item(job: DecodeJob,
                                                                           faulty: dict[str, MediaItem]) -> None:
    """The error that ran out holds the frames that hold the memory: kept until a garbage collection, it left
    the worker at its limit for the next item (or unable to report the error at all)."""
    with DecodePool(job, workers=1, timeout_s=60, memory_limit_bytes=1 * GiB) as pool:
        assert pool.submit(0, faulty["eat-me"]).result().error.startswith("decoding ran out of memory")
        workers = pool_workers()   # the same worker goes on: running out of memory does not kill it
        assert workers and all(worker.memory_info().data < 0.6 * GiB for worker in workers), \
            [worker.memory_info().data / GiB for worker in workers]


def test_a_worker_killed_from_outside_is_reported_and_the_pool_recovers(job: DecodeJob,
                                                                        faulty: dict[str, MediaItem]) -> None:
    with DecodePool(job, workers=1, timeout_s=None) as pool:
        hang = pool.submit(0, faulty["hang-me"])
        worker_inside(faulty["hang-me"]).kill()  # what the kernel's out-of-memory killer does
        assert hang.result().error == "the decoder was killed (SIGKILL), probably by the system running out of memory"
        assert pool.submit(1, faulty["fine"]).result().error is None
        # A worker that dies while idle makes pebble give up on the whole pool: items it held
        # fail, and the next submission gets a fresh pool.
        for worker in pool_workers():
            worker.kill()
        recovered = None
        for index in range(2, 5):
            decoded = pool.submit(index, faulty["fine"]).result()
            assert decoded.error is None or decoded.error.startswith("the decoding workers failed"), decoded.error
            if decoded.error is None:
                recovered = decoded
                break
        assert recovered is not None


def test_a_corrupt_file_is_an_ordinary_error(job: DecodeJob, tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(random.Random(0).randbytes(4096))
    with DecodePool(job, workers=1, timeout_s=30) as pool:
        decoded = pool.submit(0, MediaItem(str(broken), MediaType.VIDEO)).result()
    assert decoded.error is not None and decoded.error.startswith(
        "not a video: no media stream found (no decoder knows the format of its bytes); decord: ")
    assert decoded.error_kind == "undecodable"
    assert "\n" not in decoded.error and decoded.prompt is None and decoded.media is None


def test_native_decoder_lines_never_reach_our_stderr(job: DecodeJob, tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all " * 100)
    item = MediaItem(str(broken), MediaType.VIDEO)
    capfd.readouterr()
    in_process = decode_item(job, 0, item)
    assert "ERROR opening" in capfd.readouterr().err  # decord's native logger writes to fd 2
    with DecodePool(job, workers=1, timeout_s=30) as pool:
        decoded = pool.submit(0, item).result()
    assert decoded.error == in_process.error
    assert capfd.readouterr() == ("", "")


def test_shutdown_kills_a_hung_worker_at_once_and_leaves_no_process(job: DecodeJob,
                                                                    faulty: dict[str, MediaItem]) -> None:
    children_before = {child.pid for child in psutil.Process().children()}
    pool = DecodePool(job, workers=2, timeout_s=None)
    hangs = [pool.submit(0, faulty["hang-me"]), pool.submit(1, faulty["hang-me"])]
    queued = [pool.submit(index, faulty["fine"]) for index in range(2, 6)]
    wait_for(lambda: len(pool_workers()) == 2 and all(holds(worker, faulty["hang-me"]) for worker in pool_workers()),
             "both workers to hang")
    workers_before = pool_workers()
    start = time.perf_counter()
    pool.shutdown()
    took = time.perf_counter() - start
    # A hang in native code never runs pebble's Python SIGTERM handler: without the workers'
    # default SIGTERM, each would be killed only after pebble's 3 s grace.
    assert took < 2.5, f"shutdown took {took:.1f} s"
    for future in hangs + queued:  # settled at once, without raising
        assert future.done() and future.result().error == "stopped before it was decoded"
    assert not any(worker.is_running() for worker in workers_before)
    assert pool_workers() == []
    # Only the fork server and the resource tracker may stay (for this process's lifetime); no zombie.
    for child in psutil.Process().children():
        assert child.status() != psutil.STATUS_ZOMBIE, child.cmdline()
        if child.pid not in children_before:
            assert any(word in " ".join(child.cmdline()) for word in ("forkserver", "resource_tracker")), \
                child.cmdline()
    pool.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(9, faulty["fine"])


def test_threads_turn_failures_into_errors_too(job: DecodeJob, faulty: dict[str, MediaItem]) -> None:
    class OutOfMemory:
        default_frames = 8

        def load_media(self, path: str, media_type: MediaType, num_frames: int, max_image_pixels: int | None,
                       span: Span | None = None):
            raise MemoryError

    starving = DecodeJob(OutOfMemory(), 8, None)  # type: ignore[arg-type]
    with DecodePool(starving, workers=1, timeout_s=1, memory_limit_bytes=GiB, isolate=False) as pool:
        assert pool.submit(0, faulty["fine"]).result().error == \
            "decoding ran out of memory (in this process: no per-worker limit)"
    with DecodePool(job, workers=1, isolate=False) as pool:  # the fault hook does nothing in threads
        assert pool.submit(0, faulty["crash-me"]).result().error is None


class Unloadable:
    """A processor that pickles but cannot be rebuilt in a worker (as if its module failed there)."""

    default_frames = 8

    def __reduce__(self):
        return int, ("not a processor",)


def test_a_worker_that_cannot_start_fails_each_item_clearly(faulty: dict[str, MediaItem]) -> None:
    with DecodePool(DecodeJob(Unloadable(), 8, None), workers=1, timeout_s=30) as pool:  # type: ignore[arg-type]
        results = [pool.submit(index, faulty["fine"]).result() for index in range(2)]
    for decoded in results:
        assert decoded.error == ("the decoding worker could not start "
                                 "(invalid literal for int() with base 10: 'not a processor')")
        assert decoded.error_kind == "internal"


def test_allocation_failures_inside_decoders_name_the_limit(monkeypatch: pytest.MonkeyPatch,
                                                            faulty: dict[str, MediaItem]) -> None:
    """What a worker returns when FFmpeg reports ENOMEM (run here, in-process, on the worker's code path)."""
    class NoMemory:
        def load_media(self, path: str, media_type: MediaType, num_frames: int, max_image_pixels: int | None,
                       span: Span | None = None):
            raise ValueError(f"cannot decode video: pyav: {os.strerror(errno.ENOMEM)}")

    monkeypatch.setattr(workers, "_job", DecodeJob(NoMemory(), 8, None))  # type: ignore[arg-type]
    monkeypatch.setattr(workers, "_memory_limit", 3 * GiB // 2)
    decoded = pickle.loads(workers._decode_in_worker(0, faulty["fine"]))
    assert decoded.error == ("decoding ran out of memory (decode_memory_gb: 1.5 GiB per worker): "
                             "cannot decode video: pyav: Cannot allocate memory")
    assert decoded.error_kind == "out_of_memory"


def test_fault_hook_rejects_what_it_does_not_know(job: DecodeJob, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_VARIABLE, "segfault:a,explode:b")
    with pytest.raises(ValueError, match="'explode:b' is not kind:substring"):
        DecodePool(job, workers=1)


def test_default_workers_leave_a_core_to_the_model_and_decode_on_every_other_beside_a_gpu(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(sizing, "CGROUP_CPU_MAX", cpu_max)
    for cores, expected, on_gpu in [(1, 1, 1), (2, 1, 1), (3, 2, 2), (5, 4, 4), (16, 4, 15), (64, 4, 32)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)), raising=False)
        assert (default_workers(), default_workers(accelerated=True)) == (expected, on_gpu)
    cpu_max.write_text("200000 100000\n")  # a container limited to 2 CPUs on a 64-core host
    assert default_workers() == default_workers(accelerated=True) == 1
    cpu_max.write_text("max 100000\n")
    assert default_workers() == 4


def test_decoded_items_travel_by_value(job: DecodeJob) -> None:
    """Results come back as pickled bytes (no /dev/shm), tensors owned by the parent."""
    item = MediaItem(str(SAMPLE_DATA / "ball_h264.mp4"), MediaType.VIDEO)
    with DecodePool(replace(job, frames=16), workers=1, timeout_s=60) as pool:
        decoded = pool.submit(0, item).result()
    assert decoded.prompt is not None and not decoded.prompt.pixel_values.is_shared()
    assert decoded.prompt.pixel_values.shape[0] == 16 and decoded.seconds > 0
