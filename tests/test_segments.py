"""`--segments`: the spec's grammar, and the windows a fixed spec gives a video of a known length."""

from __future__ import annotations

import pytest

from tarsier_batch.inputs.segments import Segmenting, SegmentsError, VideoFacts, parse_duration
from tarsier_batch.media import Span
from tarsier_batch.outputs.resume import SettingsMismatchError, check_settings


def spans(spec: str, duration_s: float) -> list[tuple[float, float]]:
    return [(span.start_s, span.end_s) for span in Segmenting.parse(spec).fixed_spans(duration_s)]


def test_ten_second_windows_of_a_65_second_video_are_seven_rows() -> None:
    assert spans("fixed:10s", 65) == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60), (60, 65)]


def test_a_tail_shorter_than_min_joins_the_window_before_it() -> None:
    assert spans("fixed:10s", 61.5) == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 61.5)]
    assert spans("fixed:10s,min=6s", 65)[-1] == (50, 65)
    assert spans("fixed:10s,min=0", 60.1)[-1] == (60, 60.1)


def test_overlapping_windows_start_window_minus_overlap_apart() -> None:
    assert spans("fixed:10s,overlap=2s", 25) == [(0, 10), (8, 18), (16, 25)]
    assert spans("fixed:10s,overlap=4s", 22) == [(0, 10), (6, 16), (12, 22)]


def test_a_video_shorter_than_one_window_is_one_row() -> None:
    assert spans("fixed:10s", 4.2) == [(0, 4.2)]
    assert spans("fixed:10s", 10) == [(0, 10)]


def test_every_window_is_a_span_of_the_video() -> None:
    windows = Segmenting.parse("fixed:7s,overlap=1.5s,min=3s").fixed_spans(3600)
    assert all(isinstance(window, Span) and window.end_s <= 3600 for window in windows)
    assert windows[-1] == Span(3597, 3600) and len(windows) == 655   # starts 5.5 s apart; the 3 s tail is kept


@pytest.mark.parametrize(("text", "seconds"), [("10", 10), ("10s", 10), ("2.5s", 2.5), ("1m30s", 90), ("1h", 3600),
                                               ("1h2m3s", 3723)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "10x", "-1s", "1m1h", "ten"])
def test_what_is_not_a_duration_says_so(text: str) -> None:
    with pytest.raises(SegmentsError, match="is not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "message"), [
    ("fixed", "give the window's length"),
    ("fixed:0s", "longer than 0 s"),
    ("fixed:10s,overlap=10s", "shorter than the window"),
    ("fixed:10s,step=2s", "is not one of overlap=, min="),
    ("fixed:10s,max=20s", "is not one of overlap=, min="),
    ("windows:10s", "give whole, fixed:10s"),
    ("whole:3", "takes nothing more"),
    ("scenes:3", "scenes takes no ':LENGTH'"),
    ("scenes,threshold=high", "is not a number"),
    ("scenes,threshold=0", "must be above 0"),
    ("scenes,max=0s", "longer than 0 s \\(max=none keeps shots whole\\)"),
    ("scenes,max=off", "is not a duration"),
    ("scenes,overlap=2s", "is not one of threshold=, min=, max="),
])
def test_a_bad_spec_says_what_is_allowed(text: str, message: str) -> None:
    """...after the setting and the value given, whichever part of the spec is wrong."""
    with pytest.raises(SegmentsError, match=message) as raised:
        Segmenting.parse(text)
    assert str(raised.value).startswith(f"segments {text!r}: ")


def test_the_canonical_spec_reads_back_as_the_same_segmenting() -> None:
    for text in ["whole", "fixed:10s", "fixed:1m,overlap=2.5s,min=0s", "scenes", "scenes,threshold=40,min=1s,max=30s",
                 "scenes,max=none"]:
        segmenting = Segmenting.parse(text)
        assert Segmenting.parse(str(segmenting)) == segmenting
    assert str(Segmenting.parse("fixed:10")) == "fixed:10s,overlap=0s,min=2s"
    assert str(Segmenting.parse("scenes")) == "scenes,threshold=27,min=0.5s,max=30s"
    assert str(Segmenting.parse("scenes,max=none")) == "scenes,threshold=27,min=0.5s,max=none"
    assert Segmenting("scenes").max_s == Segmenting.parse("scenes").max_s == 30   # in Python as on the command line


