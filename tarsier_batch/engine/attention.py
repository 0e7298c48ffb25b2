"""Attention for one step: store every row's new keys and values, attend over each row's own context.

The step's tokens arrive flattened over rows (no padding anywhere): the projections and MLPs of
all rows run as one matrix multiply, and so does the rest of a step's work:

- the new keys and values of every row with device KV go into the cache in one indexed copy per
  layer and kind;
- the rows that compute one position (decoding rows, the usual bulk of a step) attend in one
  batched computation per layer whatever their number: each page their contexts occupy is paired
  with its row's query, every page's partial attention is one slice of a batched matrix multiply
  over the cache's first pages read where they lie, and each row's pages are then combined by their
  softmax weights (split-K attention, as flash-decoding does it; see `DecodeTables`); on CUDA the
  same is one fused Triton kernel (`fused_decode`), through the same `DecodeAttention` interface;
- a prefill chunk (many positions of one row) attends on its own with SDPA, over its own new keys
  for a prompt's first chunk and over its row's context copied out of its pages for a later one:
  a chunk is compute-bound, so that copy is small next to its arithmetic, and there are few
  chunks per step (the token budget holds one or two);
- a row whose prefill is offloaded reads its context from host memory, as before.

A row computes positions [start, start + n) and attends to positions [0, start + n), so each row
is computed as if it were alone, whatever else shares the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .kv_cache import BlockTable, HostKV, KVCache

QUERY_BLOCK = 256  # queries per attention call in a masked chunk (bounds the kernel's float mask)
# On the CPU, attention weights at most exp(WEIGHT_FLOOR) = 1.6e-28 of their page's largest are 0 (see `_masked_exp`).
WEIGHT_FLOOR = -64.0


@dataclass(frozen=True)
class RowSpan:
    """Where one row's new tokens sit in the step and in its context."""

    offset: int          # first token of the row in the step's flattened tokens
    num_tokens: int
    start: int           # the row's position of its first new token (= positions already cached)
    table: BlockTable | None
    host_kv: HostKV | None

    @property
    def decodes(self) -> bool:
        """One position against device KV: attends in the step's batched decode call."""
        return self.num_tokens == 1 and self.host_kv is None


# Decode attention reads a window of pages: the cache's first pages as they lie (a view), or, where the rows'
# pages are scattered (a row left high up, the prefix cache's kept pages between them), just the rows' pages
# copied out. Every page of the window costs the same work whoever holds it, and the copy about one more pass
# over the pages it copies: past twice the pages held, the copy costs less than the view. Not with the compiled
# decode attention: a copied window is another kind of tensor to the compiler (made in inference mode, where the
# view is of the cache), so a second compilation; it reads the view.
SPARSE_WINDOW = 2


class DecodeTables(NamedTuple):
    """Where a step's one-position rows find their context in one cache: built once per step on the host,
    used by every layer's decode attention.

    The window is `owner.shape[0]` pages: the cache's first pages, read as one view, or, when `pages` is set,
    those pages of the cache, copied out (see `SPARSE_WINDOW`); below, a page is its place in the window. A
    page is read by the rows
    that hold it (one, or several where rows share a prompt's pages): `owner` names, for each page, the row
    of each of its `readers` (`owner.shape[1]`; row 0 where a page has fewer readers, and for pages of other
    rows and free pages, whose slots are then all masked), `masked` which slots are not that reader's
    context, and `row_pages` each row's (page, reader) pairs in order, as indices into window x readers
    (padded with its first pair, whose weight `padding` zeroes).
    """

    owner: torch.Tensor       # (window, readers)
    masked: torch.Tensor      # (window, 1, readers, 1, slots): broadcast over kv heads and each one's query heads
    row_pages: torch.Tensor   # (rows, widest)
    padding: torch.Tensor     # (rows, widest, 1, 1)
    pages: torch.Tensor | None = None   # (window,) the cache's pages of a copied window


