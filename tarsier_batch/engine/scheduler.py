"""Which rows compute how many positions in the next step, under a token budget and a KV budget.

Every step spends `max_batch_tokens`: first one token for each running row that decodes, then
prefill chunks (at most `prefill_chunk` positions each) for running rows still prefilling, then
chunks of newly admitted rows while fewer than `max_rows` run. A row is admitted only when the KV
manager can give it blocks for its prompt with room to spare; a decoding row that finds no free
block to grow into preempts the most recently admitted row, whose blocks are freed and its KV
recomputed later (its tokens so far are kept). Blocks are taken anywhere: a row never waits for a
hole. Everything about blocks (how many a row needs, which are free, which of a prompt is cached,
two caches with pruning, host memory with offloaded prefill) is the KV manager's (`kv_manager`):
the scheduler asks it and passes its answers on, to it and to the model runner, without looking
inside.
Rows are admitted in input order: attention runs on each row's exact length, so mixing a short
image with a long video costs nothing and there is no reason to reorder.

A row admitted starts from its computed prefix when there is one: another question's shared
prefix about the same clip, or the prefix cache's blocks (every full block of a prompt a row
computes is remembered by its digest, see `ProcessedPrompt.page_digests`, and a later row whose
prompt starts the same way takes those blocks instead of computing them again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import KVCache
from .kv_manager import ComputedPrefix, KVManager, RowKV
from .sequence import Sequence, Status

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
    num_tokens: int   # positions computed this step, from seq.num_computed_tokens on
    kv: RowKV         # where the row's keys and values are (the KV manager's answer, for the model runner)


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
    """Waiting and running rows; the KV manager holds their blocks."""

    def __init__(self, config: SchedulerConfig, caches: list[KVCache]):
        """`caches`: one cache of every layer, or the early layers' and the late layers' (pruning)."""
        self.kv = KVManager(caches, config.prefix_cache, config.offload_prefill)
        self.max_rows = config.max_rows
        self.max_batch_tokens = config.max_batch_tokens
        self.prefill_chunk = config.prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last is preempted first
        self.prefix_counts = PrefixCacheCounts()
        self._released: list[int] = []   # row ids that let go of their KV since `take_released`

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> str | None:
        """Queue a row; returns why it can never run, if so (it is then not queued)."""
        problem = self.kv.never_fits(seq)
        if problem is None:
            self.waiting.append(seq)
        return problem

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
                step.append(ScheduledRow(seq, 1, self.kv.row_kv(seq)))
                budget -= 1
        prefilled_whole = False
        for seq in [seq for seq in self.running if seq.in_prefill]:
            tokens = self._chunk(seq, budget, prefilled_whole)
            if tokens:
                step.append(ScheduledRow(seq, tokens, self.kv.row_kv(seq)))
                budget -= tokens
                prefilled_whole = True
        while budget > 0 and len(self.running) < self.max_rows:
            seq = self._next_to_admit()
            if seq is None:
                break
            prefix = self.kv.computed_prefix(seq, self._prefix_holder(seq))
            seq.num_computed_tokens = prefix.num_tokens   # it starts after its computed prefix
            tokens = self._chunk(seq, budget, prefilled_whole)
            if not tokens or not self._admit(seq, prefix=prefix):
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            step.append(ScheduledRow(seq, tokens, self.kv.row_kv(seq)))
            budget -= tokens
            prefilled_whole = True
        if not step and not self.running and self.waiting and self.waiting[0].isolate:
            seq = self.waiting.popleft()
            if self._admit(seq, force=True):
                return self._schedule_alone(seq)
            self.waiting.appendleft(seq)
        return step

    def advance(self, step: list[ScheduledRow]) -> None:
        """The step succeeded: its positions are computed, and the prompt blocks it filled are remembered for
        rows to come (the prefix cache)."""
        for row in step:
            before = row.seq.num_computed_tokens
            row.seq.num_computed_tokens += row.num_tokens
            self.kv.cache_blocks(row.seq, before)

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
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def take_released(self) -> list[int]:
        """The ids of the rows that let go of their KV (finished or preempted) since last asked: whatever else
        is kept for them while they run can go too (its KV is recomputed, if they come back)."""
        released, self._released = self._released, []
        return released

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
            return [ScheduledRow(seq, tokens, self.kv.row_kv(seq))]
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
        if source is None or source.status is not Status.RUNNING:
            return None
        return source if self.kv.has_computed(source, seq.prefix_length) else None

    def _admit(self, seq: Sequence, force: bool = False, prefix: ComputedPrefix | None = None) -> bool:
        """Give `seq` KV and run it, starting from `prefix` (computed already: see `KVManager.computed_prefix`);
        `force`: even if that leaves no room for the running rows to grow."""
        prefix = prefix or ComputedPrefix()
        if not self.kv.allocate(seq, prefix, keep_free=not force and bool(self.running)):
            return False
        seq.forked, seq.cached = prefix.forked, prefix.cached
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

        An offloaded row gets its device blocks here, once its prefill is done. Returns False
        if `seq` cannot run this step (it was preempted, or it waits for room).
        """
        while not self.kv.allocate_slots(seq):
            if self.kv.is_offloaded(seq):
                return False  # an offloaded prefill waits for room; evicting others would thrash
            # Evict the most recently admitted row that holds device KV (`seq` itself at worst).
            victim = next(row for row in reversed(self.running) if self.kv.on_device(row))
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self._released.append(seq.row_id)
