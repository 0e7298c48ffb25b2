"""Tarsier v1 (Tarsier-7b, Tarsier-34b): LLaVA-style CLIP + Llama with frame separators."""

from __future__ import annotations

from pathlib import Path

from .family import TarsierCaptionModel, TarsierPromptProcessor, merged_layout
from .modeling import ARCHITECTURE, TarsierConfig, TarsierModel


def load_processor(model_dir: Path) -> TarsierPromptProcessor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights."""
    return TarsierPromptProcessor(model_dir, TarsierConfig.from_file(model_dir / "config.json"))


__all__ = ["ARCHITECTURE", "TarsierCaptionModel", "TarsierConfig", "TarsierModel", "TarsierPromptProcessor",
           "load_processor", "merged_layout"]
