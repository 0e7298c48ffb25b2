"""Modules the Qwen2-VL-lineage networks share: the language model named as the checkpoints name it, the vision
tower run frame-batched where its blocks allow it, and the device model's common half."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionBlock

from ..base import KVGeometry, VisionBlock
from ..decoder import DecoderCaptionModel
from ..generation_config import read_generation_defaults
from .vision import BLOCK_STEPS, FrameBatchedVisionBlock


class LanguageModel(nn.Module):
    """The decoder (`model`) and its output head (`lm_head`), named as the checkpoints' keys under their prefix.

    `decoder` is a transformers text model of the lineage (Qwen2VLTextModel, Qwen2_5_VLTextModel); with
    `tied`, the head shares the embedding matrix (checkpoints that store no `lm_head.weight`)."""

    def __init__(self, decoder: nn.Module, hidden_size: int, vocab_size: int, tied: bool = False):
        super().__init__()
        self.model = decoder
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tied = tied
        self.tie()

    def tie(self) -> None:
        """Share the embedding matrix with the head where the checkpoint ties them (again after loading)."""
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def tower_features(tower: nn.Module, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """Merged vision vectors (sum of t*h*w/4 over the blocks, hidden) for the blocks' patches; a tower with
    DeepStack mergers (Qwen3-VL) appends each merger's vectors along the hidden axis, (vectors, hidden * (1 + n)),
    so that the engine carries them wherever it puts a vision vector.

    `grids` holds each block's (t, h, w) in patches. Patches of different blocks never attend
    to each other, and within a block only those of one temporal patch do.
    """
    grid_thw = torch.tensor(grids, dtype=torch.long, device=patches.device)
    extra: dict[str, Any] = {}
    if isinstance(tower.blocks[0], FrameBatchedVisionBlock):
        extra["frame_lengths"] = [h * w for t, h, w in grids for _ in range(t)]
    dtype = tower.patch_embed.proj.weight.dtype
    output = tower(patches.to(dtype), grid_thw=grid_thw, **extra)
    deepstack = getattr(output, "deepstack_features", None)
    return torch.cat([output.pooler_output, *deepstack], dim=-1) if deepstack else output.pooler_output


def compile_frame_batched(tower: nn.Module) -> None:
    """Run a tower's frame-batched blocks' work around their attention through torch.compile from now on."""
    if isinstance(tower.blocks[0], FrameBatchedVisionBlock):
        steps = BLOCK_STEPS.compiled()
        for block in tower.blocks:
            block.steps = steps


def frame_batched(tower: nn.Module) -> nn.Module:
    """`tower` with its Qwen2-VL blocks run frame-batched (the same modules and weights; Qwen2.5-VL's windowed
    blocks are left as they are)."""
    for block in tower.blocks:
        if type(block) is Qwen2VLVisionBlock:
            block.__class__ = FrameBatchedVisionBlock
    return tower


class LineageCaptionModel(DecoderCaptionModel):
    """The device half the lineage shares: `self.model` has `vision_features(patches, grids)`,
    `compile_vision()` and a `language_model` (`LanguageModel`)."""

    merge_size: int

    def read_generation(self, model_dir: Path, eos_token_id: int | None, text_config: Any) -> None:
        """Stop ids and repetition penalty from generation_config.json; the KV cache's shape from the text config."""
        generation = read_generation_defaults(model_dir, eos_token_id)
        self.eos_token_ids, self.repetition_penalty = generation.eos_token_ids, generation.repetition_penalty
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self.kv_geometry = KVGeometry(num_layers=text_config.num_hidden_layers,
                                      kv_heads=text_config.num_key_value_heads, head_dim=head_dim)

    def block_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """A block's stored pixels (on the device) -> the tower's input patches."""
        return pixels

    @torch.inference_mode()
    def encode_vision(self, pixels: list[torch.Tensor], blocks: list[VisionBlock]) -> list[torch.Tensor]:
        """Blocks of any sizes through the tower together (moved to the device as stored, expanded there)."""
        patches = torch.cat([self.block_input(block.to(self.device)) for block in pixels])
        vectors = self.model.vision_features(patches, [block.grid for block in blocks])
        merged = self.merge_size ** 2
        return list(vectors.split([math.prod(block.grid) // merged for block in blocks if block.grid is not None]))

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None, :]  # M-RoPE: (3 axes, batch of 1, tokens)

    def compile(self) -> None:
        """The language model's layers and the frame-batched vision blocks through torch.compile (`--compile`)."""
        super().compile()
        self.model.compile_vision()
