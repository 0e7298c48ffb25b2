"""Resuming, incremental runs, the output lock, cron behaviour and kills, through the `tarsier` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.outputs.lock import OutputLock
from tarsier_batch.outputs.schema import SUMMARY_KEY

runner = CliRunner()
STABLE = ["path", "key", "caption", "num_frames", "frame_indices", "generated_tokens", "finish_reason", "error"]


def caption(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, ["caption", *args], env=env)


def where_failures_are(out: Path) -> str:
    """The line `--quiet` ends with when `out` holds failed rows."""
    return (f"tarsier: the failed rows' errors are in {out} (tarsier peek {out} --failed --last 100 lists them; "
            f"tarsier report {out} -o report.html groups them by kind, with examples)\n")


def quiet_with_one_failure(out: Path, rows: int, path: Path) -> str:
    """What `--quiet` prints of a run whose one failure, of `rows`, is the file at `path` (its error read from
    `out`)."""
    error, = [row["error"] for row in pq.read_table(out).to_pylist() if row["error"]]
    return (f"tarsier: done: captioned {rows - 1}; failed 1 (undecodable 1); output {out} ({rows} rows)\n"
            f"tarsier: failed {path}: {error}\n" + where_failures_are(out))


def stable(out: Path) -> list[dict]:
    """The rows without timings, which differ between runs."""
    return [{name: row[name] for name in STABLE} for row in pq.read_table(out).to_pylist()]


@pytest.fixture
def folder(shared_media: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ["clip_5f.gif", "tarsier_logo.jpg", "short_5f.mp4"]:
        shutil.copy(shared_media / name, folder / name)
    return folder


@pytest.mark.smoke
def test_rerun_captions_only_what_is_new_and_keeps_input_order(tiny_model_dir: Path, folder: Path,
                                                               shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3"]
    first = caption(*args)
    assert first.exit_code == 0, first.output
    before = pq.read_table(out).to_pylist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "r.parquet"]  # nothing left behind
    stamp = out.stat().st_mtime_ns
    again = caption(*args)
    assert again.exit_code == 0 and "captioned 0" in again.output and "done earlier 3" in again.output
    assert "unchanged" in again.output and out.stat().st_mtime_ns == stamp  # nothing new: the file is not rewritten
    shutil.copy(shared_media / "demo_test_f40.jpg", folder / "a_new.jpg")  # sorts first
    grown = caption(*args)
    assert grown.exit_code == 0 and "captioned 1" in grown.output and "done earlier 3" in grown.output
    after = pq.read_table(out).to_pylist()
    assert [Path(row["path"]).name for row in after] == ["a_new.jpg", "clip_5f.gif", "short_5f.mp4",
                                                         "tarsier_logo.jpg"]
    assert after[1:] == before  # earlier rows are kept exactly, timings included
    summary = json.loads(pq.read_metadata(out).metadata[SUMMARY_KEY.encode()])
    assert summary["captioned"] == 1 and summary["already_done"] == 3


def test_changed_file_is_captioned_again_and_overwrite_starts_over(tiny_model_dir: Path, folder: Path,
                                                                   shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3"]
    assert caption(*args).exit_code == 0
    shutil.copy(shared_media / "demo_test_f40.jpg", folder / "tarsier_logo.jpg")  # new content, same name
    changed = caption(*args)
    assert changed.exit_code == 0 and "captioned 1" in changed.output
    rows = {Path(row["path"]).name: row for row in pq.read_table(out).to_pylist()}
    from PIL import Image

    with Image.open(shared_media / "demo_test_f40.jpg") as new_content:
        assert (rows["tarsier_logo.jpg"]["width"], rows["tarsier_logo.jpg"]["height"]) == new_content.size
    assert rows["tarsier_logo.jpg"]["key"].split("|")[1] == str((folder / "tarsier_logo.jpg").stat().st_size)
    fresh = caption(*args, "--overwrite")
    assert fresh.exit_code == 0 and "captioned 3" in fresh.output and "done earlier" not in fresh.output


def test_other_settings_are_refused_before_loading(tiny_model_dir: Path, folder: Path, shared_media: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3"]
    assert caption(*args, "--frames", "2").exit_code == 0
    stamp = out.stat().st_mtime_ns
    refused = caption(*args, "--frames", "3")
    assert refused.exit_code == 2
    assert refused.output.startswith(f"Error: {out} holds rows made with other settings (frames 2 there, 3 now)")
    assert "--overwrite" in refused.output and "loading" not in refused.output
    shutil.copy(shared_media / "demo_test_f40.jpg", folder / "new.jpg")  # new work: the model loads
    resolved = caption(*args)  # the default frames (8) only differ once the model says what they are
    assert resolved.exit_code == 2 and "frames 2 there, 8 now" in resolved.output
    assert out.stat().st_mtime_ns == stamp and not (tmp_path / ".r.parquet.tarsier").exists()


def test_retry_errors_and_prune_missing(tiny_model_dir: Path, folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3",
            "--decode-timeout", "30"]
    crashed = caption(*args, env={"TARSIER_BATCH_FAULT": "segfault:clip_5f"})
    assert crashed.exit_code == 1, crashed.output
    rows = {Path(row["path"]).name: row for row in pq.read_table(out).to_pylist()}
    assert "SIGSEGV" in rows["clip_5f.gif"]["error"]
    kept = caption(*args)
    assert kept.exit_code == 0 and "captioned 0" in kept.output  # an error row is finished work...
    retried = caption(*args, "--retry-errors")  # ...until asked to retry it
    assert retried.exit_code == 0 and "captioned 1" in retried.output
    assert all(row["error"] is None for row in pq.read_table(out).to_pylist())
    (folder / "short_5f.mp4").unlink()
    missing = caption(*args)
    assert missing.exit_code == 0 and "1 rows kept (--prune-missing drops them)" in missing.output
    assert pq.read_table(out).num_rows == 3
    pruned = caption(*args, "--prune-missing")
    assert pruned.exit_code == 0 and "1 rows dropped" in pruned.output
    assert [Path(p).name for p in pq.read_table(out).column("path").to_pylist()] == ["clip_5f.gif",
                                                                                      "tarsier_logo.jpg"]


def test_links_to_one_file_get_a_row_each_from_one_caption(tiny_model_dir: Path, shared_media: Path,
                                                           tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    for index in range(6):
        (folder / f"link{index}.gif").symlink_to(shared_media / "clip_5f.gif")
    out = tmp_path / "r.parquet"
    result = caption(str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pylist()
    assert [Path(row["path"]).name for row in rows] == [f"link{index}.gif" for index in range(6)]
    assert len({(row["caption"], row["key"]) for row in rows}) == 1 and rows[0]["caption"]


def test_sampling_seed_follows_the_file_not_the_spelling_of_its_path(tiny_model_dir: Path, folder: Path,
                                                                    tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(folder)
    sampled = ["--model", str(tiny_model_dir), "--max-new-tokens", "6", "--temperature", "1.5", "--seed", "3"]
    relative = caption("./clip_5f.gif", "--out", str(tmp_path / "a.parquet"), *sampled)
    absolute = caption(str(folder / "clip_5f.gif"), "--out", str(tmp_path / "b.parquet"), *sampled)
    assert relative.exit_code == absolute.exit_code == 0
    assert stable(tmp_path / "a.parquet") == stable(tmp_path / "b.parquet")


def test_second_run_on_the_same_output_exits_75(tiny_model_dir: Path, folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    with OutputLock(out):
        result = caption(str(folder), "--model", str(tiny_model_dir), "--out", str(out))
    assert result.exit_code == 75
    assert result.output.startswith(f"Error: another run is writing {out} (pid {os.getpid()} on ")
    assert not out.exists()


def test_piped_paths_without_media_are_fine_for_cron_unless_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Paths from stdin (`find -newer ...`) holding no media are a quiet night; a folder named on the command line
    without media is a failed input (tests/test_cron_exits.py)."""
    (tmp_path / "notes.txt").write_text("hello")
    args = ["caption", "-", "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.parquet")]
    quiet = runner.invoke(app, args, input=f"{tmp_path / 'notes.txt'}\n")
    assert quiet.exit_code == 0
    assert quiet.output.strip() == "tarsier: no supported media in - (1 other file skipped)"
    assert runner.invoke(app, [*args, "--fail-on-empty"], input=f"{tmp_path / 'notes.txt'}\n").exit_code == 1
    assert not (tmp_path / "r.parquet").exists()


