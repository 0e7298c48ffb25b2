"""The Tarsier (v1) network: transformers' CLIP vision tower and Llama LM plus what Tarsier adds.

Tarsier adds a two-layer projector and, for every frame, one `image_newline` embedding after
each row of patch vectors and one `image_new` embedding closing the frame. Both are rows of the
LM's input-embedding table. Module names match the checkpoint's key prefixes.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import CLIPVisionModel, LlamaForCausalLM
from transformers.activations import ACT2FN

from .config import TarsierConfig


class TarsierProjector(nn.Module):
    """Maps vision features into the LM's embedding space: linear, activation, linear."""

    def __init__(self, config: TarsierConfig):
        super().__init__()
        self.linear_1 = nn.Linear(config.vision.hidden_size, config.text.hidden_size, bias=True)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.text.hidden_size, config.text.hidden_size, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class TarsierModel(nn.Module):
    """Vision tower, projector and language model of a Tarsier v1 checkpoint."""

    def __init__(self, config: TarsierConfig):
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionModel(config.vision)
        self.multi_modal_projector = TarsierProjector(config)
        self.language_model = LlamaForCausalLM(config.text)

    def drop_unused_vision_layers(self) -> None:
        """Keep only the encoder layers up to `vision_feature_layer`.

        The selected hidden state is then the encoder's last output, so no other layer's
        activations are computed or kept. Call once, after the weights are loaded.
        """
        encoder = self.vision_tower.encoder
        keep = _layers_to_keep(len(encoder.layers), self.config.vision_feature_layer)
        encoder.layers = encoder.layers[:keep]

    def frame_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Per-frame vectors for the LM, shape (frames, tokens_per_frame, hidden).

        Expects `drop_unused_vision_layers` to have run, so the encoder output is the selected layer.
        """
        hidden = self.vision_tower(pixel_values=pixel_values).last_hidden_state
        patches = self.multi_modal_projector(hidden[:, 1:])  # drop the class token
        return self.add_frame_separators(patches)

    def add_frame_separators(self, patches: torch.Tensor) -> torch.Tensor:
        """Append `image_newline` after each row of patches and `image_new` after each frame."""
        frames, num_patches, hidden = patches.shape
        grid = math.isqrt(num_patches)
        embed = self.language_model.get_input_embeddings()
        rows = torch.tensor([self.config.image_newline_idx, self.config.image_new_idx], device=patches.device)
        newline, frame_end = embed(rows).to(patches.dtype)
        grid_view = patches.view(frames, grid, grid, hidden)
        with_newlines = torch.cat([grid_view, newline.expand(frames, grid, 1, hidden)], dim=2)
        return torch.cat([with_newlines.reshape(frames, grid * (grid + 1), hidden),
                          frame_end.expand(frames, 1, hidden)], dim=1)


def _layers_to_keep(num_layers: int, feature_layer: int) -> int:
    """How many encoder layers produce `hidden_states[feature_layer]` (index 0 is the embeddings)."""
    index = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 1 <= index <= num_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is out of range for {num_layers} layers")
    return index
