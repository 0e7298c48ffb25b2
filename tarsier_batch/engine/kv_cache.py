"""The engine's own KV cache: storage allocated once, each row a contiguous range of pages in it.

Every layer's keys and values live in one preallocated tensor per kind, page-major
(layers, pages, kv_heads, PAGE_SLOTS, head_dim). A row owns a contiguous range of whole pages
(a `Region`, in slots, always page-aligned), reserved for its prompt plus some room to grow; it
grows in place when the next pages are free and moves otherwise (rarely: growth is geometric).

Why pages: a decode step attends for all its rows in one batched call (see `engine.attention`),
one small matrix multiply per (page, kv head), and that needs the pages in use to be one strided
view of the storage: the first N pages, (N * kv_heads, PAGE_SLOTS, head_dim), read where they are.
Why contiguous ranges of pages rather than a page table: a prefill chunk reads its row's earlier
context as one slice, and growth, compaction and offload stay simple range copies.

A cache may hold a range of the layers only: with vision-token pruning the engine keeps two,
one for the layers that see the whole prompt and a smaller one for the layers that see only
the survivors (see `engine.pruning`), each row holding a range in both.

`HostKV` keeps one row's keys and values in host memory, for rows whose prefill is offloaded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..families.base import KVGeometry


@dataclass
class Region:
    """A row's range of cache slots: [start, start + capacity)."""

    start: int
    capacity: int

    @property
    def end(self) -> int:
        return self.start + self.capacity


