"""Video through FFmpeg (PyAV): frames as players show them, decoded from the file's start or from the keyframe
before a span."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from PIL import Image

from ..errors import UNDECODABLE, ItemError
from .damage import DecodeDamage, declared_duration, held_duration, is_cut_short, warnings_of
from .failures import DecoderFailure, short_error
from .frames import FrameTransform, Media, finish_frame
from .kinds import MediaType
from .memory import return_freed_memory
from .sampling import FrameCount, FrameSampler
from .span_cache import kept_for_spans, spans_packets
from .timeline import Span, Timeline, reaches_end, sample_span, timeline_of


@contextlib.contextmanager
def video_stream(source: str) -> Iterator[tuple[Any, Any]]:
    """The file open with PyAV, and the stream FFmpeg picks as its video (decord picks the same)."""
    import av

    with av.open(source) as container:
        if not container.streams:  # e.g. an MP4 cut before its index: unreadable rather than without video
            raise DecoderFailure("no stream found")
        stream = container.streams.best("video")
        if stream is None:
            held = ", ".join(sorted({other.type for other in container.streams}))
            raise ItemError(UNDECODABLE, f"no video stream (the file holds {held})")
        yield container, stream


def stream_packets(container: Any, stream: Any) -> Iterator[Any]:
    """The stream's packets in file order, up to the end or to where the container is damaged."""
    import av

    demuxer = container.demux(stream)
    while True:
        try:
            packet = next(demuxer)
        except (StopIteration, av.FFmpegError):
            return
        if packet.size:  # the demuxer ends with an empty packet per stream, a flush request
            yield packet


def decoded_frames(container: Any, stream: Any) -> Iterator[Any]:
    """The stream's frames in display order; a packet that fails to decode is skipped, as players do."""
    import av

    for packet in stream_packets(container, stream):
        try:
            yield from stream.decode(packet)
        except av.FFmpegError:
            continue  # later packets (from the next keyframe at the latest) decode again
    try:
        yield from stream.decode(None)  # the frames the decoder still holds
    except av.FFmpegError:
        return


def average_rate(stream: Any) -> float | None:
    """The stream's average frame rate (None: unknown): what transformers' PyAV loader times frames by."""
    return float(stream.average_rate) if stream.average_rate else None


def pixel_aspect(stream: Any) -> Fraction:
    """A stored pixel's displayed width over its height (1 where the file does not say)."""
    return stream.sample_aspect_ratio or Fraction(1)  # None or 0 means unknown


@dataclass(frozen=True)
class _SampledFrames:
    results: dict[int, Any]   # frame index -> the transformed frame
    width: int                # as displayed
    height: int
    frame_count: int          # frames that decoded
    fps: float | None
    damage: DecodeDamage


def load_video_pyav(path: str, source: str, num_frames: FrameCount, transform: FrameTransform | None,
                    sampler: FrameSampler, span: Span | None = None) -> Media:
    """Decode with FFmpeg through PyAV from the start of the file: no seeking, so the frames asked for.

    Frames are counted by demuxing (no decoding: a packet is a frame, its presentation time the
    frame's). One decoding pass keeps the sampled frames, each shown as a player shows it
    (`_displayed`) and transformed at once. A damaged packet is skipped and a damaged or
    truncated container is read up to the damage; if then not as many frames decode as packets
    were counted, the frames are sampled again from the decoded count and decoded once more, so
    the indices follow `sampler` over frames that exist, the last one included. Every frame is
    decoded (only sampled ones are converted to RGB): ~150 frames/s for 1080p H.264 on one core,
    slower than decord's seeking on long videos.
    """
    import av

    if span is not None:
        windowed = pyav_span(path, source, span, num_frames, sampler, transform)
        if windowed is not None:
            return windowed
    try:
        with video_stream(source) as (container, stream):
            times, held_s = packet_times(container, stream)
            starts = packet_timeline(times, stream).starts
            declared = declared_duration(container, stream)
            fps = average_rate(stream)
        total = len(starts)
        for _ in range(2):
            if total < 1:
                raise DecoderFailure("no video frame decodes")
            indices = sample_span(starts[:total], span, num_frames, sampler, fps)
            sampled = _decode_sampled(source, indices, transform, DecodeDamage(times))
            if sampled.frame_count == total:
                break
            total = sampled.frame_count
        else:
            raise DecoderFailure("the number of frames that decode changes between two reads")
    except av.FFmpegError as error:
        raise DecoderFailure(error.strerror or short_error(error)) from error
    frames = [sampled.results[index] for index in indices]  # a repeated index reuses its result
    cut_short = is_cut_short(held_s, len(starts), declared, reaches_end(starts[:total], span))
    return Media(path, MediaType.VIDEO, frames, indices, sampled.width, sampled.height,
                 total / sampled.fps if sampled.fps else None, "pyav", warnings_of(cut_short, sampled.damage),
                 fps=sampled.fps)


