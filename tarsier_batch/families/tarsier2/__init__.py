"""Tarsier2 (Tarsier2-Recap-7b, Tarsier2-7b-0115): Qwen2-VL in a LLaVA-style checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..qwen_vl.positions import VisionSpan, mrope_positions
from .family import Tarsier2CaptionModel, Tarsier2PromptProcessor
from .modeling import Tarsier2Config, Tarsier2Model


def load_processor(model_dir: Path) -> Tarsier2PromptProcessor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights."""
    return Tarsier2PromptProcessor(model_dir, Tarsier2Config.from_file(model_dir / "config.json"))


__all__ = ["Tarsier2CaptionModel", "Tarsier2Config", "Tarsier2Model", "Tarsier2PromptProcessor", "VisionSpan",
           "load_processor", "mrope_positions"]
