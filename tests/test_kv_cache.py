"""The KV cache's pages, free list and in-place storage."""

from __future__ import annotations

import numpy as np
import torch

from tarsier_batch.engine.kv_cache import BlockTable, HostKV, KVCache, PagePool
from tarsier_batch.families.base import KVGeometry


def test_pages_go_out_lowest_first_and_come_back_when_no_row_holds_them() -> None:
    pool = PagePool(6)
    first, second = pool.take(2), pool.take(3)
    assert first.tolist() == [0, 1] and second.tolist() == [2, 3, 4]
    assert pool.take(2) is None and pool.free == 1, "too few free: nothing is taken"
    pool.share(first[1:])   # page 1 held by a second row too
    pool.give_back(first)
    assert pool.free == 2 and pool.holders[:2].tolist() == [0, 1], "page 1 stays its other holder's"
    assert pool.take(2).tolist() == [0, 5]   # the lowest first, wherever they came back from
    pool.give_back(np.array([1]))
    assert pool.take(1).tolist() == [1]


def test_pages_with_known_content_are_kept_when_let_go_and_handed_out_last_least_recent_first() -> None:
    """The prefix cache's bookkeeping: a remembered page no row holds is kept (counted free), found by its
    digest, held again when shared; taken only once no page is free, the one let go longest ago first, and
    forgotten then."""
    pool = PagePool(6)
    first, second = pool.take(2), pool.take(2)
    pool.remember([b"a", b"b"], first)
    pool.remember([b"c", b"a"], second)   # "a" keeps page 0; page 3 stays unknown
    pool.give_back(second)
    pool.give_back(first)
    assert pool.free == 6 and pool.kept == 3, "pages 0, 1 and 2 are kept, page 3 is free"
    assert pool.cached([b"a", b"b", b"x", b"c"]).tolist() == [0, 1], "the run of digests from the first only"
    assert pool.cached([b"c"]).tolist() == [2] and pool.cached([b"b"]).tolist() == [1]
    pool.share(np.array([1]))
    assert pool.kept == 2 and pool.holders[1] == 1 and pool.kept_among(np.array([0, 1, 2])) == 2
    assert pool.take(2).tolist() == [3, 4], "free pages first"
    assert pool.take(2).tolist() == [5, 2], "then the kept page let go longest ago (page 2 before page 0)"
    assert pool.cached([b"c"]).tolist() == [] and pool.cached([b"a"]).tolist() == [0], "a taken page is forgotten"
    assert pool.take(2) is None and pool.kept == 1, "too few: nothing taken, nothing forgotten"


def test_for_compiled_steps_kept_pages_go_out_lowest_first_with_the_free_ones() -> None:
    """A compiled step reads the cache's first pages: kept pages below the free ones are handed out first, so the
    pages in use stay at the front."""
    pool = PagePool(6, lowest_first=True)
    pages = pool.take(4)
    pool.remember([b"a", b"b"], pages[:2])
    pool.give_back(pages)
    assert pool.kept == 2 and pool.cached([b"a", b"b"]).tolist() == [0, 1]
    pool.share(np.array([1]))   # held again, then let go again: kept once, not twice
    pool.give_back(np.array([1]))
    assert pool.take(3).tolist() == [0, 1, 2] and pool.kept == 0 and pool.cached([b"a"]).tolist() == []
    assert pool.take(3).tolist() == [3, 4, 5] and pool.take(1) is None


def test_a_table_grows_into_free_pages_anywhere() -> None:
    """The fragmentation a range could not live with: the free pages are scattered between other rows' pages,
    and a row wanting more than any run of them still gets them all."""
    geometry = KVGeometry(num_layers=1, kv_heads=1, head_dim=2)
    cache = KVCache(geometry, 8 * 4, torch.float32, torch.device("cpu"), page_slots=4)
    rows = [BlockTable(4) for _ in range(4)]
    for table in rows:
        assert cache.grow(table, 8)
    for table in rows[::2]:
        cache.release(table)
    assert cache.free_slots == 16 and [table.pages.tolist() for table in rows[1::2]] == [[2, 3], [6, 7]]
    long = BlockTable(4)
    assert cache.grow(long, 13) and long.pages.tolist() == [0, 1, 4, 5]
    assert long.capacity == 16 and cache.free_slots == 0
    assert not cache.grow(long, 17) and long.capacity == 16, "no page free: the table stays as it was"
    assert cache.grow(long, 16), "already held"