def test_shots_are_the_spans_between_cuts_and_long_ones_split_evenly() -> None:
    facts = VideoFacts(65.0, (4.0, 30.0, 64.0))
    assert [(span.start_s, span.end_s) for span in Segmenting.parse("scenes,max=none").spans(facts)] == \
        [(0, 4), (4, 30), (30, 64), (64, 65)]
    split = Segmenting.parse("scenes,max=10s").spans(facts)
    assert [(round(span.start_s, 6), round(span.end_s, 6)) for span in split] == \
        [(0, 4), (4, 12.666667), (12.666667, 21.333333), (21.333333, 30), (30, 38.5), (38.5, 47), (47, 55.5),
         (55.5, 64), (64, 65)]
    assert Segmenting.parse("scenes").spans(VideoFacts(12.0)) == [Span(0, 12)]   # no cut: one shot


def test_a_last_shot_shorter_than_min_joins_the_shot_before() -> None:
    # The detector keeps `min` between cuts only: a cut 0.1 s before the end would leave a 0.1 s shot.
    facts = VideoFacts(65.0, (4.0, 30.0, 64.9))
    assert [(span.start_s, span.end_s) for span in Segmenting.parse("scenes,max=none").spans(facts)] == \
        [(0, 4), (4, 30), (30, 65)]
    assert Segmenting.parse("scenes,min=0").spans(facts)[-1] == Span(64.9, 65)
    assert Segmenting.parse("scenes,min=2s").spans(VideoFacts(3.0, (1.5,))) == [Span(0, 3)]


def test_shots_are_at_most_30_seconds_by_default_a_video_without_a_cut_included() -> None:
    ten_minutes = Segmenting.parse("scenes").spans(VideoFacts(600.0))
    assert len(ten_minutes) == 20 and ten_minutes[0].start_s == 0 and ten_minutes[-1].end_s == 600
    assert all(abs(span.end_s - span.start_s - 30) < 1e-9 for span in ten_minutes)
    assert all(before.end_s == after.start_s for before, after in zip(ten_minutes, ten_minutes[1:]))
    assert [(span.start_s, span.end_s) for span in Segmenting.parse("scenes").spans(VideoFacts(65.0, (4.0, 30.0)))] \
        == [(0, 4), (4, 30), (30, 47.5), (47.5, 65)]
    assert Segmenting.parse("scenes,max=none").spans(VideoFacts(600.0)) == [Span(0, 600)]
    assert len(Segmenting.parse("scenes,max=1m").spans(VideoFacts(600.0))) == 10


def test_a_video_without_a_cut_is_told_when_longer_than_a_row_may_be() -> None:
    scenes, whole_shots = Segmenting.parse("scenes"), Segmenting.parse("scenes,max=none")
    assert scenes.found_no_cut(VideoFacts(70.0)) and whole_shots.found_no_cut(VideoFacts(70.0))
    cut_once = VideoFacts(70.0, (35.0,))
    assert not scenes.found_no_cut(cut_once) and not whole_shots.found_no_cut(cut_once)
    assert not scenes.found_no_cut(VideoFacts(20.0))   # one short shot: a row as any shot
    assert whole_shots.found_no_cut(VideoFacts(20.0))
    assert scenes.found_no_cut(VideoFacts(70.0, (0.0, 70.0)))   # cuts at its ends cut nothing
    assert scenes.without_cuts() == "split evenly into parts of at most 30 s"
    assert whole_shots.without_cuts() == "one row each"


def test_a_scenes_output_stored_before_the_default_longest_continues_only_with_shots_kept_whole() -> None:
    # Its rows are whole shots: continuing it with the default 30 s would put split shots beside them.
    stored = {"old.parquet": {"segments": "scenes,threshold=27,min=0.5s"}}
    with pytest.raises(SettingsMismatchError, match="max=none' there, 'scenes,threshold=27,min=0.5s,max=30s' now"):
        check_settings(stored, {"segments": str(Segmenting.parse("scenes"))})
    check_settings(stored, {"segments": str(Segmenting.parse("scenes,max=none"))})
    check_settings({"new.parquet": {"segments": "scenes,threshold=27,min=0.5s,max=30s"}},
                   {"segments": str(Segmenting.parse("scenes"))})
    with pytest.raises(SettingsMismatchError):
        check_settings({"split.parquet": {"segments": "scenes,threshold=27,min=0.5s,max=10s"}},
                       {"segments": str(Segmenting.parse("scenes"))})
