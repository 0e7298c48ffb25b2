"""Tarsier v1 (Tarsier-7b, Tarsier-34b): LLaVA-style CLIP + Llama with frame separators."""

from .family import TarsierCaptioner, merge_frame_features
from .modeling import ARCHITECTURE, TarsierConfig, TarsierModel

__all__ = ["ARCHITECTURE", "TarsierCaptioner", "TarsierConfig", "TarsierModel", "merge_frame_features"]