def test_rows_are_written_to_their_pages_and_read_back_intact() -> None:
    geometry = KVGeometry(num_layers=2, kv_heads=3, head_dim=4)
    cache = KVCache(geometry, 70, torch.float32, torch.device("cpu"), page_slots=8)
    assert cache.keys.shape == (2, 8 + 1, 3, 8, 4), \
        "whole pages only, and the scratch page: (layers, pages, kv heads, slots, head dim)"
    assert cache.scratch_page == 8 and cache.capacity_tokens == 64, "the 6 slots short of a page are never used"
    cache.values.fill_(float("nan"))
    table = BlockTable(8, np.array([5, 2]))   # pages out of order
    keys, values = torch.randn(11, 3, 4), torch.randn(11, 3, 4)
    cache.write(table, 1, 0, keys[:4], values[:4])
    cache.write(table, 1, 4, keys[4:], values[4:])  # a second chunk after the first, across a page edge
    read_keys, read_values = cache.read(table, 1, 11)
    assert read_keys.shape == (1, 3, 11, 4)
    torch.testing.assert_close(read_keys[0], keys.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(read_values[0], values.transpose(0, 1), rtol=0, atol=0)
    assert cache.values[1, [0, 1, 3, 4, 6, 7]].isnan().all(), "other pages untouched"
    # The decode path's view of the first pages is the storage itself, page by page and head by head.
    paged_keys, _ = cache.page_view(1, 3)
    assert paged_keys.data_ptr() == cache.keys[1].data_ptr() and paged_keys.shape == (3 * 3, 8, 4)
    torch.testing.assert_close(paged_keys[2 * 3 + 2, 10 - 8], keys[10, 2], rtol=0, atol=0)   # page 2, head 2, slot 10



def test_a_fork_shares_the_whole_pages_of_its_prefix_and_copies_the_partial_one() -> None:
    geometry = KVGeometry(num_layers=2, kv_heads=3, head_dim=4)
    cache = KVCache(geometry, 64, torch.float32, torch.device("cpu"), page_slots=8)
    cache.values.fill_(float("nan"))
    source = BlockTable(8)
    assert cache.grow(source, 24) and source.pages.tolist() == [0, 1, 2]
    keys, values = torch.randn(19, 3, 4), torch.randn(19, 3, 4)
    for layer in range(2):
        cache.write(source, layer, 0, keys, values)
    fork = cache.hold_prefix(source.pages[:11 // 8])   # page 0 whole below 11; page 1 partly
    assert fork.pages.tolist() == [0] and cache.pool.holders[:3].tolist() == [2, 1, 1]
    assert cache.grow(fork, 16) and fork.pages.tolist() == [0, 3]
    assert not cache.values[:, 3].isnan().any(), "pages handed out have their values cleared"
    cache.copy_tokens(source, fork, 11)
    for layer in range(2):
        copied_keys, copied_values = cache.read(fork, layer, 11)
        torch.testing.assert_close(copied_keys[0], keys[:11].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(copied_values[0], values[:11].transpose(0, 1), rtol=0, atol=0)
    cache.write(fork, 0, 11, -keys[:5], -values[:5])   # the fork goes on in its own page: the source's stays
    torch.testing.assert_close(cache.read(source, 0, 19)[0][0], keys.transpose(0, 1), rtol=0, atol=0)
    cache.release(source)
    assert cache.pool.holders[:4].tolist() == [1, 0, 0, 1] and cache.free_slots == 64 - 16
    cache.release(fork)
    assert cache.free_slots == 64 and not cache.pool.holders.any()


def test_offloaded_rows_come_back_to_their_device_pages_intact() -> None:
    geometry = KVGeometry(num_layers=2, kv_heads=2, head_dim=4)
    host = HostKV(geometry, 8, torch.float32, torch.device("cpu"))
    keys = torch.randn(2, 5, 2, 4)
    for layer in range(2):
        host.write(layer, 0, keys[layer, :3], -keys[layer, :3])
        host.write(layer, 3, keys[layer, 3:], -keys[layer, 3:])
    cache = KVCache(geometry, 32, torch.float32, torch.device("cpu"), page_slots=4)
    table = BlockTable(4, np.array([6, 3]))
    cache.copy_from(table, host, 5)
    for layer in range(2):
        device_keys, device_values = cache.read(table, layer, 5)
        torch.testing.assert_close(device_keys[0], keys[layer].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(device_values[0], -keys[layer].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(host.read(layer, 5)[0], device_keys, rtol=0, atol=0)
