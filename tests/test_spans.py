"""A span of a video is sampled as if it were the whole file: the official formula over the frames that start
within it, by decord and by PyAV alike (checked by the number each decoded frame carries in its pixels)."""

from __future__ import annotations

import os
from pathlib import Path

import av
import numpy as np
import pytest

from segment_media import frame_number, write_numbered_video
from tarsier_batch.errors import UNDECODABLE, ItemError
from tarsier_batch.media import (
    MediaType,
    Span,
    frame_indices,
    frame_indices_without_repeats,
    load_media,
    video_timeline,
)
from tarsier_batch.media.decord_video import load_video_decord
from tarsier_batch.media.pyav_video import load_video_pyav


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """65 s at 10 fps: frame i starts at i / 10 s."""
    return write_numbered_video(tmp_path_factory.mktemp("spans") / "numbered.mp4", 65)


def decoded(path: Path, decoder: str, span: Span | None, frames: int = 8, sampler=frame_indices):
    load = load_video_decord if decoder == "decord" else load_video_pyav
    media = load(str(path), os.path.abspath(path), frames, None, sampler, span)
    assert media.decoder == decoder
    return media


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
@pytest.mark.parametrize(("span", "first", "count"), [
    (Span(10, 20), 100, 100),      # frames 100..199
    (Span(12.34, 17.0), 124, 46),  # a start between frames: the first frame that starts within it
    (Span(60, 70), 600, 50),       # past the end: clipped to the last frame
    (Span(0, 0.25), 0, 3),         # shorter than the frames asked: v1 repeats frames
])
def test_a_span_samples_the_official_indices_within_it(video: Path, decoder: str, span: Span, first: int,
                                                        count: int) -> None:
    media = decoded(video, decoder, span)
    expected = [first + index for index in frame_indices(count, 8)]
    assert media.frame_indices == expected
    assert [frame_number(frame) for frame in media.frames] == expected   # the pixels are those frames'
    assert media.duration_s == pytest.approx(65.0)   # the file's facts stay the file's


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_tarsier2_sampling_within_a_short_span_gives_each_frame_once(video: Path, decoder: str) -> None:
    media = decoded(video, decoder, Span(30, 30.5), frames=16, sampler=frame_indices_without_repeats)
    assert media.frame_indices == [300, 301, 302, 303, 304]
    assert [frame_number(frame) for frame in media.frames] == media.frame_indices


def test_the_whole_file_as_a_span_samples_what_no_span_samples(video: Path) -> None:
    assert decoded(video, "decord", Span(0, 65)).frame_indices == decoded(video, "decord", None).frame_indices


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_a_span_after_the_end_is_an_error_of_its_own(video: Path, decoder: str) -> None:
    with pytest.raises(ItemError, match=r"no frame in 70-80 s: the video's frames start between 0 and 64.9 s") as error:
        if decoder == "decord":
            load_media(str(video), MediaType.VIDEO, 8, span=Span(70, 80))
        else:   # PyAV's failure is the decoder's own (load_media would then say both)
            load_video_pyav(str(video), os.path.abspath(video), 8, None, frame_indices, Span(70, 80))
    assert error.value.kind == UNDECODABLE


def test_a_span_applies_to_videos_only(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "still.png")
    with pytest.raises(ItemError, match="applies to videos only"):
        load_media(str(tmp_path / "still.png"), MediaType.IMAGE, 8, span=Span(0, 1))


def test_a_span_must_run_forwards_from_zero() -> None:
    for start, end in [(-1, 2), (5, 5), (6, 5)]:
        with pytest.raises(ValueError):
            Span(start, end)


def test_windows_decoded_one_after_another_from_one_open_video_equal_each_decoded_fresh(video: Path) -> None:
    """A thread keeps the video it decodes spans of open (opening reads the whole index): what it gives for a
    window does not depend on which window it decoded before."""
    from tarsier_batch.media import span_cache

    windows = [Span(start, start + 10) for start in (0, 10, 30, 20, 50)]
    in_order = [load_media(str(video), MediaType.VIDEO, 8, span=window).frames for window in windows]
    assert span_cache.spans_video.kept[0][0] == os.path.abspath(video)   # kept open between them
    for window, frames in zip(windows, in_order):
        span_cache.spans_video.kept = span_cache.spans_packets.kept = span_cache.spans_reading.kept = None
        fresh = load_media(str(video), MediaType.VIDEO, 8, span=window).frames
        assert all(np.array_equal(np.asarray(one), np.asarray(other)) for one, other in zip(frames, fresh))


