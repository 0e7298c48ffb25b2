"""Which frames of a clip are decoded: the official loaders' rules for choosing frame indices."""

from __future__ import annotations

from collections.abc import Callable

# Chooses `num_frames` frame indices of a clip of `total_frames` frames.
FrameSampler = Callable[[int, int], list[int]]


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


def _check_counts(total_frames: int, num_frames: int) -> None:
    if total_frames < 1:
        raise ValueError("the clip has no frames")
    if num_frames < 1:
        raise ValueError("at least one frame must be requested")
