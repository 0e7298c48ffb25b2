"""Which frames of a clip are decoded: the official loaders' rules for choosing frame indices."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Chooses `num_frames` frame indices of a clip of `total_frames` frames.
FrameSampler = Callable[[int, int], list[int]]
TEMPORAL_PATCH_FRAMES = 2  # Qwen-VL video frames per temporal patch (qwen-vl-utils' FRAME_FACTOR)


def frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """Uniform frame indices that include the first and the last frame (Tarsier v1's rule).

    Matches the official formula exactly, including Python's half-to-even `round`; a clip
    shorter than `num_frames` repeats indices, and one requested frame is the first frame.
    """
    _check_counts(total_frames, num_frames)
    if num_frames == 1:
        return [0]
    return [round(i * (total_frames - 1) / (num_frames - 1)) for i in range(num_frames)]


def frame_indices_without_repeats(total_frames: int, num_frames: int) -> list[int]:
    """Tarsier2's rule: v1's uniform indices, but a clip of at most `num_frames` frames gives all of them."""
    _check_counts(total_frames, num_frames)
    if num_frames == 1:
        return [0]
    if total_frames <= num_frames:
        return list(range(total_frames))
    return frame_indices(total_frames, num_frames)


def even_frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """Qwen-VL's rule (qwen-vl-utils with a frame count): `num_frames` rounded to an even count (two frames fill
    a temporal patch), at most the clip's frames rounded down to even and at least two, spread over the clip as
    `torch.linspace(0, total - 1, n).round()` spreads them (float32 steps, halves to even)."""
    _check_counts(total_frames, num_frames)
    wanted = round(num_frames / TEMPORAL_PATCH_FRAMES) * TEMPORAL_PATCH_FRAMES
    count = max(TEMPORAL_PATCH_FRAMES, min(wanted, total_frames // TEMPORAL_PATCH_FRAMES * TEMPORAL_PATCH_FRAMES))
    return [int(value) for value in np.round(_float32_linspace(total_frames - 1, count))]


def _float32_linspace(end: int, steps: int) -> np.ndarray:
    """`torch.linspace(0, end, steps)` in float32 as torch's CPU kernel computes it: the first half counts up from
    0, the second half down from `end`, so both ends are exact."""
    step = np.float32(end) / np.float32(steps - 1)
    index = np.arange(steps, dtype=np.float32)
    rising = index * step
    falling = np.float32(end) - (np.float32(steps - 1) - index) * step
    return np.where(np.arange(steps) < steps // 2, rising, falling).astype(np.float32)


def _check_counts(total_frames: int, num_frames: int) -> None:
    if total_frames < 1:
        raise ValueError("the clip has no frames")
    if num_frames < 1:
        raise ValueError("at least one frame must be requested")
