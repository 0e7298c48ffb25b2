"""What decoding a file gives: its sampled frames, each transformed as soon as it is decoded, and its facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from .kinds import MediaType

# Applied to each sampled frame (an RGB PIL image) as soon as it is decoded, e.g. a model's
# preprocessing: then only its (much smaller) result is kept, never all full-resolution frames.
# The second argument is how many frames the item keeps (some models size frames by it).
FrameTransform = Callable[[Image.Image, int], Any]


@dataclass(frozen=True)
class Media:
    """Frames sampled from one file, with the facts about the file that end up in the output.

    `frames` holds RGB PIL images, or whatever the `frame_transform` given to `load_media`
    returned for each of them. Facts (`width`, `height`, ...) are always those of the file.
    """

    path: str
    media_type: MediaType
    frames: list[Any]
    frame_indices: list[int]
    width: int                # as displayed: after rotation and non-square pixels are applied
    height: int
    duration_s: float | None
    decoder: str              # what produced the frames: "decord", "pyav" or "pillow"
    warnings: tuple[str, ...] = ()   # damage decoding read past (`damage.WARNING_KINDS`)
    # The frame rate as the decoder reads the file (decord's average rate, the stream's in PyAV, an animation's
    # frames over its length): what the official processors divide frame indices by to time frames. None: unknown,
    # or a still image.
    fps: float | None = None


def finish_frame(frame: Image.Image, transform: FrameTransform | None, frame_count: int) -> Any:
    return frame if transform is None else transform(frame, frame_count)
