"""One item's generation state, from admission to its last token."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from itertools import count
from typing import Any

import torch

from ..families.base import ProcessedPrompt
from .pruning import RowPruning

_row_ids = count()


class Status(Enum):
    WAITING = "waiting"    # queued, or preempted and waiting to be recomputed
    RUNNING = "running"    # holds KV; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and its generated tokens; the engine computes it position by position.

    There are no prefill and decode phases, only `num_computed_tokens` (positions whose keys and
    values are cached) against `length` (prompt plus generated tokens): a prefill chunk is a
    step that computes many positions, a decode step computes one. When a step computes the
    last position the row samples its next token. A row whose vision tokens are pruned counts
    its survivors' pass through the late layers as positions too (see `engine.pruning`).
    """

    prompt: ProcessedPrompt
    max_new_tokens: int
    seed: int | None = None                  # its sampling stream (SamplingParams.row_seed); None: greedy
    payload: Any = None                      # the caller's handle, returned untouched
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None         # "eos", "length" or "error"
    error: str | None = None
    error_kind: str | None = None            # with `error`: one of `errors.KINDS`
    isolate: bool = False                    # run alone: a step it was in failed for an unknown reason
    preemptions: int = 0
    pruning: RowPruning | None = None        # set when its vision tokens are pruned after a layer
    # Another row whose first `prefix_length` positions are this row's (another question about the same
    # clip): while that row holds them computed, this one starts from their KV (holding their whole pages with
    # it, a copy of the partial last one).
    prefix_source: Sequence | None = None
    prefix_length: int = 0
    forked: int = 0                          # positions taken from `prefix_source` when last admitted
    cached: int = 0                          # positions taken from the prefix cache when last admitted
    # Prefix lengths rows forked from this one copy: its chunks stop there, so they can copy before it may
    # finish.
    fork_points: set[int] = field(default_factory=set)
    # What the KV manager and the model runner key their state of this row by: unique in the process (an
    # object's id may be reused once it is gone).
    row_id: int = field(default_factory=lambda: next(_row_ids))
    _prompt_vocabulary: torch.Tensor | None = None
    _page_digests: list[bytes] | None = None

    def page_digests(self, page_slots: int) -> list[bytes]:
        """The prompt's full pages' digests (`ProcessedPrompt.page_digests`), made once."""
        if self._page_digests is None:
            self._page_digests = self.prompt.page_digests(page_slots)
        return self._page_digests

    def prompt_vocabulary(self, device: torch.device) -> torch.Tensor:
        """Every distinct id of the prompt, on `device` (once: a repetition penalty looks at them every step)."""
        if self._prompt_vocabulary is None or self._prompt_vocabulary.device != device:
            self._prompt_vocabulary = torch.unique(self.prompt.token_ids).to(device)
        return self._prompt_vocabulary

    def seen_ids(self) -> list[int]:
        """Every distinct id of the prompt, then the generated ids: what a repetition penalty looks at."""
        return self.prompt_vocabulary(torch.device("cpu")).tolist() + self.output_ids

    @property
    def length(self) -> int:
        """Positions to compute before the next token: the prompt and the tokens generated (with pruning,
        the survivors' late-layer pass too)."""
        survivors = self.pruning.num_survivors if self.pruning is not None else 0
        return self.prompt.length + survivors + len(self.output_ids)

    @property
    def pruned(self) -> int:
        """Prompt positions the late layers never hold: the vision tokens dropped (0 unless pruned)."""
        return self.prompt.length - self.pruning.num_survivors if self.pruning is not None else 0

    def kv_length(self, late: bool = False) -> int:
        """KV slots the row needs once `length` is computed: the prompt and the tokens generated (in the
        late layers of a pruned row, the survivors and the tokens generated)."""
        return self.prompt.length + len(self.output_ids) - (self.pruned if late else 0)

    def max_length(self, late: bool = False) -> int:
        """The most KV slots this row can ever hold: the prompt (its survivors, in the late layers) and every
        token it may generate."""
        return self.prompt.length + self.max_new_tokens - (self.pruned if late else 0)

    def slots_used(self, late: bool = False) -> int:
        """KV slots holding computed keys and values, in the early (or only) layers or in the late ones."""
        if self.pruning is None:
            return self.num_computed_tokens
        prompt, survivors = self.prompt.length, self.pruning.num_survivors
        if late:
            return max(0, self.num_computed_tokens - prompt)
        return min(self.num_computed_tokens, prompt) + max(0, self.num_computed_tokens - prompt - survivors)

    @property
    def remaining(self) -> int:
        """Positions still to compute before the next token can be sampled."""
        return self.length - self.num_computed_tokens

    @property
    def chunk_limit(self) -> int:
        """The most positions one step can compute: the rest, or the rest of the current stage (a prefix other
        rows fork from; with pruning, the prompt and the survivors' late-layer pass)."""
        stage_ends = sorted(self.fork_points)
        if self.pruning is not None:
            stage_ends += [self.prompt.length, self.prompt.length + self.pruning.num_survivors]
        for stage_end in stage_ends:
            if self.num_computed_tokens < stage_end:
                return stage_end - self.num_computed_tokens
        return self.remaining

    @property
    def in_prefill(self) -> bool:
        return self.remaining > 1

    def token_ids(self, start: int, end: int) -> torch.Tensor:
        """Ids at positions [start, end): prompt ids, then generated ones (after a preemption)."""
        prompt_part = self.prompt.token_ids[start:min(end, self.prompt.length)]
        if end <= self.prompt.length:
            return prompt_part
        generated = torch.tensor(self.output_ids[max(start - self.prompt.length, 0):end - self.prompt.length],
                                 dtype=torch.long)
        return torch.cat([prompt_part, generated])

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Position ids (components, end - start); generated tokens continue from `next_position`."""
        prompt_part = self.prompt.positions[:, start:min(end, self.prompt.length)]
        if end <= self.prompt.length:
            return prompt_part
        first = self.prompt.next_position + max(start - self.prompt.length, 0)
        generated = torch.arange(first, self.prompt.next_position + end - self.prompt.length)
        return torch.cat([prompt_part, generated.expand(self.prompt.positions.shape[0], -1)], dim=1)

    def finish(self, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        self.status, self.finish_reason, self.error, self.error_kind = Status.FINISHED, reason, error, error_kind
        self.prefix_source = None   # would keep a finished source's prompt and pixels alive
