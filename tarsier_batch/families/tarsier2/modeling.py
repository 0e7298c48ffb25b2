"""The Tarsier2 network: transformers' Qwen2-VL vision tower and Qwen2-VL language model.

The checkpoints (Tarsier2-Recap-7b, Tarsier2-7b-0115) are LLaVA-style, not Qwen2-VL-style:
`model_type "llava"` with a flat Qwen2-VL `text_config`, and weights under `vision_tower.`
(the Qwen2-VL ViT with its patch merger; no separate projector) and `language_model.`
(`model.` for the decoder, `lm_head.` untied). Module names here match those keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel, Qwen2VLTextModel

from ..qwen_vl.network import LanguageModel, compile_frame_batched, frame_batched, tower_features

MODEL_TYPE = "llava"
TEXT_MODEL_TYPE = "qwen2_vl"
# Keys of the official sub-configs that only steer the official code's class loading or its
# flash-attention choice; this implementation picks its own modules and attention.
_LOADER_KEYS = ("model_type", "auto_map", "attn_implementation", "_attn_implementation", "architectures")


@dataclass(frozen=True)
class Tarsier2Config:
    """The parts of a Tarsier2 `config.json` this implementation uses."""

    vision: Qwen2VLVisionConfig
    text: Qwen2VLTextConfig
    image_token_id: int          # <|image_pad|>: where vision vectors go, for images and videos alike
    vision_start_token_id: int   # <|vision_start|>, which opens every vision block
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Tarsier2Config:
        text_raw = raw.get("text_config") or {}
        if raw.get("model_type") != MODEL_TYPE or text_raw.get("model_type") != TEXT_MODEL_TYPE:
            raise ValueError(f"not a Tarsier2 checkpoint: expected model_type {MODEL_TYPE!r} with a "
                             f"{TEXT_MODEL_TYPE!r} text_config, found {raw.get('model_type')!r} with "
                             f"{text_raw.get('model_type')!r}")
        image_token_id = raw.get("image_token_index", text_raw.get("image_token_id"))
        if image_token_id is None or text_raw.get("image_token_id", image_token_id) != image_token_id:
            raise ValueError(f"config.json: image_token_index {raw.get('image_token_index')} and "
                             f"text_config.image_token_id {text_raw.get('image_token_id')} must name the same token")
        if "vision_start_token_id" not in text_raw:
            raise ValueError("config.json: text_config has no vision_start_token_id")
        vision = Qwen2VLVisionConfig(**_without_loader_keys(raw.get("vision_config") or {}))
        text = Qwen2VLTextConfig(**_without_loader_keys(text_raw))
        # The engine brings its own attention; the vision tower uses PyTorch SDPA (the official
        # code requires flash-attn, which computes the same block-diagonal attention).
        vision._attn_implementation = text._attn_implementation = "sdpa"
        return cls(vision=vision, text=text, image_token_id=int(image_token_id),
                   vision_start_token_id=int(text_raw["vision_start_token_id"]), raw=raw)

    @classmethod
    def from_file(cls, path: Path) -> Tarsier2Config:
        return cls.from_dict(json.loads(path.read_text()))


def _without_loader_keys(raw: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in raw.items() if key not in _LOADER_KEYS}


class Tarsier2Model(nn.Module):
    """Vision tower (ViT + patch merger) and language model of a Tarsier2 checkpoint."""

    def __init__(self, config: Tarsier2Config):
        super().__init__()
        self.config = config
        self.vision_tower = frame_batched(Qwen2VisionTransformerPretrainedModel(config.vision))
        text = config.text
        self.language_model = LanguageModel(Qwen2VLTextModel(text), text.hidden_size, text.vocab_size)

    def compile_vision(self) -> None:
        """Run the vision blocks' work around their attention through torch.compile from now on."""
        compile_frame_batched(self.vision_tower)

    def vision_features(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged vision vectors (sum of t*h*w/4 over the blocks, hidden) for the blocks' patches (`tower_features`)."""
        return tower_features(self.vision_tower, patches, grids)
