"""Attention for one step: store each row's new keys and values, attend over its own context.

The step's tokens arrive flattened over rows (no padding anywhere): the projections and MLPs
of all rows run as one matrix multiply, and attention runs row by row on views of the cache.
A row computes positions [start, start + n) and attends to positions [0, start + n), so every
row is computed exactly as if it were alone, whatever else shares the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import HostKV, KVCache, Region


@dataclass(frozen=True)
class RowSpan:
    """Where one row's new tokens sit in the step and in its context."""

    offset: int          # first token of the row in the step's flattened tokens
    num_tokens: int
    start: int           # the row's position of its first new token (= positions already cached)
    region: Region | None
    host_kv: HostKV | None


class StepAttention:
    """The `Attention` callback a model calls once per layer during one engine step."""

    def __init__(self, kv: KVCache, rows: list[RowSpan], device: torch.device):
        self.kv = kv
        self.rows = rows
        self.masks = [_causal_mask(row.start, row.num_tokens, device) for row in rows]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for row, mask in zip(self.rows, self.masks):
            tokens = slice(row.offset, row.offset + row.num_tokens)
            context = row.start + row.num_tokens
            if row.host_kv is not None:
                row.host_kv.write(layer, row.start, k[tokens], v[tokens])
                keys, values = row.host_kv.read(layer, context)
            else:
                assert row.region is not None
                self.kv.write(row.region, layer, row.start, k[tokens], v[tokens])
                keys, values = self.kv.read(row.region, layer, context)
            query = q[tokens].transpose(0, 1).unsqueeze(0)
            # The first chunk of a prompt is a plain causal square; a later chunk sees all earlier
            # positions plus its own causal triangle; one new token sees everything.
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=row.start == 0 and row.num_tokens > 1,
                scale=scale, enable_gqa=query.shape[1] != keys.shape[1])
            out[tokens] = attended[0].transpose(0, 1)
        return out


def _causal_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """(num_tokens, start + num_tokens) booleans: new token i sees positions up to start + i."""
    if num_tokens == 1 or start == 0:
        return None
    return torch.ones(num_tokens, start + num_tokens, dtype=torch.bool, device=device).tril(start)
