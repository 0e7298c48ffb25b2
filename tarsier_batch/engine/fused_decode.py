"""Decode attention as one fused Triton kernel, for CUDA: each row reads its own pages through its block table.

The split-K attention of torch ops (`attention.paged_decode_attention`) writes every page's scores, weights and
partial output to memory and reads them back for the next op; at 7B shapes that traffic, not the keys and values,
is most of a decode step from 32 rows up. Here one program per (row, kv head, split of the row's positions) loads
its keys and values page by page, keeps the running maximum, sum and output of an online softmax in registers, and
writes one partial result per split; a second kernel combines a row's splits (flash-decoding). Everything read is
the cache itself: no window of pages, no copy.

A split covers fixed positions ([s * SPLIT_POSITIONS, (s + 1) * SPLIT_POSITIONS) of the row), so a row's result does
not depend on the other rows of the step nor on the padding of a step recorded as a CUDA graph. Scores and the
softmax are float32; a float32 model's products are IEEE float32 (never TF32).

This module imports Triton: import it only where Triton is installed (`model_runner.fused_attention_available`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .attention import bucket, fine_bucket, to_device
from .kv_cache import BlockTable, KVCache

# Positions a program reads per loop iteration, and per split. 512 positions of 128 dims in bfloat16 are 256 KB of
# keys and values a program: at ~10k positions a row has 20 splits, so even one row keeps 80 programs busy.
BLOCK_POSITIONS = 64
SPLIT_POSITIONS = 512


class PageTables(NamedTuple):
    """Where a step's decoding rows find their context: each row's pages in the cache, and how many positions."""

    pages: torch.Tensor      # (rows, widest) int32: the row's pages in order (past its last, repeats of its first)
    contexts: torch.Tensor   # (rows,) int32: positions to attend to, the new one included


def page_tables(tables: list[BlockTable], contexts: np.ndarray, page_slots: int, device: torch.device,
                padded: bool = False) -> PageTables:
    """The tables of rows whose contexts (`contexts` slots each) lie in the pages of `tables`. `padded`: the rows to
    a power of two and the pages per row to `fine_bucket`'s sizes, for CUDA graphs; a padding row reads row 0's
    first position only (one split, finite), so padding costs next to nothing."""
    counts = -(-contexts // page_slots)
    rows, widest = len(tables), int(counts.max())
    if padded:
        rows, widest = bucket(rows), fine_bucket(widest)
    pages = np.empty((rows, widest), dtype=np.int32)
    for index, (table, count) in enumerate(zip(tables, counts)):
        pages[index, :count] = table.pages[:count]
        pages[index, count:] = table.pages[0]
    pages[len(tables):] = pages[0]
    lengths = np.empty(rows, dtype=np.int32)
    lengths[:len(tables)] = contexts
    lengths[len(tables):] = 1
    return PageTables(to_device(pages, device), to_device(lengths, device))


class FusedDecodeAttention:
    """The engine's decode attention on CUDA (see `attention.DecodeAttention`)."""

    def tables(self, tables: list[BlockTable], contexts: np.ndarray, page_slots: int, device: torch.device,
               bucketed_within: int | None = None) -> PageTables:
        return page_tables(tables, contexts, page_slots, device, padded=bucketed_within is not None)

    def __call__(self, kv: KVCache, layer: int, q: torch.Tensor, tables: PageTables, scale: float) -> torch.Tensor:
        keys, values = kv.layer_pages(layer)
        return fused_decode_attention(q, keys, values, tables, scale)


def fused_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: PageTables,
                           scale: float, split: int | None = None, block: int | None = None) -> torch.Tensor:
    """(rows, heads, head_dim) queries over a layer's (pages, kv_heads, page_slots, head_dim) keys and values ->
    (rows, heads, head_dim). `split`, `block`: positions per split and per loop iteration (by default
    `SPLIT_POSITIONS`, `BLOCK_POSITIONS`; the GPU bench tries others)."""
    split, block = split or SPLIT_POSITIONS, block or BLOCK_POSITIONS
    rows, heads, dim = q.shape
    kv_heads, page_slots = keys.shape[1], keys.shape[2]
    assert keys.stride() == values.stride() and keys.stride(-1) == 1, "values are addressed with the keys' strides"
    splits = triton.cdiv(tables.pages.shape[1] * page_slots, split)
    q = q.contiguous()
    partial = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
    maxima = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    out = torch.empty_like(q)
    group = heads // kv_heads
    block_dim = max(16, triton.next_power_of_2(dim))
    # Triton launches on the current CUDA device, which need not be the tensors' (--device cuda:1).
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _attend_split[(rows, kv_heads, splits)](
            q, keys, values, tables.pages, tables.contexts, partial, maxima, sums, scale, splits,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), tables.pages.stride(0),
            GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK_DIM=block_dim,
            PAGE=page_slots, BLOCK_N=block, SPLIT=split, IEEE=q.dtype == torch.float32)
        block_splits = triton.next_power_of_2(splits)
        _combine_splits[(rows, heads)](
            partial, maxima, sums, tables.contexts, out, out.stride(0), out.stride(1), splits, DIM=dim,
            BLOCK_DIM=block_dim, SPLIT=split, BLOCK_SPLITS=block_splits, CHUNK=min(16, block_splits))
    return out