def test_log_file_has_timestamped_start_failures_progress_and_summary(tiny_model_dir: Path, folder: Path,
                                                                      tmp_path: Path) -> None:
    import re

    (folder / "broken.mp4").write_bytes(b"not a video")
    log = tmp_path / "logs" / "run.log"   # its folder is made, as --out's is
    out = tmp_path / "r.parquet"
    result = caption(str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2",
                     "--quiet", "--log-file", str(log))
    assert result.exit_code == 1 and result.output == quiet_with_one_failure(out, 4, folder / "broken.mp4")
    lines = log.read_text().splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d tarsier: ", line) for line in lines), lines
    texts = [line.split(" tarsier: ", 1)[1] for line in lines]
    assert texts[0].startswith(f"{tiny_model_dir} (Tarsier v1, 8 frames) on cpu") and "decoding worker" in texts[0]
    assert texts[1] == "captioning 4 items"
    assert any(text.startswith(f"failed {folder / 'broken.mp4'}: ") for text in texts)
    assert texts[-2].startswith("4/4 items, 1 failed")
    assert texts[-1].startswith("done: captioned 3; failed 1 (undecodable 1);")


def test_a_log_file_that_cannot_be_written_stops_at_once_naming_the_flag(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_text("")
    result = caption(str(folder), "--model", "demo", "--out", str(tmp_path / "r.parquet"),
                     "--log-file", str(tmp_path / "plain-file" / "run.log"))
    assert result.exit_code == 2
    assert result.output.strip().startswith(f"Error: --log-file {tmp_path / 'plain-file' / 'run.log'}: ")
    assert not (tmp_path / "r.parquet").exists()


def test_a_stopped_overwrite_is_continued_and_never_mixes_in_the_rows_it_replaces(
        tiny_model_dir: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_cli import stop_captioning_at

    def interrupt() -> None:
        raise KeyboardInterrupt

    out, reference = tmp_path / "r.parquet", tmp_path / "reference.parquet"
    common = [str(folder), "--model", str(tiny_model_dir), "--max-new-tokens"]
    assert caption(*common, "3", "--out", str(reference)).exit_code == 0   # what the overwriting run makes
    assert caption(*common, "2", "--out", str(out)).exit_code == 0         # the output it replaces
    replacing = [*common, "3", "--out", str(out), "--overwrite"]
    for again in (replacing, replacing[:-1]):   # the same command; and a run over the output without the flag
        with monkeypatch.context() as stopping:
            stop_captioning_at(stopping, 1, interrupt)
            stopped = caption(*replacing)
        assert stopped.exit_code == 130, stopped.output
        assert (f"1 finished row is saved in {tmp_path / '.r.parquet.tarsier'} and {out} was not changed yet (a "
                f"run with the same settings goes on replacing it); run the same command again to resume"
                in stopped.output), stopped.output
        peek = runner.invoke(app, ["peek", str(out), "--last", "9", "--json"])
        assert "1 rows, 1 captioned, 0 failed; unfinished run: 1 rows saved so far in 1 part files" in peek.stderr
        assert [{name: json.loads(line)[name] for name in STABLE} for line in peek.stdout.splitlines()] == \
            [row for row in stable(reference) if row["path"] == json.loads(peek.stdout)["path"]]
        resumed = caption(*again)
        assert resumed.exit_code == 0 and "captioned 2; failed 0; done earlier 1;" in resumed.output, resumed.output
        assert stable(out) == stable(reference)
        assert caption(*common, "2", "--out", str(out), "--overwrite").exit_code == 0   # the old output again
    # Stopped, then overwritten with other settings: it starts over. Other frames than the model's default only
    # differ once the model is loaded; other tokens before.
    with monkeypatch.context() as stopping:
        stop_captioning_at(stopping, 1, interrupt)
        assert caption(*replacing, "--frames", "4").exit_code == 130
    over = caption(*replacing)
    assert over.exit_code == 0 and "captioned 3; failed 0;" in over.output and "done earlier" not in over.output
    assert stable(out) == stable(reference)
    with monkeypatch.context() as stopping:
        stop_captioning_at(stopping, 1, interrupt)
        assert caption(*replacing).exit_code == 130
    over = caption(*common, "4", "--out", str(out), "--overwrite")
    assert over.exit_code == 0 and "captioned 3; failed 0;" in over.output and "done earlier" not in over.output


# --- kills and signals, in real processes --------------------------------------------------------------------

def start(args: list[str], file_size_limit: int | None = None) -> subprocess.Popen:
    """`tarsier caption ARGS` in a new process, optionally under RLIMIT_FSIZE.

    The limit is set by a small launcher that then execs the CLI, not by `preexec_fn`, which
    would make Python fork this (large) test process instead of spawning.
    """
    command = [sys.executable, "-m", "tarsier_batch.cli", "caption", *args]
    if file_size_limit is not None:
        launcher = ("import os, resource, sys; "
                    f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
                    "os.execv(sys.executable, sys.argv[1:])")
        command = [sys.executable, "-c", launcher, *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process: subprocess.Popen, what: str, limit_s: float = 120) -> None:
    """Poll the file system until `condition()` holds (the run's progress is only visible there)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s"
        time.sleep(0.02)


def parts(out: Path) -> int:
    work = out.parent / f".{out.name}.tarsier"
    return len(list(work.glob("part-*.parquet"))) if work.is_dir() else 0


def visible_files_are_readable(directory: Path) -> None:
    for path in directory.iterdir():
        if not path.name.startswith("."):
            pq.read_table(path)  # raises if torn


@pytest.fixture(scope="module")
def many(shared_media: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("many")
    for index in range(12):
        source = ["clip_5f.gif", "tarsier_logo.jpg", "short_5f.mp4"][index % 3]
        shutil.copy(shared_media / source, folder / f"{index:02d}_{source}")
    return folder


@pytest.fixture(scope="module")
def reference(many: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("reference") / "r.parquet"
    result = caption(str(many), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4",
                     "--batch-size", "2")
    assert result.exit_code == 0, result.output
    return stable(out)


@pytest.mark.kill
def test_kill_9_at_several_points_then_rerun_gives_the_uninterrupted_output(many: Path, tiny_model_dir: Path,
                                                                           reference: list[dict],
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    args = [str(many), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--flush-rows", "1", "--quiet"]
    lock_file = tmp_path / ".r.parquet.lock"
    for kill_after_parts in (0, 3, 8):
        run = start(args)
        if kill_after_parts == 0:
            wait_for(lock_file.exists, run, "the lock")  # killed while the model loads
        else:
            wait_for(lambda: parts(out) >= kill_after_parts, run, f"{kill_after_parts} parts")
        run.kill()
        run.communicate()
        visible_files_are_readable(tmp_path)
        assert not out.exists()
    finish = start(args)
    stdout, stderr = finish.communicate(timeout=300)
    assert finish.returncode == 0, stderr
    assert stable(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet"]


@pytest.mark.kill
@pytest.mark.parametrize(("signal_number", "code", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                           (signal.SIGTERM, 143, "terminated")])
def test_signals_save_finished_rows_and_say_how_to_resume(many: Path, tiny_model_dir: Path, reference: list[dict],
                                                         tmp_path: Path, signal_number: int, code: int,
                                                         word: str) -> None:
    out = tmp_path / "r.parquet"
    args = [str(many), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--flush-rows", "1000", "--flush-seconds", "1000"]
    run = start(args)
    wait_for(lambda: (tmp_path / ".r.parquet.tarsier" / "settings.json").exists(), run, "the run to start")
    run.send_signal(signal_number)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == code, stderr
    assert f"tarsier: {word}; " in stderr and "run the same command again to resume" in stderr
    assert not out.exists()
    saved = int(stderr.split(f"tarsier: {word}; ")[1].split(" finished rows")[0])
    assert parts(out) == (1 if saved else 0)  # unflushed rows were saved on the way out
    finish = start(args)
    _, stderr = finish.communicate(timeout=300)
    assert finish.returncode == 0, stderr
    assert f"done earlier {saved}" in stderr or saved == 0
    assert stable(out) == reference


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    script = ("import os, signal, time\n"
              "from tarsier_batch.cli_run import stop_signals\n"
              "with stop_signals():\n"
              "    try:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(60)\n"
              "    except BaseException as stop:\n"
              "        print(type(stop).__name__, flush=True)\n"
              "        os.kill(os.getpid(), signal.SIGINT)  # the second signal, while still stopping\n"
              "        time.sleep(60)\n"
              "        print('not reached')\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == "Terminated\n" and done.returncode == 130
    assert time.monotonic() - started < 30


@pytest.mark.kill
@pytest.mark.parametrize("fails", ["part", "final"])
def test_a_full_disk_never_claims_rows_a_readable_file_does_not_hold(many: Path, tiny_model_dir: Path,
                                                                    reference: list[dict], tmp_path: Path,
                                                                    fails: str) -> None:
    """RLIMIT_FSIZE makes writes past a size fail (EFBIG), as a full disk fails them (ENOSPC)."""
    out = tmp_path / "r.parquet"
    flush_rows = "3" if fails == "part" else "1"
    args = [str(many), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4",
            "--batch-size", "2", "--flush-rows", flush_rows, "--flush-seconds", "1000"]   # parts by rows alone,
    # after the run's first row, which is saved at once
    # A part of 1 to 3 rows fits under the limit (error_kind took one past 6.3 KB, warnings past 6.8 KB), the final
    # file of 12 rows with its metadata does not (measured: 11.5 KB).
    limit = 4_000 if fails == "part" else 7_300
    run = start(args, file_size_limit=limit)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 3, stderr
    saved = sum(pq.read_table(part).num_rows  # every row the message counts is in a readable part
                for part in (tmp_path / ".r.parquet.tarsier").glob("part-*.parquet"))
    if fails == "part":
        assert "crashed (cannot save 1 finished row in" in stderr and "0 finished rows are saved" in stderr
        assert saved == 0
    else:
        assert f"crashed (cannot write {out}: " in stderr and "the finished rows are saved in" in stderr
        assert saved == 12
    assert not out.exists() and not list(tmp_path.glob(".r.parquet.*.tmp"))
    finish = start(args)
    _, stderr = finish.communicate(timeout=300)
    assert finish.returncode == 0, stderr
    assert stable(out) == reference


@pytest.mark.long
def test_native_decoder_messages_never_reach_the_terminal(tiny_model_dir: Path, folder: Path,
                                                         tmp_path: Path) -> None:
    """In-process, decord prints 'video_reader.cc:83: ERROR opening ...' on fd 2 for this file."""
    (folder / "bad.mp4").write_bytes(b"garbage")
    out = tmp_path / "r.parquet"
    run = start([str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2", "--quiet"])
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 1   # quiet: what failed, and nothing else
    assert (stdout, stderr) == ("", quiet_with_one_failure(out, 4, folder / "bad.mp4"))
    rows = {Path(row["path"]).name: row for row in pq.read_table(tmp_path / "r.parquet").to_pylist()}
    assert rows["bad.mp4"]["error"].startswith("not a video: no media stream found (the file starts like text); "
                                               "decord: Error reading")
    assert rows["bad.mp4"]["error_kind"] == "undecodable"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_an_output_from_before_error_kind_resumes(tiny_model_dir: Path, folder: Path, shared_media: Path,
                                                  tmp_path: Path, suffix: str) -> None:
    """Its success rows read as null, its error rows as `unknown` (their kind is not guessed from the message);
    the rows made now get theirs."""
    (folder / "bad.mp4").write_text("not a video\n")
    out = tmp_path / f"r{suffix}"
    args = [str(folder), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2", "--quiet"]
    assert caption(*args).exit_code == 1
    if suffix == ".parquet":   # as an older version wrote it: the same file, without the column
        table = pq.read_table(out)
        pq.write_table(table.drop_columns(["error_kind"]).replace_schema_metadata(table.schema.metadata), out)
    else:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        out.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "error_kind"}) + "\n"
                               for row in lines))
    (folder / "worse.mp4").write_text("neither\n")
    again = caption(*args)
    assert again.exit_code == 1, again.output
    rows = pq.read_table(out).to_pylist() if suffix == ".parquet" else \
        [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {Path(row["path"]).name: row["error_kind"] for row in rows}
    assert kinds == {"bad.mp4": "unknown", "worse.mp4": "undecodable", "clip_5f.gif": None,
                     "tarsier_logo.jpg": None, "short_5f.mp4": None}
