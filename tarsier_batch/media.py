"""Decode media files into RGB frames, sampled the way the official Tarsier loader samples them."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import os
import re
import stat
import statistics
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

from .errors import (
    NOT_FOUND,
    TOO_LARGE,
    UNDECODABLE,
    UNREADABLE,
    ItemError,
    plain_message,
)

# Pillow's own limit (89 Mpx: a warning, twice that: an error) is set aside while opening: the
# caller's `max_image_pixels` decides, and its message names the option.
MAX_IMAGE_PIXELS = 250_000_000
# A JPEG above Pillow's limit is read reduced by 1/2, 1/4 or 1/8 as it is decoded (Pillow's draft
# mode: the full image is never allocated), to this many pixels or fewer: still several times what
# any model of ours takes per frame. Below the limit an image is read whole, as the official
# loaders read it.
DRAFT_ABOVE_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)   # Pillow's default MAX_IMAGE_PIXELS (89,478,485)
DRAFT_TO_PIXELS = 16_000_000
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_PILLOW_LIMIT = threading.Lock()
# Pillow also warns from its own checks elsewhere (a GIF frame growing while seeking); the limit above decides.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class MediaType(str, Enum):
    VIDEO = "video"
    GIF = "gif"
    IMAGE = "image"


VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".webm", ".mov", ".mkv", ".wmv", ".ts", ".m4v", ".mpg", ".mpeg",
                              ".3gp", ".flv"})
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})


def media_type_of(path: str | os.PathLike[str]) -> MediaType | None:
    """The media type implied by a file's extension (case-insensitive), or None if unsupported."""
    suffix = Path(path).suffix.lower()
    if suffix == ".gif":
        return MediaType.GIF
    if suffix in VIDEO_EXTENSIONS:
        return MediaType.VIDEO
    if suffix in IMAGE_EXTENSIONS:
        return MediaType.IMAGE
    return None


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


def sample_span(starts: list[float], span: Span | None, num_frames: int, sampler: FrameSampler) -> list[int]:
    """Frame indices `sampler` picks within `span`, as if the span were the whole file (None: the whole file)."""
    if span is None:
        return sampler(len(starts), num_frames)
    frames = frames_in_span(starts, span)
    if not frames:
        raise ItemError(UNDECODABLE, f"no frame in {span}: the video's frames start between 0 and "
                                     f"{starts[-1]:g} s" if starts else "the video has no frames")
    return [frames.start + index for index in sampler(len(frames), num_frames)]


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


# Chooses `num_frames` frame indices of a clip of `total_frames` frames.
FrameSampler = Callable[[int, int], list[int]]
# Applied to each sampled frame (an RGB PIL image) as soon as it is decoded, e.g. a model's
# preprocessing: then only its (much smaller) result is kept, never all full-resolution frames.
# The second argument is how many frames the item keeps (some models size frames by it).
FrameTransform = Callable[[Image.Image, int], Any]


@dataclass(frozen=True)
class Media:
    """Frames sampled from one file, with the facts about the file that end up in the output.

    `frames` holds RGB PIL images, or whatever the `frame_transform` given to `load_media`
    returned for each of them. Facts (`width`, `height`, ...) are always those of the file.
    """

    path: str
    media_type: MediaType
    frames: list[Any]
    frame_indices: list[int]
    width: int                # as displayed: after rotation and non-square pixels are applied
    height: int
    duration_s: float | None
    decoder: str              # what produced the frames: "decord", "pyav" or "pillow"


