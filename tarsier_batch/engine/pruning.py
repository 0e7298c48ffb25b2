"""Vision-token pruning at prefill (FastV, Chen et al. 2024): after layer K, only the vision
tokens the last prompt token attends to most go on.

A pruned row's prefill has two stages. Layers 0 … K-1 run over the whole prompt (in chunks),
keeping each position's layer-K input. Once the last prompt token has been computed, its
attention at layer K-1 (softmax of its rotated query against the layer's keys, averaged over
heads) ranks the vision positions; the best `kept_vision` of them and every text position are
the survivors, in prompt order, each with its original position (rotary position ids are never
renumbered and cached keys never re-rotated). Layers K … then run over the survivors only
(in chunks), and cache only them. Generated tokens run through every layer and continue from
the whole prompt's next position.

The engine counts a pruned row's work in "step positions": the prompt's P positions in the
early layers, then its S survivors in the late layers, then its generated tokens in all layers.
A chunk never crosses from one stage to the next. The late layers have their own KV cache, in
which a row holds S + generated slots instead of P + generated: that is the memory saved, and
what lets the scheduler admit more rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families.base import ProcessedPrompt

# The late layers' cache is sized for rows keeping (1 - ratio) of their prompt plus this share of the
# dropped part: the text and generated tokens a row keeps besides its vision tokens (about a tenth of
# an 8-frame video row with a long caption; more for an image, whose rows the late cache then limits).
LATE_MARGIN = 0.1


@dataclass(frozen=True)
class PruneConfig:
    """`ratio`: the share of each row's vision tokens dropped (0 < ratio < 1); `layer`: K, the first layer
    that sees only the survivors (1 <= K < number of layers)."""

    ratio: float
    layer: int

    def __post_init__(self) -> None:
        if not 0 < self.ratio < 1:
            raise ValueError(f"the pruning ratio must be in (0, 1), not {self.ratio}")
        if self.layer < 1:
            raise ValueError(f"the pruning layer must be at least 1, not {self.layer}")

    def kept_vision(self, vision_tokens: int) -> int:
        """How many of a row's vision tokens survive: all but floor(ratio x count)."""
        return vision_tokens - int(vision_tokens * self.ratio)

    def split_kv_slots(self, slots: int, num_layers: int) -> tuple[int, int]:
        """The early and the late layers' cache slots in the memory of `slots` slots of every layer: the
        late cache holds (1 - ratio) of the early one's slots, plus the margin, so more rows fit."""
        late_share = 1 - self.ratio * (1 - LATE_MARGIN)
        early = int(slots * num_layers / (self.layer + (num_layers - self.layer) * late_share))
        return early, int(early * late_share)


@dataclass(eq=False)
class RowPruning:
    """One row's pruning plan, and its survivors once chosen. (The model runner keeps the row's layer-K inputs
    while its stages run.)"""

    layer: int                       # K
    prompt_length: int               # P
    vision_mask: torch.Tensor        # (P,) bool: the prompt positions that are vision tokens
    kept_vision: int
    survivors: torch.Tensor | None = None      # (S,) prompt positions kept, ascending; set once scored

    @property
    def num_survivors(self) -> int:
        """S: every text position plus the kept vision positions (known before scoring)."""
        return self.prompt_length - int(self.vision_mask.sum()) + self.kept_vision


def attention_of_last_query(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """(heads, head_dim) query of the last prompt token and (kv_heads, P, head_dim) keys of the same layer
    -> (P,) its attention weights averaged over heads (grouped-query heads share their key head), in float32.

    This is what eager attention returns for that token (it sees every position: it is last), without
    the (heads, P, P) matrix that SDPA never forms."""
    heads, kv_heads = query.shape[0], keys.shape[0]
    expanded = keys.repeat_interleave(heads // kv_heads, dim=0).float()            # (heads, P, head_dim)
    logits = torch.einsum("hd,hpd->hp", query.float(), expanded) * scale
    return logits.softmax(dim=-1).mean(dim=0)


def choose_survivors(scores: torch.Tensor, vision_mask: torch.Tensor, kept_vision: int) -> torch.Tensor:
    """Prompt positions that go on past layer K: every text position and the `kept_vision` best-scored
    vision positions (ties: the earlier position), ascending."""
    vision = vision_mask.nonzero().squeeze(1)
    # A stable sort on descending scores keeps earlier positions first among equal scores.
    order = torch.sort(scores[vision].cpu(), descending=True, stable=True).indices[:kept_vision]
    kept = torch.zeros_like(vision_mask)
    kept[vision[order]] = True
    kept |= ~vision_mask
    return kept.nonzero().squeeze(1)


def row_pruning(prompt: ProcessedPrompt, config: PruneConfig) -> RowPruning:
    """A row's pruning state: its vision positions and how many of them survive."""
    vision_mask = torch.zeros(prompt.length, dtype=torch.bool)
    for block in prompt.vision_blocks:
        vision_mask[block.start:block.end] = True
    return RowPruning(config.layer, prompt.length, vision_mask, config.kept_vision(int(vision_mask.sum())))
