"""Decode attention at Tarsier2-7B's shapes: the engine's paged kernel against SDPA and FlexAttention.

R rows, one query each (28 heads over 4 KV heads of 128), contexts drawn between 3/4 of `context` and
`context` (rows of one batch differ in length, as clips do), in the model's dtype. The ways:

- `fused` (CUDA): `engine.fused_decode`, the engine's decode attention on CUDA, a Triton kernel reading each
  row's pages through its block table; `fused_split_1024`, `fused_split_256`, `fused_block_32`: the same with
  other positions per split or per loop iteration, to tune its sizes;
- `paged`: `engine.attention.paged_decode_attention` over the rows' pages in a KV cache laid out as the
  engine's (rows at page-aligned ranges with a free page between neighbours), eager;
- `paged_compiled`: the same through torch.compile, as `--compile` runs it;
- `gather_sdpa`: every row's pages copied into a padded batch at each call, then SDPA with a length mask
  (what the engine would do to use SDPA: the copy timed too);
- `sdpa_padded`: `F.scaled_dot_product_attention` over a padded (rows, kv_heads, longest, head_dim) batch
  with a length mask, built once (SDPA's best case);
- `flex`: `flex_attention` compiled over the same padded batch with a BlockMask of the lengths.

The padded batch is built once, outside the timing: the engine would have to gather it from its pages
every step, at least one more read of every row's keys and values, so those two are timed at their best.
Each is checked against float32 attention row by row (relative error ||out - ref|| / ||ref||; exact:
under 1e-2 in bfloat16, 1e-5 in float32) and timed as the median of `repeats` calls (CUDA events on a GPU).
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from tarsier_batch.engine.attention import attend_decoding, decode_tables, paged_decode_attention
from tarsier_batch.engine.kv_cache import PAGE_SLOTS, BlockTable, KVCache
from tarsier_batch.engine.model_runner import fused_attention_available
from tarsier_batch.families.base import KVGeometry


def timed_ms(call, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        call()
    if device.type == "cuda":
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        call()
        times.append((time.perf_counter() - start_s) * 1000)
    return statistics.median(times)


def one_shape(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device, repeats: int, compiled: bool) -> dict:
    generator = torch.Generator().manual_seed(rows)
    contexts = torch.randint(context * 3 // 4, context + 1, (rows,), generator=generator).tolist()
    pages = -(-(context + 1) // PAGE_SLOTS)   # each row's run of pages, a free page between neighbours
    cache = KVCache(KVGeometry(1, kv_heads, head_dim), rows * (pages + 1) * PAGE_SLOTS, dtype, device)
    row_tables = [BlockTable(PAGE_SLOTS, np.arange(index * (pages + 1), index * (pages + 1) + pages))
                  for index in range(rows)]
    cache.keys.normal_()
    cache.values.normal_()
    queries = torch.randn(rows, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    per_row = [cache.read(table, 0, length) for table, length in zip(row_tables, contexts)]
    reference = torch.stack([_float32_attention(query, keys[0], values[0], scale)
                             for query, (keys, values) in zip(queries, per_row)])
    tables = decode_tables(row_tables, np.array(contexts), PAGE_SLOTS, device)
    longest = max(contexts)
    padded_keys = queries.new_zeros(rows, kv_heads, longest, head_dim)
    padded_values = torch.zeros_like(padded_keys)
    for row, (keys, values) in enumerate(per_row):
        padded_keys[row, :, :contexts[row]] = keys[0]
        padded_values[row, :, :contexts[row]] = values[0]
    lengths = torch.tensor(contexts, device=device)
    mask = (torch.arange(longest, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    ways = {
        "paged": lambda: attend_decoding(cache, 0, queries, tables, scale),
        "gather_sdpa": _gather_then_sdpa(cache, queries, tables, contexts, scale),
        "sdpa_padded": lambda: F.scaled_dot_product_attention(queries[:, :, None], padded_keys, padded_values,
                                                              attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0],
    }
    if fused_attention_available(device):   # the engine's sizes, and a few others to tune them
        from tarsier_batch.engine.fused_decode import fused_decode_attention, page_tables
        fused_tables = page_tables(row_tables, np.array(contexts), PAGE_SLOTS, device)
        layer_keys, layer_values = cache.layer_pages(0)
        for name, split, block in (("fused", None, None), ("fused_split_1024", 1024, None),
                                   ("fused_split_256", 256, None), ("fused_block_32", None, 32)):
            ways[name] = functools.partial(fused_decode_attention, queries, layer_keys, layer_values, fused_tables,
                                           scale, split, block)
    if compiled:
        kernel = torch.compile(paged_decode_attention, dynamic=True)
        ways["paged_compiled"] = lambda: attend_decoding(cache, 0, queries, tables, scale, kernel)
        ways["flex"] = _flex(queries, padded_keys, padded_values, lengths, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    result = {"contexts": [min(contexts), max(contexts)]}
    for name, call in ways.items():
        started = time.perf_counter()
        out = call()
        first_s = time.perf_counter() - started
        error = float((out.float() - reference).norm() / reference.norm())
        result[name] = {"ms": round(timed_ms(call, device, repeats), 4), "relative_error": error,
                        "exact": error <= tolerance, "first_call_s": round(first_s, 2)}
    exact = {name: figures["ms"] for name, figures in result.items() if name != "contexts" and figures["exact"]}
    result["fastest_exact"] = min(exact, key=exact.get) if exact else None
    return result


def _gather_then_sdpa(cache: KVCache, queries: torch.Tensor, tables, contexts: list[int], scale: float):
    """Every row's pages copied into a padded batch, then SDPA with a length mask: the copy is timed too, as the
    engine would pay it at every step and layer."""
    kv_heads, slots, dim = cache.geometry.kv_heads, cache.page_slots, cache.geometry.head_dim
    rows, widest = tables.row_pages.shape
    assert tables.owner.shape[1] == 1, "no page is shared: a row's (page, reader) pairs are its pages"
    lengths = torch.tensor(contexts, device=queries.device)
    mask = (torch.arange(widest * slots, device=queries.device)[None, :] < lengths[:, None])[:, None, None, :]

    def call() -> torch.Tensor:
        keys, values = (pool[0].view(-1, kv_heads, slots, dim)[tables.row_pages]            # (rows, widest, h, s, d)
                        .transpose(1, 2).reshape(rows, kv_heads, widest * slots, dim)
                        for pool in (cache.keys, cache.values))
        return F.scaled_dot_product_attention(queries[:, :, None], keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)[:, :, 0]

    return call


def _float32_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """(heads, dim) query over (kv_heads, n, dim) keys and values, in float32 with grouped heads."""
    groups = query.shape[0] // keys.shape[0]
    keys, values = keys.float().repeat_interleave(groups, 0), values.float().repeat_interleave(groups, 0)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", query.float() * scale, keys), dim=-1)
    return torch.einsum("hn,hnd->hd", weights, values)


def _flex(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def within(batch, head, query, slot):
        return slot < lengths[batch]

    block_mask = create_block_mask(within, keys.shape[0], None, 1, keys.shape[2], device=keys.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(queries[:, :, None], keys, values, block_mask=block_mask, scale=scale,
                            enable_gqa=True)[:, :, 0]


def run_kernels(rows: list[int], context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, repeats: int, compiled: bool) -> dict:
    shapes = {str(count): one_shape(count, context, heads, kv_heads, head_dim, dtype, device, repeats, compiled)
              for count in rows}
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
            "context": context, "page_slots": PAGE_SLOTS, "by_rows": shapes,
            "all_paged_exact": all(shape["paged"]["exact"] for shape in shapes.values())}
