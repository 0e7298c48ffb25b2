"""Left-padding per-item prompt embeddings into one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptEmbedding:
    """One item's merged prompt: input vectors (length, hidden) and their position ids (length,)."""

    embeds: torch.Tensor
    positions: torch.Tensor

    @property
    def length(self) -> int:
        return self.embeds.shape[0]

    @property
    def next_position(self) -> int:
        """Position id of the first generated token."""
        return int(self.positions[-1]) + 1


@dataclass
class PaddedBatch:
    embeds: torch.Tensor          # (batch, length, hidden), zeros in the padding
    attention_mask: torch.Tensor  # (batch, length), 0 in the padding
    position_ids: torch.Tensor    # (batch, length), 0 in the padding (masked anyway)


def left_pad(prompts: list[PromptEmbedding]) -> PaddedBatch:
    """Right-align the prompts so every row's last prompt vector sits in the last column.

    With the mask hiding the padding and each row's own positions, a row is computed as if it
    were alone, and all rows take their next token from the same (last) column.
    """
    first = prompts[0].embeds
    length = max(prompt.length for prompt in prompts)
    batch = len(prompts)
    embeds = first.new_zeros(batch, length, first.shape[-1])
    mask = torch.zeros(batch, length, dtype=torch.long, device=first.device)
    positions = torch.zeros(batch, length, dtype=torch.long, device=first.device)
    for row, prompt in enumerate(prompts):
        start = length - prompt.length
        embeds[row, start:] = prompt.embeds
        mask[row, start:] = 1
        positions[row, start:] = prompt.positions
    return PaddedBatch(embeds, mask, positions)
