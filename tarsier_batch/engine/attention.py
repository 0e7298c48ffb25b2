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

QUERY_BLOCK = 256  # queries per attention call in a masked chunk (bounds the kernel's float mask)


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

    def __init__(self, kv: KVCache, rows: list[RowSpan], device: torch.device,
                 capture: tuple[int, set[int]] | None = None):
        """`capture`: (layer, row indices) whose last token's query to keep at that layer (`captured`)."""
        self.kv = kv
        self.rows = rows
        self.masks = [_causal_mask(row.start, row.num_tokens, device) for row in rows]
        self.capture = capture
        self.captured: dict[int, torch.Tensor] = {}   # row index -> (heads, head_dim) rotated query
        self.scale = 0.0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        if self.capture is not None and layer == self.capture[0]:
            self.scale = scale
            for index in self.capture[1]:
                row = self.rows[index]
                self.captured[index] = q[row.offset + row.num_tokens - 1].clone()
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
            out[tokens] = _attend(query, keys, values, mask, row.start == 0 and row.num_tokens > 1,
                                  scale).transpose(0, 1)
        return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            causal_square: bool, scale: float) -> torch.Tensor:
    """(1, heads, n, head_dim) attention of one row -> (heads, n, head_dim).

    The first chunk of a prompt is a plain causal square; a later chunk sees all earlier
    positions plus its own causal triangle, through a mask; one new token sees everything.
    Masked chunks go through in blocks of queries: the kernel turns the boolean mask into a
    float one of (queries, context), 310 MB for a 2048-position chunk at 38k context, and the
    blocks keep that at a few tens of MB. Each query's result is the same either way (the
    kernel treats query blocks independently), so the output does not change.
    """
    gqa = query.shape[1] != keys.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=causal_square, scale=scale,
                                              enable_gqa=gqa)[0]
    blocks = [F.scaled_dot_product_attention(query[:, :, first:first + QUERY_BLOCK], keys, values,
                                             attn_mask=mask[first:first + QUERY_BLOCK], scale=scale,
                                             enable_gqa=gqa)[0]
              for first in range(0, query.shape[2], QUERY_BLOCK)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def _causal_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """(num_tokens, start + num_tokens) booleans: new token i sees positions up to start + i."""
    if num_tokens == 1 or start == 0:
        return None
    return torch.ones(num_tokens, start + num_tokens, dtype=torch.bool, device=device).tril(start)
