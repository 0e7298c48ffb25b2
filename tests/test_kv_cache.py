"""The KV cache's range allocator and in-place storage."""

from __future__ import annotations

import torch

from tarsier_batch.engine.kv_cache import HostKV, KVCache, RangeAllocator, Region
from tarsier_batch.families.base import KVGeometry


def test_allocator_reuses_freed_ranges_and_merges_neighbours() -> None:
    allocator = RangeAllocator(100)
    a, b, c = allocator.allocate(30), allocator.allocate(30), allocator.allocate(30)
    assert [(r.start, r.capacity) for r in (a, b, c)] == [(0, 30), (30, 30), (60, 30)]
    assert allocator.allocate(20) is None and allocator.free_slots == 10
    allocator.release(b)
    assert allocator.largest_free == 30
    allocator.release(a)  # merges with b's range on its right
    assert allocator.largest_free == 60 and allocator.allocate(60) == Region(0, 60)


def test_allocator_extends_in_place_only_into_a_free_neighbour() -> None:
    allocator = RangeAllocator(100)
    a, b = allocator.allocate(10), allocator.allocate(10)
    assert not allocator.extend(a, 15), "b sits right after a"
    assert allocator.extend(b, 50) and b == Region(10, 50)
    assert allocator.free_slots == 40
    allocator.release(b)
    assert allocator.extend(a, 100) and allocator.free_slots == 0


def test_rows_are_written_to_their_pages_read_back_and_moved_intact() -> None:
    geometry = KVGeometry(num_layers=2, kv_heads=3, head_dim=4)
    cache = KVCache(geometry, 70, torch.float32, torch.device("cpu"), page_slots=8)
    assert cache.keys.shape == (2, 8 + 1, 3, 8, 4), \
        "whole pages only, and the scratch page: (layers, pages, kv heads, slots, head dim)"
    assert cache.scratch_page == 8
    region = cache.allocator.allocate(cache.whole_pages(10))
    assert region == Region(0, 16)
    rest = cache.allocator.allocate(48)
    assert rest is not None and cache.allocator.allocate(8) is None, "the 6 slots short of a page are never used"
    cache.allocator.release(rest)
    keys, values = torch.randn(11, 3, 4), torch.randn(11, 3, 4)
    cache.write(region, 1, 0, keys[:4], values[:4])
    cache.write(region, 1, 4, keys[4:], values[4:])  # a second chunk after the first, across a page edge
    read_keys, read_values = cache.read(region, 1, 11)
    assert read_keys.shape == (1, 3, 11, 4)
    torch.testing.assert_close(read_keys[0], keys.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(read_values[0], values.transpose(0, 1), rtol=0, atol=0)
    # The decode path's view of the first pages is the storage itself, page by page and head by head.
    paged_keys, _ = cache.page_view(1, 2)
    assert paged_keys.data_ptr() == cache.keys[1].data_ptr() and paged_keys.shape == (2 * 3, 8, 4)
    torch.testing.assert_close(paged_keys[3 + 2, 10 - 8], keys[10, 2], rtol=0, atol=0)   # page 1, head 2, slot 10
    overlapping = Region(8, 16)  # compaction moves ranges onto themselves
    cache.copy_tokens(region, overlapping, 11)
    moved_keys, moved_values = cache.read(overlapping, 1, 11)
    torch.testing.assert_close(moved_keys[0], keys.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(moved_values[0], values.transpose(0, 1), rtol=0, atol=0)


def test_offloaded_rows_come_back_to_the_device_range_intact() -> None:
    geometry = KVGeometry(num_layers=2, kv_heads=2, head_dim=4)
    host = HostKV(geometry, 8, torch.float32, torch.device("cpu"))
    keys = torch.randn(2, 5, 2, 4)
    for layer in range(2):
        host.write(layer, 0, keys[layer, :3], -keys[layer, :3])
        host.write(layer, 3, keys[layer, 3:], -keys[layer, 3:])
    cache = KVCache(geometry, 32, torch.float32, torch.device("cpu"), page_slots=4)
    cache.allocator.allocate(4)
    region = cache.allocator.allocate(8)   # from the second page on
    cache.copy_from(region, host, 5)
    for layer in range(2):
        device_keys, device_values = cache.read(region, layer, 5)
        torch.testing.assert_close(device_keys[0], keys[layer].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(device_values[0], -keys[layer].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(host.read(layer, 5)[0], device_keys, rtol=0, atol=0)
