"""When a video's frames start, and the stretches of it (spans) that a segment's row captions."""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

from ..errors import UNDECODABLE, ItemError
from .sampling import FrameCount, FrameSampler, frames_for


@dataclass(frozen=True)
class Span:
    """A stretch of a video, [start_s, end_s) in seconds from its first frame: what a segment's row captions."""

    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s:
            raise ValueError(f"a span runs from a start at or after 0 s to a later end, not {self}")

    def __str__(self) -> str:
        return f"{self.start_s:g}-{self.end_s:g} s"


# A frame whose start time is within this of a span's boundary counts as at the boundary (times are rounded
# from the stream's time base: 1/12288 s and the like).
_SPAN_TOLERANCE_S = 1e-6


def frames_in_span(starts: list[float], span: Span) -> range:
    """The frames (display order) that start within `span`; `starts` are the frames' start times, ascending,
    the first at 0. A span past the end is clipped to it (an empty range: nothing of it is in the video)."""
    return range(bisect.bisect_left(starts, span.start_s - _SPAN_TOLERANCE_S),
                 bisect.bisect_left(starts, span.end_s - _SPAN_TOLERANCE_S))


def reaches_end(starts: list[float], span: Span | None) -> bool:
    """Does `span` (None: the whole file) hold the last of the frames that start at `starts`?"""
    return span is None or frames_in_span(starts, span).stop == len(starts)


def sample_span(starts: list[float], span: Span | None, num_frames: FrameCount, sampler: FrameSampler,
                fps: float | None) -> list[int]:
    """Frame indices `sampler` picks within `span`, as if the span were the whole file (None: the whole file) at
    the file's rate `fps`: a span sampled by rate counts its own frames."""
    if span is None:
        return sampler(len(starts), frames_for(num_frames, len(starts), fps))
    frames = frames_in_span(starts, span)
    if not frames:
        raise ItemError(UNDECODABLE, f"no frame in {span}: the video's frames start between 0 and "
                                     f"{starts[-1]:g} s" if starts else "the video has no frames")
    return [frames.start + index for index in sampler(len(frames), frames_for(num_frames, len(frames), fps))]


# Timestamps that step forward by more than this between two frames, or back by more than `_REORDER_S` in
# stream order, have jumped (a recording paused, files joined, a clock reset): time is counted in frames then.
_JUMP_S = 10.0
_REORDER_S = 1.0   # how far back B-frames step in stream order (a few frames; at least this much is allowed)


@dataclass(frozen=True)
class Timeline:
    """Each frame's start time, seconds from the first frame's, ascending (what spans and `sample_span` count in),
    and the video's length (from the first frame's start to the last one's end). `by_frames`: the timestamps
    were missing or jumped, so the times are frame numbers over the frame rate instead."""

    starts: list[float]
    duration_s: float
    by_frames: bool = False


def timeline_of(stamps: list[float | None], rate: float | None) -> Timeline:
    """The timeline of frames whose timestamps (seconds, in stream order; None where a frame has none) are
    `stamps`, at the stream's nominal `rate` (frames/s, if known)."""
    steps: list[float] = []
    if stamps and None not in stamps:
        known = [stamp for stamp in stamps if stamp is not None]
        ordered = sorted(known)
        steps = [later - earlier for earlier, later in zip(ordered, ordered[1:])]
        typical = statistics.median(steps) if steps else 0.0
        back = max((earlier - later for earlier, later in zip(known, known[1:])), default=0.0)
        if max(steps, default=0.0) <= _JUMP_S and back <= max(_REORDER_S, 10 * typical):
            frame_s = typical or (1 / rate if rate else 0.0)
            return Timeline([stamp - ordered[0] for stamp in ordered], ordered[-1] - ordered[0] + frame_s)
    # The most common step is the frame interval even where the stream jumps; a rate FFmpeg averaged over the
    # jump is not.
    positive = [step for step in steps if step > 0]
    # Rounded: timestamps in a time base such as 1/10240 s give 9.99999 frames/s for 10.
    fps = round(1 / statistics.median(positive), 3) if positive else rate or 25.0
    return Timeline([index / fps for index in range(len(stamps))], len(stamps) / fps, by_frames=True)
