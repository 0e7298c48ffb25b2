"""The engine's own KV cache: storage allocated once, each row a contiguous token range in it.

Every layer's keys and values live in one preallocated tensor per kind, head-major
(layers, kv_heads, capacity, head_dim), so a row's context is a strided *view* that attention
reads directly: nothing is concatenated, copied or re-padded when a token is added or a row
joins or leaves. A row owns a contiguous range (a `Region`), reserved for its prompt plus some
room to grow; it grows in place when the next range is free and moves otherwise (rarely: growth
is geometric). Ranges rather than pages, because CPU attention kernels need each row's context
contiguous; paging would cost a gather, i.e. a copy of the context, in every layer of every step.

A cache may hold a range of the layers only: with vision-token pruning the engine keeps two,
one for the layers that see the whole prompt and a smaller one for the layers that see only
the survivors (see `engine.pruning`), each row holding a range in both.

`HostKV` is the same interface over host memory, for rows whose prefill is offloaded.
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


class KVCache:
    """Preallocated keys and values of some layers (all by default) for all rows, on the model's device."""

    def __init__(self, geometry: KVGeometry, capacity_tokens: int, dtype: torch.dtype, device: torch.device,
                 layers: range | None = None):
        self.layers = layers if layers is not None else range(geometry.num_layers)
        shape = (len(self.layers), geometry.kv_heads, capacity_tokens, geometry.head_dim)
        # torch.empty reserves without touching: on the CPU the pages are committed as rows use them.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.geometry = geometry
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

    def write(self, region: Region, layer: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a row's new (tokens, kv_heads, head_dim) keys and values from position `offset` on."""
        start, index = region.start + offset, layer - self.layers.start
        self.keys[index, :, start:start + keys.shape[0]] = keys.transpose(0, 1)
        self.values[index, :, start:start + values.shape[0]] = values.transpose(0, 1)

    def read(self, region: Region, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (1, kv_heads, length, head_dim) of a row's first `length` keys and values."""
        window, index = slice(region.start, region.start + length), layer - self.layers.start
        return self.keys[index, :, window].unsqueeze(0), self.values[index, :, window].unsqueeze(0)

    def move(self, source: Region, target: Region, length: int) -> None:
        """Copy a row's first `length` tokens to another range (when it cannot grow in place)."""
        for storage in (self.keys, self.values):  # clone: compaction moves ranges onto themselves
            storage[:, :, target.start:target.start + length] = storage[:, :, source.start:source.start + length].clone()

    def copy_from(self, region: Region, host: HostKV, length: int) -> None:
        """Bring an offloaded row's first `length` tokens into its device range (a cache of every layer)."""
        window = slice(region.start, region.start + length)
        self.keys[:, :, window].copy_(host.keys[:, :, :length], non_blocking=True)
        self.values[:, :, window].copy_(host.values[:, :, :length], non_blocking=True)


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
