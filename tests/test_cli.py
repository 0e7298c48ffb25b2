"""`tarsier caption` end to end: the Parquet file, metadata, exit codes and bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.outputs.schema import PROVENANCE_KEY, SUMMARY_KEY

runner = CliRunner()
COLUMNS = ["path", "key", "media_type", "caption", "model", "prompt", "num_frames", "frame_indices", "width", "height",
           "duration_s", "decoder", "prompt_tokens", "generated_tokens", "finish_reason", "error", "error_kind",
           "warnings", "elapsed_s", "size_bytes", "mtime"]


def run(*args: str):
    return runner.invoke(app, ["caption", *args])


def stop_captioning_at(monkeypatch, index: int, stop) -> None:
    """Make the run call `stop()` when it reaches result number `index` (0-based)."""
    from tarsier_batch.api import Captioner

    real_caption = Captioner.caption

    def caption_then_stop(self, items, on_tokens=None, in_order=True):
        for position, result in enumerate(real_caption(self, items, on_tokens, in_order)):
            if position == index:
                stop()
            yield result

    monkeypatch.setattr(Captioner, "caption", caption_then_stop)


def saved_rows(out: Path) -> int:
    """Rows in the part files a stopped run left for the next one."""
    return sum(pq.read_table(part).num_rows for part in (out.parent / f".{out.name}.tarsier").glob("part-*.parquet"))


def media_in(*folders: Path) -> list[Path]:
    from tarsier_batch.media import media_type_of

    return sorted(path for folder in folders for path in folder.rglob("*") if media_type_of(path))


@pytest.mark.smoke
def test_captions_shared_media_and_sample_data(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    from conftest import SAMPLE_DATA

    out = tmp_path / "r.parquet"
    result = run(str(shared_media), str(SAMPLE_DATA), "--model", str(tiny_model_dir), "--out", str(out),
                 "--max-new-tokens", "8", "--with-token-ids")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column_names == COLUMNS + ["generated_ids"]
    rows = table.to_pylist()
    expected = [str(path) for path in media_in(shared_media)] + [str(path) for path in media_in(SAMPLE_DATA)]
    assert [row["path"] for row in rows] == expected
    assert len(rows) == 9 + 13
    # Random weights may end at once (EOS first: an empty caption); every file still gets its row, no error.
    assert all(row["caption"] is not None and row["error"] is None and row["finish_reason"] in ("eos", "length")
               for row in rows)
    assert all(row["generated_tokens"] == len(row["generated_ids"]) <= 8 for row in rows)
    by_name = {Path(row["path"]).name: row for row in rows}
    video = by_name["demo_test.mp4"]
    assert (video["media_type"], video["num_frames"], video["frame_indices"]) == (
        "video", 8, [0, 12, 24, 36, 47, 59, 71, 83])
    assert (video["width"], video["height"], video["duration_s"]) == (1920, 800, 10.5)
    assert video["prompt"] == "Describe the video in detail." and video["model"] == str(tiny_model_dir)
    assert video["prompt_tokens"] > 8 * 21  # eight frames of 21 vectors plus the text
    assert by_name["clip_5f.gif"]["num_frames"] == 5 and by_name["clip_5f.gif"]["media_type"] == "gif"
    image = by_name["portrait.JPG"]
    assert (image["media_type"], image["num_frames"], image["duration_s"]) == ("image", 1, None)
    assert image["prompt"] == "Describe the image in detail."
    metadata = pq.read_metadata(out).metadata
    provenance = json.loads(metadata[PROVENANCE_KEY.encode()])
    assert provenance["model"] == str(tiny_model_dir) and provenance["frames"] == 8
    assert provenance["generation"] == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0,
                                        "repetition_penalty": 1.0, "eos_token_ids": [2]}
    assert provenance["dtype"] == "float32" and provenance["device"] == "cpu"
    assert provenance["frame_decoders"]["video"].startswith("decord")
    assert provenance["tool_version"]
    summary = json.loads(metadata[SUMMARY_KEY.encode()])
    assert summary["complete"] is True and summary["captioned"] == 22 and summary["skipped"] == 1  # README.md
    assert "skipped 1 (1 .md)" in result.output and "captioned 22" in result.output
    assert table.schema.metadata[PROVENANCE_KEY.encode()] == metadata[PROVENANCE_KEY.encode()]  # read_table sees it
    assert rows[0]["size_bytes"] == os.stat(rows[0]["path"]).st_size
    assert rows[0]["mtime"].timestamp() == pytest.approx(os.stat(rows[0]["path"]).st_mtime, abs=1e-6)
    log = [line.split(" ", 1)[1] for line in result.output.splitlines()]  # not a terminal: timestamped lines
    assert "tarsier: captioning 22 items" in log
    assert any(line.startswith("tarsier: 22/22 items, 0 failed,") for line in log)
    assert {row["decoder"] for row in rows} == {"decord", "pillow"}
    assert rows[0]["key"] == "|".join([os.path.realpath(rows[0]["path"]), str(os.stat(rows[0]["path"]).st_size),
                                      str(os.stat(rows[0]["path"]).st_mtime_ns)])


@pytest.mark.smoke
def test_corrupt_file_becomes_an_error_row_and_exit_1(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a_broken.mp4").write_bytes(b"this is not a video")
    (folder / "b_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (folder / "c_good.gif").write_bytes((shared_media / "clip_5f.gif").read_bytes())
    out = tmp_path / "r.parquet"
    result = run(str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4")
    assert result.exit_code == 1, result.output
    rows = pq.read_table(out).to_pylist()
    assert [Path(row["path"]).name for row in rows] == ["a_broken.mp4", "b_broken.png", "c_good.gif"]
    for broken in rows[:2]:
        assert broken["finish_reason"] == "error" and broken["caption"] is None
        assert broken["error"] and "\n" not in broken["error"]
    assert rows[2]["error"] is None and rows[2]["caption"]
    assert "failed 2" in result.output and "a_broken.mp4" in result.output


@pytest.mark.parametrize("name", ["nope", "nothere.mp4"])   # named like media or not: a typo either way
def test_missing_input_stops_with_exit_2(tiny_model_dir: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "r.parquet"
    result = run(str(tmp_path / name), "--model", str(tiny_model_dir), "--out", str(out))
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: input not found: {tmp_path / name}"   # said at once, nothing loaded
    assert not out.exists()


@pytest.mark.parametrize(("flag", "value"), [("--frames", "0"), ("--batch-size", "0"), ("--top-p", "0"),
                                             ("--temperature", "-1"), ("--dtype", "float8"),
                                             ("--device", "tpu"), ("--max-new-tokens", "0")])
def test_bad_flag_values_stop_with_exit_2(tiny_model_dir: Path, shared_media: Path, tmp_path: Path,
                                          flag: str, value: str) -> None:
    out = tmp_path / "r.parquet"
    result = run(str(shared_media / "clip_5f.gif"), "--model", str(tiny_model_dir), "--out", str(out), flag, value)
    assert result.exit_code == 2, result.output
    assert "Error" in result.output
    assert not out.exists()


def test_a_bad_segments_value_names_the_flag_and_the_value(tiny_model_dir: Path, shared_media: Path,
                                                          tmp_path: Path) -> None:
    result = run(str(shared_media / "clip_5f.gif"), "--model", str(tiny_model_dir), "--out",
                 str(tmp_path / "r.parquet"), "--segments", "fixed:30s,overlap=40s")
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: --segments 'fixed:30s,overlap=40s': overlap=40s must be shorter than "
                                     "the window (30s)")


def test_existing_output_needs_overwrite(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    out.write_bytes(b"precious")
    args = [str(shared_media / "clip_5f.gif"), "--model", str(tiny_model_dir), "--out", str(out),
            "--max-new-tokens", "2"]
    refused = run(*args)
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    assert out.read_bytes() == b"precious"
    replaced = run(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert pq.read_table(out).num_rows == 1


def test_unusable_model_stops_with_exit_2(shared_media: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    result = run(str(shared_media / "clip_5f.gif"), "--model", str(empty), "--out", str(tmp_path / "r.parquet"))
    assert result.exit_code == 2
    assert "config.json" in result.output


def test_custom_prompt_and_frames(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    result = run(str(shared_media / "demo_test.mp4"), "--model", str(tiny_model_dir), "--out", str(out),
                 "--prompt", "Who is hiding?", "--frames", "3", "--max-new-tokens", "3", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.output == ""
    row = pq.read_table(out).to_pylist()[0]
    assert (row["prompt"], row["num_frames"], row["frame_indices"]) == ("Who is hiding?", 3, [0, 42, 83])


def test_make_tiny_model_command(tmp_path: Path) -> None:
    result = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "m"), "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "config.json").exists()
    again = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "m")])
    assert again.exit_code == 2 and "not empty" in again.output
    wrong = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "n"), "--size", "huge"])
    assert wrong.exit_code == 2


@pytest.mark.parametrize("command", [["dev", "make-tiny-model"], ["inspect"]])
def test_family_help_names_every_family(command: list[str]) -> None:
    import typer

    from tarsier_batch import model_families

    group = typer.main.get_command(app)
    for name in command:
        group = group.commands[name]
    help_text = next(param.help for param in group.params if param.name == "family")
    assert [family.key for family in model_families() if family.key not in help_text] == [], help_text


def test_ctrl_c_keeps_finished_rows_and_exits_130(tiny_model_dir: Path, shared_media: Path, tmp_path: Path,
                                                 monkeypatch) -> None:
    def interrupt() -> None:
        raise KeyboardInterrupt

    stop_captioning_at(monkeypatch, 2, interrupt)
    out = tmp_path / "r.parquet"
    result = run(str(shared_media), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2")
    assert result.exit_code == 130
    assert "interrupted; 2 finished rows are saved in" in result.output
    assert "r.parquet is not written yet; run the same command again to resume" in result.output
    assert not out.exists()
    assert saved_rows(out) == 2
    # Once the output exists, a stop leaves it as it was, and says so.
    monkeypatch.undo()
    assert run(str(shared_media), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2"
               ).exit_code == 0
    written = out.read_bytes()
    more = tmp_path / "more"
    more.mkdir()
    shutil.copy(shared_media / "demo_test_8frames.gif", more / "new.gif")
    stop_captioning_at(monkeypatch, 0, interrupt)
    result = run(str(shared_media), str(more), "--model", str(tiny_model_dir), "--out", str(out),
                 "--max-new-tokens", "2")
    assert result.exit_code == 130, result.output
    assert "r.parquet was not changed; run the same command again to resume" in result.output
    assert out.read_bytes() == written


def test_dash_reads_paths_from_stdin(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    piped = f"{shared_media / 'clip_5f.gif'}\n\n{shared_media / 'tarsier_logo.jpg'}\n"
    result = runner.invoke(app, ["caption", "-", str(shared_media / "short_5f.mp4"), "--model", str(tiny_model_dir),
                                 "--out", str(out), "--max-new-tokens", "2"], input=piped)
    assert result.exit_code == 0, result.output
    names = [Path(path).name for path in pq.read_table(out).column("path").to_pylist()]
    assert names == ["clip_5f.gif", "tarsier_logo.jpg", "short_5f.mp4"]


def test_crash_mid_run_keeps_finished_rows_and_exits_3(tiny_model_dir: Path, shared_media: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    def device_dies() -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    stop_captioning_at(monkeypatch, 2, device_dies)
    out = tmp_path / "r.parquet"
    result = run(str(shared_media), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2")
    assert result.exit_code == 3
    assert ("crashed (RuntimeError: CUDA error: device-side assert triggered); 2 finished rows are saved"
            in result.output)
    assert not out.exists() and saved_rows(out) == 2


def test_sigterm_stops_like_ctrl_c_and_exits_143(tiny_model_dir: Path, shared_media: Path, tmp_path: Path,
                                                 monkeypatch) -> None:
    import os
    import signal

    stop_captioning_at(monkeypatch, 1, lambda: os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "r.parquet"
    result = run(str(shared_media), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2")
    assert result.exit_code == 143
    assert "terminated; 1 finished row is saved" in result.output
    assert saved_rows(out) == 1
    assert signal.getsignal(signal.SIGTERM) == previous


def test_model_that_fails_to_load_is_a_usage_error_and_leaves_nothing(tiny_model_dir: Path, shared_media: Path,
                                                                      tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out_dir = tmp_path / "out"
    result = run(str(shared_media / "clip_5f.gif"), "--model", str(broken), "--out", str(out_dir / "r.parquet"))
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
    assert list(out_dir.iterdir()) == []


def test_a_bug_while_loading_shows_its_traceback_and_exits_3(tiny_model_dir: Path, shared_media: Path,
                                                            tmp_path: Path, monkeypatch) -> None:
    """Exit 2 says "your input is wrong"; a bug of the tool while loading must not hide behind it."""
    import tarsier_batch.api

    def broken_loader(*args, **kwargs):
        raise TypeError("a bug in the loading code")

    monkeypatch.setattr(tarsier_batch.api, "load_caption_model", broken_loader)
    out_dir = tmp_path / "out"
    result = run(str(shared_media / "clip_5f.gif"), "--model", str(tiny_model_dir), "--out", str(out_dir / "r.parquet"))
    assert result.exit_code == 3, result.output
    assert "Traceback" in result.output and "TypeError: a bug in the loading code" in result.output
    assert "crashed while loading the model (TypeError: a bug in the loading code); nothing was written to " \
        in result.output
    assert list(out_dir.iterdir()) == []


def test_odd_file_names_are_stored_and_shown_safely(tiny_model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    import os

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "clip[b].gif").write_bytes((shared_media / "clip_5f.gif").read_bytes())
    (folder / "[bold]a.png").write_bytes(b"not a png")
    undecodable = os.fsencode(folder) + b"/bad\xff.gif"
    with open(undecodable, "wb") as handle:
        handle.write((shared_media / "clip_5f.gif").read_bytes())
    out = tmp_path / "r.parquet"
    result = run(str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2")
    assert result.exit_code == 1, result.output
    rows = pq.read_table(out).to_pylist()
    assert [Path(row["path"]).name for row in rows] == ["[bold]a.png", "bad\\xff.gif", "clip[b].gif"]
    assert rows[0]["error"] and rows[1]["caption"] and rows[2]["caption"]


def test_rich_display_shows_markup_characters_literally() -> None:
    import io

    from rich.console import Console

    from tarsier_batch.outputs.results import CaptionResult
    from tarsier_batch.progress import RichReporter, RunStats, print_summary, summary_rows

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    stats = RunStats(total=1)
    with RichReporter(stats, console) as reporter:
        failure = CaptionResult(path="clips/a[/x].png", media_type="image", error="bad [/red] data")
        stats.record(failure)
        reporter.on_result(failure)
    print_summary(console, summary_rows(stats, "out[1].parquet", ""))
    text = buffer.getvalue()
    assert "a[/x].png" in text and "bad [/red] data" in text and "out[1].parquet" in text


def test_dtype_choices_match_the_devices_module() -> None:
    import typing

    import typer.main

    from tarsier_batch.model.devices import DTYPES

    caption = typer.main.get_command(app).commands["caption"]   # type: ignore[attr-defined]
    [dtype] = [param for param in caption.params if param.name == "dtype"]
    assert set(typing.get_args(dtype.type_descriptor.annotation)) == {"auto", *DTYPES}


def test_frames_beyond_what_the_kv_cache_can_hold_stop_at_once(tiny_model_dir: Path, shared_media: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    result = run(str(shared_media / "short_5f.mp4"), "--model", str(tiny_model_dir), "--out", str(out),
                 "--frames", "100000", "--kv-cache-gb", "0.5")
    assert result.exit_code == 2
    assert result.output.startswith("Error: --frames 100000 needs at least 2100000 positions per item, more than "
                                    "the KV cache holds")
    assert not out.exists() and not list(tmp_path.iterdir())
