"""Model families behind one interface; `load_caption_model` picks the family from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import CaptionModel, ProcessedPrompt
from .tarsier import ARCHITECTURE as TARSIER_ARCHITECTURE
from .tarsier import TarsierCaptioner


def load_caption_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CaptionModel:
    """Load the checkpoint in `model_dir` with the family its config.json names."""
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model checkpoint")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    if TARSIER_ARCHITECTURE in architectures:
        return TarsierCaptioner(model_dir, dtype, device)
    raise ValueError(f"unsupported architecture {architectures} in {config_path}; "
                     f"supported: {TARSIER_ARCHITECTURE} (Tarsier v1)")


__all__ = ["CaptionModel", "ProcessedPrompt", "load_caption_model"]
