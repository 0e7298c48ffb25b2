"""Tarsier v1 (Tarsier-7b, Tarsier-34b): LLaVA-style CLIP + Llama with frame separators."""

from .family import TarsierCaptioner, TarsierPromptProcessor, merged_layout
from .modeling import ARCHITECTURE, TarsierConfig, TarsierModel

__all__ = ["ARCHITECTURE", "TarsierCaptioner", "TarsierConfig", "TarsierModel", "TarsierPromptProcessor",
           "merged_layout"]
