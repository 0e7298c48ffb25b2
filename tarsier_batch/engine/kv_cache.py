"""The engine's own KV cache: storage allocated once, in pages; each row holds a block table of pages.

Every layer's keys and values live in one preallocated tensor per kind, page-major
(layers, pages, kv_heads, PAGE_SLOTS, head_dim). A row holds a `BlockTable` per cache: its pages in
context order, any pages anywhere, taken from the cache's free list as the row grows and given
back when it finishes or is preempted (the KV manager, `engine.kv_manager`, keeps the rows' tables
and decides when). Nothing needs a contiguous hole and nothing moves: a long row never waits for,
or preempts others to make, a hole while enough pages are free in total.

Why pages: a decode step attends for all its rows in one batched call (see `engine.attention`),
one small matrix multiply per (page, kv head), and that needs the pages in use to be one strided
view of the storage: the first N pages, (N * kv_heads, PAGE_SLOTS, head_dim), read where they are.
The free list hands out the lowest free pages first, so the pages in use stay at the front and N
stays close to the pages held. A prefill chunk reads its row's earlier context gathered from its
pages (a chunk is compute-bound: the copy is small next to its arithmetic).

A cache may hold a range of the layers only: with vision-token pruning the engine keeps two,
one for the layers that see the whole prompt and a smaller one for the layers that see only
the survivors (see `engine.pruning`), each row holding a table in both.

`HostKV` keeps one row's keys and values in host memory, for rows whose prefill is offloaded.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np
import torch

from ..families.base import KVGeometry


class BlockTable:
    """A row's pages in one cache, in context order: the row's slot i is slot i % page_slots of page
    pages[i // page_slots]."""

    def __init__(self, page_slots: int, pages: np.ndarray | None = None):
        self.page_slots = page_slots
        self.pages = pages if pages is not None else np.zeros(0, dtype=np.int64)

    @property
    def capacity(self) -> int:
        """Slots the row's pages hold."""
        return len(self.pages) * self.page_slots

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset in page) of the row's slots [start, stop), as two arrays."""
        slots = np.arange(start, stop)
        return self.pages[slots // self.page_slots], slots % self.page_slots

    def first_pages(self, slots: int) -> np.ndarray:
        """The pages holding the row's first `slots` slots."""
        return self.pages[:-(-slots // self.page_slots)]


class PagePool:
    """The pages of one cache: free, held by rows (how many rows hold each), or kept.

    A kept page is the prefix cache: no row holds it, but it holds a prompt's computed full page, known by
    its digest (see `Sequence.page_digests`), and a later row whose prompt starts the same way takes it
    instead of computing it (a retry, a preempted row coming back, the same clip under a second path or asked
    again). A held page is remembered the same way, so rows running together share too. Kept pages count as
    free: one is handed out again only when no page is free, the one let go longest ago first, and loses its
    digest then.

    `lowest_first`: kept pages go out with the free ones, the lowest page first, as if they were free. Decode
    attention reads the cache's first pages up to the highest one in use; an eager step copies out the pages in
    use where that window is sparse, a compiled step cannot (see `attention.SPARSE_WINDOW`), and with kept
    pages below them taken last the pages in use would climb to the top of the cache. Kept pages then last
    while no lower page is wanted.
    """

    def __init__(self, pages: int, lowest_first: bool = False):
        self._free = list(range(pages))   # a heap, and sorted to start with
        self.holders = np.zeros(pages, dtype=np.int64)
        self._kept: OrderedDict[int, None] = OrderedDict()   # least recently let go first
        self._page_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self.lowest_first = lowest_first
        self._kept_by_page: list[int] = []   # with `lowest_first`: a heap of kept pages (some no longer kept)

    @property
    def free(self) -> int:
        """Pages a row may take: the free ones and the kept ones."""
        return len(self._free) + len(self._kept)

    @property
    def kept(self) -> int:
        return len(self._kept)

    def take(self, count: int) -> np.ndarray | None:
        """`count` pages, now held once, or None (and nothing taken) if fewer are free: the lowest free pages,
        then kept ones, least recently let go first (with `lowest_first`: the lowest of both)."""
        if count > self.free:
            return None
        pages = np.array([self._next_page() for _ in range(count)], dtype=np.int64)
        self.holders[pages] = 1
        return pages

    def _next_page(self) -> int:
        if self.lowest_first:
            while self._kept_by_page and self._kept_by_page[0] not in self._kept:   # held again since, or taken
                heapq.heappop(self._kept_by_page)
            if self._kept_by_page and (not self._free or self._kept_by_page[0] < self._free[0]):
                return self._forget(heapq.heappop(self._kept_by_page))
        if self._free:
            return heapq.heappop(self._free)
        return self._forget(next(iter(self._kept)))

    def _forget(self, page: int) -> int:
        """A kept page, no longer kept nor known."""
        del self._kept[page]
        del self._page_of[self._digest_of.pop(page)]
        return page

    def kept_among(self, pages: np.ndarray) -> int:
        """How many of `pages` are kept (free, but held once shared)."""
        return int((self.holders[pages] == 0).sum())

    def share(self, pages: np.ndarray) -> None:
        """One more row holds each of `pages` (distinct pages, held or kept)."""
        for page in pages[self.holders[pages] == 0].tolist():
            del self._kept[page]
        self.holders[pages] += 1

    def give_back(self, pages: np.ndarray) -> None:
        """One row fewer holds each of `pages` (distinct); those no row holds any more are kept if their content
        is known, else free."""
        self.holders[pages] -= 1
        # Last page first: a row's last pages are then taken before its first, which a row with the same prompt
        # finds even without them (a cached prefix is a run of pages from the first).
        for page in pages[self.holders[pages] == 0][::-1].tolist():
            if page in self._digest_of:
                self._kept[page] = None
                if self.lowest_first:
                    heapq.heappush(self._kept_by_page, page)
            else:
                heapq.heappush(self._free, page)

    def remember(self, digests: list[bytes], pages: np.ndarray) -> None:
        """`pages` (held) now hold the computed full pages known by `digests`. A digest already known keeps its
        page (two rows computed the same page at once: the second's copy is freed with its row)."""
        for digest, page in zip(digests, pages.tolist()):
            if digest not in self._page_of and page not in self._digest_of:
                self._page_of[digest] = page
                self._digest_of[page] = digest

    def cached(self, digests: list[bytes]) -> np.ndarray:
        """The pages holding the longest run of `digests` from the first (not taken: `share` them)."""
        pages = []
        for digest in digests:
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return np.array(pages, dtype=np.int64)


# Slots per page: a row holds whole pages. Larger pages waste more slots per row (at most
# PAGE_SLOTS - 1) but make decode attention's per-page partial results a smaller share of what a step
# reads: (heads x head_dim) floats per page against 2 x kv_heads x head_dim values per slot, i.e.
# (query heads per kv head) / PAGE_SLOTS of the keys and values in float32 against bfloat16: 22 %
# for Tarsier2-7b's 7 query heads per kv head at 32 slots, 3 % for Tarsier-7b's multi-head attention.
PAGE_SLOTS = 32


class KVCache:
    """Preallocated keys and values of some layers (all by default) for all rows, on the model's device."""

    def __init__(self, geometry: KVGeometry, capacity_tokens: int, dtype: torch.dtype, device: torch.device,
                 layers: range | None = None, page_slots: int = PAGE_SLOTS, lowest_first: bool = False):
        """`lowest_first`: see `PagePool` (for compiled steps)."""
        self.layers = layers if layers is not None else range(geometry.num_layers)
        self.first_layer = self.layers.start   # a plain int: compiled steps trace the index arithmetic
        self.page_slots = page_slots
        self.pages = capacity_tokens // page_slots   # the tail of `capacity_tokens` short of a page is not used
        # One page more than rows can hold: the scratch page, where the padding rows of a decode step
        # padded to a fixed size write their keys and values (see `engine.decode_step`).
        self.scratch_page = self.pages
        shape = (len(self.layers), self.pages + 1, geometry.kv_heads, page_slots, geometry.head_dim)
        # torch.empty reserves without touching: on the CPU the pages are committed as rows use them.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.geometry = geometry
        self.pool = PagePool(self.pages, lowest_first)

    @property
    def capacity_tokens(self) -> int:
        return self.pages * self.page_slots

    @property
    def free_slots(self) -> int:
        return self.pool.free * self.page_slots

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_slot(self) -> int:
        """Keys and values of one token in every layer this cache holds."""
        return 2 * len(self.layers) * self.geometry.kv_heads * self.geometry.head_dim * self.keys.element_size()

    def whole_pages(self, slots: int) -> int:
        """`slots` rounded up to whole pages: what a table of at least that many slots takes."""
        return -(-slots // self.page_slots) * self.page_slots

    def grow(self, table: BlockTable, slots: int) -> bool:
        """Give `table` pages until it holds at least `slots` slots; False (and nothing taken) if too few are
        free."""
        missing = -(-slots // self.page_slots) - len(table.pages)
        if missing <= 0:
            return True
        pages = self.pool.take(missing)
        if pages is None:
            return False
        # Decode attention multiplies a page's slots past its row's context by weight 0, and never-written
        # memory may hold NaN. Slices of consecutive pages (those taken together mostly are): no index to copy
        # to the device, which would wait for it.
        for first, stop in _runs(pages):
            self.values[:, first:stop] = 0
        table.pages = np.concatenate([table.pages, pages])
        return True

    def release(self, table: BlockTable) -> None:
        """Let go of a finished or preempted row's pages (a page other rows share stays theirs)."""
        self.pool.give_back(table.pages)
        table.pages = table.pages[:0]

    def hold_prefix(self, pages: np.ndarray) -> BlockTable:
        """A table for a row whose first pages are `pages`, computed already (another question's prefix about the
        same clip, or the prefix cache's): it holds them with the rows holding them, without a copy (no row
        writes to a page below its computed positions, so they no longer change)."""
        self.pool.share(pages)
        return BlockTable(self.page_slots, pages.copy())

    def write(self, table: BlockTable, layer: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a row's new (tokens, kv_heads, head_dim) keys and values from position `offset` on."""
        pages, offsets = table.locate(offset, offset + keys.shape[0])
        self.write_at(layer, torch.from_numpy(pages).to(keys.device), torch.from_numpy(offsets).to(keys.device),
                      keys, values)

    def write_at(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        """Store (tokens, kv_heads, head_dim) keys and values at (page, offset in page) pairs (tokens,) each:
        one indexed copy per kind, however many rows the tokens belong to."""
        # The layer as an index tensor, not a view of the layer: compiled, a write through a view of the storage
        # becomes a copy of the whole storage (functionalisation scatters the view back), a write through indices
        # stays in place.
        layers = torch.full_like(pages, layer - self.first_layer)
        self.keys[layers, pages, :, offsets] = keys
        self.values[layers, pages, :, offsets] = values

    def read(self, table: BlockTable, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's first `length` keys and values, (1, kv_heads, length, head_dim): gathered from its pages."""
        return self.gather(torch.from_numpy(table.first_pages(length)).to(self.keys.device, non_blocking=True),
                           layer, length)

    def gather(self, pages: torch.Tensor, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values in `pages` (a row's, on the device: a step makes its index once for
        every layer), (1, kv_heads, length, head_dim)."""
        return (self._contiguous(self.keys, pages, layer, length),
                self._contiguous(self.values, pages, layer, length))

    def page_view(self, layer: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `pages` pages of one layer as views (pages * kv_heads, page_slots, head_dim)."""
        # narrow and a view of explicit sizes (not a slice and -1): a compiled step keeps `pages` a symbol
        # instead of specialising on it.
        index = layer - self.first_layer
        shape = (pages * self.geometry.kv_heads, self.page_slots, self.geometry.head_dim)
        return self.keys[index].narrow(0, 0, pages).view(shape), self.values[index].narrow(0, 0, pages).view(shape)

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values whole, (pages + 1, kv_heads, page_slots, head_dim): the scratch page last."""
        index = layer - self.first_layer
        return self.keys[index], self.values[index]

    def page_copy(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`pages` (on the device) of one layer, copied out as (len(pages) * kv_heads, page_slots, head_dim)."""
        index = layer - self.first_layer
        return self.keys[index, pages].flatten(0, 1), self.values[index, pages].flatten(0, 1)

    def copy_tokens(self, source: BlockTable, target: BlockTable, length: int) -> None:
        """Copy a row's first `length` tokens into another row's pages where the two hold different pages (a
        fork's partial last page of the prefix)."""
        count = -(-length // self.page_slots)
        differ = source.pages[:count] != target.pages[:count]
        into, out_of = (torch.from_numpy(pages[:count][differ]).to(self.keys.device, non_blocking=True)
                        for pages in (target.pages, source.pages))
        for storage in (self.keys, self.values):
            storage[:, into] = storage[:, out_of]

    def copy_from(self, table: BlockTable, host: HostKV, length: int) -> None:
        """Bring an offloaded row's first `length` tokens into its device pages (a cache of every layer): one
        copy to the device (from a strided slice of host memory, which torch stages unpinned), then laid out in
        pages there."""
        count = -(-length // self.page_slots)
        pages = torch.from_numpy(table.pages[:count]).to(self.keys.device, non_blocking=True)
        for storage, kept in ((self.keys, host.keys), (self.values, host.values)):
            layers, heads, _, dim = kept.shape
            paged = storage.new_zeros(layers, heads, count * self.page_slots, dim)
            paged[:, :, :length].copy_(kept[:, :, :length], non_blocking=True)
            storage[:, pages] = paged.view(layers, heads, count, self.page_slots, dim).transpose(1, 2)

    def _contiguous(self, storage: torch.Tensor, pages: torch.Tensor, layer: int, length: int) -> torch.Tensor:
        gathered = storage[layer - self.first_layer, pages]        # (count, heads, page, dim)
        count, heads, _, dim = gathered.shape
        return gathered.transpose(0, 1).reshape(heads, count * self.page_slots, dim)[:, :length].unsqueeze(0)


def _runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """`pages` as [first, stop) runs of consecutive pages, in order."""
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(pages, breaks) if len(run)]


class HostKV:
    """One row's keys and values in host memory (pinned on CUDA), for offloaded prefill.

    During an offloaded prefill each layer reads the row's earlier context from here, so the
    device holds one layer of this row's context at a time instead of all of them.
    """

    def __init__(self, geometry: KVGeometry, length: int, dtype: torch.dtype, device: torch.device):
        shape = (geometry.num_layers, geometry.kv_heads, length, geometry.head_dim)
        pin = device.type == "cuda"
        self.keys = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.values = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.device = device

    def write(self, layer: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = offset + keys.shape[0]
        self.keys[layer, :, offset:end].copy_(keys.transpose(0, 1))
        self.values[layer, :, offset:end].copy_(values.transpose(0, 1))

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's first `length` tokens of one layer, on the device (1, kv_heads, length, head_dim)."""
        keys = self.keys[layer, :, :length].to(self.device, non_blocking=True)
        values = self.values[layer, :, :length].to(self.device, non_blocking=True)
        return keys.unsqueeze(0), values.unsqueeze(0)