@dataclass(frozen=True)
class PacketTimes:
    """A video's frames as its packets list them: each frame's presentation timestamp in display order (None
    where decoded frames cannot be matched to them by timestamp: some missing, two alike, or time counted in
    frames), its start time from the first frame's, and the stream's average rate; how long they run
    (`damage.held_duration`), and how long the container declares the video (`damage.declared_duration`)."""

    timestamps: list[int] | None
    starts: list[float]
    fps: float | None
    frames: int
    held_s: float | None
    declared_s: float | None


def pyav_span(path: str, source: str, span: Span, num_frames: FrameCount, sampler: FrameSampler,
              transform: FrameTransform | None, starts: list[float] | None = None) -> Media | None:
    """`span` decoded by PyAV from the keyframe before it, sampled by `starts` (default: the packets' times);
    None where its timestamps cannot be trusted."""
    import av

    try:
        packets = kept_for_spans(spans_packets, source, lambda: read_packet_times(source))
        return decode_span_pyav(path, source, packets, span, num_frames, sampler, transform, starts)
    except av.FFmpegError as error:
        raise DecoderFailure(error.strerror or short_error(error)) from error


def read_packet_times(source: str) -> PacketTimes:
    with video_stream(source) as (container, stream):
        timestamps, held_s = packet_times(container, stream)
        timeline = packet_timeline(timestamps, stream)
        fps = average_rate(stream)
        declared = declared_duration(container, stream)
    matchable = not timeline.by_frames and len(set(timestamps)) == len(timestamps)   # by_frames: some are None
    ordered = sorted(stamp for stamp in timestamps if stamp is not None) if matchable else None
    return PacketTimes(ordered, timeline.starts, fps, len(timestamps), held_s, declared)


