"""Damaged files that still decode: a row captioned from what decodes, marked with its `warnings` (`cut_short`,
`corrupt_packets`) in every output format, in segment rows, through resume and merge, the summary and the report."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import av
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from awkward_media import Ok, make_awkward_inputs, numbered, write_video
from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.families.catalog import TARSIER
from tarsier_batch.inputs.sources import MediaItem
from tarsier_batch.media import WARNING_KINDS, MediaType, Span, load_media, media_type_of
from tarsier_batch.outputs.formats import OutputTarget
from tarsier_batch.outputs.results import CaptionResult
from tarsier_batch.outputs.schema import OutputColumns
from tarsier_batch.outputs.store import ResultStore
from tarsier_batch.review.inspection import inspect_file
from test_report import body_data, chromium

runner = CliRunner()
ZEROED_BYTES = 200_000


def index_first(source: Path, target: Path) -> Path:
    """`source` remuxed with its index (moov) before its media data, as streaming sites serve MP4s."""
    with av.open(str(source)) as given, av.open(str(target), "w", options={"movflags": "faststart"}) as output:
        stream = given.streams.video[0]
        copy = output.add_stream_from_template(stream)
        for packet in given.demux(stream):
            if packet.dts is not None:   # the demuxer's closing empty packet
                packet.stream = copy
                output.mux(packet)
    return target


def cut_in_half(source: Path, target: Path) -> Path:
    data = source.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    return target


def zeroed_in_the_middle(source: Path, target: Path) -> Path:
    data = bytearray(source.read_bytes())
    middle = len(data) // 2
    data[middle - ZEROED_BYTES // 2: middle + ZEROED_BYTES // 2] = bytes(ZEROED_BYTES)
    target.write_bytes(bytes(data))
    return target


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory, shared_media: Path) -> dict[str, Path]:
    """The demo clip (10.5 s, 84 frames at 8 fps, 1920x800 H.264) whole, cut to half its bytes with its index
    first (the index still says 10.5 s; 51 frames remain), and with 200 kB of zeros over its middle."""
    folder = tmp_path_factory.mktemp("damaged")
    healthy = shutil.copy(shared_media / "demo_test.mp4", folder / "healthy.mp4")
    indexed = index_first(shared_media / "demo_test.mp4", tmp_path_factory.mktemp("whole") / "indexed_first.mp4")
    return {"healthy": Path(healthy), "cut": cut_in_half(indexed, folder / "cut.mp4"),
            "zeroed": zeroed_in_the_middle(shared_media / "demo_test.mp4", folder / "zeroed.mp4")}


def test_a_cut_file_and_a_zeroed_file_are_marked_and_a_healthy_one_is_not(damaged: dict[str, Path]) -> None:
    healthy = load_media(str(damaged["healthy"]), MediaType.VIDEO, 8)
    assert (healthy.decoder, healthy.frame_indices, healthy.warnings) == ("decord", [0, 12, 24, 36, 47, 59, 71, 83], ())
    # decord fails on the cut's last, partial packet; PyAV samples the 50 frames that decode.
    cut = load_media(str(damaged["cut"]), MediaType.VIDEO, 8)
    assert (cut.decoder, cut.duration_s, cut.warnings) == ("pyav", 6.25, ("cut_short",))
    # Sampled clear of the cut, decord gives the frames; its frame count still falls short of the index's length.
    early = load_media(str(damaged["cut"]), MediaType.VIDEO, 4, sampler=lambda total, count: [0, 10, 20, 30])
    assert (early.decoder, early.duration_s, early.warnings) == ("decord", 51 / 8, ("cut_short",))
    # Two packets of zeros fail to decode: decord stops at them, PyAV skips them (and the frames that depend on
    # them) and samples the 80 frames that decode.
    zeroed = load_media(str(damaged["zeroed"]), MediaType.VIDEO, 8)
    assert (zeroed.decoder, zeroed.frame_indices[-1], zeroed.warnings) == ("pyav", 81, ("corrupt_packets",))


@pytest.mark.long
def test_inspect_names_the_warnings_the_row_would_carry(damaged: dict[str, Path]) -> None:
    """`tarsier inspect` said "would caption" of a file whose row then carried corrupt_packets."""
    verdicts = {name: inspect_file(str(path), TARSIER, frames=8) for name, path in damaged.items()}
    assert {name: found.warnings for name, found in verdicts.items()} == \
        {"healthy": [], "cut": ["cut_short"], "zeroed": ["corrupt_packets"]}
    last_lines = {name: found.as_text().splitlines()[-1].split(None, 1) for name, found in verdicts.items()}
    assert last_lines["healthy"] == ["verdict", "would caption"]
    assert last_lines["zeroed"] == ["verdict",
                                    "would caption, with warning corrupt_packets (from the frames that decode)"]
    shown = runner.invoke(app, ["inspect", "--family", "tarsier", str(damaged["cut"])])
    assert shown.exit_code == 0 and "would caption, with warning cut_short" in shown.output


def test_no_whole_file_of_any_container_or_codec_is_marked(tmp_path: Path, shared_media: Path) -> None:
    """Rounded container durations, a variable frame rate, B-frames, MPEG-TS, AVI, GIFs, the sample and shared
    media: none reads as damaged; the one file cut short does."""
    awkward = make_awkward_inputs(tmp_path / "awkward")
    whole = [path for path, expected in awkward.items() if isinstance(expected, Ok)] + \
        [path for folder in (SAMPLE_DATA, shared_media) for path in sorted(folder.iterdir()) if media_type_of(path)]
    marked = {}
    for path in whole:
        media = load_media(str(path), media_type_of(path), 8)
        marked.update({path.name: media.warnings} if media.warnings else {})
    assert marked == {"numbered_cut.mp4": ("cut_short",)}


# Healthy files whose frames run as long as their container declares, by a measure other than their count over
# the average rate: options of `write_video`, and the decoder that reads the file (the rotated ones go to PyAV).
UNEVENLY_TIMED = {
    # 3 s at 25 fps then 10 s at 2 fps: decord's average rate comes from the first seconds (95 frames: 3.8 s).
    "variable_rate.mkv": ({"frames": 95, "pts_step": [40] * 75 + [500] * 20}, "decord"),
    "variable_rate.webm": ({"frames": 95, "pts_step": [40] * 75 + [500] * 20}, "decord"),
    # A 20 s pause in the timestamps: frames are counted for the timeline (4 s); the container spans 24 s.
    "jump.mkv": ({"frames": 100, "pts_step": [40] * 49 + [20_000] + [40] * 50}, "decord"),
    "jump_rotated.mp4": ({"frames": 100, "pts_step": [40] * 49 + [20_000] + [40] * 50, "rotation": 90}, "pyav"),
    # Frames from 1 s to 3 s: Matroska's duration (3 s) counts from 0.
    "late.mkv": ({"frames": 50, "pts_step": [40], "first_pts": 1000}, "decord"),
    "late_rotated.mkv": ({"frames": 50, "pts_step": [40], "first_pts": 1000, "rotation": 90}, "pyav"),
    # The last of 2 s of frames shown for 3 s (its packet's duration), not for one frame step.
    "long_last_frame.mkv": ({"frames": 50, "pts_step": [40], "last_frame_ms": 3000}, "decord"),
    "long_last_frame_rotated.mkv": ({"frames": 50, "pts_step": [40], "last_frame_ms": 3000, "rotation": 90}, "pyav"),
}


@pytest.mark.parametrize("name", UNEVENLY_TIMED)
def test_a_healthy_file_timed_unevenly_is_not_marked(tmp_path: Path, name: str) -> None:
    """Neither as a whole nor in a window that runs to its end."""
    options, decoder = UNEVENLY_TIMED[name]
    path = write_video(tmp_path / name, "libvpx-vp9" if name.endswith(".webm") else "libx264", **options)
    whole = load_media(str(path), MediaType.VIDEO, 8)
    last_window = load_media(str(path), MediaType.VIDEO, 4, span=Span(1.0, 30.0))
    assert (whole.decoder, whole.warnings, last_window.warnings) == (decoder, (), ())


def test_each_window_carries_its_own_warnings(damaged: dict[str, Path]) -> None:
    """The zeros lie in the packets of frames 51-52 (6.4 s); windows decoded from the keyframe at frame 43 on pass
    through them. Windows before are whole, and so is every window of the healthy file."""
    windows = [Span(start, start + 2.0) for start in (0.0, 2.0, 4.0, 6.0)]
    marked = [load_media(str(damaged["zeroed"]), MediaType.VIDEO, 4, span=span).warnings for span in windows]
    assert marked == [(), (), (), ("corrupt_packets",)]
    assert all(load_media(str(damaged["healthy"]), MediaType.VIDEO, 4, span=span).warnings == ()
               for span in windows)


def caption(*args: str):
    return runner.invoke(app, ["caption", *args, "--max-new-tokens", "2"])


@pytest.mark.long
def test_rows_summary_and_segments_of_damaged_files(damaged: dict[str, Path], tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    done = caption(str(damaged["healthy"].parent), "--model", str(tiny_model_dir), "-o", str(out))
    assert done.exit_code == 0, done.output   # marked rows are captioned rows, not failures
    rows = {Path(row["path"]).name: row for row in pq.read_table(out).to_pylist()}
    assert {name: (row["warnings"], row["error"]) for name, row in rows.items()} == \
        {"cut.mp4": (["cut_short"], None), "healthy.mp4": (None, None), "zeroed.mp4": (["corrupt_packets"], None)}
    assert rows["cut.mp4"]["duration_s"] == 6.25 and rows["cut.mp4"]["caption"] is not None
    assert "captioned 3; failed 0; with warnings 2 (corrupt_packets 1, cut_short 1: captioned from damaged files)" \
        in " ".join(done.output.split())
    windows = tmp_path / "windows.parquet"
    done = caption(str(damaged["zeroed"]), str(damaged["healthy"]), "--segments", "fixed:4s", "--model",
                   str(tiny_model_dir), "-o", str(windows))
    # The 4-8 s window samples frame 50, which does not decode: an error of that window alone. The 8-10.5 s window
    # decodes from the keyframe at frame 43, through the zeros, and is marked.
    assert done.exit_code == 1, done.output
    marked = [(Path(row["path"]).name, row["start_s"], row["warnings"], row["error_kind"])
              for row in pq.read_table(windows).to_pylist()]
    assert marked == [("zeroed.mp4", 0.0, None, None), ("zeroed.mp4", 4.0, None, "undecodable"),
                      ("zeroed.mp4", 8.0, ["corrupt_packets"], None),
                      ("healthy.mp4", 0.0, None, None), ("healthy.mp4", 4.0, None, None),
                      ("healthy.mp4", 8.0, None, None)]


def write_rows(out: Path, results: list[CaptionResult]) -> None:
    """`results` written to `out` as a run writes them."""
    columns = OutputColumns()
    provenance = {"settings": {"model": "m"}, "model": "m"}
    store = ResultStore(OutputTarget(out), columns)
    store.begin(provenance, fresh=False)
    store.commit([columns.row(result, MediaItem(result.path, MediaType(result.media_type)), "m") for result in results],
                 provenance, {"complete": True})


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv"])
def test_every_format_writes_and_reads_back_the_warnings(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"r{suffix}"
    write_rows(out, [CaptionResult(path=f"/{name}.mp4", media_type="video", key=name, caption="c",
                                   finish_reason="eos", warnings=warnings)
                     for name, warnings in [("both", ["cut_short", "corrupt_packets"]), ("healthy", None)]])
    stored = ResultStore(OutputTarget(out), OutputColumns()).read()
    assert [row["warnings"] for row in stored.rows.values()] == [["cut_short", "corrupt_packets"], None]


def write_small_cut(folder: Path) -> Path:
    """`folder`/cut.mp4: a small MP4, index first, cut at three quarters of its bytes (3 s declared, about 1.6 s
    left); `folder` holds nothing else."""
    folder.mkdir()
    whole = write_video(folder.parent / "whole.mp4", "libx264", frames=30, options={"movflags": "faststart"},
                        picture=numbered, codec_options={"g": "12", "bf": "2"})
    data = whole.read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) * 3 // 4])
    return folder


@pytest.fixture
def small_cut(tmp_path: Path) -> Path:
    return write_small_cut(tmp_path / "in")


def without_warnings(out: Path) -> None:
    """`out` as a version without the column wrote it."""
    if out.suffix == ".parquet":
        table = pq.read_table(out)
        pq.write_table(table.drop_columns(["warnings"]).replace_schema_metadata(table.schema.metadata), out)
    else:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        out.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "warnings"}) + "\n" for row in lines))


def read_rows(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist() if out.suffix == ".parquet" else \
        [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_an_output_from_before_warnings_resumes(small_cut: Path, shared_media: Path, tiny_model_dir: Path,
                                                tmp_path: Path, suffix: str) -> None:
    """Its rows read as without warnings (what was not looked for is not claimed); the rows made now get theirs."""
    shutil.copy(shared_media / "short_5f.mp4", small_cut / "short_5f.mp4")
    out = tmp_path / f"r{suffix}"
    args = [str(small_cut), "--model", str(tiny_model_dir), "-o", str(out), "--quiet"]
    assert caption(*args).exit_code == 0
    assert {Path(row["path"]).name: row["warnings"] for row in read_rows(out)} == \
        {"cut.mp4": ["cut_short"], "short_5f.mp4": None}
    without_warnings(out)
    shutil.copy(small_cut / "cut.mp4", small_cut / "cut_again.mp4")
    again = caption(*args)
    assert again.exit_code == 0, again.output
    assert {Path(row["path"]).name: row["warnings"] for row in read_rows(out)} == \
        {"cut.mp4": None, "short_5f.mp4": None, "cut_again.mp4": ["cut_short"]}


def test_shards_from_before_warnings_merge_with_new_ones(small_cut: Path, shared_media: Path, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    shutil.copy(shared_media / "short_5f.mp4", small_cut / "short_5f.mp4")
    shards = tmp_path / "shards"
    for index in range(2):
        done = caption(str(small_cut), "--model", str(tiny_model_dir), "--shard", f"{index}/2", "--quiet",
                       "-o", str(shards / f"s{index}.parquet"))
        assert done.exit_code == 0, done.output
    older = next(shard for shard in shards.iterdir() if pq.read_metadata(shard).num_rows)
    without_warnings(older)
    merged = tmp_path / "merged.parquet"
    done = runner.invoke(app, ["merge", str(shards), "-o", str(merged)])
    assert done.exit_code == 0, done.output
    rows = {Path(row["path"]).name: row["warnings"] for row in pq.read_table(merged).to_pylist()}
    from_older = {Path(row["path"]).name for row in pq.read_table(older).to_pylist()}
    assert rows == {"cut.mp4": None if "cut.mp4" in from_older else ["cut_short"], "short_5f.mp4": None}
    assert "warnings" in pq.read_schema(merged).names


def test_the_report_counts_marks_and_filters_warned_items(tmp_path: Path, shared_media: Path) -> None:
    results = []
    for index, warnings in enumerate([["cut_short"], ["corrupt_packets"], ["cut_short", "corrupt_packets"], None]):
        path = str(shutil.copy(shared_media / "tarsier_logo.jpg", tmp_path / f"{index}.jpg"))
        results.append(CaptionResult(path=path, media_type="image", key=f"k{index}", caption=f"caption {index}",
                                     num_frames=1, frame_indices=[0], width=10, height=10, decoder="pillow",
                                     finish_reason="eos", warnings=warnings))
    out = tmp_path / "r.jsonl"
    write_rows(out, results)
    page = tmp_path / "report.html"
    done = runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "1"])
    assert done.exit_code == 0, done.output
    assert "<dt>with warnings</dt><dd>3 (corrupt_packets 2, cut_short 2)</dd>" in page.read_text()
    dom = chromium("--dump-dom", page.as_uri() + "#status=warnings", tmp_path=tmp_path)
    assert body_data(dom)["matching"] == "3"
    assert dom.count('<span class="badge">cut_short</span>') == 2
    assert dom.count('<span class="badge">corrupt_packets</span>') == 2


def test_the_output_page_explains_every_warning_kind() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "pipelines.md").read_text()
    table = page.split("| `warnings` value |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == list(WARNING_KINDS)
