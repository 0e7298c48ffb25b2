"""Decoding in worker processes: same results as in-process, and every failure stays one item's error."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch

from tarsier_batch.media import MediaType
from tarsier_batch.sources import MediaItem
from tarsier_batch.workers import FAULT_VARIABLE, DecodeJob, DecodePool, decode_item


@pytest.fixture(scope="module")
def job(tiny_model) -> DecodeJob:
    return DecodeJob(tiny_model.processor, 8, None)


def items(shared_media: Path) -> list[MediaItem]:
    return [MediaItem(str(shared_media / "demo_test.mp4"), MediaType.VIDEO),
            MediaItem(str(shared_media / "clip_5f.gif"), MediaType.GIF),
            MediaItem(str(shared_media / "tarsier_logo.jpg"), MediaType.IMAGE, prompt="Name the logo.")]


def test_workers_give_exactly_the_in_process_results(job: DecodeJob, shared_media: Path) -> None:
    with DecodePool(job, workers=2, timeout_s=60, memory_limit_bytes=4 * 2**30) as pool:
        futures = [pool.submit(index, item) for index, item in enumerate(items(shared_media))]
        results = [future.result() for future in futures]
    for index, (item, decoded) in enumerate(zip(items(shared_media), results)):
        expected = decode_item(job, index, item)
        assert decoded.error is None and decoded.index == index and decoded.item == item
        assert decoded.media == expected.media and decoded.media is not None and decoded.media.frames == []
        assert decoded.prompt is not None and expected.prompt is not None
        assert torch.equal(decoded.prompt.pixel_values, expected.prompt.pixel_values)
        assert torch.equal(decoded.prompt.token_ids, expected.prompt.token_ids)
        assert decoded.prompt.vision_blocks == expected.prompt.vision_blocks
        assert decoded.prompt.instruction == expected.prompt.instruction
    assert results[2].prompt is not None and results[2].prompt.instruction == "Name the logo."


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch, shared_media: Path, tmp_path: Path) -> dict[str, MediaItem]:
    """Links named after the fault each one triggers (the hook matches a substring of the path)."""
    monkeypatch.setenv(FAULT_VARIABLE, "segfault:crash-me,hang:hang-me,oom:eat-me")
    made = {}
    for name in ["crash-me", "hang-me", "eat-me", "fine"]:
        link = tmp_path / f"{name}.gif"
        link.symlink_to(shared_media / "clip_5f.gif")
        made[name] = MediaItem(str(link), MediaType.GIF)
    return made


def test_crash_hang_and_memory_blowup_cost_one_item_each(job: DecodeJob, faulty: dict[str, MediaItem]) -> None:
    with DecodePool(job, workers=1, timeout_s=3, memory_limit_bytes=2 * 2**30) as pool:
        crash, after_crash = pool.submit(0, faulty["crash-me"]).result(), pool.submit(1, faulty["fine"]).result()
        hang, after_hang = pool.submit(2, faulty["hang-me"]).result(), pool.submit(3, faulty["fine"]).result()
        oom, after_oom = pool.submit(4, faulty["eat-me"]).result(), pool.submit(5, faulty["fine"]).result()
    assert crash.error == "the decoder crashed (SIGSEGV)"
    assert hang.error == "decoding took longer than 3 s (--decode-timeout); the worker was stopped"
    assert oom.error == "decoding ran out of memory (limit 2 GiB per worker, --decode-memory-gb)"
    for fine in (after_crash, after_hang, after_oom):  # each time a fresh worker took over
        assert fine.error is None and fine.prompt is not None


def test_corrupt_file_is_an_ordinary_error(job: DecodeJob, tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(os.urandom(4096))
    with DecodePool(job, workers=1, timeout_s=30) as pool:
        decoded = pool.submit(0, MediaItem(str(broken), MediaType.VIDEO)).result()
    assert decoded.error is not None and decoded.error.startswith("ValueError: cannot decode video: decord: Error reading")
    assert decoded.prompt is None and decoded.media is None


def test_shutdown_stops_a_hung_worker_and_leaves_no_worker(job: DecodeJob, faulty: dict[str, MediaItem]) -> None:
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    pool = DecodePool(job, workers=1, timeout_s=None)
    hung = pool.submit(0, faulty["hang-me"])
    queued = pool.submit(1, faulty["fine"])
    workers = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    pool.shutdown()
    assert hung.result().error is not None and queued.result().error is not None
    # The fork server and the resource tracker live as long as this process; the workers are gone.
    alive = [child for child in workers if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert all("forkserver" in " ".join(child.cmdline()) or "resource_tracker" in " ".join(child.cmdline())
               for child in alive), [child.cmdline() for child in alive]