def same_pixels(ours: list, theirs: list) -> bool:
    return len(ours) == len(theirs) and all(np.array_equal(np.asarray(one), np.asarray(other))
                                            for one, other in zip(ours, theirs))


def test_spans_are_decoded_by_pyav_where_it_gives_decords_frames(video: Path) -> None:
    """decord reads ahead of each frame it seeks to (up to the rest of the file: memory and time at each of a long
    video's windows' seeks); PyAV reads only a span's stretch. Where PyAV gives the video decord's pixels, it
    decodes the spans, sampling them by decord's frame times: the same frames, the same pixels."""
    for window in [Span(0, 10), Span(12.34, 17.0), Span(60, 70), Span(0, 0.25)]:
        ours = load_media(str(video), MediaType.VIDEO, 8, span=window)
        theirs = decoded(video, "decord", window)
        assert ours.decoder == "pyav"
        assert ours.frame_indices == theirs.frame_indices and same_pixels(ours.frames, theirs.frames)


def test_a_video_whose_pixels_pyav_converts_otherwise_keeps_decord_for_its_spans(tmp_path: Path) -> None:
    ten_bit = tmp_path / "ten-bit.mp4"
    with av.open(str(ten_bit), "w") as output:   # noise: flat colours convert alike in both
        stream = output.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p10le"
        noise = np.random.default_rng(0)
        for _ in range(200):
            picture = noise.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            output.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        output.mux(stream.encode())
    window = Span(5, 15)
    by_decord = decoded(ten_bit, "decord", window)
    by_pyav = decoded(ten_bit, "pyav", window)
    # The premise: 10-bit H.264 comes out of the two decoders' RGB conversions differently.
    assert by_pyav.frame_indices == by_decord.frame_indices and not same_pixels(by_pyav.frames, by_decord.frames)
    ours = load_media(str(ten_bit), MediaType.VIDEO, 8, span=window)
    assert ours.decoder == "decord" and same_pixels(ours.frames, by_decord.frames)


def test_pyav_decodes_a_late_window_from_the_keyframe_before_it(video: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long video's windows each cost about their own length: a window near the end is not decoded from the
    # file's start (which made a file's windows together cost its length squared).
    from tarsier_batch.media import pyav_video

    counted = []
    real = pyav_video.decoded_frames

    def counting(container, stream):
        for frame in real(container, stream):
            counted.append(frame.pts)
            yield frame

    monkeypatch.setattr(pyav_video, "decoded_frames", counting)
    late = decoded(video, "pyav", Span(60, 64))
    assert [frame_number(frame) for frame in late.frames] == late.frame_indices == \
        [600 + index for index in frame_indices(40, 8)]
    # The window, and at most one group of pictures before it (libx264's default: 250 frames), not 640 frames.
    assert 0 < len(counted) <= 40 + 250


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 s of frames at 10 fps whose timestamps jump by 10 minutes after 30 s (a paused recording)."""
    return write_numbered_video(tmp_path_factory.mktemp("paused") / "paused.mp4", 60, jump=(30, 600))


def test_timestamps_that_jump_are_counted_in_frames(paused: Path) -> None:
    timeline = video_timeline(str(paused))
    assert timeline.by_frames and timeline.duration_s == 60.0
    assert timeline.starts == [index / 10 for index in range(600)]
    regular = video_timeline(str(write_numbered_video(paused.with_name("regular.mp4"), 6)))
    assert not regular.by_frames and regular.duration_s == pytest.approx(6.0)


@pytest.mark.parametrize("decoder", ["decord", "pyav"])
def test_a_span_of_a_video_whose_timestamps_jump_samples_by_frame_count(paused: Path, decoder: str) -> None:
    # 30-40 s in frames is frames 300-399, just after the jump (in timestamps, 630-640 s).
    media = decoded(paused, decoder, Span(30, 40))
    assert media.frame_indices == [300 + index for index in frame_indices(100, 8)]
    assert [frame_number(frame) for frame in media.frames] == media.frame_indices
