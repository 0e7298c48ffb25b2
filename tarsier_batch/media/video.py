"""A video's frames and timeline, each from the decoder that gives them as players show them: decord where it
does, PyAV otherwise."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from ..errors import UNDECODABLE, ItemError
from .damage import declared_duration
from .decord_video import OpenVideo, decord_failures, decord_timeline, load_video_decord
from .diagnosis import check_regular_file, why_no_decoder_opens
from .failures import DecoderFailure, short_error
from .frames import FrameTransform, Media
from .pyav_video import (
    decode_span_pyav,
    decoded_frames,
    load_video_pyav,
    packet_timeline,
    pixel_aspect,
    pyav_span,
    read_packet_times,
    stream_packets,
    video_stream,
)
from .sampling import FrameCount, FrameSampler
from .span_cache import kept_for_spans, spans_packets, spans_reading, spans_video
from .timeline import Span, Timeline


def load_video(path: str, num_frames: FrameCount, transform: FrameTransform | None, sampler: FrameSampler,
               span: Span | None = None) -> Media:
    """decord where it gives the frames asked for, as they are shown (the official decoder, so the
    official pixels); PyAV otherwise, and when decord fails.

    The decoders get the absolute path: FFmpeg reads a relative name such as "pipe:0.mp4" or
    "http:x.mp4" as a protocol (standard input, the network), an absolute path always as a file.
    Only a decoder's failure sends the file on to PyAV: an error raised by the frame transform,
    or a MemoryError, propagates as it is.
    """
    source = os.path.abspath(path)
    failures: list[str] = []
    if span is None:
        probe = _probe(source)
    else:
        spans = kept_for_spans(spans_reading, source, lambda: _SpansReading.of(path, source, num_frames, sampler))
        probe = spans.probe
        if spans.decord_starts is not None:
            with contextlib.suppress(DecoderFailure):   # decord then, as for any video
                windowed = pyav_span(path, source, span, num_frames, sampler, transform, spans.decord_starts)
                if windowed is not None:
                    return windowed
    if probe.decord_problem is None:
        try:
            return load_video_decord(path, source, num_frames, transform, sampler, span, probe.declared_s)
        except DecoderFailure as failure:
            failures.append(f"decord: {failure}")
    try:
        return load_video_pyav(path, source, num_frames, transform, sampler, span)
    except DecoderFailure as failure:
        failures.append(f"pyav: {failure}")
    why = why_no_decoder_opens(source)
    said = "; ".join(failures)
    raise ItemError(UNDECODABLE, f"cannot decode video: {said}" if why is None else f"{why}; {said}")


def frame_starts(path: str) -> list[float]:
    """Each frame's start time in display order, from the first frame's: the times `sample_span` counts in
    (decord's where it reads the file, else PyAV's packet times)."""
    return video_timeline(path).starts


def video_timeline(path: str) -> Timeline:
    """The video's `Timeline`, as its frames are sampled: decord's frame timestamps where decord reads the file,
    else PyAV's packet times. Spans are cut from its length."""
    check_regular_file(path)
    source = os.path.abspath(path)
    if decord_problem(source) is None:
        import decord

        decord.logging.set_level(decord.logging.QUIET)
        try:
            with decord_failures():
                reader = decord.VideoReader(source, num_threads=1, ctx=decord.cpu(0))
                if len(reader) > 0:
                    return decord_timeline(reader)
        except DecoderFailure:
            pass
    import av

    try:
        with video_stream(source) as (container, stream):
            timeline = packet_timeline([packet.pts for packet in stream_packets(container, stream)], stream)
    except (av.FFmpegError, DecoderFailure) as error:
        raise ItemError(UNDECODABLE, f"cannot read the video's length: {short_error(error)}") from None
    if not timeline.starts:
        raise ItemError(UNDECODABLE, "the video has no frames")
    return timeline


# Containers (FFmpeg's names) in which decord's seeking was checked against decoding every frame
# and returns the frames asked for (tests/test_hostile_media.py). In MPEG-TS and MPEG-PS (.ts,
# .mpg) it silently returns other frames, whatever the codec.
_DECORD_CONTAINERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "flv", "asf", "avi"})


def decord_problem(source: str) -> str | None:
    """Why decord would not return the frames asked for, as players show them (None: it would): `_probe`'s."""
    return _probe(source).decord_problem


@dataclass(frozen=True)
class _Probe:
    """What opening a video with PyAV tells before it is decoded: why decord would not give its frames as players
    show them (None: it would), and how long its container declares it (`damage.declared_duration`)."""

    decord_problem: str | None
    declared_s: float | None = None


