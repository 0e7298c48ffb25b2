"""The generation loop: one prefill over the padded prompts, then one decode step per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import Cache

from .prefill import PromptEmbedding, prefill
from .sampling import SamplingParams, select_tokens


class StepModel(Protocol):
    """What the loop needs from a model family: token embeddings and one step over a KV cache."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(batch, length) ids -> (batch, length, hidden) input vectors."""

    def new_cache(self) -> Cache:
        """An empty KV cache for one batch."""

    def forward_step(self, embeds: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Run `embeds` after what `cache` holds; logits of each row's last column, (batch, vocab).

        `attention_mask` covers the cached columns and the new ones.
        """


@dataclass
class Generation:
    """What one row produced: token ids (the stop token included) and why it stopped."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"


@torch.inference_mode()
def generate(model: StepModel, prompts: list[PromptEmbedding], params: SamplingParams,
             eos_token_ids: frozenset[int], generators: list[torch.Generator | None] | None = None,
             on_tokens: Callable[[int], None] | None = None) -> list[Generation]:
    """Generate for every prompt; a row that stops leaves the batch and its cache rows are freed."""
    if generators is None:
        generators = [None] * len(prompts)
    batch = prefill(model, prompts)
    logits, cache, mask = batch.logits, batch.cache, batch.attention_mask
    results = [Generation() for _ in prompts]
    active = list(range(len(prompts)))   # indices into `prompts` of the rows still in the batch
    next_positions = torch.tensor([prompt.next_position for prompt in prompts], device=mask.device)
    for step in range(params.max_new_tokens):
        tokens = select_tokens(logits, params, [generators[row] for row in active])
        if on_tokens is not None:
            on_tokens(len(tokens))
        keep: list[int] = []
        for slot, (row, token) in enumerate(zip(active, tokens)):
            results[row].token_ids.append(token)
            if token in eos_token_ids:
                results[row].finish_reason = "eos"
            elif step + 1 < params.max_new_tokens:
                keep.append(slot)
        if not keep:
            break
        if len(keep) < len(active):
            kept = torch.tensor(keep, device=mask.device)
            cache.batch_select_indices(kept)
            mask, next_positions = mask[kept], next_positions[kept]
            active = [active[slot] for slot in keep]
            tokens = [tokens[slot] for slot in keep]
        token_ids = torch.tensor(tokens, device=mask.device).unsqueeze(1)
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        positions = (next_positions + step).unsqueeze(1)
        logits = model.forward_step(model.embed_tokens(token_ids), mask, positions, cache)
    return results