def load_media(path: str, media_type: MediaType, num_frames: int,
               frame_transform: FrameTransform | None = None, sampler: FrameSampler = frame_indices,
               max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
    """Decode `path` and sample `num_frames` frames with `sampler` (images give one frame); with `span`, within
    that stretch of a video only, as if it were the whole file (`sample_span`).

    With `frame_transform`, each sampled frame is transformed soon after it is decoded and only
    the result is kept. Full-resolution frames are released before decoding goes on, except
    that video frames decord must decode in one pass (sampled frames between the same two
    keyframes) are decoded together first. A frame sampled twice (a video shorter than
    `num_frames`) is decoded and transformed once; its result appears at both places. An image or
    GIF of more than `max_image_pixels` pixels (None: any) fails without being decoded.
    """
    check_regular_file(path)
    if span is not None and media_type is not MediaType.VIDEO:
        raise ItemError(UNDECODABLE, f"a span ({span}) applies to videos only; this is {media_type.value}")
    if media_type is MediaType.VIDEO:
        return _load_video(path, num_frames, frame_transform, sampler, span)
    if media_type is MediaType.GIF:
        return _load_gif(path, num_frames, frame_transform, sampler, max_image_pixels)
    return _load_image(path, num_frames, frame_transform, sampler, max_image_pixels)


def check_regular_file(path: str) -> None:
    """Fail with a clear reason, before opening, on anything but a readable, non-empty regular file.

    Opening a FIFO named like media would block for ever, and a device would never end.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ItemError(NOT_FOUND, "the file no longer exists" if os.path.lexists(path) is False
                        else "broken symbolic link") from None
    except OSError as error:  # ELOOP (a symlink loop), EACCES on a folder on the way, ...
        raise ItemError(UNREADABLE, f"cannot open: {error.strerror}") from None
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    for test, kind in kinds:
        if test(info.st_mode):
            raise ItemError(UNREADABLE, f"not a regular file: {kind}")
    if info.st_size == 0:
        raise ItemError(UNREADABLE, "empty file (0 bytes)")
    if not os.access(path, os.R_OK):
        raise ItemError(UNREADABLE, "cannot open: permission denied")


def decoder_versions() -> dict[str, str]:
    """Versions of the frame decoders, recorded in the output's provenance."""
    import av
    import decord
    import PIL

    return {"video": f"decord {decord.__version__}", "video_fallback": f"pyav {av.__version__}",
            "gif": f"pillow {PIL.__version__}", "image": f"pillow {PIL.__version__}"}


def _load_video(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler,
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
        problem = decord_problem(source)
    else:
        spans = _kept_for_spans(_spans_reading, source, lambda: _SpansReading.of(path, source, num_frames, sampler))
        problem = spans.decord_problem
        if spans.decord_starts is not None:
            with contextlib.suppress(_DecoderFailure):   # decord then, as for any video
                windowed = _pyav_span(path, source, span, num_frames, sampler, transform, spans.decord_starts)
                if windowed is not None:
                    return windowed
    if problem is None:
        try:
            return _load_video_decord(path, source, num_frames, transform, sampler, span)
        except _DecoderFailure as failure:
            failures.append(f"decord: {failure}")
    try:
        return _load_video_pyav(path, source, num_frames, transform, sampler, span)
    except _DecoderFailure as failure:
        failures.append(f"pyav: {failure}")
    why = _why_no_decoder_opens(source)
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
            with _decord_failures():
                reader = decord.VideoReader(source, num_threads=1, ctx=decord.cpu(0))
                if len(reader) > 0:
                    return decord_timeline(reader)
        except _DecoderFailure:
            pass
    import av

    try:
        with _video_stream(source) as (container, stream):
            timeline = _packet_timeline([packet.pts for packet in _packets(container, stream)], stream)
    except (av.FFmpegError, _DecoderFailure) as error:
        raise ItemError(UNDECODABLE, f"cannot read the video's length: {_short(error)}") from None
    if not timeline.starts:
        raise ItemError(UNDECODABLE, "the video has no frames")
    return timeline


def decord_timeline(reader: Any) -> Timeline:
    """The timeline of a decord reader's frames (its timestamps by frame index: stream order)."""
    stamps = reader.get_frame_timestamp(range(len(reader)))
    timeline = timeline_of(stamps[:, 0].tolist(), reader.get_avg_fps() or None)
    if timeline.by_frames:
        return timeline
    # decord knows each frame's end: the length runs to the last frame's.
    return replace(timeline, duration_s=float(stamps[:, 1].max() - stamps[:, 0].min()))


def _why_no_decoder_opens(source: str) -> str | None:
    """What the file's bytes say about why no decoder opened it, where they say more than the decoders: FFmpeg
    gives "Invalid data found when processing input" alike for text, random bytes and an MP4 cut short."""
    try:
        with open(source, "rb") as file:
            head = file.read(_HEAD_BYTES)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return None
    if head[4:8] == b"ftyp":   # ISO base media (MP4, MOV, 3GP): its boxes say whether the file is whole
        return _mp4_problem(source, size)
    for signature, name in _CONTAINER_SIGNATURES:
        if head.startswith(signature):
            return f"the {name} file is damaged or cut short: no decoder can open it"
    if _looks_like_text(head):
        return "not a video: no media stream found (the file starts like text)"
    return "not a video: no media stream found (no decoder knows the format of its bytes)"


_HEAD_BYTES = 4096
_CONTAINER_SIGNATURES = ((b"\x1a\x45\xdf\xa3", "Matroska/WebM"), (b"RIFF", "AVI"), (b"FLV", "FLV"),
                         (b"OggS", "Ogg"), (b"\x00\x00\x01\xba", "MPEG-PS"), (b"\x30\x26\xb2\x75", "ASF/WMV"))


def _mp4_problem(source: str, size: int) -> str:
    """Why an MP4 no decoder opens is unreadable, from its top-level boxes (size, then type; a size of 1: a
    64-bit size follows; 0: up to the end of the file)."""
    offset, types = 0, set()
    with open(source, "rb") as file:
        while offset + 8 <= size:
            file.seek(offset)
            header = file.read(16)
            length, kind = int.from_bytes(header[:4], "big"), header[4:8]
            if length == 1 and len(header) == 16:
                length = int.from_bytes(header[8:16], "big")
            elif length == 0:
                length = size - offset
            if length < 8:
                return f"the MP4 is damaged: a box at byte {offset:,} has an impossible size ({length})"
            types.add(kind)
            if offset + length > size:
                return (f"the video is cut short: the file ends at byte {size:,}, inside its "
                        f"{kind.decode('latin-1')!r} box, which runs to byte {offset + length:,}")
            offset += length
    if b"moov" not in types:
        return "the video is cut short or was never finished: the MP4 has no index (moov box)"
    return "the MP4 is damaged: its boxes are whole, but no decoder finds a playable stream in them"


def _looks_like_text(head: bytes) -> bool:
    """Do the first bytes read as text (UTF-8, no control characters but whitespace)?"""
    if not head or b"\x00" in head:
        return False
    for cut in range(4):   # the head may end inside a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(character.isprintable() or character.isspace() for character in text)
    return False


class _DecoderFailure(Exception):
    """A decoder could not open or decode the file; the message is one line."""


def _short(error: BaseException) -> str:
    """An error on one line, without decord's "[12:00:00] /src/video/video_reader.cc:83: " prefix."""
    text = _NATIVE_LOG_PREFIX.sub("", " ".join(str(error).split()))
    return text[:200] or type(error).__name__


_NATIVE_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")

# Containers (FFmpeg's names) in which decord's seeking was checked against decoding every frame
# and returns the frames asked for (tests/test_hostile_media.py). In MPEG-TS and MPEG-PS (.ts,
# .mpg) it silently returns other frames, whatever the codec.
_DECORD_CONTAINERS = frozenset({"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "flv", "asf", "avi"})


def decord_problem(source: str) -> str | None:
    """Why decord would not return the frames asked for, as players show them (None: it would).

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
        with _video_stream(source) as (container, stream):
            first = next(_decoded_frames(container, stream), None)
            codec = stream.codec_context
            container_name = container.format.name
            aspect = _pixel_aspect(stream)
    except (av.FFmpegError, _DecoderFailure):
        return None
    if container_name not in _DECORD_CONTAINERS:
        return f"decord seeks to other frames than asked in this container ({container_name})"
    if codec.has_b_frames and (container_name == "avi" or codec.name == "mpeg4"):
        return f"decord seeks to other frames than asked in {codec.name} with B-frames in {container_name}"
    if first is not None and first.rotation != 0:
        return f"decord ignores the display rotation ({first.rotation} degrees)"
    if aspect != 1:
        return f"decord ignores non-square pixels (sample aspect ratio {aspect})"
    return None


@contextlib.contextmanager
def _video_stream(source: str) -> Iterator[tuple[Any, Any]]:
    """The file open with PyAV, and the stream FFmpeg picks as its video (decord picks the same)."""
    import av

    with av.open(source) as container:
        if not container.streams:  # e.g. an MP4 cut before its index: unreadable rather than without video
            raise _DecoderFailure("no stream found")
        stream = container.streams.best("video")
        if stream is None:
            held = ", ".join(sorted({other.type for other in container.streams}))
            raise ItemError(UNDECODABLE, f"no video stream (the file holds {held})")
        yield container, stream


def _packets(container: Any, stream: Any) -> Iterator[Any]:
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


def _decoded_frames(container: Any, stream: Any) -> Iterator[Any]:
    """The stream's frames in display order; a packet that fails to decode is skipped, as players do."""
    import av

    for packet in _packets(container, stream):
        try:
            yield from stream.decode(packet)
        except av.FFmpegError:
            continue  # later packets (from the next keyframe at the latest) decode again
    try:
        yield from stream.decode(None)  # the frames the decoder still holds
    except av.FFmpegError:
        return


def _pixel_aspect(stream: Any) -> Fraction:
    """A stored pixel's displayed width over its height (1 where the file does not say)."""
    return stream.sample_aspect_ratio or Fraction(1)  # None or 0 means unknown


@dataclass(frozen=True)
class _SampledFrames:
    results: dict[int, Any]   # frame index -> the transformed frame
    width: int                # as displayed
    height: int
    frame_count: int          # frames that decoded
    fps: float | None


def _load_video_pyav(path: str, source: str, num_frames: int, transform: FrameTransform | None,
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
        windowed = _pyav_span(path, source, span, num_frames, sampler, transform)
        if windowed is not None:
            return windowed
    try:
        with _video_stream(source) as (container, stream):
            starts = _packet_starts(container, stream)
        total = len(starts)
        for _ in range(2):
            if total < 1:
                raise _DecoderFailure("no video frame decodes")
            indices = sample_span(starts[:total], span, num_frames, sampler)
            sampled = _decode_sampled(source, indices, transform)
            if sampled.frame_count == total:
                break
            total = sampled.frame_count
        else:
            raise _DecoderFailure("the number of frames that decode changes between two reads")
    except av.FFmpegError as error:
        raise _DecoderFailure(error.strerror or _short(error)) from error
    frames = [sampled.results[index] for index in indices]  # a repeated index reuses its result
    return Media(path, MediaType.VIDEO, frames, indices, sampled.width, sampled.height,
                 total / sampled.fps if sampled.fps else None, "pyav")


@dataclass(frozen=True)
class _PacketTimes:
    """A video's frames as its packets list them: each frame's presentation timestamp in display order (None
    where decoded frames cannot be matched to them by timestamp: some missing, two alike, or time counted in
    frames), its start time from the first frame's, and the stream's average rate."""

    timestamps: list[int] | None
    starts: list[float]
    fps: float | None
    frames: int


# What a worker reads of the video whose spans it decodes, kept for its next span: a worker takes a long video's
# windows one after another, and reading the index (decord) or the packets (PyAV) of an hour of video takes
# longer than decoding a window's frames.
_spans_video = threading.local()
_spans_packets = threading.local()
_spans_reading = threading.local()
# The stretch at a video's end on which PyAV's frames are compared with decord's (`_SpansReading`).
_COMPARED_TAIL_S = 10.0
T = TypeVar("T")


def _kept_for_spans(slot: threading.local, source: str, read: Callable[[], T]) -> T:
    """What `read` reads of `source`, kept in this thread's `slot`: the one read last if of the same unchanged file."""
    stat = os.stat(source)
    identity = (source, stat.st_size, stat.st_mtime_ns)
    kept: tuple[tuple[str, int, int], T] | None = getattr(slot, "kept", None)
    if kept is None or kept[0] != identity:
        slot.kept = None   # the other video's goes before this one is read
        slot.kept = (identity, read())
    return slot.kept[1]


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

    decord_problem: str | None
    decord_starts: list[float] | None   # None: decord decodes the spans (where it reads the video at all)

    @classmethod
    def of(cls, path: str, source: str, num_frames: int, sampler: FrameSampler) -> _SpansReading:
        problem = decord_problem(source)
        return cls(problem, _starts_where_pyav_equals_decord(path, source, num_frames, sampler)
                   if problem is None else None)


def _starts_where_pyav_equals_decord(path: str, source: str, num_frames: int,
                                     sampler: FrameSampler) -> list[float] | None:
    """decord's frame times of the video, where PyAV gives its spans decord's frames; else None."""
    import av

    try:
        with _decord_failures():
            opened = _kept_for_spans(_spans_video, source, lambda: _OpenVideo(source, with_starts=True))
        packets = _kept_for_spans(_spans_packets, source, lambda: _read_packet_times(source))
        if not opened.starts or len(opened.starts) != len(packets.starts) or any(
                abs(ours - theirs) > _SAME_TIME_S for ours, theirs in zip(packets.starts, opened.starts)):
            return None
        tail = Span(max(0.0, opened.starts[-1] - _COMPARED_TAIL_S), opened.starts[-1] + 1.0)
        by_decord = _load_video_decord(path, source, num_frames, None, sampler, tail)
        by_pyav = _decode_span_pyav(path, source, packets, tail, num_frames, sampler, None, opened.starts)
    except (_DecoderFailure, ItemError, av.FFmpegError):
        return None
    same = by_pyav is not None and by_pyav.frame_indices == by_decord.frame_indices and all(
        (ours.size, ours.tobytes()) == (theirs.size, theirs.tobytes())
        for ours, theirs in zip(by_pyav.frames, by_decord.frames))
    return opened.starts if same else None


def _pyav_span(path: str, source: str, span: Span, num_frames: int, sampler: FrameSampler,
               transform: FrameTransform | None, starts: list[float] | None = None) -> Media | None:
    """`span` decoded by PyAV from the keyframe before it, sampled by `starts` (default: the packets' times);
    None where its timestamps cannot be trusted."""
    import av

    try:
        packets = _kept_for_spans(_spans_packets, source, lambda: _read_packet_times(source))
        return _decode_span_pyav(path, source, packets, span, num_frames, sampler, transform, starts)
    except av.FFmpegError as error:
        raise _DecoderFailure(error.strerror or _short(error)) from error


def _read_packet_times(source: str) -> _PacketTimes:
    with _video_stream(source) as (container, stream):
        timestamps = [packet.pts for packet in _packets(container, stream)]
        timeline = _packet_timeline(timestamps, stream)
        fps = float(stream.average_rate) if stream.average_rate else None
    matchable = not timeline.by_frames and len(set(timestamps)) == len(timestamps)   # by_frames: some are None
    ordered = sorted(stamp for stamp in timestamps if stamp is not None) if matchable else None
    return _PacketTimes(ordered, timeline.starts, fps, len(timestamps))


def _decode_span_pyav(path: str, source: str, packets: _PacketTimes, span: Span, num_frames: int,
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
    indices = sample_span(packets.starts if starts is None else starts, span, num_frames, sampler)
    wanted = {timestamps[index]: index for index in indices}
    first, last = min(wanted), max(wanted)
    # A decoded frame's timestamp is a packet's: missing frames are then damage, not timestamps that differ.
    matched = False
    for seek in (True, False):
        results: dict[int, Any] = {}
        width = height = 0
        overshot = False
        with _video_stream(source) as (container, stream):
            aspect = _pixel_aspect(stream)
            if seek:
                container.seek(first, stream=stream, backward=True, any_frame=False)   # to the keyframe before
            for number, frame in enumerate(_decoded_frames(container, stream)):
                if frame.pts is None:
                    return None
                if number == 0 and seek and frame.pts > first:
                    overshot = True
                    break
                if not matched:
                    position = bisect.bisect_left(timestamps, frame.pts)
                    matched = position < len(timestamps) and timestamps[position] == frame.pts
                if frame.pts in wanted:
                    image = _displayed(frame, aspect)
                    width, height = image.size
                    results[wanted[frame.pts]] = _finish(image, transform, len(indices))
                    del image
                    if transform is not None:
                        _return_freed_memory()
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
    frames = [results[index] for index in indices]
    duration = packets.frames / packets.fps if packets.fps else None
    return Media(path, MediaType.VIDEO, frames, indices, width, height, duration, "pyav")


def _packet_starts(container: Any, stream: Any) -> list[float]:
    """Each frame's start time in display order, from the first frame's, read from the packets (no decoding)."""
    return _packet_timeline([packet.pts for packet in _packets(container, stream)], stream).starts


def _packet_timeline(times: list[int | None], stream: Any) -> Timeline:
    """The timeline of packets with presentation timestamps `times` (stream order; in the stream's time base)."""
    rate = float(stream.guessed_rate or stream.average_rate or 0) or None
    return timeline_of([None if time is None else float(time * stream.time_base) for time in times], rate)


def _decode_sampled(source: str, indices: list[int], transform: FrameTransform | None) -> _SampledFrames:
    """Decode every frame, keeping the transformed displayed frames at `indices`, and count them."""
    wanted = set(indices)
    results: dict[int, Any] = {}
    width = height = frame_count = 0
    with _video_stream(source) as (container, stream):
        aspect = _pixel_aspect(stream)
        for frame in _decoded_frames(container, stream):
            if frame_count in wanted:
                image = _displayed(frame, aspect)
                width, height = image.size
                results[frame_count] = _finish(image, transform, len(indices))
                del image  # otherwise the full frame stays alive while the next ones decode
                if transform is not None:
                    _return_freed_memory()
            frame_count += 1
        fps = float(stream.average_rate) if stream.average_rate else None
    return _SampledFrames(results, width, height, frame_count, fps)


def _displayed(frame: Any, aspect: Fraction) -> Image.Image:
    """The frame as a player shows it: stretched to its pixel aspect (width x SAR, bicubic), then
    rotated by the display matrix (counter-clockwise degrees; a mirroring in the matrix is ignored)."""
    image = frame.to_image()  # RGB
    if aspect != 1:
        image = image.resize((max(1, round(image.width * aspect)), image.height), Image.Resampling.BICUBIC)
    if frame.rotation:
        image = image.rotate(frame.rotation, expand=True)
    return image


class _OpenVideo:
    """A video open with decord, and what sampling needs of it: frame count, keyframes, rate, frame start times."""

    def __init__(self, source: str, with_starts: bool = False):
        import decord

        self.reader = decord.VideoReader(source, num_threads=1, ctx=decord.cpu(0))
        self.total = len(self.reader)
        self.keyframes = [int(key) for key in self.reader.get_key_indices()]
        self.fps = self.reader.get_avg_fps()
        self.starts = decord_timeline(self.reader).starts if with_starts and self.total else []


def _load_video_decord(path: str, source: str, num_frames: int, transform: FrameTransform | None,
                       sampler: FrameSampler, span: Span | None = None) -> Media:
    import decord

    decord.logging.set_level(decord.logging.QUIET)  # FFmpeg's own messages would garble the display
    with _decord_failures():
        opened = _OpenVideo(source) if span is None else \
            _kept_for_spans(_spans_video, source, lambda: _OpenVideo(source, with_starts=True))
    reader, total, keyframes, fps, starts = opened.reader, opened.total, opened.keyframes, opened.fps, opened.starts
    if total < 1:
        raise _DecoderFailure("no frames")
    indices = sample_span(starts, span, num_frames, sampler) if span else sampler(total, num_frames)
    # decord's get_batch on the whole index list decodes each distinct index in order (seeking
    # unless the reader can simply decode forward to it) and copies repeats. Calling it with
    # one index at a time, in the same order, runs the same decoder steps (plus a seek between
    # runs, where get_batch seeks anyway), so the pixels are the same; but only the frames of
    # one run exist at full resolution at a time, instead of all of them.
    done: dict[int, Any] = {}
    width = height = 0
    for run in _decoder_runs(sorted(set(indices)), keyframes, total):
        with _decord_failures():
            arrays = [(index, _video_frame(reader, index)) for index in run]
        height, width = arrays[0][1].shape[:2]
        _stop_read_ahead(reader)
        arrays.reverse()
        while arrays:  # popping frees each full-size frame once it is transformed
            index, array = arrays.pop()
            done[index] = _finish(Image.fromarray(array), transform, len(indices))  # fromarray copies: an RGB image
            del array  # otherwise alive while the next run decodes
            if transform is not None:
                _return_freed_memory()
    frames = [done[index] for index in indices]  # a repeated index reuses its result, as get_batch copies it
    return Media(path, MediaType.VIDEO, frames, indices, width, height,
                 total / fps if fps > 0 else None, "decord")


@contextlib.contextmanager
def _decord_failures() -> Iterator[None]:
    """decord's errors as a `_DecoderFailure`; nothing else is caught (no MemoryError, no caller's error)."""
    import decord

    try:
        yield
    except (RuntimeError, decord.DECORDError) as error:
        raise _DecoderFailure(_short(error)) from error
    except UnicodeEncodeError:  # decord hands the path to C as UTF-8: a name that is not UTF-8 cannot reach it
        raise _DecoderFailure("the file name is not UTF-8") from None


def _video_frame(reader: Any, index: int) -> Any:
    """Frame `index` as a (height, width, 3) uint8 RGB array."""
    return reader.get_batch([index]).asnumpy()[0]


def _decoder_runs(indices: list[int], keyframes: list[int], total: int) -> list[list[int]]:
    """Split ascending frame indices where decord's get_batch would seek before the next one.

    After decoding frame i a decord 0.6 reader stands at i + 1; it reaches j by decoding
    forward when j lies in the same keyframe interval as i + 1, and seeks otherwise
    (`VideoReader::SeekAccurate`). Frames of one run must be decoded back to back (see
    `_stop_read_ahead`); between runs the reader would seek anyway. Misjudging a boundary
    costs memory or time, never pixels: decoding from the keyframe gives the same frame.
    """
    runs: list[list[int]] = []
    for index in indices:
        if runs and _keyframe_at(index, keyframes, total) == _keyframe_at(runs[-1][-1] + 1, keyframes, total):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _keyframe_at(index: int, keyframes: list[int], total: int) -> int:
    """The keyframe decoding of frame `index` starts from, as decord's `LocateKeyframe` finds it."""
    if not keyframes or index <= keyframes[0]:
        return 0
    if index >= total:
        return keyframes[-1]
    return keyframes[bisect.bisect_right(keyframes, index) - 1]


def _stop_read_ahead(reader: Any) -> None:
    """Stop decord's decoder thread and drop the frames it decoded beyond the one asked for.

    To return one frame, decord's reader queues packets until its decoder thread yields a
    frame, often many (up to the rest of the file), and the thread keeps decoding them into
    full-size RGB frames while we preprocess: ~400 MB for the 84-frame 1920x800 demo clip.
    A seek stops the thread and drops its queues. It changes no pixels: get_batch would seek
    before the next run anyway (to frame 0, then to that run's keyframe), and frame 0 is
    where this leaves the reader, so its own seek to 0 becomes a no-op.
    """
    try:
        reader.seek(0)
    except RuntimeError:
        pass  # the thread was stopped all the same; the next get_batch seeks as it would have


def _finish(frame: Image.Image, transform: FrameTransform | None, frame_count: int) -> Any:
    return frame if transform is None else transform(frame, frame_count)


def _return_freed_memory() -> None:
    """Hand the freed temporaries of the last frame back to the system (glibc only).

    Each kept result (a 1.35 MB pixel tensor at 336 px) is allocated among its frame's
    temporaries (the full frame, its stretched square and their arrays, 5-15 MB each). Once
    those are freed the results split the free space into pieces too small for the next
    frame's temporaries, so the heap grows: measured ~2 MB per frame on top of the results.
    `malloc_trim` releases the free pages (well under a millisecond).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc (musl, macOS) or no C library handle
        return None


def _load_gif(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler,
              max_pixels: int | None) -> Media:
    # Like the official loader, walk the frames once and keep those whose index was sampled:
    # repeated indices collapse, so a short GIF yields fewer frames than requested.
    with open_image(path, max_pixels) as gif:
        return _sample_animation(path, gif, num_frames, transform, sampler, lambda frame: frame.convert("RGB"))


def _sample_animation(path: str, animation: Image.Image, num_frames: int, transform: FrameTransform | None,
                      sampler: FrameSampler, to_rgb: Callable[[Image.Image], Image.Image]) -> Media:
    frames: list[Any] = []
    kept: list[int] = []
    duration_ms = 0
    with _pillow_damage_undecodable("the animation", seeking_frames=True):
        frame_count = animation.n_frames   # counting the frames reads them all
    wanted = set(sampler(frame_count, num_frames))
    for index, frame in enumerate(_animation_frames(animation)):
        duration_ms += frame.info.get("duration", 0) or 0
        if index in wanted:
            with _pillow_damage_undecodable("the animation"):
                rgb = to_rgb(frame)
            frames.append(_finish(rgb, transform, len(wanted)))
            kept.append(index)
            if transform is not None:
                _return_freed_memory()
    width, height = animation.size
    if not frames:
        raise ItemError(UNDECODABLE, "the animation has no readable frames")
    return Media(path, MediaType.GIF, frames, kept, width, height,
                 duration_ms / 1000 if duration_ms else None, "pillow")




def open_image(path: str, max_pixels: int | None) -> Image.Image:
    """Open an image (lazily: its size is known, no pixel is decoded), refusing one above `max_pixels`."""
    with _PILLOW_LIMIT:   # Pillow's limit is a module global: set it aside for this open only
        pillows, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            with _pillow_damage_undecodable("the image"):   # a header cut short ("Truncated File Read")
                image = Image.open(path)
        except UnidentifiedImageError:
            raise ItemError(UNDECODABLE, "not an image: Pillow recognises no image format in its bytes") from None
        finally:
            Image.MAX_IMAGE_PIXELS = pillows
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        raise ItemError(TOO_LARGE, f"image too large: {width}x{height} = {width * height / 1e6:.3g} Mpx, above the "
                         f"{max_pixels / 1e6:.3g} Mpx limit (--max-image-pixels)")
    return image


@contextlib.contextmanager
def _pillow_damage_undecodable(what: str, seeking_frames: bool = False) -> Iterator[None]:
    """Pillow's ways of saying the data is cut short or damaged, as an undecodable item. OSError without an
    errno ("image file is truncated"; one with an errno is the file's reading failing: unreadable, as the
    caller classes it) and SyntaxError are its own. With `seeking_frames` (counting or walking an
    animation's frames, and nothing of ours inside), also IndexError, EOFError and struct.error: reading past
    the end of a cut GIF while seeking its frames, with words ("index out of range", "unpack_from requires a
    buffer of at least 2 bytes") that say nothing to whoever reads the row."""
    cut_while_seeking = (IndexError, EOFError, struct.error) if seeking_frames else ()
    try:
        yield
    except UnidentifiedImageError:   # an OSError without an errno too: the caller says it its own way
        raise
    except (OSError, SyntaxError) as error:
        if isinstance(error, OSError) and error.errno is not None:
            raise
        raise ItemError(UNDECODABLE, f"{what} is damaged or cut short ({plain_message(error)})") from None
    except cut_while_seeking:
        raise ItemError(UNDECODABLE, f"{what} is cut short: its data ends inside a frame") from None


def _animation_frames(animation: Image.Image) -> Iterator[Image.Image]:
    """The frames in order, Pillow's damage as undecodable (only Pillow's seeking is inside: the caller's own
    work on each frame is not)."""
    with _pillow_damage_undecodable("the animation", seeking_frames=True):
        yield from ImageSequence.Iterator(animation)


def _read_reduced_if_huge(image: Image.Image) -> None:
    """Have a huge JPEG decoded at the smallest reduction (1/2, 1/4, 1/8) that brings it to DRAFT_TO_PIXELS."""
    width, height = image.size
    if image.format not in ("JPEG", "MPO") or width * height <= DRAFT_ABOVE_PIXELS:   # MPO: a JPEG with more pictures
        return
    scale = next((scale for scale in (2, 4, 8) if width * height / scale**2 <= DRAFT_TO_PIXELS), 8)
    image.draft(image.mode, (width // scale, height // scale))   # Pillow reduces by size // requested


# Formats whose extra frames are an animation. A JPEG holding more pictures (MPO: a camera's
# preview, a phone's HDR gain map or depth map) and a multi-page TIFF are still images.
_ANIMATED_FORMATS = frozenset({"GIF", "PNG", "WEBP"})


def _load_image(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler,
                max_pixels: int | None) -> Media:
    """A still image; an animated one (WebP, APNG) is sampled like a GIF (its rows say media_type "gif")."""
    with open_image(path, max_pixels) as image:
        with _pillow_damage_undecodable("the image", seeking_frames=True):   # a GIF under another name: counted
            animated = image.format in _ANIMATED_FORMATS and getattr(image, "n_frames", 1) > 1
        if animated:
            return _sample_animation(path, image, num_frames, transform, sampler, _animation_frame_rgb)
        stored = image.size
        with _pillow_damage_undecodable("the image"):
            _read_reduced_if_huge(image)
            swapped = image.getexif().get(_EXIF_ORIENTATION) in _SWAPPING_ORIENTATIONS
            ImageOps.exif_transpose(image, in_place=True)  # in place: a large photo is not held twice
            frame = _to_rgb(image)
    width, height = reversed(stored) if swapped else stored   # as displayed, at full size
    return Media(path, MediaType.IMAGE, [_finish(frame, transform, 1)], [0], width, height, None, "pillow")


def _animation_frame_rgb(frame: Image.Image) -> Image.Image:
    # A copy, not in place: an APNG's next frame is drawn over this one.
    return _to_rgb(ImageOps.exif_transpose(frame))


_SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16B", "I;16L", "I"})
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as a viewer shows it; ordinary 8-bit images are exactly `image.convert("RGB")`, as upstream.

    Where upstream's plain conversion is wrong, this does what a viewer shows: 16-bit grey
    levels are scaled to 8 bits (Pillow's conversion clips them, which turns most photos white;
    32-bit levels are taken as 16-bit ones, clipped to 0-65535); transparent pixels (an alpha
    band, a transparent palette entry or colour key) are composited over white (a plain
    conversion reveals whatever colour hides under them). CMYK, palette and greyscale images
    are converted as Pillow does.
    """
    if image.mode in _SIXTEEN_BIT_GREY:
        import numpy as np

        levels = np.clip(np.asarray(image, dtype=np.int64), 0, 0xFFFF) >> 8
        return Image.fromarray(levels.astype(np.uint8), mode="L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