def _probe(source: str) -> _Probe:
    """Why decord would not return the frames asked for, as players show them, and the declared length.

    Any reason sends the file to PyAV. A PyAV probe tells (opening the file and decoding its
    first frame: ~30 ms for 1080p H.264):
    - a display rotation (phone videos) or non-square pixels: decord ignores both (and fails
      on a 90-degree rotation); PyAV's path shows the frames as players do;
    - containers and codecs where decord's seeking silently returns other frames than asked:
      MPEG-TS and MPEG-PS, AVI with B-frames (AVI stores no presentation times), and MPEG-4
      Part 2 (DivX, Xvid) with B-frames in any container.
    A file PyAV cannot open is left to decord; if decord fails too, both reasons are reported.
    A file without a video stream is an error here.
    """
    import av

    try:
        with video_stream(source) as (container, stream):
            first = next(decoded_frames(container, stream), None)
            codec = stream.codec_context
            container_name = container.format.name
            aspect = pixel_aspect(stream)
            declared = declared_duration(container, stream)
    except (av.FFmpegError, DecoderFailure):
        return _Probe(None)
    problem = None
    if container_name not in _DECORD_CONTAINERS:
        problem = f"decord seeks to other frames than asked in this container ({container_name})"
    elif codec.has_b_frames and (container_name == "avi" or codec.name == "mpeg4"):
        problem = f"decord seeks to other frames than asked in {codec.name} with B-frames in {container_name}"
    elif first is not None and first.rotation != 0:
        problem = f"decord ignores the display rotation ({first.rotation} degrees)"
    elif aspect != 1:
        problem = f"decord ignores non-square pixels (sample aspect ratio {aspect})"
    return _Probe(problem, declared)


# The stretch at a video's end on which PyAV's frames are compared with decord's (`_SpansReading`).
_COMPARED_TAIL_S = 10.0
# decord keeps timestamps as float32: its frame times differ from the packets' by rounding (~0.1 ms in an hour).
_SAME_TIME_S = 1e-3


@dataclass(frozen=True)
class _SpansReading:
    """How a worker decodes a video's spans, settled at its first one.

    decord reads ahead of every frame it seeks to: until its decoder thread returns the first frame, it queues
    packets as fast as the file gives them, up to the rest of the file (measured: +130-180 MB per seek in a 720p
    file longer than a few minutes, and the time to read them, at each of a window's ~8 seeks). PyAV decodes a
    span from the keyframe before it and reads nothing past it. So where PyAV gives this video's spans exactly
    decord's frames (the same frame times, so the same frames sampled, and the same pixels, compared on the
    video's last seconds, where decord's read-ahead is short), PyAV decodes its spans, sampling them by decord's
    frame times."""

    probe: _Probe
    decord_starts: list[float] | None   # None: decord decodes the spans (where it reads the video at all)

    @classmethod
    def of(cls, path: str, source: str, num_frames: FrameCount, sampler: FrameSampler) -> _SpansReading:
        probe = _probe(source)
        return cls(probe, _starts_where_pyav_equals_decord(path, source, num_frames, sampler)
                   if probe.decord_problem is None else None)


def _starts_where_pyav_equals_decord(path: str, source: str, num_frames: FrameCount,
                                     sampler: FrameSampler) -> list[float] | None:
    """decord's frame times of the video, where PyAV gives its spans decord's frames; else None."""
    import av

    try:
        with decord_failures():
            opened = kept_for_spans(spans_video, source, lambda: OpenVideo(source, with_starts=True))
        packets = kept_for_spans(spans_packets, source, lambda: read_packet_times(source))
        if not opened.starts or len(opened.starts) != len(packets.starts) or any(
                abs(ours - theirs) > _SAME_TIME_S for ours, theirs in zip(packets.starts, opened.starts)):
            return None
        tail = Span(max(0.0, opened.starts[-1] - _COMPARED_TAIL_S), opened.starts[-1] + 1.0)
        by_decord = load_video_decord(path, source, num_frames, None, sampler, tail)
        by_pyav = decode_span_pyav(path, source, packets, tail, num_frames, sampler, None, opened.starts)
    except (DecoderFailure, ItemError, av.FFmpegError):
        return None
    same = by_pyav is not None and by_pyav.frame_indices == by_decord.frame_indices and all(
        (ours.size, ours.tobytes()) == (theirs.size, theirs.tobytes())
        for ours, theirs in zip(by_pyav.frames, by_decord.frames))
    return opened.starts if same else None
