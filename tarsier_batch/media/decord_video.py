"""Video through decord, the official loaders' decoder: the sampled frames, one decoder run at a time."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from PIL import Image

from .damage import held_duration, is_cut_short, warnings_of
from .failures import DecoderFailure, short_error
from .frames import FrameTransform, Media, finish_frame
from .kinds import MediaType
from .memory import return_freed_memory
from .sampling import FrameCount, FrameSampler, frames_for
from .span_cache import kept_for_spans, spans_video
from .timeline import Span, Timeline, reaches_end, sample_span, timeline_of


def decord_timeline(reader: Any) -> Timeline:
    """The timeline of a decord reader's frames (its timestamps by frame index: stream order)."""
    stamps = reader.get_frame_timestamp(range(len(reader)))
    timeline = timeline_of(stamps[:, 0].tolist(), reader.get_avg_fps() or None)
    if timeline.by_frames:
        return timeline
    # decord knows each frame's end: the length runs to the last frame's.
    return replace(timeline, duration_s=float(stamps[:, 1].max() - stamps[:, 0].min()))


def decord_held_duration(reader: Any) -> float | None:
    """How long a decord reader's frames run (`damage.held_duration`), by the start and end times it gives each
    (an end at the start: a length not stored)."""
    stamps = reader.get_frame_timestamp(range(len(reader)))
    return held_duration(stamps[:, 0].tolist(), (stamps[:, 1] - stamps[:, 0]).tolist())


class OpenVideo:
    """A video open with decord, and what sampling needs of it: frame count, keyframes, rate, frame start times; and
    how long its frames run (`decord_held_duration`)."""

    def __init__(self, source: str, with_starts: bool = False):
        import decord

        self.reader = decord.VideoReader(source, num_threads=1, ctx=decord.cpu(0))
        self.total = len(self.reader)
        self.keyframes = [int(key) for key in self.reader.get_key_indices()]
        self.fps = self.reader.get_avg_fps()
        self.starts = decord_timeline(self.reader).starts if with_starts and self.total else []
        self.held_s = decord_held_duration(self.reader) if self.total else None


def load_video_decord(path: str, source: str, num_frames: FrameCount, transform: FrameTransform | None,
                      sampler: FrameSampler, span: Span | None = None, declared_s: float | None = None) -> Media:
    """The sampled frames (within `span`), decoded by decord; `cut_short` where its frames run shorter than the
    `declared_s` of the container (both from the first frame). decord says nothing of packets that fail to decode:
    it fails, or its FFmpeg conceals the damage unseen."""
    import decord

    decord.logging.set_level(decord.logging.QUIET)  # FFmpeg's own messages would garble the display
    with decord_failures():
        opened = OpenVideo(source) if span is None else \
            kept_for_spans(spans_video, source, lambda: OpenVideo(source, with_starts=True))
    reader, total, keyframes, fps, starts = opened.reader, opened.total, opened.keyframes, opened.fps, opened.starts
    if total < 1:
        raise DecoderFailure("no frames")
    rate = fps or None   # decord's average rate, as the official loaders read it (0: unknown)
    indices = sample_span(starts, span, num_frames, sampler, rate) if span else \
        sampler(total, frames_for(num_frames, total, rate))
    # decord's get_batch on the whole index list decodes each distinct index in order (seeking
    # unless the reader can simply decode forward to it) and copies repeats. Calling it with
    # one index at a time, in the same order, runs the same decoder steps (plus a seek between
    # runs, where get_batch seeks anyway), so the pixels are the same; but only the frames of
    # one run exist at full resolution at a time, instead of all of them.
    done: dict[int, Any] = {}
    width = height = 0
    for run in _decoder_runs(sorted(set(indices)), keyframes, total):
        with decord_failures():
            arrays = [(index, _video_frame(reader, index)) for index in run]
        height, width = arrays[0][1].shape[:2]
        _stop_read_ahead(reader)
        arrays.reverse()
        while arrays:  # popping frees each full-size frame once it is transformed
            index, array = arrays.pop()
            # fromarray copies: an RGB image
            done[index] = finish_frame(Image.fromarray(array), transform, len(indices))
            del array  # otherwise alive while the next run decodes
            if transform is not None:
                return_freed_memory()
    frames = [done[index] for index in indices]  # a repeated index reuses its result, as get_batch copies it
    cut_short = is_cut_short(opened.held_s, total, declared_s, reaches_end(starts, span))
    return Media(path, MediaType.VIDEO, frames, indices, width, height, total / fps if fps > 0 else None, "decord",
                 warnings_of(cut_short, None), fps=rate)


@contextlib.contextmanager
def decord_failures() -> Iterator[None]:
    """decord's errors as a `DecoderFailure`; nothing else is caught (no MemoryError, no caller's error)."""
    import decord

    try:
        yield
    except (RuntimeError, decord.DECORDError) as error:
        raise DecoderFailure(short_error(error)) from error
    except UnicodeEncodeError:  # decord hands the path to C as UTF-8: a name that is not UTF-8 cannot reach it
        raise DecoderFailure("the file name is not UTF-8") from None


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
