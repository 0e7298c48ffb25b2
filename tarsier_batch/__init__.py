"""tarsier-batch: offline batch captioning of videos and images with Tarsier models."""

__version__ = "0.1.0"

from .api import Captioner, CaptionResult, CaptionSettings  # noqa: E402
from .engine import SamplingParams  # noqa: E402
from .sources import MediaItem, discover  # noqa: E402

__all__ = ["CaptionResult", "CaptionSettings", "Captioner", "MediaItem", "SamplingParams", "__version__",
           "discover"]
