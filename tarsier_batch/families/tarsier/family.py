"""Tarsier v1 behind the family interface: the device model beside its CPU prompt processor (`processing`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base import KVGeometry, VisionBlock
from ..catalog import TARSIER
from ..decoder import DecoderCaptionModel
from ..generation_config import read_generation_defaults
from .config import TarsierConfig
from .processing import TarsierPromptProcessor
from .weights import load_model


class TarsierCaptionModel(DecoderCaptionModel):
    """A Tarsier v1 checkpoint loaded for captioning."""

    family = TARSIER

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.config = TarsierConfig.from_file(model_dir / "config.json")
        self.processor = TarsierPromptProcessor(model_dir, self.config)
        self.model = load_model(model_dir, self.config, dtype, device)
        self.dtype, self.device = dtype, device
        generation = read_generation_defaults(model_dir, self.processor.tokenizer.eos_token_id)
        self.eos_token_ids, self.repetition_penalty = generation.eos_token_ids, generation.repetition_penalty
        text = self.config.text
        self.kv_geometry = KVGeometry(
            num_layers=text.num_hidden_layers,
            kv_heads=text.num_key_value_heads or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    @torch.inference_mode()
    def encode_vision(self, pixels: list[torch.Tensor], blocks: list[VisionBlock]) -> list[torch.Tensor]:
        """Every v1 frame has the same size: the frames go through the tower stacked."""
        return list(self.model.frame_features(torch.stack(pixels).to(self.device, self.dtype)).unbind(0))
