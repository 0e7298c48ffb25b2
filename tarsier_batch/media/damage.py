"""Damage a decoder reads past: a file that holds less video than its container declares, packets inside the
decoded stretch that fail to decode. Such a file still gives frames and a row; the row's `warnings` name what was
found (`WARNING_KINDS`), from what decoding already saw, without decoding anything again."""

from __future__ import annotations

import bisect
import statistics
from typing import Any

CUT_SHORT = "cut_short"
CORRUPT_PACKETS = "corrupt_packets"

# Every value the `warnings` column holds (docs/pipelines.md, "Output", lists the same).
WARNING_KINDS: dict[str, str] = {
    CUT_SHORT: "the file holds less video than its container declares (a download or copy cut short), and the "
               "sampled stretch reaches the end of what it holds: frames were sampled from the part that is there",
    CORRUPT_PACKETS: "packets within the decoded stretch failed to decode, or decoded frames the decoder flagged as "
                     "corrupt (bytes overwritten or lost inside the file): frames may be missing or show artefacts",
}

# How much shorter than declared a video may be and still count as whole: container durations and frame times are
# rounded, and where a frame's length is not stored it is taken to be the typical step between frames.
_SLACK_FRAMES = 2
_SLACK_S = 0.25


def declared_duration(container: Any, stream: Any) -> float | None:
    """The video's length from its first frame as its container declares it (seconds; None where it does not): the
    stream's own, else the container's where the video is its only stream (another stream, such as audio, may run
    longer). Matroska counts the container's duration from 0, other containers from the first frame; for a video
    whose first frame comes later, the reading from 0 less the start is the shorter one, and is taken, so that a
    healthy file is not marked."""
    if stream.duration:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        start = max(container.start_time or 0, 0)
        return (container.duration - start) / 1_000_000   # in AV_TIME_BASE units
    return None


def held_duration(starts: list[float], lengths: list[float]) -> float | None:
    """How long frames that start at `starts` and last `lengths` (seconds in the stream's own clock, any order; a
    length of 0: not stored) run, from the first one's start to the latest end (None: no frames). Raw times: a
    timestamp jump counts as the time it skips, as in the container's duration. A frame without a stored length
    lasts the typical step between frames."""
    if not starts:
        return None
    ordered = sorted(starts)
    steps = [later - earlier for earlier, later in zip(ordered, ordered[1:]) if later > earlier]
    typical = statistics.median(steps) if steps else 0.0
    return max(start + (length if length > 0 else typical) for start, length in zip(starts, lengths)) - ordered[0]


def is_cut_short(held_s: float | None, frames: int, declared_s: float | None, reaches_end: bool) -> bool:
    """Does a video whose `frames` frames last `held_s` seconds (`held_duration`) hold less than the `declared_s`
    of its container, with the sampled stretch reaching the end of what it holds (`reaches_end`)?"""
    if not held_s or declared_s is None or frames < 1 or not reaches_end:
        return False
    return declared_s - held_s > max(_SLACK_S, _SLACK_FRAMES * held_s / frames)


class DecodeDamage:
    """What the frames of one decoding pass show: frames FFmpeg flagged corrupt (damage it concealed), and frames
    missing between the first and the last one decoded (packets that failed to decode, which FFmpeg skips, and
    frames that depended on them). Missing frames are told by the packets' presentation times, where every decoded
    frame has one of them; frames missing after the last decoded one are where a file cut short ends (`cut_short`
    says that), or beyond the stretch decoded."""

    def __init__(self, packet_times: list[int | None]):
        self._packets = sorted(time for time in packet_times if time is not None) \
            if None not in packet_times and len(set(packet_times)) == len(packet_times) else None
        self._decoded: list[int] = []
        self._flagged = 0

    def decoded(self, frame: Any) -> None:
        self._flagged += bool(frame.is_corrupt)
        if frame.pts is not None:
            self._decoded.append(frame.pts)

    @property
    def found(self) -> bool:
        return bool(self._flagged) or self._frames_missing()

    def _frames_missing(self) -> bool:
        packets, decoded = self._packets, set(self._decoded)
        if not packets or not decoded or not decoded <= set(packets):
            return False   # no times to tell by, or frames timed otherwise than their packets
        inside = bisect.bisect_right(packets, max(decoded)) - bisect.bisect_left(packets, min(decoded))
        return inside > len(decoded)


def warnings_of(cut_short: bool, damage: DecodeDamage | None) -> tuple[str, ...]:
    """The row's warning kinds, in `WARNING_KINDS`' order."""
    return tuple(kind for kind, found in ((CUT_SHORT, cut_short), (CORRUPT_PACKETS, bool(damage and damage.found)))
                 if found)
