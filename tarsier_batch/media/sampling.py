"""Which frames of a clip are decoded: the official loaders' rules for choosing frame indices."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Chooses `num_frames` frame indices of a clip of `total_frames` frames.
FrameSampler = Callable[[int, int], list[int]]
TEMPORAL_PATCH_FRAMES = 2  # Qwen-VL video frames per temporal patch (qwen-vl-utils' FRAME_FACTOR)
# The fewest frames a clip sampled by rate gives (qwen-vl-utils' FPS_MIN_FRAMES), and its default most
# (FPS_MAX_FRAMES).
RATE_MIN_FRAMES = 4   # even: whole temporal patches
RATE_MAX_FRAMES = 768


@dataclass(frozen=True)
class FramesAtRate:
    """Frames sampled at `fps` per second of each clip (qwen-vl-utils' `smart_nframes`), at most `most`; a clip of
    unknown rate gives the fixed count `unknown_rate` (at most `most`)."""

    fps: float
    most: int = RATE_MAX_FRAMES
    unknown_rate: int = 16

    def count(self, clip_frames: int, clip_fps: float | None) -> int:
        """How many frames a clip of `clip_frames` frames at `clip_fps` gives: its seconds times `fps`, within
        [RATE_MIN_FRAMES, most] and the clip's frames, floored to fill whole temporal patches; at least one patch
        (a one-frame clip gives its frame twice, where qwen-vl-utils refuses it)."""
        if not clip_fps:
            return min(self.unknown_rate, self.most)
        wanted = clip_frames / clip_fps * self.fps   # in this order, as qwen-vl-utils computes it
        bounded = min(max(wanted, RATE_MIN_FRAMES), _floor_to_patches(self.most), clip_frames)
        return max(TEMPORAL_PATCH_FRAMES, _floor_to_patches(bounded))


# How many frames each clip gives: a fixed count, or a rate (the count then depends on the clip's length).
FrameCount = int | FramesAtRate


def frames_in_words(frames: FrameCount) -> str:
    """The rule in words: "16 frames", "2 fps, 4-768 frames"."""
    if isinstance(frames, FramesAtRate):
        return f"{frames.fps:g} fps, {min(RATE_MIN_FRAMES, frames.most)}-{frames.most} frames"
    return f"{frames} frames"


def frames_for(frames: FrameCount, clip_frames: int, clip_fps: float | None) -> int:
    """The count of frames to sample from a clip of `clip_frames` frames at `clip_fps` (None: unknown)."""
    return frames.count(clip_frames, clip_fps) if isinstance(frames, FramesAtRate) else frames


def by_rate(frames: FrameCount) -> bool:
    """Whether the count depends on the clip's rate (which a decoder then reads before it samples)."""
    return isinstance(frames, FramesAtRate)


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


def _floor_to_patches(frames: float) -> int:
    return math.floor(frames / TEMPORAL_PATCH_FRAMES) * TEMPORAL_PATCH_FRAMES


def _check_counts(total_frames: int, num_frames: int) -> None:
    if total_frames < 1:
        raise ValueError("the clip has no frames")
    if num_frames < 1:
        raise ValueError("at least one frame must be requested")
