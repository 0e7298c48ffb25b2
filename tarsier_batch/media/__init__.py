"""Decode media files into RGB frames, sampled the way the official Tarsier loaders sample them.

One concern a module: `kinds` (extensions), `sampling` (frame indices), `timeline` (frame times, spans),
`loading` (the entry point), `video` (which decoder a video goes to), `decord_video` and `pyav_video` (the
two video decoders), `damage` (what they decode past: a file cut short, corrupt packets), `span_cache` (what a
worker keeps between a video's spans), `images` (Pillow: images, animations, image bombs), `diagnosis` (why a
file does not decode), `failures` and `memory` (shared by the decoders). Other units import the names below from
the package.
"""

from .damage import WARNING_KINDS
from .diagnosis import check_regular_file
from .frames import Media
from .images import MAX_IMAGE_PIXELS, open_image
from .kinds import MediaType, media_type_of
from .loading import decoder_versions, load_media
from .sampling import (
    FrameCount,
    FrameSampler,
    FramesAtRate,
    even_frame_indices,
    frame_indices,
    frame_indices_without_repeats,
    frames_in_words,
)
from .timeline import Span, Timeline, frames_in_span
from .video import decord_problem, frame_starts, video_timeline

__all__ = [
    "MAX_IMAGE_PIXELS",
    "FrameCount",
    "FrameSampler",
    "FramesAtRate",
    "even_frame_indices",
    "Media",
    "MediaType",
    "Span",
    "Timeline",
    "WARNING_KINDS",
    "check_regular_file",
    "decoder_versions",
    "decord_problem",
    "frame_indices",
    "frame_indices_without_repeats",
    "frame_starts",
    "frames_in_span",
    "frames_in_words",
    "load_media",
    "media_type_of",
    "open_image",
    "video_timeline",
]
