"""Choosing the decode attention kernel: one call for every row against one call per row.

    python bench/bench_attention.py [--rows 1 8 32] [--context 256 2048] [--repeats 20]

Decode attention of R rows (one query each, 4 query heads over 2 KV heads of 128, Tarsier2's
grouping at the `deep` checkpoints' width) over their contexts in one cache, rows at scattered
places with free room between them, float32, one torch thread. Three ways, side by side:

- `per_row_sdpa`: what the engine did before, one SDPA call per row on a view of its range;
- `paged`: what it does now, `engine.attention.paged_decode_attention` over the cache's pages;
- `flex`: PyTorch's FlexAttention compiled (torch.compile; eager FlexAttention materialises the
  full score matrix), the batch being the rows over the cache broadcast to each, and a BlockMask
  built from the rows' ranges (kv blocks of 64 slots; the blocks wholly inside a range as full
  blocks, the two ends as partial ones).

For each: ms per call (median), kernel-launching ops per call (torch.profiler, see
`engine.profiling`), the largest difference from `per_row_sdpa`, and for `flex` the time of its
first call (the compile; every new shape compiles again). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Inductor's generated CPU kernels show in the profiler only with this, set before torch is imported.
os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.engine.attention import attend_decoding, decode_tables  # noqa: E402
from tarsier_batch.engine.kv_cache import PAGE_SLOTS, BlockTable, KVCache  # noqa: E402
from tarsier_batch.engine.profiling import kernel_ops  # noqa: E402
from tarsier_batch.families.base import KVGeometry  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, FLEX_BLOCK = 4, 2, 128, 64


def layout(rows: int, context: int, page: int) -> tuple[KVCache, list[BlockTable]]:
    """A cache holding `rows` contexts in runs of pages with a free page between neighbours."""
    pages = -(-(context + 1) // page)
    cache = KVCache(KVGeometry(1, KV_HEADS, HEAD_DIM), rows * (pages + 1) * page, torch.float32, torch.device("cpu"))
    tables = [BlockTable(page, np.arange(index * (pages + 1), index * (pages + 1) + pages)) for index in range(rows)]
    cache.values.zero_()
    generator = torch.Generator().manual_seed(0)
    for table in tables:
        cache.write(table, 0, 0, torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator),
                    torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator))
    return cache, tables


def per_row_sdpa(contexts: list[tuple[torch.Tensor, torch.Tensor]], queries: torch.Tensor) -> torch.Tensor:
    """One SDPA call per row over its (1, kv_heads, context, head_dim) keys and values (the old engine read
    them as views of a head-major cache; here they are copied out once, before any timing)."""
    return torch.stack([F.scaled_dot_product_attention(query[None, :, None], keys, values, scale=0.1,
                                                       enable_gqa=True)[0, :, 0]
                        for query, (keys, values) in zip(queries, contexts)])


def flex_inputs(cache: KVCache, tables: list[BlockTable], context: int):
    """The cache as (1, kv_heads, slots, head_dim) and a BlockMask of each row's run of pages."""
    from torch.nn.attention.flex_attention import BlockMask

    heads_first = lambda storage: storage[0].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)[None]  # noqa: E731
    keys, values = heads_first(cache.keys), heads_first(cache.values)
    slots, rows = keys.shape[2], len(tables)
    blocks = slots // FLEX_BLOCK
    starts = torch.tensor([int(table.pages[0]) * table.page_slots for table in tables])
    partial_index = torch.zeros(rows, 1, 1, blocks, dtype=torch.int32)
    partial_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
    full_index = torch.zeros(rows, 1, 1, blocks, dtype=torch.int32)
    full_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
    for row, start in enumerate(starts.tolist()):
        end = start + context
        first, last = start // FLEX_BLOCK, (end - 1) // FLEX_BLOCK
        full = [block for block in range(first, last + 1)
                if block * FLEX_BLOCK >= start and (block + 1) * FLEX_BLOCK <= end]
        partial = [block for block in range(first, last + 1) if block not in full]
        full_count[row], partial_count[row] = len(full), len(partial)
        full_index[row, 0, 0, :len(full)] = torch.tensor(full, dtype=torch.int32)
        partial_index[row, 0, 0, :len(partial)] = torch.tensor(partial, dtype=torch.int32)

    def inside(batch, head, query, slot):
        return (slot >= starts[batch]) & (slot < starts[batch] + context)

    mask = BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index,
                                    BLOCK_SIZE=(128, FLEX_BLOCK), mask_mod=inside, seq_lengths=(1, slots))
    return keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), mask


def timed(call, repeats: int) -> tuple[float, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, len(kernel_ops(profile.events()))


def one_shape(rows: int, context: int, repeats: int) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    cache, row_tables = layout(rows, context, PAGE_SLOTS)
    queries = torch.randn(rows, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    contexts = [cache.read(table, 0, context) for table in row_tables]
    reference = per_row_sdpa(contexts, queries)
    tables = decode_tables(row_tables, np.full(len(row_tables), context), PAGE_SLOTS, torch.device("cpu"))
    paged = lambda: attend_decoding(cache, 0, queries, tables, 0.1)  # noqa: E731
    keys, values, mask = flex_inputs(cache, row_tables, context)
    compiled = torch.compile(flex_attention, dynamic=False)
    flex = lambda: compiled(queries[:, :, None], keys, values, block_mask=mask, scale=0.1,  # noqa: E731
                            enable_gqa=True)[:, :, 0]
    start = time.perf_counter()
    flex_out = flex()
    first_flex = time.perf_counter() - start
    result: dict = {}
    for name, call, out in (("per_row_sdpa", lambda: per_row_sdpa(contexts, queries), reference),
                            ("paged", paged, paged()), ("flex", flex, flex_out)):
        ms, ops = timed(call, repeats)
        result[name] = {"ms": round(ms, 3), "kernel_ops": ops,
                        "max_abs_diff": float((out - reference).abs().max())}
    result["flex"]["first_call_s"] = round(first_flex, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--context", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {f"{rows} rows x {context}": one_shape(rows, context, args.repeats)
               for context in args.context for rows in args.rows}
    print(json.dumps({**measured_on(), "benchmark": "decode attention kernels", "heads": HEADS, "kv_heads": KV_HEADS,
                      "head_dim": HEAD_DIM, "page_slots": PAGE_SLOTS, "threads": 1, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
