"""Model families behind one interface; `load_caption_model` picks the family from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..catalog import TARSIER, TARSIER2, family_of_config
from .base import CaptionModel, ProcessedPrompt


def load_caption_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CaptionModel:
    """Load the checkpoint in `model_dir` with the family its config.json names."""
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model checkpoint")
    family = family_of_config(json.loads(config_path.read_text()), str(config_path))
    if family is TARSIER2:
        from .tarsier2 import Tarsier2Captioner

        return Tarsier2Captioner(model_dir, dtype, device)
    assert family is TARSIER
    from .tarsier import TarsierCaptioner

    return TarsierCaptioner(model_dir, dtype, device)


__all__ = ["CaptionModel", "ProcessedPrompt", "load_caption_model"]
