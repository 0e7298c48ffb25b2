"""What cutting each video into rows needs of it, read in worker processes before a run plans its segments
(`--segments`): its length, and for scenes where its shots change.

Opening a file runs native decoder code, which a hostile file can crash or hang: as when decoding, that
happens in a worker that can die alone. Lengths are read first, under the decoding timeout; scene detection
reads every frame, so it may take twice the video's own length on top. A video whose facts cannot be read
keeps its one whole-file item, whose decoding then gives its row the reason.

Scene detection is the slow part (minutes for an hour of video), so its cuts are kept in the tool's cache
(`storage.cache_home()/scenes`), by the file's key (its content's identity) and the detector's settings: a run
that continues an output, or captions the same files again, does not detect them again.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from pebble import ProcessPool

from .. import storage
from ..inputs.copies import readable_copy
from ..inputs.segments import Segmenting, VideoFacts
from ..inputs.sources import MediaItem
from ..media import Timeline, video_timeline
from .fork_server import quiet_worker
from .scenes import cut_times

DETECTION_S_PER_VIDEO_S = 2.0   # scene detection's time limit, on top of the decoding timeout
T = TypeVar("T")


def video_facts(items: list[MediaItem], segmenting: Segmenting, workers: int, timeout_s: float | None,
                meanwhile: Callable[[], object] | None = None) -> list[VideoFacts | None]:
    """Each item's `VideoFacts` as `segmenting` needs them, None where they cannot be read. `meanwhile` runs in
    this process while the workers read (a run loads its model then): a worker's start alone, a fresh interpreter
    importing the command's module and the decoders, is about half a second."""
    scenes = segmenting.mode == "scenes"
    known: dict[int, VideoFacts] = {}
    if scenes:
        known = {index: facts for index, item in enumerate(items) if (facts := _kept_cuts(item, segmenting))}
    unknown = [index for index in range(len(items)) if index not in known]
    if not unknown:
        if meanwhile is not None:
            meanwhile()
        return [known[index] for index in range(len(items))]
    # Fresh interpreters, not the decoding fork server: reading lengths and cuts needs the decoders alone, where
    # that server first imports torch and the model's processor (seconds before a first worker, and all of a
    # dry run's time). As many as there are videos to read, at most `workers`.
    pool = ProcessPool(min(workers, len(unknown)), initializer=quiet_worker,
                       initargs=(storage.environment(credentials=True),), context=multiprocessing.get_context("spawn"))
    try:
        lengths = {index: pool.schedule(_length, (items[index],), timeout=timeout_s) for index in unknown}
        if meanwhile is not None:
            meanwhile()
        measured = {index: _result_or_none(future) for index, future in lengths.items()}
        if not scenes:
            return [None if measured[index] is None else VideoFacts(measured[index][0], by_frames=measured[index][1])
                    for index in range(len(items))]
        detections = {index: pool.schedule(_cuts, (items[index], segmenting),
                                           timeout=None if timeout_s is None
                                           else timeout_s + DETECTION_S_PER_VIDEO_S * length[0])
                      for index, length in measured.items() if length is not None}
        for index, future in detections.items():
            cuts = _result_or_none(future)
            duration_s, by_frames = measured[index]   # type: ignore[misc]
            if cuts is not None:
                known[index] = VideoFacts(duration_s, tuple(cuts), by_frames)
                _keep_cuts(items[index], segmenting, known[index])
        return [known.get(index) for index in range(len(items))]
    finally:
        pool.stop()
        pool.join()


def _length(item: MediaItem) -> tuple[float, bool]:
    """The video's length, and whether its time is counted in frames (`media.Timeline.by_frames`)."""
    with readable_copy(item) as path:
        timeline: Timeline = video_timeline(path)
        return timeline.duration_s, timeline.by_frames


def _cuts(item: MediaItem, segmenting: Segmenting) -> list[float]:
    with readable_copy(item) as path:
        return cut_times(path, segmenting.threshold, segmenting.min_s)


def _result_or_none(future: Future[T]) -> T | None:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - a crash, a timeout, an unreadable file: its decoding will say which
        return None


# --- the cache of cuts -----------------------------------------------------------------------------------


def _cache_file(item: MediaItem, segmenting: Segmenting) -> Path | None:
    """Where `item`'s cuts under `segmenting`'s detector settings are kept; None for an item without a key
    (its content has no identity to trust)."""
    if item.key is None:
        return None
    detector = f"threshold={segmenting.threshold:g},min={segmenting.min_s:g}"
    digest = hashlib.sha256(f"{item.key}\n{detector}".encode()).hexdigest()[:32]
    return storage.cache_home() / "scenes" / f"{digest}.json"


def _kept_cuts(item: MediaItem, segmenting: Segmenting) -> VideoFacts | None:
    path = _cache_file(item, segmenting)
    try:
        kept = json.loads(path.read_text()) if path is not None else None
        if kept is None or kept["key"] != item.key:   # a digest's collision, however unlikely, is not a hit
            return None
        return VideoFacts(float(kept["duration_s"]), tuple(float(cut) for cut in kept["cuts_s"]),
                          bool(kept.get("by_frames", False)))
    except (OSError, ValueError, KeyError, TypeError):   # none kept, or a damaged file: detect again
        return None


def _keep_cuts(item: MediaItem, segmenting: Segmenting, facts: VideoFacts) -> None:
    path = _cache_file(item, segmenting)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")   # runs writing at once each write their own
        temporary.write_text(json.dumps({"key": item.key, "duration_s": facts.duration_s,
                                         "cuts_s": list(facts.cuts_s), "by_frames": facts.by_frames}))
        temporary.replace(path)
    except OSError:   # a read-only or full cache only costs the next run the detection
        return
