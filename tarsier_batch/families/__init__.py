"""Model families behind one interface; `load_caption_model` picks the family from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..catalog import TARSIER, TARSIER2, FamilyInfo, family_of_config
from .base import CaptionModel, ProcessedPrompt, Processor


def load_caption_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CaptionModel:
    """Load the checkpoint in `model_dir` with the family its config.json names."""
    if _family_of(model_dir) is TARSIER2:
        from .tarsier2 import Tarsier2Captioner

        return Tarsier2Captioner(model_dir, dtype, device)
    from .tarsier import TarsierCaptioner

    return TarsierCaptioner(model_dir, dtype, device)


def load_processor(model_dir: Path) -> Processor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights: what decoding takes."""
    if _family_of(model_dir) is TARSIER2:
        from .tarsier2 import Tarsier2Config, Tarsier2PromptProcessor

        return Tarsier2PromptProcessor(model_dir, Tarsier2Config.from_file(model_dir / "config.json"))
    from .tarsier import TarsierConfig, TarsierPromptProcessor

    return TarsierPromptProcessor(model_dir, TarsierConfig.from_file(model_dir / "config.json"))


def _family_of(model_dir: Path) -> FamilyInfo:
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model checkpoint")
    family = family_of_config(json.loads(config_path.read_text()), str(config_path))
    assert family in (TARSIER, TARSIER2)
    return family


__all__ = ["CaptionModel", "ProcessedPrompt", "Processor", "load_caption_model", "load_processor"]
