"""The scheduler's one view of KV memory: which blocks a row holds, and whether it can have more.

The scheduler asks questions and gets answers it does not look inside: can this row ever fit; which
of its prompt is computed already (`computed_prefix`: another question's prefix about the same clip,
or the prefix cache's pages); give it blocks for its prompt (`allocate`) or for its next step
(`allocate_slots`); remember the full blocks it computed (`cache_blocks`); free them (`free`). Each
running row's KV (`RowKV`: a block table per cache, or host memory while an offloaded prefill runs) is
kept here by row id; the scheduler hands it to the model runner with the row's share of the step.

Under it, `KVCache` holds one cache's storage and pages: one of every layer, or with vision-token
pruning two (the early layers' and the late layers', see `engine.pruning`), a row holding a table in
each. The prefix cache serves rows of one cache of every layer on the device only: FastV's survivors
differ per prompt, and an offloaded prefill's prefix is not on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_cache import BlockTable, HostKV, KVCache
from .sequence import Sequence

# Slots reserved at admission for the first generated tokens.
FIRST_DECODE_RESERVE = 16
# A row is admitted only if this share of the cache stays free for the running rows to grow.
ADMISSION_WATERMARK = 1 / 32


@dataclass(eq=False)
class RowKV:
    """Where one row's keys and values are: a block table per cache on the device, or host memory while its
    prefill is offloaded."""

    tables: list[BlockTable] = field(default_factory=list)
    host: HostKV | None = None


@dataclass(frozen=True, eq=False)
class ComputedPrefix:
    """The computed start of a row's prompt, which it is admitted with instead of computing it: `forked` positions
    of another row's shared prefix (that row's whole blocks held with it, a copy of the partial last one), or
    `cached` positions of whole blocks from the prefix cache."""

    forked: int = 0
    cached: int = 0
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    source: RowKV | None = None   # a fork's: the row whose partial last block of the prefix is copied

    @property
    def num_tokens(self) -> int:
        return self.forked + self.cached


class KVManager:
    """The blocks of one cache of every layer, or of the early and the late layers' caches (pruning), handed out
    to rows by row id."""

    def __init__(self, caches: list[KVCache], prefix_cache: bool, offload_prefill: bool):
        """`prefix_cache`: remember computed full blocks for rows that start the same way (with one cache on the
        device only); `offload_prefill`: a prefilling row keeps its KV in host memory until it decodes."""
        if offload_prefill and len(caches) > 1:
            raise ValueError("offloaded prefill keeps one cache of every layer")
        self.caches = caches
        self.late = (False, True)[:len(caches)]   # per cache: does it hold the late layers of pruned rows
        self.prefix_cache = prefix_cache and len(caches) == 1 and not offload_prefill
        self.offload_prefill = offload_prefill
        self._rows: dict[int, RowKV] = {}

    def never_fits(self, seq: Sequence) -> str | None:
        """Why `seq` can never run, however many rows finish: its longest context is more than a cache holds."""
        for late, cache in zip(self.late, self.caches):
            if cache.whole_pages(seq.max_length(late)) > cache.capacity_tokens:
                gib = seq.max_length(late) * cache.bytes_per_slot / 2**30
                layers = f"layers {cache.layers.start}-{cache.layers.stop - 1}" if len(self.caches) > 1 else "the model"
                return (f"needs {seq.max_length(late)} tokens of KV cache for {layers} ({gib:.2f} GiB: prompt "
                        f"{seq.prompt.length - (seq.pruned if late else 0)} + {seq.max_new_tokens} new), more than "
                        f"the cache holds ({cache.capacity_tokens} tokens); "
                        f"raise kv_cache_gb or lower frames / max_new_tokens")
        return None

    def row_kv(self, seq: Sequence) -> RowKV:
        """Where a running row's keys and values are (for the model runner)."""
        return self._rows[seq.row_id]

    def block_tables(self, seq: Sequence) -> list[BlockTable]:
        """A row's block table in each cache (none while it holds no device KV)."""
        row = self._rows.get(seq.row_id)
        return row.tables if row is not None else []

    def on_device(self, seq: Sequence) -> bool:
        """Does `seq` hold device blocks (freeing them makes room)?"""
        return bool(self.block_tables(seq))

    def is_offloaded(self, seq: Sequence) -> bool:
        row = self._rows.get(seq.row_id)
        return row is not None and row.host is not None

    def has_computed(self, seq: Sequence, length: int) -> bool:
        """Does `seq` hold its first `length` positions computed on the device (a prefix other rows fork from)?"""
        return self.on_device(seq) and seq.slots_used() >= length

    def computed_prefix(self, seq: Sequence, source: Sequence | None) -> ComputedPrefix:
        """What of `seq`'s prompt it can be admitted with computed: `source`'s shared prefix (a row that
        `has_computed` it), else the full blocks of the prefix cache its prompt starts with. At least its last
        position is left to compute: it samples from there."""
        page = self.caches[0].page_slots
        if source is not None:
            source_kv = self._rows[source.row_id]
            blocks = source_kv.tables[0].pages[:seq.prefix_length // page]
            return ComputedPrefix(forked=seq.prefix_length, blocks=blocks, source=source_kv)
        if not self.prefix_cache:
            return ComputedPrefix()
        blocks = self.caches[0].pool.cached(seq.page_digests(page)[:(seq.length - 1) // page])
        return ComputedPrefix(cached=len(blocks) * page, blocks=blocks)

    def allocate(self, seq: Sequence, prefix: ComputedPrefix, keep_free: bool) -> bool:
        """Give an admitted row its KV: blocks for its context so far and its first generated tokens, starting
        with `prefix`'s; False (and nothing taken) if too few are free, leaving `ADMISSION_WATERMARK` of each
        cache free with `keep_free`. An offloaded prefill takes host memory instead."""
        if self.offload_prefill and seq.in_prefill:
            cache = self.caches[0]
            self._rows[seq.row_id] = RowKV(host=HostKV(cache.geometry, seq.kv_length(), cache.keys.dtype,
                                                       cache.keys.device))
            return True
        needs = [min(seq.max_length(late), seq.kv_length(late) + FIRST_DECODE_RESERVE) for late in self.late]
        assert not len(prefix.blocks) or len(self.caches) == 1, "a shared prefix is of every layer"
        for cache, need in zip(self.caches, needs):
            # The slots that round a table up to whole pages are room to grow like the watermark's.
            watermark = int(cache.capacity_tokens * ADMISSION_WATERMARK) if keep_free else 0
            # Shared blocks need no free page, but a kept one is free no more once held.
            free = cache.free_slots - cache.pool.kept_among(prefix.blocks) * cache.page_slots
            if free - (need - len(prefix.blocks) * cache.page_slots) < watermark:
                return False
        row = RowKV()
        for index, (cache, need) in enumerate(zip(self.caches, needs)):
            row.tables.append(cache.hold_prefix(prefix.blocks) if index == 0 else BlockTable(cache.page_slots))
            if not cache.grow(row.tables[-1], need):
                self._release(row)
                return False
        if prefix.source is not None:   # the prefix's partial last block
            self.caches[0].copy_tokens(prefix.source.tables[0], row.tables[0], prefix.forked)
        self._rows[seq.row_id] = row
        return True

    def allocate_slots(self, seq: Sequence) -> bool:
        """Blocks for every position a running row will have computed after its next step, in each cache (an
        offloaded row's prefill is done: its KV comes to the device, with room for its first tokens); False if
        too few are free."""
        row = self._rows[seq.row_id]
        if row.host is not None:
            cache, table = self.caches[0], BlockTable(self.caches[0].page_slots)
            if not cache.grow(table, min(seq.max_length(), seq.kv_length() + FIRST_DECODE_RESERVE)):
                return False
            cache.copy_from(table, row.host, seq.slots_used())
            row.host, row.tables = None, [table]
            return True
        # A table grows by the pages it needs now: nothing moves, so growing often costs nothing.
        return all(cache.grow(table, seq.kv_length(late)) for cache, table, late in zip(self.caches, row.tables,
                                                                                         self.late))

    def cache_blocks(self, seq: Sequence, computed_before: int) -> None:
        """Remember the full prompt blocks `seq` computed since `computed_before` positions (the prefix cache)."""
        row = self._rows.get(seq.row_id)
        if not self.prefix_cache or row is None or not row.tables:
            return
        page = self.caches[0].page_slots
        first, stop = computed_before // page, min(seq.num_computed_tokens, seq.prompt.length) // page
        if stop > first:
            self.caches[0].pool.remember(seq.page_digests(page)[first:stop], row.tables[0].pages[first:stop])

    def free(self, seq: Sequence) -> None:
        """Let go of a finished or preempted row's KV (blocks other rows share stay theirs)."""
        row = self._rows.pop(seq.row_id, None)
        if row is not None:
            self._release(row)

    def _release(self, row: RowKV) -> None:
        for cache, table in zip(self.caches, row.tables):
            cache.release(table)
        row.tables, row.host = [], None
