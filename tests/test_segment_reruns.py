"""Running `--segments` again over its output: a video whose rows are all stored, from the same version of the
file, is cut as its rows say without being opened again; a changed or half-done video is read again."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from segment_media import write_numbered_video
from tarsier_batch.cli import app
from tarsier_batch.inputs.sources import MediaItem, row_id_of, with_span
from tarsier_batch.media import MediaType, Span
from tarsier_batch.outputs.resume import plan_run, stored_spans
from tarsier_batch.outputs.store import StoredRows

runner = CliRunner()


def caption(*args: str):
    return runner.invoke(app, ["caption", *args, "--max-new-tokens", "4"])


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own cache of scene cuts, which a test empties to show that the rows alone decide."""
    monkeypatch.setenv("TARSIER_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()


def garble_keeping_version(path: Path) -> None:
    """Make `path` undecodable with its size and modification time unchanged: the same version to a run, which
    fails on any read of its frames or length."""
    before = path.stat()
    path.write_bytes(b"\0" * before.st_size)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def captioned_in_windows(model: Path, folder: Path, seconds: float) -> tuple[Path, Path, list[str]]:
    """A `seconds`-long video captioned in 10 s windows: the video, the output, and the command's arguments."""
    video = write_numbered_video(folder / "clip.mp4", seconds)
    out = folder / "out.parquet"
    args = [str(video), "--segments", "fixed:10s", "--model", str(model), "-o", str(out)]
    done = caption(*args)
    assert done.exit_code == 0, done.output
    return video, out, args


def test_a_rerun_over_finished_windows_reads_no_video(tiny_model_dir: Path, tmp_path: Path) -> None:
    video, out, args = captioned_in_windows(tiny_model_dir, tmp_path, 45)
    assert [(row["segment"], row["num_segments"], row["end_s"]) for row in rows_of(out)] == \
        [(number, 5, min(10.0 * number + 10, 45.0)) for number in range(5)]
    garble_keeping_version(video)
    again = caption(*args)
    assert again.exit_code == 0, again.output
    assert "captioned 0; failed 0; done earlier 5;" in again.output
    assert "warning" not in again.output


def test_an_output_whose_rows_do_not_count_segments_gets_the_counts_on_its_next_run(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    video, out, args = captioned_in_windows(tiny_model_dir, tmp_path, 25)
    uncounted = pq.read_table(out).drop_columns(["num_segments"])   # as written before rows counted them
    pq.write_table(uncounted, out)
    counted = caption(*args)   # reads the video's length again, and writes the counts
    assert "captioned 0; failed 0; done earlier 3;" in counted.output and "unchanged" not in counted.output
    assert [row["num_segments"] for row in rows_of(out)] == [3, 3, 3]
    garble_keeping_version(video)
    again = caption(*args)
    assert again.exit_code == 0 and "captioned 0; failed 0; done earlier 3;" in again.output, again.output
    assert "(3 rows, unchanged)" in again.output


def test_a_do_nothing_rerun_reports_the_wall_time_of_its_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    _, _, args = captioned_in_windows(tiny_model_dir, tmp_path, 25)
    before = time.perf_counter()
    again = caption(*args)
    measured_s = time.perf_counter() - before
    assert "captioned 0; failed 0; done earlier 3;" in again.output, again.output
    hours, minutes, seconds = re.search(r"wall time (\d+):(\d\d):(\d\d);", again.output).groups()
    reported_s = 3600 * int(hours) + 60 * int(minutes) + int(seconds)
    # From the process's start (this one's, the test's: in it the command runs), so more than the run itself.
    assert reported_s > 0 and reported_s >= round(measured_s)


def test_a_rerun_over_finished_scenes_reads_no_video_and_still_counts_those_without_a_cut(
        tiny_model_dir: Path, tmp_path: Path, own_cache: Path) -> None:
    shots = write_numbered_video(tmp_path / "shots.mp4", 20, scene_s=4)
    uncut = write_numbered_video(tmp_path / "lecture.mp4", 40, fps=5)
    out = tmp_path / "out.parquet"
    args = [str(shots), str(uncut), "--segments", "scenes", "--model", str(tiny_model_dir), "-o", str(out)]
    first = caption(*args)
    assert first.exit_code == 0, first.output
    assert "no scene cut 1 video" in first.output
    assert [(Path(row["path"]).name, row["num_segments"]) for row in rows_of(out)] == \
        [("shots.mp4", 5)] * 5 + [("lecture.mp4", 2)] * 2
    shutil.rmtree(own_cache)   # the cuts kept beside the detector: gone, so only the rows can tell them
    garble_keeping_version(shots)
    garble_keeping_version(uncut)
    again = caption(*args)
    assert again.exit_code == 0, again.output
    assert "captioned 0; failed 0; done earlier 7;" in again.output
    assert "no scene cut 1 video: split evenly into parts of at most 30 s;" in again.output


def test_a_changed_video_is_cut_again_from_what_it_holds_now(tiny_model_dir: Path, tmp_path: Path) -> None:
    video, out, args = captioned_in_windows(tiny_model_dir, tmp_path, 30)
    assert len(rows_of(out)) == 3
    write_numbered_video(video, 45)   # longer now: its stored windows are the first three of five
    again = caption(*args)
    assert again.exit_code == 0, again.output
    assert "captioned 5; failed 0;" in again.output, again.output
    rows = rows_of(out)
    assert [(row["start_s"], row["end_s"], row["num_segments"]) for row in rows] == \
        [(10.0 * number, min(10.0 * number + 10, 45.0), 5) for number in range(5)]
    assert len({row["key"].split("#")[0] for row in rows}) == 1


def test_the_windows_of_a_changed_video_that_it_no_longer_has_leave_the_output(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    video, out, args = captioned_in_windows(tiny_model_dir, tmp_path, 45)
    write_numbered_video(video, 25)   # shorter now: 0-10 and 10-20 again, 20-25 in place of 20-30, 30-40, 40-45
    planned = caption(*args, "--dry-run")
    assert f"drop\t{video}#t=40,45\tits file changed and is cut anew" in planned.output, planned.output
    again = caption(*args)
    assert again.exit_code == 0 and "captioned 3; failed 0;" in again.output, again.output
    assert [(row["start_s"], row["end_s"], row["num_segments"]) for row in rows_of(out)] == \
        [(0.0, 10.0, 3), (10.0, 20.0, 3), (20.0, 25.0, 3)]


def test_a_video_left_half_done_by_limit_gets_exactly_its_missing_windows(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    video = write_numbered_video(tmp_path / "clip.mp4", 45)
    common = [str(video), "--segments", "fixed:10s", "--model", str(tiny_model_dir)]
    reference = tmp_path / "reference.parquet"
    assert caption(*common, "-o", str(reference)).exit_code == 0
    out = tmp_path / "out.parquet"
    assert caption(*common, "--limit", "2", "-o", str(out)).exit_code == 0
    assert len(rows_of(out)) == 2
    rest = caption(*common, "-o", str(out))
    assert "captioned 3; failed 0; done earlier 2;" in rest.output, rest.output
    stable = ["path", "key", "segment", "num_segments", "start_s", "end_s", "caption", "frame_indices"]
    assert [{name: row[name] for name in stable} for row in rows_of(out)] == \
        [{name: row[name] for name in stable} for row in rows_of(reference)]


def window_rows(path: str, key: str, spans: list[Span], count: int | None = None) -> list[dict]:
    return [{"path": path, "key": with_span(key, span), "segment": number, "start_s": span.start_s,
             "end_s": span.end_s, "num_segments": len(spans) if count is None else count}
            for number, span in enumerate(spans)]


def test_stored_spans_are_a_videos_only_when_every_one_of_its_version_is_stored() -> None:
    spans = [Span(0.0, 10.0), Span(10.0, 20.0), Span(20.0, 25.0)]
    video = MediaItem("a.mp4", MediaType.VIDEO, key="a.mp4|100|7")
    whole = window_rows("a.mp4", "a.mp4|100|7", spans)
    assert stored_spans([video], whole) == {"a.mp4": spans}
    assert stored_spans([video], whole[::-1]) == {"a.mp4": spans}   # in segment order, whatever the rows' order
    assert stored_spans([video], whole[:2]) == {}                 # the last window missing: a stopped run's
    assert stored_spans([video], whole[1:]) == {}                 # the first one missing
    assert stored_spans([video], window_rows("a.mp4", "a.mp4|100|7", spans[:2], count=3)) == {}
    assert stored_spans([video], window_rows("a.mp4", "a.mp4|101|8", spans)) == {}    # another version
    assert stored_spans([MediaItem("a.mp4", MediaType.VIDEO)], whole) == {}           # no version to trust
    assert stored_spans([video], [{**row, "num_segments": None} for row in whole]) == {}   # an earlier output
    other = MediaItem("b.mp4", MediaType.VIDEO, key="b.mp4|100|7")
    assert stored_spans([video, other], whole + window_rows("b.mp4", "b.mp4|100|7", spans[:1])) == \
        {"a.mp4": spans, "b.mp4": spans[:1]}


def test_a_videos_rows_follow_what_each_run_can_cut_it_into(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Unreadable, then readable, then unreadable again (each a new version): each run's rows of the video take
    the place of the earlier run's, never beside them."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(np.random.default_rng(0).bytes(5000))
    out = tmp_path / "out.parquet"
    args = [str(video), "--segments", "fixed:10s", "--model", str(tiny_model_dir), "-o", str(out)]

    def spans() -> list[tuple]:
        return [(row["segment"], row["num_segments"], row["start_s"], row["end_s"], row["error"] is None)
                for row in rows_of(out)]

    assert caption(*args).exit_code == 1
    assert spans() == [(None, None, None, None, False)]   # its length unread: the whole file, failed
    write_numbered_video(video, 25)
    planned = caption(*args, "--dry-run")
    assert f"drop\t{video}\tits file is cut into segments now" in planned.output, planned.output
    readable = caption(*args)
    assert readable.exit_code == 0 and "captioned 3; failed 0;" in readable.output, readable.output
    assert spans() == [(0, 3, 0.0, 10.0, True), (1, 3, 10.0, 20.0, True), (2, 3, 20.0, 25.0, True)]
    video.write_bytes(np.random.default_rng(1).bytes(6000))
    planned = caption(*args, "--dry-run")
    assert f"drop\t{video}#t=20,25\tits file changed and is captioned whole" in planned.output, planned.output
    assert caption(*args).exit_code == 1
    assert spans() == [(None, None, None, None, False)]


def test_a_video_whose_length_cannot_be_read_now_keeps_only_the_segments_of_its_version() -> None:
    spans = [Span(0.0, 10.0), Span(10.0, 20.0)]
    video = MediaItem("a.mp4", MediaType.VIDEO, key="a.mp4|100|7")   # left whole by --segments this run

    def planned(rows: list[dict]):
        stored = StoredRows(rows={row_id_of(row): {**row, "error": None} for row in rows})
        return plan_run([video], stored, exists=lambda path: True)

    same_version = planned(window_rows("a.mp4", "a.mp4|100|7", spans))   # its length timed out this time
    assert [row_id_of(row) for row in same_version.kept] == ["a.mp4#t=0,10", "a.mp4#t=10,20"]
    assert same_version.superseded == {}
    older = planned(window_rows("a.mp4", "a.mp4|90|5", spans))
    assert older.kept == [] and list(older.superseded) == ["a.mp4#t=0,10", "a.mp4#t=10,20"]
    # A manifest's span of a video this run cuts into segments is the manifest's: kept.
    listed = {"path": "a.mp4", "key": "a.mp4|100|7#t=3,4", "start_s": 3.0, "end_s": 4.0, "num_segments": None}
    cut = replace(video, span=spans[0], segment=0, num_segments=1)
    plan = plan_run([cut], StoredRows(rows={"a.mp4#t=3,4": {**listed, "error": None}}), exists=lambda path: True)
    assert [row_id_of(row) for row in plan.kept] == ["a.mp4#t=3,4"] and plan.superseded == {}
