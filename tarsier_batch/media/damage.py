"""Damage a decoder reads past: a file that holds less video than its container declares, packets inside the
decoded stretch that fail to decode. Such a file still gives frames and a row; the row's `warnings` name what was
found (`WARNING_KINDS`), from what decoding already saw, without decoding anything again."""

from __future__ import annotations

import bisect
from typing import Any

from .timeline import Span

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
# rounded, and a variable frame rate makes the last frame's length a guess.
_SLACK_FRAMES = 2
_SLACK_S = 0.25


def declared_duration(container: Any, stream: Any) -> float | None:
    """The video's length as its container declares it (seconds; None where it does not): the stream's own, else
    the container's where the video is its only stream (another stream, such as audio, may run longer)."""
    if stream.duration:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / 1_000_000   # in AV_TIME_BASE units
    return None


def is_cut_short(held_s: float | None, frames: int, declared_s: float | None, span: Span | None) -> bool:
    """Does a video whose `frames` frames last `held_s` seconds hold less than the `declared_s` of its container,
    with the sampled `span` (None: the whole file) reaching the end of what it holds?"""
    if not held_s or declared_s is None or frames < 1:
        return False
    slack = max(_SLACK_S, _SLACK_FRAMES * held_s / frames)
    if declared_s - held_s <= slack:
        return False
    return span is None or span.end_s >= held_s - slack


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
