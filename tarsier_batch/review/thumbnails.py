"""Strips of the frames a caption was made from, re-extracted from each file at its recorded frame indices.

One small JPEG per item, the frames side by side (one image per item is smaller than one per
frame, and the page decodes one picture instead of eight). Decoding runs in worker processes;
a worker that crashes costs the items it was working on a placeholder, never the report.
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
CHUNK = 8   # items per task: few round trips, little lost to a crashed worker


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
    """A data: URI of the strip, or why there is none."""

    uri: str | None = None
    problem: str | None = None


def shown_indices(recorded: list[int], most: int) -> list[int]:
    """At most `most` of the recorded indices, evenly spread, first and last kept (0: all)."""
    if most <= 0 or len(recorded) <= most:
        return list(recorded)
    if most == 1:
        return [recorded[0]]
    return [recorded[round(step * (len(recorded) - 1) / (most - 1))] for step in range(most)]


def make_strips(jobs: list[StripJob], workers: int, on_done: Callable[[int], None] = lambda count: None
                ) -> list[Strip]:
    """Strips for `jobs`, in order, decoded by `workers` processes (0: in this process)."""
    if workers <= 0:
        strips = []
        for job in jobs:
            strips.append(make_strip(job))
            on_done(1)
        return strips
    chunks = [jobs[start:start + CHUNK] for start in range(0, len(jobs), CHUNK)]
    results: list[list[Strip]] = []
    for chunk_strips in _map_surviving_crashes(chunks, workers):
        results.append(chunk_strips)
        on_done(len(chunk_strips))
    return [strip for chunk in results for strip in chunk]


def _map_surviving_crashes(chunks: list[list[StripJob]], workers: int) -> Iterator[list[Strip]]:
    """`_strips_of` over the chunks, in order; a broken pool fails its chunk and a new pool goes on."""
    context = quiet_fork_server(["decord", "av", __name__])   # FFmpeg's log lines stay off the terminal
    start = 0
    while start < len(chunks):
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [pool.submit(_strips_of, chunk) for chunk in chunks[start:]]
            for future in futures:
                try:
                    yield future.result()
                except BrokenProcessPool:
                    yield [Strip(problem="the decoder crashed") for _ in chunks[start]]
                    start += 1
                    break
                start += 1


def _strips_of(chunk: list[StripJob]) -> list[Strip]:
    return [make_strip(job) for job in chunk]


def make_strip(job: StripJob) -> Strip:
    """The frames at `job.indices`, each scaled to `job.height` px high, side by side, as a JPEG data: URI."""
    indices = list(job.indices)

    def small(frame: Image.Image, count: int) -> Image.Image:
        width = max(1, round(frame.width * job.height / frame.height))
        return frame.convert("RGB").resize((width, job.height), Image.Resampling.BILINEAR)

    os.environ.update(job.storage_environment)
    try:
        # An object or a shard's member is read into a local copy first; a file is read where it is.
        item = item_of_path(job.path) if is_url(job.path) or split_member_path(job.path) else None
        item = item or MediaItem(job.path, MediaType(job.media_type))
        with readable_copy(item) as path:
            media = load_media(path, MediaType(job.media_type), len(indices), frame_transform=small,
                               sampler=lambda total, wanted: [index for index in indices if index < total])
    except Exception as error:  # the file changed, vanished or no longer decodes: say so on the page
        return Strip(problem=redact_text(str(error) if isinstance(error, ValueError) else one_line(error)))
    frames: list[Any] = media.frames
    if not frames:
        return Strip(problem="no frame at the recorded indices (the file changed?)")
    strip = Image.new("RGB", (sum(frame.width for frame in frames) + 2 * (len(frames) - 1), job.height), "white")
    left = 0
    for frame in frames:
        strip.paste(frame, (left, 0))
        left += frame.width + 2
    buffer = io.BytesIO()
    strip.save(buffer, "JPEG", quality=JPEG_QUALITY, optimize=True)
    return Strip(uri="data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"))
