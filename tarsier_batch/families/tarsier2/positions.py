"""3-D M-RoPE positions of a Tarsier2 prompt, computed the way the official `get_rope_index` does.

Text tokens get (p, p, p), counting on from the previous segment. A vision block starting at
text position s with a merged grid of t x h x w vectors gives vector (i, j, k) the position
(s + i, s + j, s + k), in t-major order; the text after it resumes at s + max(t, h, w). The
temporal index is the frame's index in the sample (one temporal patch per frame, because each
frame is duplicated), not a time. transformers 5's own `get_rope_index` resumes at
s + max(h, w) for videos, ignoring t, so it cannot be used here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """Where a vision block's vectors lie in the prompt, and their merged grid."""

    start: int          # index of the first vector in the prompt's token ids
    grid: tuple[int, int, int]   # (t, h, w) after the 2 x 2 spatial merge

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w


def mrope_positions(length: int, spans: list[VisionSpan]) -> tuple[torch.Tensor, int]:
    """Positions (3, length) of a prompt with vision `spans` (in order), and the first generated position.

    Decoding then goes on at last + 1 on all three axes (the official rope delta), i.e. from
    the returned next position.
    """
    positions = torch.empty(3, length, dtype=torch.long)
    cursor = 0        # next token index
    next_position = 0
    for span in spans:
        text = span.start - cursor
        positions[:, cursor:span.start] = torch.arange(next_position, next_position + text)
        next_position += text
        t, h, w = span.grid
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        positions[:, span.start:span.start + span.length] = grid.reshape(3, -1) + next_position
        next_position += max(t, h, w)
        cursor = span.start + span.length
    positions[:, cursor:] = torch.arange(next_position, next_position + length - cursor)
    return positions, next_position + length - cursor
