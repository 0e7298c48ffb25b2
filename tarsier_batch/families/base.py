"""The small interface every model family implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..engine import PromptEmbedding, StepModel
from ..media import Media


@dataclass
class PreparedInput:
    """CPU-side work for one item, done in loader threads: the prompt tokens and the pixels."""

    instruction: str
    prompt_ids: list[int]
    pixel_values: torch.Tensor


class CaptionModel(StepModel, Protocol):
    """A loaded checkpoint: preprocessing, merged prompt embeddings, one decode step, detokenising."""

    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device

    def prepare(self, media: Media, instruction: str | None) -> PreparedInput:
        """Prompt tokens and pixels for one item; `instruction` None means the default one."""

    def embed_prompts(self, inputs: list[PreparedInput]) -> list[PromptEmbedding]:
        """Run the vision side and merge its vectors into each prompt, on the model's device."""

    def decode(self, token_ids: list[int]) -> str:
        """Caption text for generated ids."""

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies, for choosing batch sizes."""

    def estimated_prompt_tokens(self, frames: int) -> int:
        """An upper estimate of the merged prompt length for `frames` frames."""