def decode_tables(tables: list[BlockTable], contexts: np.ndarray, page_slots: int, device: torch.device,
                  bucketed_within: int | None = None, copy_sparse: bool = True) -> DecodeTables:
    """The tables of rows whose contexts (`contexts` slots each, the new position included) lie in the pages
    of `tables`. `bucketed_within` pads every size to one of a few: the rows to a power of two (`bucket`), the
    pages per row and the window (at most that many pages) to `fine_bucket`'s sizes, the readers per page (1
    unless rows share pages) to a power of two. A padding row repeats row 0's pages; the pages past the rows'
    last are masked.

    `copy_sparse`: copy out the rows' pages where they lie scattered (see `SPARSE_WINDOW`).

    Built with numpy on the host (no Python loop over pages, which at 7B scale number thousands a step),
    then copied to the device without waiting for it.
    """
    counts = -(-contexts // page_slots)
    page_index = np.concatenate([table.pages[:count] for table, count in zip(tables, counts)])
    held = np.unique(page_index)
    copied = copy_sparse and int(held[-1]) + 1 > SPARSE_WINDOW * len(held)
    if copied:   # the window is the rows' pages, in order
        page_index = np.searchsorted(held, page_index)
    row_of_page = np.repeat(np.arange(len(contexts)), counts)
    number_in_row = np.arange(len(row_of_page)) - np.repeat(np.cumsum(counts) - counts, counts)
    # Each (page, row) pair's rank among the page's readers, in row order.
    order = np.argsort(page_index, kind="stable")
    ranked = page_index[order]
    reader = np.empty_like(order)
    reader[order] = np.arange(len(order)) - np.searchsorted(ranked, ranked)
    rows, window, widest = len(contexts), int(page_index.max()) + 1, int(counts.max())
    readers = int(reader.max()) + 1
    if bucketed_within is not None:
        rows, window, widest = bucket(rows), min(fine_bucket(window), bucketed_within), fine_bucket(widest)
        readers = 1 << (readers - 1).bit_length()   # 1 stays 1: a static size, not marked as varying
    owner = np.zeros((window, readers), dtype=np.int64)
    owner[page_index, reader] = row_of_page
    filled = np.zeros((window, readers), dtype=np.int64)
    filled[page_index, reader] = np.minimum(page_slots, contexts[row_of_page] - number_in_row * page_slots)
    pair = page_index * readers + reader
    # Padding repeats the row's first pair: weighted 0, and finite (a free page may hold NaN, and 0 * NaN
    # would reach the row).
    table = np.repeat(pair[number_in_row == 0][:, None], widest, axis=1)
    table[row_of_page, number_in_row] = pair
    padding = np.arange(widest) >= counts[:, None]
    if rows > len(contexts):
        extra = rows - len(contexts)
        table = np.concatenate([table, np.repeat(table[:1], extra, axis=0)])
        padding = np.concatenate([padding, np.repeat(padding[:1], extra, axis=0)])
    masked = np.arange(page_slots) >= filled[:, :, None]
    pages = None
    if copied:   # padded with the window's first page (its slots masked there, as any page no row reads)
        pages = to_device(np.concatenate([held, np.repeat(held[:1], window - len(held))]), device)
    return DecodeTables(to_device(owner, device), to_device(masked, device)[:, None, :, None, :],
                        to_device(table, device), to_device(padding, device)[:, :, None, None], pages)


def bucket(count: int) -> int:
    """The power of two at or above `count`, at least 2: the few sizes a static decode step is padded to. Never
    1: torch.compile specialises a size of 1, which would compile the layers and the decode attention again."""
    return max(2, 1 << (count - 1).bit_length())


def fine_bucket(count: int) -> int:
    """`count` rounded up to a multiple of an eighth of the power of two at or below it (at most 12.5 % more; up
    to 16, `bucket`): the sizes a static decode step's page window and pages per row are padded to. Every page of
    the window is computed, so padding it to a power of two would cost up to twice the attention; eight sizes per
    doubling keep the graphs a run records few."""
    if count <= 16:
        return bucket(count)
    step = 1 << (count.bit_length() - 4)
    return -(-count // step) * step


def attend_decoding(kv: KVCache, layer: int, q: torch.Tensor, tables: DecodeTables, scale: float,
                    kernel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """(rows, heads, head_dim) queries -> (rows, heads, head_dim) attention over each row's pages."""
    # (window * kv_heads, slots, dim): in place, or copied out
    keys, values = (kv.page_view(layer, tables.owner.shape[0]) if tables.pages is None
                    else kv.page_copy(layer, tables.pages))
    return (kernel or paged_decode_attention)(q, keys, values, tables, scale)


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: DecodeTables,
                           scale: float) -> torch.Tensor:
    """Decode attention of every row at once over pages (see `DecodeTables` for the layout).

    Scores and the softmax are float32; for a bfloat16 model the scores come out of the matrix
    multiply in bfloat16 first, as in transformers' eager attention.
    """
    owner, masked, row_pages, padding = tables.owner, tables.masked, tables.row_pages, tables.padding
    rows, heads, dim = q.shape
    window, readers = owner.shape
    kv_heads = keys.shape[0] // window
    group = heads // kv_heads
    # Each (page, kv head) meets the query heads of that kv head of each of the page's readers.
    grouped = (q * scale)[owner].view(window, readers, kv_heads, group, dim).transpose(1, 2)
    grouped = grouped.reshape(window * kv_heads, readers * group, dim)
    slots = keys.shape[1]
    scores = _float32(torch.bmm(grouped, keys.transpose(1, 2)).view(window, kv_heads, readers, group, slots))
    scores.masked_fill_(masked, float("-inf"))
    # A page with no slot of a reader has max -inf: clamped, its weights come out 0, not NaN.
    page_max = scores.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)
    weights = _masked_exp(scores.sub_(page_max))                  # (window, kv_heads, readers, group, slots)
    page_sum = weights.sum(dim=-1, keepdim=True)
    weights = weights.view(window * kv_heads, readers * group, slots)
    page_out = _float32(torch.bmm(weights if values.dtype == torch.float32 else weights.to(values.dtype),
                                  values).view(window, kv_heads, readers, group, dim))
    # Combine each row's pages: rescale every page to the row's maximum, add, normalise (the sums ride
    # along as one more column of the outputs). Per (page, reader) pair: (window * readers, heads, ...).
    partial = torch.cat([page_out, page_sum], dim=-1).transpose(1, 2).reshape(window * readers, heads, dim + 1)
    by_pair = page_max.transpose(1, 2).reshape(window * readers, heads, 1)
    partial = partial[row_pages]                                                       # (rows, widest, heads, dim + 1)
    row_max_by_page = by_pair[row_pages].masked_fill_(padding, float("-inf"))          # (rows, widest, heads, 1)
    scale_by_page = _masked_exp(row_max_by_page.sub_(row_max_by_page.amax(dim=1, keepdim=True)))
    combined = (scale_by_page * partial).sum(dim=1)                                     # (rows, heads, dim + 1)
    out = combined[..., :dim] / combined[..., dim:]
    return out if q.dtype == torch.float32 else out.to(q.dtype)


class DecodeAttention(Protocol):
    """How a step's one-position rows attend over their pages: tables built once a step on the host (padded to a
    few sizes where `bucketed_within` is set, for a static step: see `decode_tables`), then a call per layer."""

    def tables(self, tables: list[BlockTable], contexts: np.ndarray, page_slots: int, device: torch.device,
               bucketed_within: int | None = None) -> Any: ...

    def __call__(self, kv: KVCache, layer: int, q: torch.Tensor, tables: Any, scale: float) -> torch.Tensor: ...


class SplitDecodeAttention:
    """`paged_decode_attention` over a window of pages, eager or compiled (`kernel`): torch ops, any device."""

    def __init__(self, kernel: Callable[..., torch.Tensor] = paged_decode_attention):
        self.kernel = kernel

    def tables(self, tables: list[BlockTable], contexts: np.ndarray, page_slots: int, device: torch.device,
               bucketed_within: int | None = None) -> DecodeTables:
        # Compiled, the window is always the view (see `SPARSE_WINDOW`).
        return decode_tables(tables, contexts, page_slots, device, bucketed_within,
                             copy_sparse=self.kernel is paged_decode_attention)

    def __call__(self, kv: KVCache, layer: int, q: torch.Tensor, tables: DecodeTables, scale: float) -> torch.Tensor:
        return attend_decoding(kv, layer, q, tables, scale, self.kernel)


def _masked_exp(shifted: torch.Tensor) -> torch.Tensor:
    """exp, in place, of scores less their maximum (masked entries -inf, which come out 0)."""
    if shifted.device.type != "cpu":
        return shifted.exp_()
    # On x86 CPUs, arithmetic on float32's subnormal numbers (below 1.2e-38) takes a slow path: torch's exp for
    # arguments below ~-87 (25x the time of the rest: 497 us against 20 on 180 pages of 4 x 32 scores), and the
    # weights-by-values product wherever a weight times a value is that small (a decode step's bmm 4x slower:
    # 1.49 ms against 0.37 at 16 rows of 350 positions). Random weights spread the scores widely, and long contexts
    # of real ones do too. So weights below exp(WEIGHT_FLOOR) of the page's largest (1) are 0: all of a page's
    # slots at that weight add under 1e-26 to its sum of weights, which is at least 1, nothing a float32 holds.
    # Clamped a step lower, the weights set to 0 are all clearly under the threshold, whatever exp's last bit.
    return F.threshold_(shifted.clamp_(min=WEIGHT_FLOOR - 1).exp_(), math.exp(WEIGHT_FLOOR), 0.0)


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.float32 else tensor.float()


class StepAttention:
    """The `Attention` callback a model calls once per layer during one engine step."""

    def __init__(self, kv: KVCache, rows: list[RowSpan], device: torch.device,
                 capture: tuple[int, set[int]] | None = None, decode_attention: DecodeAttention | None = None):
        """`capture`: (layer, row indices) whose last token's query to keep at that layer (`captured`);
        `decode_attention`: how decoding rows attend (by default `SplitDecodeAttention`)."""
        self.kv = kv
        self.decode_attention = decode_attention or SplitDecodeAttention()
        self.rows = rows
        self.capture = capture
        self.captured: dict[int, torch.Tensor] = {}   # row index -> (heads, head_dim) rotated query
        self.scale = 0.0
        decoding = [row for row in rows if row.decodes]
        self.decode: Any = None   # the decode attention's tables
        if decoding:
            tables = [row.table for row in decoding if row.table is not None]
            assert len(tables) == len(decoding), "a decoding row holds device KV"
            self.decode = self.decode_attention.tables(tables, np.array([row.start + 1 for row in decoding]),
                                                       kv.page_slots, device)
        offsets = [row.offset for row in decoding]
        self.decode_tokens: slice | torch.Tensor = (slice(0, len(offsets)) if offsets == list(range(len(offsets)))
                                                    else to_device(offsets, device))
        self.chunks = [row for row in rows if not row.decodes]
        # The pages a later chunk reads its row's context from, on the device once for every layer.
        self.context_pages = [to_device(row.table.first_pages(row.start + row.num_tokens), device)
                              if row.table is not None and row.host_kv is None and row.start > 0 else None
                              for row in self.chunks]
        # On CUDA a later chunk's causal triangle goes to the fused kernels as a lower-right causal bias; a
        # boolean mask would keep them out (see `_attend`).
        self.fused_chunks = fuses_chunks(device)
        self.masks = [None if self.fused_chunks else _causal_mask(row.start, row.num_tokens, device)
                      for row in self.chunks]
        self.only_decodes = not self.chunks and isinstance(self.decode_tokens, slice)
        # Every token of a row with device KV, written in one indexed copy per layer and kind.
        cached = [(row, row.table) for row in rows if row.host_kv is None and row.table is not None]
        tokens = np.concatenate([np.arange(row.offset, row.offset + row.num_tokens) for row, _ in cached] or [[]])
        located = [table.locate(row.start, row.start + row.num_tokens) for row, table in cached]
        every_token = len(cached) == len(rows)   # rows are laid out back to back, so then tokens is 0..n-1
        self.write_tokens = None if every_token else to_device(tokens.astype(np.int64), device)
        self.write_pages = to_device(np.concatenate([pages for pages, _ in located] or [[]]).astype(np.int64), device)
        self.write_offsets = to_device(np.concatenate([offsets for _, offsets in located] or [[]]).astype(np.int64),
                                       device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        if self.capture is not None and layer == self.capture[0]:
            self.scale = scale
            for index in self.capture[1]:
                row = self.rows[index]
                self.captured[index] = q[row.offset + row.num_tokens - 1].clone()
        if self.write_pages.numel():
            device_k, device_v = (k, v) if self.write_tokens is None else (k[self.write_tokens], v[self.write_tokens])
            self.kv.write_at(layer, self.write_pages, self.write_offsets, device_k, device_v)
        if self.decode is not None:
            decoded = self.decode_attention(self.kv, layer, q[self.decode_tokens], self.decode, scale)
            if self.only_decodes:
                return decoded
        out = torch.empty_like(q)
        if self.decode is not None:
            out[self.decode_tokens] = decoded
        for row, mask, pages in zip(self.chunks, self.masks, self.context_pages):
            tokens = slice(row.offset, row.offset + row.num_tokens)
            keys, values = self._context(row, pages, layer, k[tokens], v[tokens])
            query = q[tokens].transpose(0, 1).unsqueeze(0)
            out[tokens] = _attend(query, keys, values, mask, row.start == 0 and row.num_tokens > 1, scale,
                                  self.fused_chunks).transpose(0, 1)
        return out

    def _context(self, row: RowSpan, pages: torch.Tensor | None, layer: int, new_keys: torch.Tensor,
                 new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, kv_heads, context, head_dim) keys and values a chunk attends to (its own new ones included)."""
        context = row.start + row.num_tokens
        if row.host_kv is not None:
            row.host_kv.write(layer, row.start, new_keys, new_values)
            return row.host_kv.read(layer, context)
        if row.start == 0:   # a prompt's first chunk: its context is what it just computed
            return new_keys.transpose(0, 1).unsqueeze(0), new_values.transpose(0, 1).unsqueeze(0)
        assert pages is not None
        return self.kv.gather(pages, layer, context)


def fuses_chunks(device: torch.device) -> bool:
    """Whether prefill chunks attend through SDPA's fused kernels (see `_attend`): on CUDA."""
    return device.type == "cuda"


def to_device(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """A step's host-made indices (ints, or a numpy array of ints or booleans) on the device without waiting
    for it: a blocking copy to a GPU would first drain the GPU's queue, so a step would synchronise once
    per tensor instead of once in all."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.long)
    return host.to(device, non_blocking=True)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            causal_square: bool, scale: float, fused: bool = False) -> torch.Tensor:
    """(1, heads, n, head_dim) attention of one row -> (heads, n, head_dim).

    The first chunk of a prompt is a plain causal square; a later chunk sees all earlier
    positions plus its own causal triangle; one new token sees everything.

    `fused` (CUDA): the triangle is a lower-right causal bias and the keys and values are widened to
    the query heads first. SDPA then runs it in its flash or memory-efficient kernel: a boolean mask,
    or grouped heads, would send a 2048-position chunk at 10k context to the math kernel, which writes
    every score out (2.2 GB per layer at Tarsier2-7B's 28 heads). The widening is one copy of the
    chunk's context (70 MB at 10k positions in bfloat16), small next to the chunk's arithmetic.

    Otherwise (CPU) the triangle is `mask`, whose chunks go through in blocks of queries: the kernel
    turns the boolean mask into a float one of (queries, context), 310 MB for a 2048-position chunk
    at 38k context, and the blocks keep that at a few tens of MB. Each query's result is the same
    either way (the kernel treats query blocks independently), so the output does not change.
    """
    gqa = query.shape[1] != keys.shape[1]
    if fused:
        if gqa:
            groups = query.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        # Imported here: torch.nn.attention.bias imports torch._dynamo (and Triton where installed), ~1.5 s that
        # every process on the CPU, which never comes here, would pay at start-up.
        from torch.nn.attention.bias import causal_lower_right

        queries, context = query.shape[2], keys.shape[2]
        lower_right = causal_lower_right(queries, context) if queries > 1 and not causal_square else None
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=lower_right,
                                              is_causal=causal_square, scale=scale)[0]
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
