"""Strips of the frames a caption was made from, re-extracted from each file at its recorded frame indices.

One small JPEG per item, the frames side by side (one image per item is smaller than one per
frame, and the page decodes one picture instead of eight). A file is opened and decoded once for
all the strips it gives (a long video's segments: one pass, not one per segment). Decoding runs in
worker processes; a worker that crashes costs the strips it was working on a placeholder, never
the report.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ..errors import one_line
from ..inputs.copies import readable_copy
from ..inputs.sources import MediaItem, item_of_path
from ..inputs.tars import split_member_path
from ..media import MediaType, load_media
from ..storage import environment, is_url, redact_text
from ..workers.fork_server import quiet_fork_server

JPEG_QUALITY = 70
STRIPS_PER_TASK = 32   # strips of one file per task: few round trips, little lost to a crashed worker


@dataclass(frozen=True)
class StripJob:
    path: str
    media_type: str
    indices: tuple[int, ...]
    height: int
    # The object-store settings and credentials of the process that asked (the fork server's children keep its
    # environment; see `storage.environment`). Never in a repr.
    storage_environment: dict[str, str] = field(default_factory=lambda: environment(credentials=True), repr=False)


@dataclass
class Strip:
    """The strip as JPEG bytes, or why there is none."""

    jpeg: bytes | None = None
    problem: str | None = None

    @property
    def uri(self) -> str | None:
        """The strip as a data: URI, to inline in a page."""
        return None if self.jpeg is None else "data:image/jpeg;base64," + base64.b64encode(self.jpeg).decode("ascii")


@dataclass(frozen=True)
class FileStrips:
    """Several strips of one file (a long video's segments, or items that show the same frames): decoded once."""

    path: str
    media_type: str
    height: int
    wanted: tuple[tuple[int, ...], ...]   # each strip's frame indices
    storage_environment: dict[str, str] = field(repr=False)


def shown_indices(recorded: list[int], most: int) -> list[int]:
    """At most `most` of the recorded indices, evenly spread, first and last kept (0: all)."""
    if most <= 0 or len(recorded) <= most:
        return list(recorded)
    if most == 1:
        return [recorded[0]]
    return [recorded[round(step * (len(recorded) - 1) / (most - 1))] for step in range(most)]


def make_strips(jobs: list[StripJob], workers: int, on_done: Callable[[int], None] = lambda count: None
                ) -> list[Strip]:
    """Strips for `jobs`, in order, decoded by `workers` processes (0: in this process).

    Jobs of one file are decoded together (a file is opened, and its frames decoded, once for all its segments'
    strips); identical jobs share one strip.
    """
    tasks, places = _file_tasks(jobs)
    made: list[list[Strip]] = []
    for task_strips in _strips_of_tasks(tasks, workers):
        made.append(task_strips)
        on_done(sum(len(place) for place in places[len(made) - 1]))
    strips: list[Strip] = [Strip() for _ in jobs]
    for task_strips, task_places in zip(made, places):
        for strip, place in zip(task_strips, task_places):
            for index in place:
                strips[index] = strip
    return strips


def _file_tasks(jobs: list[StripJob]) -> tuple[list[FileStrips], list[list[list[int]]]]:
    """The jobs as tasks of at most STRIPS_PER_TASK distinct strips of one file each, and for each task's strips
    the places (indices in `jobs`) they fill."""
    by_file: dict[tuple[str, str, int], dict[tuple[int, ...], list[int]]] = {}
    for index, job in enumerate(jobs):
        by_file.setdefault((job.path, job.media_type, job.height), {}).setdefault(job.indices, []).append(index)
    tasks: list[FileStrips] = []
    places: list[list[list[int]]] = []
    for (path, media_type, height), strips in by_file.items():
        wanted = list(strips)
        for start in range(0, len(wanted), STRIPS_PER_TASK):
            chunk = wanted[start:start + STRIPS_PER_TASK]
            first = strips[chunk[0]][0]
            tasks.append(FileStrips(path, media_type, height, tuple(chunk), jobs[first].storage_environment))
            places.append([strips[indices] for indices in chunk])
    return tasks, places


def _strips_of_tasks(tasks: list[FileStrips], workers: int) -> Iterator[list[Strip]]:
    """`file_strips` of each task, in order: here (`workers` 0), or in a pool where a broken pool fails its task
    and a new pool goes on."""
    if workers <= 0:
        yield from (file_strips(task) for task in tasks)
        return
    context = quiet_fork_server(["decord", "av", __name__])   # FFmpeg's log lines stay off the terminal
    start = 0
    while start < len(tasks):
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [pool.submit(file_strips, task) for task in tasks[start:]]
            for future in futures:
                try:
                    yield future.result()
                except BrokenProcessPool:
                    yield [Strip(problem="the decoder crashed") for _ in tasks[start].wanted]
                    start += 1
                    break
                start += 1


def make_strip(job: StripJob) -> Strip:
    """The frames at `job.indices`, each scaled to `job.height` px high, side by side, as a JPEG."""
    return file_strips(FileStrips(job.path, job.media_type, job.height, (job.indices,), job.storage_environment))[0]


def file_strips(task: FileStrips) -> list[Strip]:
    """Each strip of `task`, from one decoding of the file at every index any of them shows."""
    os.environ.update(task.storage_environment)
    every = sorted({index for indices in task.wanted for index in indices})

    def small(frame: Image.Image, count: int) -> Image.Image:
        width = max(1, round(frame.width * task.height / frame.height))
        # reducing_gap: shrink by a whole factor first (a box filter), then resample: a 1280 x 720 frame to 72 px
        # high in about a third of the time of one bilinear pass over the whole frame, and alike to the eye.
        return frame.convert("RGB").resize((width, task.height), Image.Resampling.BILINEAR, reducing_gap=2.0)

    try:
        # An object or a shard's member is read into a local copy first; a file is read where it is.
        item = item_of_path(task.path) if is_url(task.path) or split_member_path(task.path) else None
        item = item or MediaItem(task.path, MediaType(task.media_type))
        with readable_copy(item) as path:
            media = load_media(path, MediaType(task.media_type), len(every), frame_transform=small,
                               sampler=lambda total, wanted: [index for index in every if index < total])
    except Exception as error:  # the file changed, vanished or no longer decodes: say so on the page
        problem = redact_text(str(error) if isinstance(error, ValueError) else one_line(error))
        return [Strip(problem=problem) for _ in task.wanted]
    frames = dict(zip(media.frame_indices, media.frames))
    return [_strip([frames[index] for index in indices if index in frames], task.height) for indices in task.wanted]


def _strip(frames: list[Any], height: int) -> Strip:
    if not frames:
        return Strip(problem="no frame at the recorded indices (the file changed?)")
    strip = Image.new("RGB", (sum(frame.width for frame in frames) + 2 * (len(frames) - 1), height), "white")
    left = 0
    for frame in frames:
        strip.paste(frame, (left, 0))
        left += frame.width + 2
    buffer = io.BytesIO()
    strip.save(buffer, "JPEG", quality=JPEG_QUALITY, optimize=True)
    return Strip(jpeg=buffer.getvalue())
