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


def vector_changes(frames: torch.Tensor) -> list[torch.Tensor | None]:
    """Per frame, a score per vision vector of how much it adds to what the vectors around it show: its mean absolute
    pixel difference to the same vector in the previous frame, plus its difference to the mean of its four
    neighbours in the frame. A still, flat background scores least and goes first; a still object keeps the
    contrast to its surroundings, so it stays longer than the background around it; what moves scores most. None
    for the first frame (nothing to compare with: kept whole). `frames` is (frames, rows, columns, values): the
    pixels of each vector on the frame's grid of vectors."""
    padded = torch.nn.functional.pad(frames.permute(0, 3, 1, 2), (1, 1, 1, 1), mode="replicate").permute(0, 2, 3, 1)
    neighbours = (padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2] + padded[:, 1:-1, 2:]) / 4
    contrast = (frames - neighbours).abs().mean(dim=-1)
    changes: list[torch.Tensor | None] = [None]
    for index in range(1, frames.shape[0]):
        temporal = (frames[index] - frames[index - 1]).abs().mean(dim=-1)
        changes.append((temporal + contrast[index]).flatten())
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
