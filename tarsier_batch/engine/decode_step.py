"""Steps in which every row decodes its next token: the bulk of a run, at a few fixed shapes.

A decode step is the same computation every time, only its sizes change: the rows, and the cache
pages their contexts span. It is one function of tensors alone (token ids, positions, and the page
tables and KV write indices of each cache, all built on the host with numpy), with no host
synchronisation and no Python control flow that depends on values, so on CUDA it is recorded as a
CUDA graph and replayed (`cuda_graphs`): one launch for the whole step instead of one per kernel.

A graph is recorded per distinct set of sizes, so there the sizes are padded to a few: the rows to
powers of two (`attention.bucket`; padding rows read row 0's pages and write their keys and values to
each cache's scratch page), the pages per row and the window of pages read to within 12.5 %
(`attention.fine_bucket`). On CUDA the rows attend in the fused Triton kernel (`fused_decode`); with
--compile the layers (and the split attention of torch ops, where it is used) run through torch.compile,
at the same padded sizes, so that their few compilations serve every step. Otherwise (the CPU, eager)
the step keeps its exact sizes: padding would only add arithmetic.

Steps with prefill chunks (or rows whose prefill is offloaded) take the general path in
`model_runner`; their decoding rows still attend in one batched call there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ..families.base import CaptionModel
from .attention import DecodeAttention, SplitDecodeAttention, bucket, to_device
from .cuda_graphs import StepGraphs
from .kv_cache import KVCache
from .scheduler import ScheduledRow
from .sequence import Sequence


class CacheStep(NamedTuple):
    """One cache's part of a decode step: where rows read their context and write their new keys and values."""

    tables: Any                   # the decode attention's tables
    write_pages: torch.Tensor     # (rows,)
    write_offsets: torch.Tensor   # (rows,)


class DecodeStep:
    """Runs the steps in which every row decodes (`accepts`): eager at their own sizes, or at padded ones
    as CUDA graphs or compiled."""

    def __init__(self, model: CaptionModel, pools: list[KVCache], attention: DecodeAttention | None = None,
                 graphs: bool = False, static_shapes: bool | None = None):
        """`pools` as the model runner's; `attention`: how rows attend (by default `SplitDecodeAttention`);
        `graphs`: replay CUDA graphs; `static_shapes`: padded to a few sizes (by default with graphs)."""
        self.model = model
        self.pools = pools
        self.attention = attention or SplitDecodeAttention()
        self.static_shapes = graphs if static_shapes is None else static_shapes
        # Which cache each layer uses, as booleans: fixed for the model, whatever the step.
        self.late_layers = tuple(layer not in pools[0].layers for layer in range(model.kv_geometry.num_layers))
        self.graphs = StepGraphs(model.device) if graphs else None

    @staticmethod
    def accepts(step: list[ScheduledRow]) -> bool:
        """Every row computes one generated token against device KV (and then samples)."""
        return all(row.num_tokens == 1 and row.kv.host is None and row.seq.remaining == 1
                   and _generated_index(row.seq) >= 0 for row in step)

    def run(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor]:
        """The step's rows (all of them sample) and their next-token logits."""
        device = self.model.device
        rows = [row.seq for row in step]
        padded = bucket(len(rows)) if self.static_shapes else len(rows)
        token_ids = np.zeros(padded, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        for index, seq in enumerate(rows):
            generated = _generated_index(seq)
            token_ids[index] = seq.output_ids[generated]
            positions[index] = seq.prompt.next_position + generated
        components = rows[0].prompt.positions.shape[0]
        parts = tuple(self._cache_step(pool, part, step, padded) for part, pool in enumerate(self.pools))
        inputs = (to_device(token_ids, device), to_device(positions, device).expand(components, -1), parts)
        logits = self.logits(*inputs) if self.graphs is None else self.graphs(self.logits, *inputs)
        return rows, logits[:len(rows)]

    def logits(self, token_ids: torch.Tensor, positions: torch.Tensor, parts: tuple[CacheStep, ...]) -> torch.Tensor:
        """The whole step, as a function of tensors: (rows,) ids at (components, rows) positions -> (rows, vocab)."""
        attention = _PagedDecode(self.pools, parts, self.late_layers, self.attention)
        return self.model.logits(self.model.forward(self.model.embed_tokens(token_ids), positions, attention))

    def _cache_step(self, pool: KVCache, part: int, step: list[ScheduledRow], padded: int) -> CacheStep:
        """Each row's slot for its new token in `pool` (the `part`-th cache), and the pages it reads."""
        row_tables = [row.kv.tables[part] for row in step]
        positions = np.array([_kv_position(row.seq, late=part == 1) for row in step])
        page = pool.page_slots
        tables = self.attention.tables(row_tables, positions + 1, page, self.model.device,   # the new one included
                                       pool.scratch_page if self.static_shapes else None)
        write_pages = np.full(padded, pool.scratch_page, dtype=np.int64)
        write_offsets = np.zeros(padded, dtype=np.int64)
        write_pages[:len(step)] = [table.pages[position // page] for table, position in zip(row_tables, positions)]
        write_offsets[:len(step)] = positions % page
        return CacheStep(tables, to_device(write_pages, self.model.device), to_device(write_offsets, self.model.device))


class _PagedDecode:
    """The `Attention` callback of a decode step: each layer writes its cache and attends over its pages."""

    def __init__(self, pools: list[KVCache], parts: tuple[CacheStep, ...], late_layers: tuple[bool, ...],
                 attention: DecodeAttention):
        self.pools = pools
        self.parts = parts
        self.late_layers = late_layers
        self.attention = attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        part = 1 if self.late_layers[layer] else 0
        pool, inputs = self.pools[part], self.parts[part]
        pool.write_at(layer, inputs.write_pages, inputs.write_offsets, k, v)
        return self.attention(pool, layer, q, inputs.tables, scale)


def _generated_index(seq: Sequence) -> int:
    """Which generated token the row computes next (negative while it is still in its prompt)."""
    return _kv_position(seq) - seq.prompt.length


def _kv_position(seq: Sequence, late: bool = False) -> int:
    """The slot, in the row's table of the early (or only) cache or of the late one, of the position
    the row computes next. A pruned row's survivors count as positions but hold early slots of their own
    only in the late cache (see `engine.pruning`)."""
    if seq.pruning is None:
        return seq.num_computed_tokens
    if late:
        return seq.num_computed_tokens - seq.prompt.length
    return seq.num_computed_tokens - seq.pruning.num_survivors
