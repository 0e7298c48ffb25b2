"""Decode a media file into its sampled frames: the one entry point, whatever the file's kind."""

from __future__ import annotations

import importlib
from importlib import metadata

from ..errors import UNDECODABLE, ItemError
from .diagnosis import check_regular_file
from .frames import FrameTransform, Media
from .images import MAX_IMAGE_PIXELS, load_gif, load_image
from .kinds import MediaType
from .sampling import FrameCount, FrameSampler, frame_indices
from .timeline import Span
from .video import load_video


def load_media(path: str, media_type: MediaType, num_frames: FrameCount,
               frame_transform: FrameTransform | None = None, sampler: FrameSampler = frame_indices,
               max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
    """Decode `path` and sample `num_frames` frames with `sampler` (images give one frame; a `FramesAtRate` counts
    each clip's frames from its length and rate); with `span`, within
    that stretch of a video only, as if it were the whole file (`sample_span`).

    With `frame_transform`, each sampled frame is transformed soon after it is decoded and only
    the result is kept. Full-resolution frames are released before decoding goes on, except
    that video frames decord must decode in one pass (sampled frames between the same two
    keyframes) are decoded together first. A frame sampled twice (a video shorter than
    `num_frames`) is decoded and transformed once; its result appears at both places. An image or
    GIF of more than `max_image_pixels` pixels (None: any) fails without being decoded.
    """
    check_regular_file(path)
    if span is not None and media_type is not MediaType.VIDEO:
        raise ItemError(UNDECODABLE, f"a span ({span}) applies to videos only; this is {media_type.value}")
    if media_type is MediaType.VIDEO:
        return load_video(path, num_frames, frame_transform, sampler, span)
    if media_type is MediaType.GIF:
        return load_gif(path, num_frames, frame_transform, sampler, max_image_pixels)
    return load_image(path, num_frames, frame_transform, sampler, max_image_pixels)


def decoder_versions() -> dict[str, str]:
    """Versions of the frame decoders, recorded in the output's provenance."""
    pillow = installed_version("pillow", "PIL")
    return {"video": f"decord {installed_version('decord', 'decord')}",
            "video_fallback": f"pyav {installed_version('av', 'av')}", "gif": f"pillow {pillow}",
            "image": f"pillow {pillow}"}


def installed_version(distribution: str, module: str) -> str:
    """A package's version from its installed metadata: the process that records it decodes nothing, and
    importing decord and PyAV there only to ask costs ~0.2 s of every run's start."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:   # installed under another distribution's name
        return importlib.import_module(module).__version__
