"""What cutting each video into rows needs of it, read in worker processes before a run plans its segments
(`--segments`): its length, and for scenes where its shots change.

Opening a file runs native decoder code, which a hostile file can crash or hang: as when decoding, that
happens in a worker that can die alone (under the decoding timeout for lengths; scene detection reads every
frame, so it runs as long as the video needs). A video whose facts cannot be read keeps its one whole-file
item, whose decoding then gives its row the reason.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future

from pebble import ProcessPool

from .. import storage
from ..inputs.segments import Segmenting, VideoFacts
from ..inputs.sources import MediaItem, readable_copy
from ..media import video_duration
from .fork_server import start_decoding_server
from .scenes import cut_times
from .workers import quiet_worker


def video_facts(items: list[MediaItem], segmenting: Segmenting, workers: int,
                timeout_s: float | None) -> list[VideoFacts | None]:
    """Each item's `VideoFacts` as `segmenting` needs them, None where they cannot be read."""
    if not items:
        return []
    start_decoding_server()
    pool = ProcessPool(workers, initializer=quiet_worker, initargs=(storage.environment(),),
                       context=multiprocessing.get_context("forkserver"))
    try:
        futures = [pool.schedule(_facts, (item, segmenting),
                                 timeout=None if segmenting.mode == "scenes" else timeout_s) for item in items]
        return [_facts_or_none(future) for future in futures]
    finally:
        pool.stop()
        pool.join()


def _facts(item: MediaItem, segmenting: Segmenting) -> VideoFacts:
    with readable_copy(item) as path:
        duration = video_duration(path)
        if segmenting.mode != "scenes":
            return VideoFacts(duration)
        return VideoFacts(duration, tuple(cut_times(path, segmenting.threshold, segmenting.min_s)))


def _facts_or_none(future: Future[VideoFacts]) -> VideoFacts | None:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - a crash, a timeout, an unreadable file: its decoding will say which
        return None
