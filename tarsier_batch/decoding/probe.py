"""How long each video is, asked in worker processes before a run cuts its files into windows (`--segments
fixed`).

Opening a file runs native decoder code, which a hostile file can crash or hang: as when decoding, that
happens in a worker that can die alone, under a timeout. A video whose length cannot be read keeps its one
whole-file item, whose decoding then gives its row the reason.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future

from pebble import ProcessPool

from .. import storage
from ..inputs.sources import MediaItem, readable_copy
from ..media import video_duration
from .fork_server import start_decoding_server
from .workers import quiet_worker


def video_durations(items: list[MediaItem], workers: int, timeout_s: float | None) -> list[float | None]:
    """Each item's length in seconds (`media.video_duration`), None where it cannot be read."""
    if not items:
        return []
    start_decoding_server()
    pool = ProcessPool(workers, initializer=quiet_worker, initargs=(storage.environment(),),
                       context=multiprocessing.get_context("forkserver"))
    try:
        futures = [pool.schedule(_duration, (item,), timeout=timeout_s) for item in items]
        return [_duration_or_none(future) for future in futures]
    finally:
        pool.stop()
        pool.join()


def _duration(item: MediaItem) -> float:
    with readable_copy(item) as path:
        return video_duration(path)


def _duration_or_none(future: Future[float]) -> float | None:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - a crash, a timeout, an unreadable file: its decoding will say which
        return None
