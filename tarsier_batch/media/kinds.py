"""What kind of media a file holds, by its name's extension."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path


class MediaType(str, Enum):
    VIDEO = "video"
    GIF = "gif"
    IMAGE = "image"


VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".webm", ".mov", ".mkv", ".wmv", ".ts", ".m4v", ".mpg", ".mpeg",
                              ".3gp", ".flv"})
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
