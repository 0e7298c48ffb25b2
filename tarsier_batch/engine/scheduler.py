"""Which rows compute how many positions in the next step, under a token budget and a KV budget.

Every step spends `max_batch_tokens`: first one token for each running row that decodes, then
prefill chunks (at most `prefill_chunk` positions each) for running rows still prefilling, then
chunks of newly admitted rows while fewer than `max_rows` run. A row is admitted only when its
prompt fits the KV cache's free pages with room to spare; a decoding row that finds no free page
to grow into preempts the most recently admitted row, whose pages are freed and its KV recomputed
later (its tokens so far are kept). Pages are taken anywhere: a row never waits for a hole.
With vision-token pruning there are two caches (the early layers' and the late layers'): a row
holds a table in each, sized for its whole prompt and for its survivors, and is admitted only
when both have room.
Rows are admitted in input order: attention runs on each row's exact length, so mixing a short
image with a long video costs nothing and there is no reason to reorder.

The prefix cache: every full page of a prompt a row computes is remembered by its digest (see
`ProcessedPrompt.page_digests`), and a row admitted later takes the computed pages its prompt starts
with instead of computing them again, while they are held or kept (see `PagePool`). Not with
pruning's two caches (FastV's survivors differ per prompt) or offloaded prefill (its prefix is not
on the device).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .kv_cache import BlockTable, HostKV, KVCache
from .sequence import Sequence, Status

# Slots reserved at admission for the first generated tokens.
FIRST_DECODE_RESERVE = 16
# A row is admitted only if this share of the cache stays free for the running rows to grow.
ADMISSION_WATERMARK = 1 / 32
MIN_BATCH_TOKENS = 16


@dataclass
class PrefixCacheCounts:
    """What shared prompts saved: of the prompt positions of the rows admitted (again, after a preemption),
    how many they took computed from the prefix cache, and how many a prompt set's question took from
    another question of its clip (the shared prefix, held with it)."""

    rows: int = 0
    rows_hit: int = 0
    prompt_positions: int = 0
    reused_positions: int = 0
    shared_positions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.reused_positions / self.prompt_positions if self.prompt_positions else 0.0


@dataclass(frozen=True)
class ScheduledRow:
    seq: Sequence
    num_tokens: int   # positions computed this step, from seq.num_computed on


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int
    max_batch_tokens: int
    prefill_chunk: int      # 0: a prompt is prefilled whole
    offload_prefill: bool   # keep a prefilling row's KV in host memory until it decodes
    prefix_cache: bool = True   # keep computed prompt pages for rows that start the same way

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("the batch size must be at least 1")
        if self.max_batch_tokens < self.max_rows:
            raise ValueError(f"max batch tokens ({self.max_batch_tokens}) must be at least the batch size "
                             f"({self.max_rows}): every running row decodes one token per step")
        if self.prefill_chunk < 0:
            raise ValueError("the prefill chunk must be 0 (off) or positive")


class Scheduler:
    """Waiting and running rows, and the KV pages they hold."""

    def __init__(self, config: SchedulerConfig, pools: list[KVCache]):
        """`pools`: one cache of every layer, or the early layers' and the late layers' (pruning)."""
        if config.offload_prefill and len(pools) > 1:
            raise ValueError("offloaded prefill keeps one cache of every layer")
        self.pools = pools
        self.late = (False, True)[:len(pools)]   # per cache: does it hold the late layers of pruned rows
        self.max_rows = config.max_rows
        self.max_batch_tokens = config.max_batch_tokens
        self.prefill_chunk = config.prefill_chunk
        self.offload_prefill = config.offload_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last is preempted first
        self.prefix_cache = config.prefix_cache and len(pools) == 1 and not config.offload_prefill
        self.prefix_counts = PrefixCacheCounts()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> str | None:
        """Queue a row; returns why it can never run, if so (it is then not queued)."""
        for late, pool in zip((False, True), self.pools):
            if pool.whole_pages(seq.max_length(late)) > pool.capacity_tokens:
                gib = seq.max_length(late) * pool.bytes_per_slot / 2**30
                layers = f"layers {pool.layers.start}-{pool.layers.stop - 1}" if len(self.pools) > 1 else "the model"
                return (f"needs {seq.max_length(late)} tokens of KV cache for {layers} ({gib:.2f} GiB: prompt "
                        f"{seq.prompt.length - (seq.pruned if late else 0)} + {seq.max_new_tokens} new), more than "
                        f"the cache holds ({pool.capacity_tokens} tokens); "
                        f"raise --kv-cache-gb or lower --frames / --max-new-tokens")
        self.waiting.append(seq)
        return None

    def holds(self, seq: Sequence) -> bool:
        """Is `seq` queued or running here (not finished, not another engine's)?"""
        return seq.status is not Status.FINISHED and (seq in self.running or seq in self.waiting)

    def schedule(self) -> list[ScheduledRow]:
        """The next step's rows; KV is in place for every position they will compute."""
        isolated = next((seq for seq in self.running if seq.isolate), None)
        if isolated is not None:
            return self._schedule_alone(isolated)
        budget = self.max_batch_tokens
        step: list[ScheduledRow] = []
        for seq in [seq for seq in self.running if not seq.in_prefill]:
            if seq.status is Status.RUNNING and budget > 0 and self._make_room(seq):
                step.append(ScheduledRow(seq, 1))
                budget -= 1
        prefilled_whole = False
        for seq in [seq for seq in self.running if seq.in_prefill]:
            tokens = self._chunk(seq, budget, prefilled_whole)
            if tokens:
                step.append(ScheduledRow(seq, tokens))
                budget -= tokens
                prefilled_whole = True
        while budget > 0 and len(self.running) < self.max_rows:
            seq = self._next_to_admit()
            if seq is None:
                break
            source = self._prefix_holder(seq)
            cached = self._cached_pages(seq) if source is None else None
            # A fork starts after the prefix, a row finding its first pages cached after them.
            seq.num_computed = seq.prefix_length if source is not None else len(cached) * self.pools[0].page_slots
            tokens = self._chunk(seq, budget, prefilled_whole)
            if not tokens or not self._admit(seq, source=source, cached=cached):
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            step.append(ScheduledRow(seq, tokens))
            budget -= tokens
            prefilled_whole = True
        if not step and not self.running and self.waiting and self.waiting[0].isolate:
            seq = self.waiting.popleft()
            if self._admit(seq, force=True):
                return self._schedule_alone(seq)
            self.waiting.appendleft(seq)
        return step

    def advance(self, step: list[ScheduledRow]) -> None:
        """The step succeeded: its positions are computed, and the prompt pages it filled are remembered for
        rows to come (the prefix cache)."""
        for row in step:
            seq = row.seq
            before, seq.num_computed = seq.num_computed, seq.num_computed + row.num_tokens
            if self.prefix_cache and seq.tables:
                page = self.pools[0].page_slots
                first, stop = before // page, min(seq.num_computed, seq.prompt.length) // page
                if stop > first:
                    self.pools[0].pool.remember(seq.page_digests(page)[first:stop], seq.tables[0].pages[first:stop])

    def finish(self, seq: Sequence) -> None:
        """Free a finished row's KV at once, so a waiting row can take its place next step."""
        self._release(seq)
        self.running.remove(seq)

    def clear(self) -> None:
        for seq in list(self.running):
            self.finish(seq)
        self.waiting.clear()

    def preempt(self, seq: Sequence) -> None:
        """Free a running row's KV and queue it first, to be recomputed from its tokens so far."""
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.encoded.clear()
        if seq.pruning is not None:  # its survivors stay chosen: recomputing reproduces the same row
            seq.pruning.layer_inputs = None
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def lower_budget_after_oom(self) -> bool:
        """Halve the token budget and the running rows after running out of memory.

        Returns False when nothing is left to lower: the step was one row at the smallest budget.
        """
        lowered = False
        if self.max_batch_tokens > MIN_BATCH_TOKENS:
            self.max_batch_tokens = max(MIN_BATCH_TOKENS, self.max_batch_tokens // 2)
            if self.prefill_chunk:
                self.prefill_chunk = min(self.prefill_chunk, self.max_batch_tokens)
            lowered = True
        if len(self.running) > 1:
            self.max_rows = max(1, len(self.running) // 2)
            while len(self.running) > self.max_rows:
                self.preempt(self.running[-1])
            lowered = True
        return lowered

    # -- internals -----------------------------------------------------------------------

    def _schedule_alone(self, seq: Sequence) -> list[ScheduledRow]:
        tokens = self._chunk(seq, max(self.max_batch_tokens, 1), False)
        if seq.in_prefill or self._make_room(seq):
            return [ScheduledRow(seq, tokens)]
        return []

    def _chunk(self, seq: Sequence, budget: int, prefilled_whole: bool) -> int:
        """Positions of `seq` to compute this step within `budget`."""
        limit = seq.chunk_limit
        if not self.prefill_chunk:  # unchunked: the whole rest (of a pruning stage) at once, over budget if first
            return limit if limit <= budget or not prefilled_whole else 0
        return min(limit, self.prefill_chunk, budget)

    def _next_to_admit(self) -> Sequence | None:
        """The first waiting row that may join now. Rows join in order, except that a row whose shared prefix
        another row is still computing lets the rows behind it pass until the prefix is done (or its holder
        is gone: then it computes the prefix itself), keeping a row free for it. A row to be run alone stops
        admission."""
        awaiting, passed = 0, set()
        for seq in self.waiting:
            if seq.isolate:
                return None
            source = seq.prefix_source
            if source is not None and self._prefix_holder(seq) is None:
                if source.status is Status.RUNNING:   # its prefix is on the way: keep a row for it
                    awaiting += 1
                    passed.add(id(seq))
                    continue
                if id(source) in passed:   # queued ahead of it (itself waiting for a prefix)
                    passed.add(id(seq))
                    continue
                seq.prefix_source = None   # finished, or queued behind it: compute the prefix
            return seq if len(self.running) + awaiting < self.max_rows else None
        return None

    def _prefix_holder(self, seq: Sequence) -> Sequence | None:
        """The row whose device KV holds `seq`'s shared prefix computed, if there is one now."""
        source = seq.prefix_source
        if source is None or source.status is not Status.RUNNING or not source.tables:
            return None
        return source if source.slots_used() >= seq.prefix_length else None

    def _cached_pages(self, seq: Sequence) -> np.ndarray:
        """The computed pages `seq`'s prompt starts with, held or kept (none without the prefix cache). At least
        its last position is left to compute: it samples from there."""
        if not self.prefix_cache:
            return np.zeros(0, dtype=np.int64)
        page = self.pools[0].page_slots
        digests = seq.page_digests(page)[:(seq.length - 1) // page]
        return self.pools[0].pool.cached(digests)

    def _admit(self, seq: Sequence, force: bool = False, source: Sequence | None = None,
               cached: np.ndarray | None = None) -> bool:
        """Give `seq` KV and run it; `source`: a row holding `seq`'s shared prefix, copied instead of computed;
        `cached`: the computed pages its prompt starts with (the prefix cache)."""
        if self.offload_prefill and seq.in_prefill:
            pool = self.pools[0]
            seq.host_kv = HostKV(pool.geometry, seq.kv_length(), pool.keys.dtype, pool.keys.device)
        else:
            needs = [min(seq.max_length(late), seq.kv_length(late) + FIRST_DECODE_RESERVE) for late in self.late]
            # The computed pages the row starts from: a fork holds its source's whole pages of the prefix.
            shared = (source.tables[0].pages[:seq.prefix_length // self.pools[0].page_slots] if source is not None
                      else cached if cached is not None else np.zeros(0, dtype=np.int64))
            assert not len(shared) or len(self.pools) == 1, "a shared prefix is of every layer, not with two caches"
            for pool, need in zip(self.pools, needs):
                # The slots that round a table up to whole pages are room to grow like the watermark's.
                watermark = 0 if force or not self.running else int(pool.capacity_tokens * ADMISSION_WATERMARK)
                # Shared pages need no free page, but a kept one is free no more once held.
                free = pool.free_slots - pool.pool.kept_among(shared) * pool.page_slots
                if free - (need - len(shared) * pool.page_slots) < watermark:
                    return False
            for index, (pool, need) in enumerate(zip(self.pools, needs)):
                table = pool.hold_prefix(shared) if index == 0 else BlockTable(pool.page_slots)
                if not pool.grow(table, need):
                    pool.release(table)
                    self._release(seq)
                    return False
                seq.tables.append(table)
            if source is not None:   # the prefix's partial last page
                self.pools[0].copy_tokens(source.tables[0], seq.tables[0], seq.prefix_length)
        seq.forked = seq.prefix_length if source is not None else 0
        seq.cached = len(cached) * self.pools[0].page_slots if source is None and cached is not None else 0
        self._count_admission(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _count_admission(self, seq: Sequence) -> None:
        counts = self.prefix_counts
        counts.rows += 1
        counts.rows_hit += seq.cached > 0
        counts.prompt_positions += seq.prompt.length
        counts.reused_positions += seq.cached
        counts.shared_positions += seq.forked

    def _make_room(self, seq: Sequence) -> bool:
        """Ensure `seq` holds device slots for every position it will have computed after this step,
        preempting later rows if it must.

        An offloaded row gets its device range here, once its prefill is done. Returns False
        if `seq` cannot run this step (it was preempted, or it waits for room).
        """
        for index, late in enumerate(self.late):
            table = seq.tables[index] if seq.tables else None
            needed = seq.kv_length(late)
            if table is not None and table.capacity >= needed:
                continue
            # A table grows by the pages it needs now (nothing moves, so growing often costs nothing); an
            # offloaded row coming to the device brings room for its first tokens, as an admitted row does.
            target = needed if table is not None else min(seq.max_length(late), needed + FIRST_DECODE_RESERVE)
            while not self._grow(seq, index, target):
                if seq.host_kv is not None:
                    return False  # an offloaded prefill waits for room; evicting others would thrash
                # Evict the most recently admitted row that holds device KV (`seq` itself at worst).
                victim = next(row for row in reversed(self.running) if row.tables)
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def _grow(self, seq: Sequence, index: int, slots: int) -> bool:
        pool = self.pools[index]
        if seq.tables:
            return pool.grow(seq.tables[index], slots)
        # An offloaded prefill is done: bring its KV to the device.
        assert seq.host_kv is not None
        table = BlockTable(pool.page_slots)
        if not pool.grow(table, slots):
            return False
        pool.copy_from(table, seq.host_kv, seq.slots_used())
        seq.host_kv = None
        seq.tables = [table]
        return True

    def _release(self, seq: Sequence) -> None:
        for pool, table in zip(self.pools, seq.tables):
            pool.release(table)
        seq.tables = []
        seq.host_kv = None