# Sizes and strides as plain arguments, not specialised on (Triton compiles a variant per value that is 1 or a
# multiple of 16 otherwise): a run meets many split counts.
@triton.jit(do_not_specialize=["splits", "pages_row_stride"])
def _attend_split(q_ptr, k_ptr, v_ptr, pages_ptr, contexts_ptr, partial_ptr, maxima_ptr, sums_ptr, scale, splits,
                  q_row_stride, q_head_stride, kv_page_stride, kv_head_stride, kv_slot_stride, pages_row_stride,
                  GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """One (row, kv head, split): the query heads of that kv head against the split's positions."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(contexts_ptr + row)
    start = split * SPLIT
    if start < context:   # a split past the row's context writes nothing: `_combine_splits` reads its row's own
        group = tl.arange(0, BLOCK_GROUP)
        dims = tl.arange(0, BLOCK_DIM)
        heads = kv_head * GROUP + group
        real_head = group < GROUP
        real_dim = dims < DIM
        q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + dims[None, :],
                    mask=real_head[:, None] & real_dim[None, :], other=0.0)
        # Scaled in the model's dtype before the product, as the torch path and transformers' eager attention do.
        q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
        running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
        acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)
        kv_base = kv_head * kv_head_stride
        # A fixed count of blocks (a bound loaded from memory would be the same on the GPU; Triton's interpreter,
        # which the tests run, cannot loop to one). The first block holds the split's first position, so the
        # running maximum is finite from then on; a block wholly past the context adds weights of 0.
        for block in range(SPLIT // BLOCK_N):
            positions = start + block * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = positions < context
            page = tl.load(pages_ptr + row * pages_row_stride + positions // PAGE, mask=inside, other=0)
            offsets = kv_base + page.to(tl.int64) * kv_page_stride + (positions % PAGE) * kv_slot_stride
            mask = inside[:, None] & real_dim[None, :]
            k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=mask, other=0.0)
            v = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(inside[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(weights, axis=1)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        at = (row * (GROUP * tl.num_programs(1)) + heads) * splits + split
        tl.store(maxima_ptr + at, running_max, mask=real_head)
        tl.store(sums_ptr + at, running_sum, mask=real_head)
        tl.store(partial_ptr + at[:, None] * DIM + dims[None, :], acc, mask=real_head[:, None] & real_dim[None, :])


@triton.jit(do_not_specialize=["splits_count"])
def _combine_splits(partial_ptr, maxima_ptr, sums_ptr, contexts_ptr, out_ptr, out_row_stride, out_head_stride,
                    splits_count, DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    """One (row, head): the splits holding its context rescaled to their common maximum, added and normalised,
    CHUNK splits' partial outputs at a time (a row of ~40k positions has 80 splits: too many to hold at once)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    context = tl.load(contexts_ptr + row)
    first_split = (row * tl.num_programs(1) + head) * splits_count
    splits = tl.arange(0, BLOCK_SPLITS)
    real = (splits < splits_count) & (splits * SPLIT < context)
    maxima = tl.load(maxima_ptr + first_split + splits, mask=real, other=float("-inf"))
    largest = tl.max(maxima, axis=0)   # split 0 always holds positions: finite
    total = tl.sum(tl.exp(maxima - largest) * tl.load(sums_ptr + first_split + splits, mask=real, other=0.0), axis=0)
    dims = tl.arange(0, BLOCK_DIM)
    acc = tl.zeros([BLOCK_DIM], dtype=tl.float32)
    for start in range(0, BLOCK_SPLITS, CHUNK):
        chunk = start + tl.arange(0, CHUNK)
        inside = (chunk < splits_count) & (chunk * SPLIT < context)
        weights = tl.exp(tl.load(maxima_ptr + first_split + chunk, mask=inside, other=float("-inf")) - largest)
        partial = tl.load(partial_ptr + (first_split + chunk)[:, None] * DIM + dims[None, :],
                          mask=inside[:, None] & (dims[None, :] < DIM), other=0.0)
        acc += tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + row * out_row_stride + head * out_head_stride + dims, (acc / total).to(out_ptr.dtype.element_ty),
             mask=dims < DIM)
