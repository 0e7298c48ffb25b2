"""3-D M-RoPE positions of a Qwen2-VL-lineage prompt (Tarsier2, Qwen2-VL, Qwen2.5-VL).

Text tokens get (p, p, p), counting on from the previous segment. A vision block starting at
text position s with a merged grid of t x h x w vectors gives vector (i, j, k) the position
(s + time(i), s + j, s + k), in t-major order, where time(i) = int(i * interval): the interval is 1
for Tarsier2 and Qwen2-VL (the temporal index counts temporal patches) and, for Qwen2.5-VL, the
positions per second times the seconds per temporal patch, so that the temporal axis follows
absolute time. The text after a block resumes one past the block's largest position,
s + max(time(t - 1) + 1, h, w), as the models' own code computes it. transformers 5's
`get_rope_index` resumes at s + max(h, w), leaving out the temporal axis, so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """Where a vision block's vectors lie in the prompt, their merged grid and the temporal spacing."""

    start: int          # index of the first vector in the prompt's token ids
    grid: tuple[int, int, int]   # (t, h, w) after the 2 x 2 spatial merge
    time_interval: float = 1.0   # temporal positions per temporal patch (truncated to integers)

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def offsets(self) -> torch.Tensor:
        """(3, length) positions of the block's vectors relative to its start position."""
        t, h, w = self.grid
        # An integer range times a Python float: float32 products, truncated, as transformers computes them.
        times = (torch.arange(t) * self.time_interval).long()
        grid = torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack(grid).reshape(3, -1)


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
        offsets = span.offsets()
        positions[:, span.start:span.start + span.length] = offsets + next_position
        next_position += int(offsets.max()) + 1
        cursor = span.start + span.length
    positions[:, cursor:] = torch.arange(next_position, next_position + length - cursor)
    return positions, next_position + length - cursor
