"""Temporal pruning: drop the vision vectors that repeat the previous frame, before the language model.

Most of a video's vision tokens show what the frame before already showed (a still background, a
static camera); the language model's prefill is most of a captioning run's work and grows with
every token. In the spirit of DyCoke's and FastVID's temporal merging and of run-length
tokenization (RLT), a vision vector is compared with the vector at the same place in the previous
frame, here through the pixels it is made of (its patch, or the 2x2 patches a Qwen2-VL merged
token covers), which the decoding worker has at hand: the share `ratio` of the item's vision
vectors that changed least are left out of the prompt. The first frame is always kept whole,
and so are the vectors that are not patches (v1's row and frame separators), so the model still
sees every place once and the frame structure.

The survivors keep their positions (1-D or M-RoPE) and the generated tokens continue after the
unpruned prompt's, so a dropped vector leaves a gap in the positions rather than shifting the
rest. The vision encoder still sees whole frames (both towers attend within a frame); each
block's `VisionBlock.kept` says which of its vectors the prompt holds. Everything after is the
usual engine: chunked prefill, batching and preemption see a shorter prompt.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import ProcessedPrompt, VisionBlock

ALWAYS_KEPT = float("inf")   # the change score of a vector that is never dropped


def patch_changes(frames: torch.Tensor, patches_per_vector: int) -> list[torch.Tensor | None]:
    """Per frame, each vector's mean absolute pixel difference to the same vector in the previous frame (None for
    the first frame: nothing to compare with). `frames` is (frames, patches, values) with the patches of a vector
    consecutive."""
    changes: list[torch.Tensor | None] = [None]
    for before, after in zip(frames[:-1], frames[1:]):
        difference = (after - before).abs().mean(dim=-1)
        changes.append(difference.view(-1, patches_per_vector).mean(dim=-1))
    return changes


def drop_static_vision(prompt: ProcessedPrompt, changes: list[torch.Tensor | None], ratio: float) -> ProcessedPrompt:
    """`prompt` without the `ratio` share of its vision vectors that changed least (`changes`: per block, a score
    per encoder vector, `ALWAYS_KEPT` for those never dropped, None for a block kept whole)."""
    total = sum(block.length for block in prompt.vision_blocks)
    scores = torch.cat([torch.full((block.length,), ALWAYS_KEPT) if change is None else change.float()
                        for block, change in zip(prompt.vision_blocks, changes)])
    droppable = int((scores < ALWAYS_KEPT).sum())
    count = min(round(ratio * total), droppable)
    if count == 0:
        return prompt
    # Stable: equal scores drop the earlier vector first, the same way in every process.
    order = torch.sort(scores, stable=True).indices
    kept_vision = torch.ones(total, dtype=torch.bool)
    kept_vision[order[:count]] = False
    kept = torch.ones(prompt.length, dtype=torch.bool)
    blocks: list[VisionBlock] = []
    offset = 0
    for block in prompt.vision_blocks:
        block_kept = kept_vision[offset:offset + block.length]
        offset += block.length
        kept[block.start:block.end] = block_kept
        start = int(kept[:block.start].sum())
        if block_kept.all():   # whole: nothing to select
            blocks.append(replace(block, start=start))
            continue
        indices = tuple(block_kept.nonzero().flatten().tolist())
        blocks.append(replace(block, start=start, length=len(indices), kept=indices))
    return replace(prompt, token_ids=prompt.token_ids[kept], positions=prompt.positions[:, kept],
                   vision_blocks=blocks)
