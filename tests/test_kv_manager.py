"""The KV manager's answers to the scheduler: can a row fit, which of its prompt is computed, can it have blocks."""

from __future__ import annotations

import torch

from tarsier_batch.engine.kv_cache import KVCache
from tarsier_batch.engine.kv_manager import ComputedPrefix, KVManager
from tarsier_batch.engine.sequence import Sequence
from tarsier_batch.families.base import KVGeometry, ProcessedPrompt

PAGE = 4
GEOMETRY = KVGeometry(num_layers=2, kv_heads=1, head_dim=4)


def manager(prefix_cache: bool = True, offload_prefill: bool = False, slots: int = 64) -> KVManager:
    """One cache of every layer: `slots` / PAGE blocks of PAGE slots."""
    cache = KVCache(GEOMETRY, slots, torch.float32, torch.device("cpu"), page_slots=PAGE)
    return KVManager([cache], prefix_cache=prefix_cache, offload_prefill=offload_prefill)


def row(ids: list[int], max_new_tokens: int = 4) -> Sequence:
    prompt = ProcessedPrompt("", torch.tensor(ids), torch.arange(len(ids))[None], len(ids), [], torch.zeros(0))
    return Sequence(prompt, max_new_tokens)


def computed(kv: KVManager, seq: Sequence) -> None:
    """`seq` admitted and its whole prompt computed (its full blocks remembered)."""
    assert kv.allocate(seq, kv.computed_prefix(seq, None), keep_free=False)
    seq.num_computed_tokens = seq.prompt.length
    kv.cache_blocks(seq, 0)


def test_a_prompt_computed_before_is_answered_in_whole_blocks_leaving_its_last_position() -> None:
    kv = manager()
    ids = list(range(1, 11))   # 10 positions: two full blocks and a partial one
    first = row(ids)
    assert kv.computed_prefix(first, None).num_tokens == 0, "nothing is computed yet"
    computed(kv, first)
    again = row(ids + [99])
    prefix = kv.computed_prefix(again, None)
    assert (prefix.cached, prefix.forked) == (8, 0)
    assert kv.computed_prefix(row(ids[:8]), None).cached == 4, "the last position is computed again: it samples"
    assert kv.computed_prefix(row([7] + ids[1:]), None).cached == 0, "another first block: nothing in common"
    assert kv.allocate(again, prefix, keep_free=False)
    assert (kv.block_tables(again)[0].pages[:2] == kv.block_tables(first)[0].pages[:2]).all(), "held, not copied"
    kv.free(first)
    kv.free(again)
    assert kv.computed_prefix(row(ids), None).cached == 8, "blocks no row holds are kept for rows to come"
    assert kv.caches[0].free_slots == 64


def test_without_the_prefix_cache_no_prompt_is_answered_computed() -> None:
    kv = manager(prefix_cache=False)
    computed(kv, row(list(range(1, 11))))
    assert kv.computed_prefix(row(list(range(1, 11))), None).num_tokens == 0


def test_a_fork_is_answered_with_its_source_prefix() -> None:
    kv = manager()
    source, fork = row(list(range(1, 11))), row(list(range(1, 7)) + [50, 51])
    computed(kv, source)
    fork.prefix_source, fork.prefix_length = source, source.prompt.shared_prefix(fork.prompt)
    assert fork.prefix_length == 6 and kv.has_computed(source, 6) and not kv.has_computed(fork, 1)
    prefix = kv.computed_prefix(fork, source)
    assert (prefix.forked, prefix.cached, prefix.num_tokens) == (6, 0, 6)
    held = 64 - kv.caches[0].free_slots
    assert kv.allocate(fork, prefix, keep_free=False)
    # The prefix's whole block is held with the source; the fork's own blocks hold the rest and its first tokens.
    assert kv.block_tables(fork)[0].pages[0] == kv.block_tables(source)[0].pages[0]
    assert 64 - kv.caches[0].free_slots == held + kv.block_tables(fork)[0].capacity - PAGE


def test_admission_is_all_or_nothing_and_leaves_room_to_grow_when_rows_run() -> None:
    kv = manager(prefix_cache=False)
    big = row(list(range(40)), max_new_tokens=8)                   # 48 slots at most: 12 blocks
    assert kv.allocate(big, ComputedPrefix(), keep_free=False)
    assert kv.caches[0].free_slots == 16
    small = row(list(range(12)), max_new_tokens=4)                 # 16 slots: exactly what is free
    assert not kv.allocate(small, ComputedPrefix(), keep_free=True), "the watermark stays free for running rows"
    assert kv.caches[0].free_slots == 16 and not kv.on_device(small), "a refused row takes nothing"
    assert kv.allocate(small, ComputedPrefix(), keep_free=False)
    assert kv.caches[0].free_slots == 0 and kv.on_device(small)
    kv.free(big)
    assert kv.caches[0].free_slots == 48 and kv.block_tables(big) == []


def test_a_running_row_gets_slots_for_its_next_step_while_blocks_are_free() -> None:
    kv = manager(prefix_cache=False)
    growing, filler = row([1, 2, 3, 4], max_new_tokens=40), row(list(range(40)), max_new_tokens=4)
    assert kv.allocate(growing, ComputedPrefix(), keep_free=False)   # prompt + 16 first tokens: 5 blocks
    assert kv.allocate(filler, ComputedPrefix(), keep_free=False)    # 44 slots: 11 blocks, the rest
    growing.num_computed_tokens, growing.output_ids = 20, [0] * 16
    assert kv.allocate_slots(growing), "its 20 slots are held already"
    growing.output_ids.append(0)
    assert not kv.allocate_slots(growing), "a 21st slot needs a block, and none is free"
    kv.free(filler)
    assert kv.allocate_slots(growing) and kv.block_tables(growing)[0].capacity == 24


def test_an_offloaded_prefill_holds_host_memory_until_its_kv_comes_to_the_device() -> None:
    kv = manager(prefix_cache=False, offload_prefill=True)
    seq = row(list(range(10)))
    assert kv.allocate(seq, ComputedPrefix(), keep_free=False)
    assert kv.is_offloaded(seq) and not kv.on_device(seq) and kv.caches[0].free_slots == 64
    keys, values = torch.randn(10, 1, 4), torch.randn(10, 1, 4)
    for layer in range(2):
        kv.row_kv(seq).host.write(layer, 0, keys * (layer + 1), values)
    seq.num_computed_tokens, seq.output_ids = 10, [3]
    assert kv.allocate_slots(seq)
    assert not kv.is_offloaded(seq) and kv.on_device(seq)
    for layer in range(2):
        read_keys, read_values = kv.caches[0].read(kv.block_tables(seq)[0], layer, 10)
        torch.testing.assert_close(read_keys[0], (keys * (layer + 1)).transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(read_values[0], values.transpose(0, 1), rtol=0, atol=0)


def test_a_row_longer_than_the_cache_is_told_why_it_never_fits() -> None:
    kv = manager(slots=64)
    assert kv.never_fits(row(list(range(60)), max_new_tokens=4)) is None
    problem = kv.never_fits(row(list(range(60)), max_new_tokens=8))
    assert problem is not None and "needs 68 tokens of KV cache for the model" in problem and "(64 tokens)" in problem
