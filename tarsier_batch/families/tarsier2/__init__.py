"""Tarsier2 (Tarsier2-Recap-7b, Tarsier2-7b-0115): Qwen2-VL in a LLaVA-style checkpoint."""

from .family import Tarsier2Captioner, Tarsier2PromptProcessor
from .modeling import Tarsier2Config, Tarsier2Model
from .positions import VisionSpan, mrope_positions

__all__ = ["Tarsier2Captioner", "Tarsier2Config", "Tarsier2Model", "Tarsier2PromptProcessor", "VisionSpan",
           "mrope_positions"]
