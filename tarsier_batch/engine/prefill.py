"""Prefill: each prompt alone, then their KV caches stacked left-padded into one decode batch.

Prefilling rows one at a time means no padding ever enters the attention of a prompt (it is
computed exactly as if alone, and costs the sum of its own lengths, not batch x longest), and
only one prompt's activations are alive at once. The decode steps that follow run the rows
together: each row's cache is right-aligned, and the attention mask hides the padding on its left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import Cache

if TYPE_CHECKING:
    from .generate import StepModel


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
class PrefilledBatch:
    logits: torch.Tensor          # (batch, vocab): each row's next-token logits
    cache: Cache                  # (batch, heads, longest, head_dim) per layer, zeros on the left
    attention_mask: torch.Tensor  # (batch, longest): 0 over each row's left padding


def prefill(model: StepModel, prompts: list[PromptEmbedding]) -> PrefilledBatch:
    """Run every prompt through the model alone and stack the results for joint decoding."""
    longest = max(prompt.length for prompt in prompts)
    device = prompts[0].embeds.device
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    stacked: list[tuple[torch.Tensor, torch.Tensor]] = []
    logits = []
    for row, prompt in enumerate(prompts):
        cache = model.new_cache()
        own_mask = torch.ones(1, prompt.length, dtype=torch.long, device=device)
        logits.append(model.forward_step(prompt.embeds[None], own_mask, prompt.positions[None], cache))
        start = longest - prompt.length
        mask[row, start:] = 1
        for layer, (keys, values) in enumerate(_layer_tensors(cache)):
            if row == 0:
                shape = (len(prompts), keys.shape[1], longest, keys.shape[3])
                stacked.append((keys.new_zeros(shape), values.new_zeros(shape)))
            stacked[layer][0][row, :, start:] = keys[0]
            stacked[layer][1][row, :, start:] = values[0]
        del cache
    # `update` copies each layer into the cache; release our copy layer by layer so the peak
    # stays near one batch cache instead of two.
    batch_cache = model.new_cache()
    stacked.reverse()
    for layer in range(len(stacked)):
        keys, values = stacked.pop()
        batch_cache.update(keys, values, layer)
        del keys, values
    return PrefilledBatch(torch.cat(logits), batch_cache, mask)


def _layer_tensors(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of every layer, each (batch, heads, length, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]
