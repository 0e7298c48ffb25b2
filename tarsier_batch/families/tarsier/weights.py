"""Read and write Tarsier v1 weights in the official safetensors layout."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from ..weights import load_weights, save_weights
from .config import TarsierConfig
from .modeling import TarsierModel

# transformers 5 flattened CLIPVisionModel (no `vision_model.` level); the checkpoints keep it.
_CHECKPOINT_VISION_PREFIX = "vision_tower.vision_model."
_MODULE_VISION_PREFIX = "vision_tower."


def checkpoint_to_module_key(key: str) -> str:
    """The module name a checkpoint key loads into."""
    if key.startswith(_CHECKPOINT_VISION_PREFIX):
        return _MODULE_VISION_PREFIX + key[len(_CHECKPOINT_VISION_PREFIX):]
    return key


def module_to_checkpoint_key(key: str) -> str:
    """The checkpoint key a module parameter is saved under (the official names)."""
    if key.startswith(_MODULE_VISION_PREFIX):
        return _CHECKPOINT_VISION_PREFIX + key[len(_MODULE_VISION_PREFIX):]
    return key


def load_model(model_dir: Path, config: TarsierConfig, dtype: torch.dtype, device: torch.device) -> TarsierModel:
    """Build the network without random initialisation and fill it from the checkpoint."""
    with no_init_weights():
        model = TarsierModel(config)
    load_weights(model, model_dir, dtype, device, "Tarsier v1", checkpoint_to_module_key, module_to_checkpoint_key)
    model.drop_unused_vision_layers()
    return model.to(device).eval()


def save_model(model: TarsierModel, model_dir: Path) -> None:
    """Write the weights as one safetensors file with the official key names."""
    save_weights(model, model_dir, module_to_checkpoint_key)
