"""Rows below the file: a manifest's `start_s`/`end_s` give one file several rows, each captioning its span, each
identified by (path, span) through resume, streams, shards and merge."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from segment_media import write_numbered_video
from tarsier_batch.cli import app
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import frame_indices
from tarsier_batch.version import install_extra_command

runner = CliRunner()


def caption(*args: str):
    return runner.invoke(app, ["caption", *args, "--max-new-tokens", "4"])


@pytest.fixture(scope="module")
def tiny_tarsier2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tarsier2"), "tiny", seed=0, family="tarsier2")


@pytest.fixture(scope="module")
def long_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """65 s at 10 fps, a new scene every 4 s."""
    return write_numbered_video(tmp_path_factory.mktemp("segments") / "long.mp4", 65, scene_s=4)


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own cache: scene cuts kept by one test are not another's."""
    monkeypatch.setenv("TARSIER_BATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def manifest(folder: Path, rows: list[tuple]) -> Path:
    lines = ["path,start_s,end_s,id"] + [",".join("" if cell is None else str(cell) for cell in row) for row in rows]
    path = folder / "clips.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()


def test_each_span_is_a_row_sampled_within_it_and_a_second_run_has_nothing_to_do(
        long_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    listed = manifest(tmp_path, [(long_video, 0, 10, "a"), (long_video, 10, 20, "b"), (long_video, 60, 70, "c"),
                                 (long_video, None, None, "whole")])
    out = tmp_path / "out.parquet"
    args = ["--manifest", str(listed), "--keep-columns", "id", "--model", str(tiny_model_dir), "-o", str(out)]
    assert caption(*args).exit_code == 0
    rows = rows_of(out)
    assert [(row["id"], row["segment"], row["start_s"], row["end_s"]) for row in rows] == [
        ("a", 0, 0.0, 10.0), ("b", 1, 10.0, 20.0), ("c", 2, 60.0, 70.0), ("whole", None, None, None)]
    assert {row["path"] for row in rows} == {str(long_video)}   # the file's path: rows of one file group by it
    assert rows[0]["frame_indices"] == frame_indices(100, 8)
    assert rows[1]["frame_indices"] == [100 + index for index in frame_indices(100, 8)]
    assert rows[2]["frame_indices"] == [600 + index for index in frame_indices(50, 8)]   # clipped at the end
    assert rows[3]["frame_indices"] == frame_indices(650, 8)
    assert len({row["key"] for row in rows}) == 4 and rows[1]["key"].endswith("#t=10,20")
    assert all(row["error"] is None for row in rows)

    again = caption(*args)
    assert "captioned 0; failed 0; done earlier 4" in again.output

    # One more span: only it is captioned; the others stay as they were.
    listed = manifest(tmp_path, [(long_video, 0, 10, "a"), (long_video, 10, 20, "b"), (long_video, 60, 70, "c"),
                                 (long_video, None, None, "whole"), (long_video, 30, 40, "d")])
    more = caption(*args)
    assert "captioned 1; failed 0; done earlier 4" in more.output, more.output
    assert [row["id"] for row in rows_of(out)] == ["a", "b", "c", "whole", "d"]
    assert [row["elapsed_s"] for row in rows_of(out)[:4]] == [row["elapsed_s"] for row in rows]   # kept as stored


def cut(source: Path, first: int, stop: int, out: Path) -> Path:
    """Frames [first, stop) of `source` in a file of their own, losslessly (x264 at qp 0 keeps the decoded YUV)."""
    with av.open(str(source)) as container, av.open(str(out), "w") as output:
        stream = output.add_stream("libx264", rate=Fraction(10))
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.options = {"qp": "0"}
        for number, frame in enumerate(container.decode(video=0)):
            if first <= number < stop:
                frame.pts, frame.time_base = number - first, Fraction(1, 10)
                for packet in stream.encode(frame):
                    output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return out


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_tarsier2_dir"])
def test_a_span_is_captioned_as_its_frames_alone_are(long_video: Path, model: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    """The span's caption (greedy, float32) equals the caption of a file holding exactly its frames."""
    model_dir = request.getfixturevalue(model)
    alone = cut(long_video, 120, 200, tmp_path / "alone.mp4")   # 12-20 s
    listed = manifest(tmp_path, [(long_video, 12, 20, "span"), (alone, None, None, "alone")])
    out = tmp_path / "out.parquet"
    result = caption("--manifest", str(listed), "--keep-columns", "id", "--model", str(model_dir), "-o", str(out),
                     "--with-token-ids")
    assert result.exit_code == 0, result.output
    span, whole = rows_of(out)
    assert [index - 120 for index in span["frame_indices"]] == whole["frame_indices"]
    assert span["generated_ids"] == whole["generated_ids"] and span["caption"] == whole["caption"]
    assert span["prompt_tokens"] == whole["prompt_tokens"]


def test_spans_stream_in_order_and_shards_merge_back_per_span(long_video: Path, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    other = write_numbered_video(tmp_path / "other.mp4", 12)
    listed = manifest(tmp_path, [(long_video, 0, 10, "a"), (other, 0, 6, "b"), (long_video, 10, 20, "c"),
                                 (other, 6, 12, "d")])
    streamed = caption("--manifest", str(listed), "--keep-columns", "id", "--model", str(tiny_model_dir), "-o", "-",
                       "--quiet")
    assert streamed.exit_code == 0, streamed.output
    lines = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert [(line["id"], line["segment"], line["start_s"]) for line in lines] == \
        [("a", 0, 0.0), ("b", 0, 0.0), ("c", 1, 10.0), ("d", 1, 6.0)]

    for index in range(2):
        done = caption("--manifest", str(listed), "--keep-columns", "id", "--model", str(tiny_model_dir),
                       "--shard", f"{index}/2", "-o", str(tmp_path / "shards" / f"shard-{index}.parquet"))
        assert done.exit_code == 0, done.output
    shards = [rows_of(tmp_path / "shards" / f"shard-{index}.parquet") for index in range(2)]
    assert sorted(len(rows) for rows in shards) in ([0, 4], [2, 2])   # a file's segments stay in one shard
    merged = runner.invoke(app, ["merge", str(tmp_path / "shards"), "-o", str(tmp_path / "all.parquet")])
    assert merged.exit_code == 0, merged.output
    assert [row["id"] for row in rows_of(tmp_path / "all.parquet")] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("rows", "message"), [
    ([("{video}", 0, 10, "a"), ("{video}", 0, 10, "b")], "row 2 repeats the path and span of row 1"),
    ([("{video}", 10, 5, "a")], "row 1: start_s '10' and end_s '5' must be seconds"),
    ([("{video}", "soon", 5, "a")], "must be seconds"),
    ([("{image}", 0, 1, "a")], "a span, which applies to videos only"),
])
def test_a_manifest_with_bad_spans_stops_before_anything_loads(long_video: Path, tmp_path: Path, rows: list,
                                                               message: str) -> None:
    image = tmp_path / "still.png"
    image.write_bytes(b"")
    listed = manifest(tmp_path, [tuple(str(cell).format(video=long_video, image=image) for cell in row)
                                 for row in rows])
    result = caption("--manifest", str(listed), "--model", "demo", "-o", str(tmp_path / "out.parquet"))
    assert result.exit_code == 2 and message in result.output, result.output


def test_one_span_column_without_its_partner_is_refused(long_video: Path, tmp_path: Path) -> None:
    (tmp_path / "half.csv").write_text(f"path,start_s\n{long_video},3\n")
    result = caption("--manifest", str(tmp_path / "half.csv"), "--model", "demo", "-o", str(tmp_path / "o.parquet"))
    assert result.exit_code == 2 and "needs its partner" in result.output


# --- --segments fixed: windows cut from each video's length --------------------------------------------------

def test_fixed_windows_give_a_row_per_window_and_a_row_per_image_or_short_video(
        long_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    short = write_numbered_video(tmp_path / "short.mp4", 4)
    still = tmp_path / "still.png"
    Image.new("RGB", (32, 32), "red").save(still)
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    out = tmp_path / "out.parquet"
    args = [str(long_video), str(short), str(still), str(tmp_path / "broken.mp4"), "--segments", "fixed:10s",
            "--model", str(tiny_model_dir), "-o", str(out)]
    plan = caption(*args, "--dry-run")
    assert f"caption\t{long_video}#t=60,65\tnew" in plan.output and f"caption\t{short}#t=0,4\tnew" in plan.output
    done = caption(*args)
    assert done.exit_code == 1, done.output   # the broken file's row is an error
    rows = rows_of(out)
    windows = [row for row in rows if row["path"] == str(long_video)]
    assert [(row["segment"], row["start_s"], row["end_s"]) for row in windows] == \
        [(number, 10.0 * number, min(10.0 * number + 10, 65.0)) for number in range(7)]
    assert [row["frame_indices"] for row in windows] == \
        [[100 * number + index for index in frame_indices(100 if number < 6 else 50, 8)] for number in range(7)]
    by_path = {row["path"]: row for row in rows if row["path"] != str(long_video)}
    assert (by_path[str(short)]["segment"], by_path[str(short)]["end_s"]) == (0, 4.0)   # shorter than a window
    assert by_path[str(still)]["segment"] is None and by_path[str(still)]["error"] is None
    broken = by_path[str(tmp_path / "broken.mp4")]
    assert broken["segment"] is None and broken["error_kind"] == "undecodable"   # its length unknown: one row

    assert "captioned 0; failed 0; done earlier 10" in caption(*args).output   # the error row too
    changed = caption(*args[:-4], "--segments", "fixed:20s", "--model", str(tiny_model_dir), "-o", str(out))
    assert changed.exit_code == 2
    assert "segments 'fixed:10s,overlap=0s,min=2s' there, 'fixed:20s,overlap=0s,min=2s' now" in changed.output
    assert len(changed.output.strip().splitlines()) == 1


def test_a_bad_segments_spec_stops_at_once(tmp_path: Path) -> None:
    result = caption(str(tmp_path), "--segments", "fixed:10x", "--model", "demo", "-o", str(tmp_path / "o.parquet"))
    assert result.exit_code == 2 and "'10x' is not a duration" in result.output


@pytest.mark.kill
def test_kill_9_mid_file_then_rerun_captions_only_the_missing_windows(long_video: Path, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    from test_resume_cli import parts, start, wait_for

    args = [str(long_video), "--segments", "fixed:10s", "--model", str(tiny_model_dir), "--max-new-tokens", "4",
            "--batch-size", "1", "--flush-rows", "1", "--quiet"]
    reference = tmp_path / "reference.parquet"
    assert caption(*args[:-1], "-o", str(reference)).exit_code == 0
    out = tmp_path / "out.parquet"
    run = start([*args, "--out", str(out)])
    wait_for(lambda: parts(out) >= 3, run, "3 parts")
    run.kill()
    run.wait()
    saved = parts(out)
    assert 3 <= saved < 7
    again = caption(*args[:-1], "-o", str(out))
    assert f"captioned {7 - saved}; failed 0; done earlier {saved}" in again.output, again.output
    stable = ["path", "segment", "start_s", "end_s", "key", "caption", "frame_indices"]
    assert [{name: row[name] for name in stable} for row in rows_of(out)] == \
        [{name: row[name] for name in stable} for row in rows_of(reference)]


def test_questions_are_asked_of_each_window_and_the_long_layout_has_a_row_per_window_and_question(
        long_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "asked.parquet"
    args = [str(long_video), "--segments", "fixed:30s", "--model", str(tiny_model_dir), "--ask", "what=What?",
            "--ask", "who=Who?", "--long", "-o", str(out)]
    assert caption(*args).exit_code == 0
    rows = rows_of(out)
    assert [(row["segment"], row["question"]) for row in rows] == \
        [(0, "what"), (0, "who"), (1, "what"), (1, "who"), (2, "what"), (2, "who")]   # 0-30, 30-60, 60-65
    assert [row["end_s"] for row in rows[::2]] == [30.0, 60.0, 65.0]
    assert "captioned 0; failed 0; done earlier 3" in caption(*args).output


def test_windows_of_shards_merge_back_in_file_then_window_order(long_video: Path, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    other = write_numbered_video(tmp_path / "other.mp4", 25)
    common = [str(long_video), str(other), "--segments", "fixed:20s", "--model", str(tiny_model_dir)]
    for index in range(2):
        done = caption(*common, "--shard", f"{index}/2", "-o", str(tmp_path / "shards" / f"shard-{index}.parquet"))
        assert done.exit_code == 0, done.output
    merged = runner.invoke(app, ["merge", str(tmp_path / "shards"), "-o", str(tmp_path / "all.parquet")])
    assert merged.exit_code == 0, merged.output
    assert [(Path(row["path"]).name, row["segment"]) for row in rows_of(tmp_path / "all.parquet")] == \
        [("long.mp4", 0), ("long.mp4", 1), ("long.mp4", 2), ("long.mp4", 3), ("other.mp4", 0), ("other.mp4", 1)]
    whole = caption(*common, "-o", str(tmp_path / "all.parquet"))   # the merged file continues as one run's
    assert "captioned 0; failed 0; done earlier 6" in whole.output, whole.output


# --- --segments scenes: a row per shot --------------------------------------------------------------------

def test_scenes_are_found_at_the_cuts_and_each_samples_its_own_shot(long_video: Path, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """`long_video` changes colour every 4 s (40 frames): 17 shots, each cut found within a frame."""
    out = tmp_path / "shots.parquet"
    done = caption(str(long_video), "--segments", "scenes", "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 0, done.output
    rows = rows_of(out)
    assert len(rows) == 17
    assert all(abs(row["start_s"] - 4 * number) <= 0.1 for number, row in enumerate(rows))
    assert rows[-1]["end_s"] == 65.0
    for number, row in enumerate(rows[:-1]):   # frames of its own shot only: 40 * number up to 40 * number + 39
        assert 40 * number - 1 <= row["frame_indices"][0] and row["frame_indices"][-1] <= 40 * number + 40

    split = caption(str(long_video), "--segments", "scenes,max=3s", "--model", str(tiny_model_dir),
                    "-o", str(tmp_path / "split.parquet"))
    assert split.exit_code == 0 and len(rows_of(tmp_path / "split.parquet")) == 33   # 16 shots of 4 s in 2, 1 s


def test_a_threshold_no_cut_reaches_gives_one_shot(long_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.parquet"
    whole = caption(str(long_video), "--segments", "scenes,threshold=250,max=none", "--model", str(tiny_model_dir),
                    "-o", str(out))
    assert whole.exit_code == 0, whole.output
    assert [(row["segment"], row["start_s"], row["end_s"]) for row in rows_of(out)] == [(0, 0.0, 65.0)]
    assert "no scene cut 1 video: one row each;" in whole.output


@pytest.fixture(scope="module")
def uncut_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """70 s at 5 fps of one shot (a lecture, a dashcam): nothing for the detector to cut."""
    return write_numbered_video(tmp_path_factory.mktemp("uncut") / "lecture.mp4", 70, fps=5)


def spans_of(out: Path) -> list[tuple[int, float, float]]:
    return [(row["segment"], row["start_s"], row["end_s"]) for row in rows_of(out)]


def test_a_video_without_a_cut_is_split_into_rows_of_at_most_30_seconds_and_the_summary_says_so(
        uncut_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lecture.parquet"
    done = caption(str(uncut_video), "--segments", "scenes", "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 0, done.output
    spans = spans_of(out)
    assert [segment for segment, _, _ in spans] == [0, 1, 2]
    assert spans[0][1] == 0.0 and spans[-1][2] == 70.0
    assert all(end - start <= 30.0 for _, start, end in spans)
    assert all(before[2] == after[1] for before, after in zip(spans, spans[1:]))   # in order, nothing left out
    assert "no scene cut 1 video: split evenly into parts of at most 30 s;" in done.output
    frames = [row["frame_indices"] for row in rows_of(out)]   # each row samples its own third of the 350 frames
    assert frames[0][-1] < frames[1][0] and frames[1][-1] < frames[2][0] and frames[2][-1] <= 349


def test_a_longest_of_ones_own_or_none_is_kept(uncut_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    shorter = caption(str(uncut_video), "--segments", "scenes,max=10s", "--model", str(tiny_model_dir),
                      "-o", str(tmp_path / "ten.parquet"))
    assert shorter.exit_code == 0, shorter.output
    assert [(start, end) for _, start, end in spans_of(tmp_path / "ten.parquet")] == \
        [(10.0 * number, 10.0 * number + 10) for number in range(7)]
    assert "split evenly into parts of at most 10 s" in shorter.output
    whole = caption(str(uncut_video), "--segments", "scenes,max=none", "--model", str(tiny_model_dir),
                    "-o", str(tmp_path / "whole.parquet"))
    assert whole.exit_code == 0 and spans_of(tmp_path / "whole.parquet") == [(0, 0.0, 70.0)]
    # The longest is part of the output's settings: the default does not continue an output of whole shots.
    mixed = caption(str(uncut_video), "--segments", "scenes", "--model", str(tiny_model_dir),
                    "-o", str(tmp_path / "whole.parquet"))
    assert mixed.exit_code != 0 and "max=none' there" in mixed.output, mixed.output


def test_scenes_without_pyscenedetect_stop_at_once_with_the_install_line(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "scenedetect"
                        else real(name, *rest))
    result = caption(str(tmp_path), "--segments", "scenes", "--model", "demo", "-o", str(tmp_path / "o.parquet"))
    assert result.exit_code == 2
    assert f"needs PySceneDetect: {install_extra_command('scenes')}" in result.output


def test_a_fresh_segmented_run_loads_its_model_while_the_videos_are_probed(long_video: Path, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    # Nothing stored: the model is wanted whatever the probe finds, so it loads before the run has cut its videos
    # (while the workers read them). A run continuing an output loads only once its plan is known: it may have
    # nothing left to do.
    from tarsier_batch import CaptionRun, CaptionSettings, RunSettings, SamplingParams
    from tarsier_batch.inputs.segments import Segmenting
    from tarsier_batch.run import load_captioner

    runs: list[CaptionRun] = []
    cut_when_loading: list[bool] = []

    def load(settings: CaptionSettings):
        cut_when_loading.append(runs[-1]._segmented)
        return load_captioner(settings)

    settings = RunSettings(CaptionSettings(model=str(tiny_model_dir), sampling=SamplingParams(max_new_tokens=2)),
                           segments=Segmenting.parse("fixed:30s"))
    out = tmp_path / "out.parquet"
    second = tmp_path / "second.mp4"
    second.hardlink_to(long_video)
    for inputs in ([long_video], [long_video, second]):
        runs.append(CaptionRun(inputs, out, settings, load=load))
        assert runs[-1].execute().error is None
    assert cut_when_loading == [False, True]
    rows = rows_of(out)
    assert sorted((row["path"], row["start_s"]) for row in rows) == [
        (str(path), start) for path in sorted([str(long_video), str(second)]) for start in (0.0, 30.0, 60.0)]


def test_scene_cuts_are_kept_by_file_key_and_detector_settings(long_video: Path, own_cache: Path) -> None:
    from dataclasses import replace

    from tarsier_batch.inputs.segments import Segmenting, VideoFacts
    from tarsier_batch.inputs.sources import MediaItem
    from tarsier_batch.media import MediaType
    from tarsier_batch.workers.probe import video_facts

    item = MediaItem(str(long_video), MediaType.VIDEO, key="long.mp4:v1")
    scenes = Segmenting.parse("scenes")
    [first] = video_facts([item], scenes, 1, 60.0)
    assert first is not None and len(first.cuts_s) == 16
    [kept] = (own_cache / "scenes").glob("*.json")
    # A run that finds them kept reads them and detects nothing: shown by cuts only the kept file holds.
    planted = {**json.loads(kept.read_text()), "cuts_s": [1.5]}
    kept.write_text(json.dumps(planted))
    assert video_facts([item], scenes, 1, 60.0) == [VideoFacts(first.duration_s, (1.5,))]
    assert video_facts([item], Segmenting.parse("scenes,max=3s"), 1, 60.0)[0].cuts_s == (1.5,)  # splitting only
    # Another key (the file changed), other detector settings, or a damaged file: detected again.
    assert video_facts([replace(item, key="long.mp4:v2")], scenes, 1, 60.0) == [first]
    assert video_facts([item], Segmenting.parse("scenes,threshold=250"), 1, 60.0)[0].cuts_s == ()
    kept.write_text("{damaged")
    assert video_facts([item], scenes, 1, 60.0) == [first]
    # An item without a key has no identity to keep its cuts by.
    assert video_facts([replace(item, key=None)], scenes, 1, 60.0) == [first]
    assert len(list((own_cache / "scenes").glob("*.json"))) == 3   # v1 (rewritten), v2, threshold=250


def test_a_video_whose_timestamps_jump_is_cut_by_frame_count_with_a_warning(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    # 60 s of frames whose timestamps jump by 10 minutes after 30 s: cut in time its windows would be 67, 63 of
    # them with no frame; counted in frames they are 6 windows of 100 frames each.
    paused = write_numbered_video(tmp_path / "paused.mp4", 60, jump=(30, 600))
    out = tmp_path / "paused.parquet"
    done = caption(str(paused), "--segments", "fixed:10s", "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 0, done.output
    assert f"warning: {paused}: its timestamps are missing or jump; its segments are counted in frames at its " \
           "frame rate (60 s)" in " ".join(done.output.split())
    rows = rows_of(out)
    assert [(row["start_s"], row["end_s"], row["error"]) for row in rows] == [
        (float(start), float(start + 10), None) for start in range(0, 60, 10)]
    assert [row["frame_indices"][0] for row in rows] == [0, 100, 200, 300, 400, 500]


def test_a_video_the_probe_cannot_read_leaves_the_others_segmented(long_video: Path, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    # The probe's error for the cut-short file comes back from its worker as an error of that file alone (it
    # once failed to unpickle and broke the pool: every later video then stayed whole).
    folder = tmp_path / "clips"
    folder.mkdir()
    (folder / "a_broken.mp4").write_bytes(long_video.read_bytes()[:20_000])
    (folder / "b_long.mp4").write_bytes(long_video.read_bytes())
    out = tmp_path / "out.parquet"
    done = caption(str(folder), "--segments", "fixed:10s", "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 1, done.output   # some rows failed
    rows = rows_of(out)
    assert [(Path(row["path"]).name, row["segment"], row["error"] is None) for row in rows] == \
        [("a_broken.mp4", None, False)] + [("b_long.mp4", number, True) for number in range(7)]


def test_a_damaged_stretch_fails_its_own_windows_only(long_video: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    # 3 KB zeroed in the middle of the file: the windows whose sampled frames fall in it are errors that say so;
    # every other window samples the official indices of its own span (nothing shifted by the lost frames).
    data = bytearray(long_video.read_bytes())
    data[len(data) // 2:len(data) // 2 + 3000] = bytes(3000)
    damaged = tmp_path / "damaged.mp4"
    damaged.write_bytes(bytes(data))
    out = tmp_path / "out.parquet"
    done = caption(str(damaged), "--segments", "fixed:10s", "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 1, done.output
    rows = rows_of(out)
    assert [row["start_s"] for row in rows] == [float(start) for start in range(0, 65, 10)]
    failed = [row for row in rows if row["error"]]
    assert failed and rows[0]["error"] is None
    assert all(row["error"].endswith("do not decode: the file is damaged there") for row in failed)
    for row in rows:
        if row["error"] is None:
            first = round(row["start_s"] * 10)
            count = min(100, 650 - first)
            assert row["frame_indices"] == [first + index for index in frame_indices(count, 8)]


def test_a_cut_is_a_frame_start_to_the_microsecond(shared_media: Path) -> None:
    """decord's frame times are float32: the frame at 2.52 s reads 2.5199999809265137, which a row's start_s would
    show. The cut keeps the frame's start rounded to the microsecond, within which frames_in_span counts a frame
    at a span's start as in it."""
    from tarsier_batch.media import Span, frame_starts, frames_in_span
    from tarsier_batch.workers.scenes import cut_times

    path = str(shared_media / "portrait_25fps.mp4")
    [cut] = cut_times(path, 27.0, 0.5)
    starts = frame_starts(path)
    assert cut == 2.52 and starts[63] != 2.52 and abs(starts[63] - 2.52) < 1e-6   # frame 63 of 25 frames/s
    assert frames_in_span(starts, Span(cut, starts[-1] + 0.04))[0] == 63