def decode_span_pyav(path: str, source: str, packets: PacketTimes, span: Span, num_frames: FrameCount,
                     sampler: FrameSampler, transform: FrameTransform | None,
                     starts: list[float] | None = None) -> Media | None:
    """A span's sampled frames, decoded from the keyframe before its first one up to its last: a long video's
    windows cost about their own length each, not the file's. Frames are matched by their timestamps.

    None where timestamps cannot be trusted (packets without them, two alike, or decoded frames whose
    timestamps match none of the packets'): the caller then decodes the file from its start, as for a whole
    file. A seek that lands past the span's first frame (a damaged index) is retried from the file's start.
    Sampled frames that do not decode while their neighbours do are damage in this stretch: an error of this
    span alone (the file's other spans decode as they are). Frames are sampled by `starts` (a frame's start
    times as another decoder reads them, the packets' by default)."""
    timestamps = packets.timestamps
    if not timestamps:
        return None
    starts = packets.starts if starts is None else starts
    indices = sample_span(starts, span, num_frames, sampler, packets.fps)
    wanted = {timestamps[index]: index for index in indices}
    first, last = min(wanted), max(wanted)
    # A decoded frame's timestamp is a packet's: missing frames are then damage, not timestamps that differ.
    matched = False
    for seek in (True, False):
        results: dict[int, Any] = {}
        width = height = 0
        overshot = False
        damage = DecodeDamage(timestamps)
        with video_stream(source) as (container, stream):
            aspect = pixel_aspect(stream)
            if seek:
                container.seek(first, stream=stream, backward=True, any_frame=False)   # to the keyframe before
            for number, frame in enumerate(decoded_frames(container, stream)):
                if frame.pts is None:
                    return None
                damage.decoded(frame)
                if number == 0 and seek and frame.pts > first:
                    overshot = True
                    break
                if not matched:
                    position = bisect.bisect_left(timestamps, frame.pts)
                    matched = position < len(timestamps) and timestamps[position] == frame.pts
                if frame.pts in wanted:
                    image = _displayed(frame, aspect)
                    width, height = image.size
                    results[wanted[frame.pts]] = finish_frame(image, transform, len(indices))
                    del image
                    if transform is not None:
                        return_freed_memory()
                if frame.pts >= last:
                    break
        if not overshot:
            break
    if not matched:
        return None
    if len(results) != len(wanted):
        missing = sorted(set(indices) - set(results))
        which = f"frame {missing[0]}" if len(missing) == 1 else f"frames {missing[0]} to {missing[-1]}"
        raise ItemError(UNDECODABLE, f"{len(missing)} of the {len(set(indices))} frames sampled in {span} ({which}) "
                                     f"do not decode: the file is damaged there")
    cut_short = is_cut_short(packets.held_s, packets.frames, packets.declared_s, reaches_end(starts, span))
    return Media(path, MediaType.VIDEO, [results[index] for index in indices], indices, width, height,
                 packets.frames / packets.fps if packets.fps else None, "pyav", warnings_of(cut_short, damage),
                 fps=packets.fps)


def packet_times(container: Any, stream: Any) -> tuple[list[int | None], float | None]:
    """The presentation timestamps of the stream's packets (stream order; in its time base), and how long the
    packets run (`damage.held_duration`; None where one has no timestamp)."""
    times: list[int | None] = []
    lengths: list[float] = []
    for packet in stream_packets(container, stream):
        times.append(packet.pts)
        lengths.append(float((packet.duration or 0) * stream.time_base))
    if None in times:
        return times, None
    return times, held_duration([float(time * stream.time_base) for time in times if time is not None], lengths)


def packet_timeline(times: list[int | None], stream: Any) -> Timeline:
    """The timeline of packets with presentation timestamps `times` (stream order; in the stream's time base)."""
    rate = float(stream.guessed_rate or stream.average_rate or 0) or None
    return timeline_of([None if time is None else float(time * stream.time_base) for time in times], rate)


def _decode_sampled(source: str, indices: list[int], transform: FrameTransform | None,
                    damage: DecodeDamage) -> _SampledFrames:
    """Decode every frame, keeping the transformed displayed frames at `indices`, and count them (each told to
    `damage`)."""
    wanted = set(indices)
    results: dict[int, Any] = {}
    width = height = frame_count = 0
    with video_stream(source) as (container, stream):
        aspect = pixel_aspect(stream)
        for frame in decoded_frames(container, stream):
            damage.decoded(frame)
            if frame_count in wanted:
                image = _displayed(frame, aspect)
                width, height = image.size
                results[frame_count] = finish_frame(image, transform, len(indices))
                del image  # otherwise the full frame stays alive while the next ones decode
                if transform is not None:
                    return_freed_memory()
            frame_count += 1
        fps = average_rate(stream)
    return _SampledFrames(results, width, height, frame_count, fps, damage)


def _displayed(frame: Any, aspect: Fraction) -> Image.Image:
    """The frame as a player shows it: stretched to its pixel aspect (width x SAR, bicubic), then
    rotated by the display matrix (counter-clockwise degrees; a mirroring in the matrix is ignored)."""
    image = frame.to_image()  # RGB
    if aspect != 1:
        image = image.resize((max(1, round(image.width * aspect)), image.height), Image.Resampling.BICUBIC)
    if frame.rotation:
        image = image.rotate(frame.rotation, expand=True)
    return image
