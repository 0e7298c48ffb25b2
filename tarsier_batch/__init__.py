"""tarsier-batch: offline batch captioning of videos and images with Tarsier models.

The public names are imported on first use, so that `tarsier --help` or a bad flag answers
without first loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {"Captioner": "api", "CaptionResult": "results", "CaptionSettings": "api",
            "SamplingParams": "engine", "MediaItem": "sources", "discover": "sources"}

if TYPE_CHECKING:
    from .api import Captioner, CaptionSettings
    from .results import CaptionResult
    from .engine import SamplingParams
    from .sources import MediaItem, discover


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CaptionResult", "CaptionSettings", "Captioner", "MediaItem", "SamplingParams", "__version__",
           "discover"]
