"""Loading a checkpoint with the family its config.json names (see `catalog` for the registry)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .catalog import FamilyInfo, family_of_config

if TYPE_CHECKING:
    import torch

    from .base import CaptionModel, Processor


def load_caption_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CaptionModel:
    """Load the checkpoint in `model_dir` with the family its config.json names."""
    return family_of_checkpoint(model_dir).code("loader")(model_dir, dtype, device)


def load_processor(model_dir: Path) -> Processor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights: what decoding takes."""
    return family_of_checkpoint(model_dir).code("processor_loader")(model_dir)


def family_of_checkpoint(model_dir: Path) -> FamilyInfo:
    """The family the checkpoint's config.json names, without loading anything."""
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a model checkpoint")
    return family_of_config(json.loads(config_path.read_text()), str(config_path))