class RangeAllocator:
    """First-fit allocation of contiguous ranges in [0, capacity), with free neighbours merged."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # sorted (start, size)

    @property
    def free_slots(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def allocate(self, size: int) -> Region | None:
        for index, (start, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, free_size - size)
                return Region(start, size)
        return None

    def release(self, region: Region) -> None:
        index = bisect.bisect(self._free, (region.start, 0))
        self._free.insert(index, (region.start, region.capacity))
        self._merge_around(index)

    def extend(self, region: Region, size: int) -> bool:
        """Grow `region` in place to `size` slots if the range right after it is free."""
        extra = size - region.capacity
        if extra <= 0:
            return True
        index = bisect.bisect(self._free, (region.end, -1))
        if index < len(self._free) and self._free[index][0] == region.end and self._free[index][1] >= extra:
            start, free_size = self._free[index]
            if free_size == extra:
                del self._free[index]
            else:
                self._free[index] = (start + extra, free_size - extra)
            region.capacity = size
            return True
        return False

    def reset(self, used: int) -> None:
        """Everything from `used` on is free (after the holders were compacted below it)."""
        self._free = [(used, self.capacity - used)] if used < self.capacity else []

    def _merge_around(self, index: int) -> None:
        for left in (index, index - 1):
            if 0 <= left < len(self._free) - 1:
                start, size = self._free[left]
                next_start, next_size = self._free[left + 1]
                if start + size == next_start:
                    self._free[left] = (start, size + next_size)
                    del self._free[left + 1]


# Slots per page: a row's range is whole pages. Larger pages waste more slots per row (at most
# PAGE_SLOTS - 1) but make decode attention's per-page partial results a smaller share of what a step
# reads: (heads x head_dim) floats per page against 2 x kv_heads x head_dim values per slot, i.e.
# (query heads per kv head) / PAGE_SLOTS of the keys and values in float32 against bfloat16: 22 %
# for Tarsier2-7b's 7 query heads per kv head at 32 slots, 3 % for Tarsier-7b's multi-head attention.
PAGE_SLOTS = 32


class KVCache:
    """Preallocated keys and values of some layers (all by default) for all rows, on the model's device."""

    def __init__(self, geometry: KVGeometry, capacity_tokens: int, dtype: torch.dtype, device: torch.device,
                 layers: range | None = None, page_slots: int = PAGE_SLOTS):
        self.layers = layers if layers is not None else range(geometry.num_layers)
        self.first_layer = self.layers.start   # a plain int: compiled steps trace the index arithmetic
        self.page_slots = page_slots
        pages = capacity_tokens // page_slots
        # One page more than ranges can use: the scratch page, where the padding rows of a decode step
        # padded to a fixed size write their keys and values (see `engine.decode_step`).
        self.scratch_page = pages
        shape = (len(self.layers), pages + 1, geometry.kv_heads, page_slots, geometry.head_dim)
        # torch.empty reserves without touching: on the CPU the pages are committed as rows use them.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.geometry = geometry
        # Every range is whole pages, so the tail of `capacity_tokens` short of a page is never handed out.
        self.allocator = RangeAllocator(capacity_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_slot(self) -> int:
        """Keys and values of one token in every layer this cache holds."""
        return 2 * len(self.layers) * self.geometry.kv_heads * self.geometry.head_dim * self.keys.element_size()

    def whole_pages(self, slots: int) -> int:
        """`slots` rounded up to whole pages: what a range of at least that many slots takes."""
        return -(-slots // self.page_slots) * self.page_slots

    def write(self, region: Region, layer: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a row's new (tokens, kv_heads, head_dim) keys and values from position `offset` on."""
        slots = torch.arange(region.start + offset, region.start + offset + keys.shape[0], device=keys.device)
        self.write_at(layer, slots // self.page_slots, slots % self.page_slots, keys, values)

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

    def read(self, region: Region, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's first `length` keys and values, (1, kv_heads, length, head_dim): a copy out of its pages."""
        return self._contiguous(self.keys, region, layer, length), self._contiguous(self.values, region, layer, length)

    def page_view(self, layer: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `pages` pages of one layer as views (pages * kv_heads, page_slots, head_dim)."""
        # narrow and a view of explicit sizes (not a slice and -1): a compiled step keeps `pages` a symbol
        # instead of specialising on it.
        index = layer - self.first_layer
        shape = (pages * self.geometry.kv_heads, self.page_slots, self.geometry.head_dim)
        return self.keys[index].narrow(0, 0, pages).view(shape), self.values[index].narrow(0, 0, pages).view(shape)

    def clear_values(self, start: int, end: int) -> None:
        """Zero the values of slots [start, end) as a range is handed out: decode attention multiplies a
        page's slots past its row's context by weight 0, and never-written memory may hold NaN."""
        self.values[:, start // self.page_slots:end // self.page_slots] = 0

    def copy_tokens(self, source: Region, target: Region, length: int) -> None:
        """Copy a row's first `length` tokens to another range: a row that cannot grow in place moves, a row
        forked from another's prefix starts from a copy of it."""
        count = -(-length // self.page_slots)
        first, to = source.start // self.page_slots, target.start // self.page_slots
        for storage in (self.keys, self.values):  # clone: compaction moves ranges onto themselves
            storage[:, to:to + count] = storage[:, first:first + count].clone()
        self.clear_values(target.start + count * self.page_slots, target.end)

    def copy_from(self, region: Region, host: HostKV, length: int) -> None:
        """Bring an offloaded row's first `length` tokens into its device range (a cache of every layer): one
        copy to the device (from a strided slice of host memory, which torch stages unpinned), then laid out in
        pages there."""
        count = -(-length // self.page_slots)
        first = region.start // self.page_slots
        for storage, kept in ((self.keys, host.keys), (self.values, host.values)):
            layers, heads, _, dim = kept.shape
            paged = storage.new_zeros(layers, heads, count * self.page_slots, dim)
            paged[:, :, :length].copy_(kept[:, :, :length], non_blocking=True)
            storage[:, first:first + count] = paged.view(layers, heads, count, self.page_slots, dim).transpose(1, 2)

    def _contiguous(self, storage: torch.Tensor, region: Region, layer: int, length: int) -> torch.Tensor:
        first, count = region.start // self.page_slots, -(-length // self.page_slots)
        pages = storage[layer - self.first_layer, first:first + count]        # (count, heads, page, dim)
        heads, dim = pages.shape[1], pages.shape[3]
        return pages.transpose(0, 1).reshape(heads, count * self.page_slots, dim)[:, :length].unsqueeze(0)


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
