"""Decode media files into RGB frames, sampled the way the official Tarsier loader samples them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from PIL import Image, ImageSequence


class MediaType(str, Enum):
    VIDEO = "video"
    GIF = "gif"
    IMAGE = "image"


VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".webm", ".mov", ".mkv", ".wmv"})
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})


def media_type_of(path: str | os.PathLike[str]) -> MediaType | None:
    """The media type implied by a file's extension (case-insensitive), or None if unsupported."""
    suffix = Path(path).suffix.lower()
    if suffix == ".gif":
        return MediaType.GIF
    if suffix in VIDEO_EXTENSIONS:
        return MediaType.VIDEO
    if suffix in IMAGE_EXTENSIONS:
        return MediaType.IMAGE
    return None


def frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """Uniform frame indices that include the first and the last frame.

    Matches the official formula exactly, including Python's half-to-even `round`; a clip
    shorter than `num_frames` repeats indices, and one requested frame is the first frame.
    """
    if total_frames < 1:
        raise ValueError("the clip has no frames")
    if num_frames < 1:
        raise ValueError("at least one frame must be requested")
    if num_frames == 1:
        return [0]
    return [round(i * (total_frames - 1) / (num_frames - 1)) for i in range(num_frames)]


@dataclass(frozen=True)
class Media:
    """Frames sampled from one file, with the facts about the file that end up in the output."""

    path: str
    media_type: MediaType
    frames: list[Image.Image]
    frame_indices: list[int]
    width: int
    height: int
    duration_s: float | None


def load_media(path: str, media_type: MediaType, num_frames: int) -> Media:
    """Decode `path` and sample `num_frames` frames (images give one frame)."""
    if media_type is MediaType.VIDEO:
        return _load_video(path, num_frames)
    if media_type is MediaType.GIF:
        return _load_gif(path, num_frames)
    return _load_image(path)


def decoder_versions() -> dict[str, str]:
    """Versions of the frame decoders, recorded in the output's provenance."""
    import decord
    import PIL

    return {"video": f"decord {decord.__version__}", "gif": f"pillow {PIL.__version__}",
            "image": f"pillow {PIL.__version__}"}


def _load_video(path: str, num_frames: int) -> Media:
    import decord

    decord.logging.set_level(decord.logging.QUIET)  # FFmpeg's own messages would garble the display
    reader = decord.VideoReader(path, num_threads=1, ctx=decord.cpu(0))
    total = len(reader)
    indices = frame_indices(total, num_frames)
    batch = reader.get_batch(indices).asnumpy()
    frames = [Image.fromarray(array).convert("RGB") for array in batch]
    fps = reader.get_avg_fps()
    height, width = batch.shape[1:3]
    return Media(path, MediaType.VIDEO, frames, indices, int(width), int(height),
                 total / fps if fps > 0 else None)


def _load_gif(path: str, num_frames: int) -> Media:
    # Like the official loader, walk the frames once and keep those whose index was sampled:
    # repeated indices collapse, so a short GIF yields fewer frames than requested.
    with Image.open(path) as gif:
        wanted = set(frame_indices(gif.n_frames, num_frames))
        frames: list[Image.Image] = []
        kept: list[int] = []
        duration_ms = 0
        for index, frame in enumerate(ImageSequence.Iterator(gif)):
            duration_ms += frame.info.get("duration", 0) or 0
            if index in wanted:
                frames.append(frame.convert("RGB"))
                kept.append(index)
        width, height = gif.size
    if not frames:
        raise ValueError("the GIF has no readable frames")
    return Media(path, MediaType.GIF, frames, kept, width, height,
                 duration_ms / 1000 if duration_ms else None)


def _load_image(path: str) -> Media:
    with Image.open(path) as image:
        frame = image.convert("RGB")
    return Media(path, MediaType.IMAGE, [frame], [0], frame.width, frame.height, None)
