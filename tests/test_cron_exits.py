"""What a cron job sees: inputs that give no rows, earlier errors and an output that refuses writes each change the
exit code or say so in one line, naming what the user gave and what to do."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.outputs.formats import OutputError, OutputTarget
from tarsier_batch.outputs.schema import OutputColumns
from tarsier_batch.outputs.store import OutputWriteError, ResultStore
from test_damaged_files import write_small_cut
from test_resume_cli import quiet_with_one_failure, start, where_failures_are

runner = CliRunner()


def caption(*args: str):
    return runner.invoke(app, ["caption", *args])


@pytest.fixture
def clip(shared_media: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(shared_media / "clip_5f.gif", folder / "clip.gif")
    return folder / "clip.gif"


def refuse_listing(monkeypatch: pytest.MonkeyPatch, locked: Path) -> None:
    """`locked` cannot be listed, as a folder without read permission (tests run as root, who reads any folder)."""
    real_scandir = os.scandir

    def scandir(path: object = ".") -> object:
        if not isinstance(path, int) and os.fspath(path) == str(locked):   # type: ignore[arg-type]
            raise PermissionError(errno.EACCES, "Permission denied", str(locked))
        return real_scandir(path)   # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)


def test_an_unreadable_folder_named_alone_exits_1_naming_it(tiny_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    refuse_listing(monkeypatch, locked)
    done = caption(str(locked), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.parquet"))
    assert done.exit_code == 1
    assert done.output == f"tarsier: cannot read {locked}: Permission denied\n"   # the reason once, not contradicted
    assert not (tmp_path / "r.parquet").exists()


def test_a_named_folder_without_media_exits_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An empty mount point looks like a folder without media: a cron job must see it."""
    (tmp_path / "notes.txt").write_text("hello")
    done = caption(str(tmp_path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.parquet"))
    assert done.exit_code == 1
    assert done.output.strip() == f"tarsier: no supported media in {tmp_path} (1 other file skipped)"


def test_an_unreadable_subfolder_and_an_empty_named_folder_are_failed_inputs(
        tiny_model_dir: Path, clip: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = clip.parent / "locked"
    locked.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse_listing(monkeypatch, locked)
    out = tmp_path / "r.parquet"
    done = caption(str(clip.parent), str(empty), "--model", str(tiny_model_dir), "--out", str(out),
                   "--max-new-tokens", "2")
    assert done.exit_code == 1, done.output
    assert f"tarsier: warning: cannot read {locked}: Permission denied\n" in done.output
    assert f"tarsier: warning: no supported media in {empty}\n" in done.output
    assert "; failed inputs 2 (unreadable or without media, named above);" in done.output
    assert [row["error"] for row in pq.read_table(out).to_pylist()] == [None]   # the readable clip is captioned


def test_a_rerun_counts_the_errors_its_output_holds(tiny_model_dir: Path, clip: Path, tmp_path: Path) -> None:
    for name in ("bad.mp4", "worse.png"):
        (clip.parent / name).write_text("not media\n")
    args = [str(clip.parent), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.parquet"),
            "--max-new-tokens", "2"]
    assert caption(*args).exit_code == 1
    again = caption(*args)
    assert again.exit_code == 0   # this run's items: none failed (the summary says what the output holds)
    assert "; done earlier 3, 2 of them failed; --retry-errors tries them again;" in again.output


@pytest.mark.parametrize("out, reason, fix", [
    ("file/sub/r.parquet", "Not a directory", "a part of its folder is a file: write the output in a folder"),
    ("/sys/tarsier-test/r.parquet", None, None),   # root cannot make a folder there: EPERM/EACCES, or ENOENT
])
def test_an_output_folder_that_refuses_writes_is_one_line(tiny_model_dir: Path, clip: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, out: str,
                                                          reason: str | None, fix: str | None) -> None:
    if out.startswith("/sys") and not os.path.isdir("/sys/kernel"):
        pytest.skip("no sysfs here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    done = caption(str(clip), "--model", str(tiny_model_dir), "--out", out)
    assert done.exit_code == 2
    line, = done.output.splitlines()
    assert line.startswith(f"Error: cannot write --out {out}: ")
    assert ".lock" not in line and ".tarsier" not in line   # never a file of ours the user did not name
    if reason is not None:
        assert line == f"Error: cannot write --out {out}: {reason}; {fix}"
    else:
        assert line.endswith(("; make its folder writable, or write the output elsewhere",
                              "; its folder cannot be made: write the output in a folder that exists"))


def test_a_read_only_output_folder_names_the_output_not_the_lock(tiny_model_dir: Path, clip: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder mounted read-only: opening the lock file beside --out is the first write, refused with EROFS."""
    from tarsier_batch.outputs import lock

    def read_only_open(path: object, *args: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))   # type: ignore[arg-type]

    monkeypatch.setattr(lock.os, "open", read_only_open)
    out = tmp_path / "r.parquet"
    done = caption(str(clip), "--model", str(tiny_model_dir), "--out", str(out))
    assert done.exit_code == 2
    assert done.output == (f"Error: cannot write --out {out}: Read-only file system; make its folder writable, or "
                           f"write the output elsewhere\n")


def test_an_output_named_as_a_folder_that_does_not_exist_says_so(tmp_path: Path) -> None:
    done = caption(str(tmp_path), "--out", "newdir/")
    assert done.exit_code == 2
    assert done.output == ("Error: --out newdir/ names a folder; give a file in it, such as newdir/results.parquet, "
                           "or --out-dir newdir/ for shards\n")


def test_a_full_disk_says_to_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=100)
    store.begin({"settings": {}}, fresh=False)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    store.add({"path": "/a"})
    with pytest.raises(OutputWriteError) as raised:
        store.flush()
    assert str(raised.value) == (f"cannot save 1 finished row in {store.work_shown}: No space left on device; "
                                 f"free space on its disk and run the same command again")


def test_an_unreadable_folder_beside_an_empty_one_names_both(tiny_model_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    locked, empty = tmp_path / "locked", tmp_path / "empty"
    locked.mkdir()
    empty.mkdir()
    refuse_listing(monkeypatch, locked)
    done = caption(str(locked), str(empty), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.parquet"))
    assert done.exit_code == 1
    assert done.output == (f"tarsier: cannot read {locked}: Permission denied; no supported media in {locked} {empty} "
                           f"(0 other files skipped)\n")


def test_quiet_with_failures_still_says_what_failed(tiny_model_dir: Path, clip: Path, tmp_path: Path) -> None:
    """A cron job's mail is never empty when the exit code says that something failed, nor when the output holds
    failures of earlier runs."""
    (clip.parent / "bad.mp4").write_text("not media\n")
    out = tmp_path / "r.parquet"
    args = [str(clip.parent), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2", "--quiet"]
    done = caption(*args)
    assert done.exit_code == 1
    assert done.output == quiet_with_one_failure(out, 2, clip.parent / "bad.mp4")
    again = caption(*args)   # nothing failed in this run (exit 0), but the output holds a failure to retry
    assert again.exit_code == 0
    assert again.output == (f"tarsier: done: captioned 0; failed 0; done earlier 2, 1 of them failed; "
                            f"--retry-errors tries them again; output {out} (2 rows, unchanged)\n"
                            + where_failures_are(out))


def test_quiet_names_a_few_failures_and_counts_the_rest(tiny_model_dir: Path, clip: Path, tmp_path: Path) -> None:
    """Seven failures: the first five named with their errors, the other two counted, never a line each."""
    for index in range(7):
        (clip.parent / f"bad{index}.mp4").write_text("not media\n")
    (clip.parent / "empty.png").touch()
    out = tmp_path / "r.parquet"
    done = caption(str(clip.parent), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "2",
                   "--quiet")
    assert done.exit_code == 1
    failed = {f"tarsier: failed {row['path']}: {row['error']}" for row in pq.read_table(out).to_pylist()
              if row["error"]}
    lines = done.output.splitlines()
    assert lines[0] == (f"tarsier: done: captioned 1; failed 8 (undecodable 7, unreadable 1); "
                        f"output {out} (9 rows)")
    assert len(set(lines[1:6])) == 5 and set(lines[1:6]) <= failed
    assert "\n".join(lines[6:]) + "\n" == "tarsier: ... and 3 more failed\n" + where_failures_are(out)


def test_quiet_counts_rows_captioned_from_damaged_files_and_a_clean_run_says_nothing(
        tiny_model_dir: Path, clip: Path, tmp_path: Path) -> None:
    clean = caption(str(clip), "--model", str(tiny_model_dir), "--out", str(tmp_path / "clean.parquet"),
                    "--max-new-tokens", "2", "--quiet")
    assert (clean.exit_code, clean.output) == (0, "")
    out = tmp_path / "r.parquet"
    damaged = caption(str(write_small_cut(tmp_path / "cut")), "--model", str(tiny_model_dir), "--out", str(out),
                      "--max-new-tokens", "2", "--quiet")
    assert (damaged.exit_code, damaged.output) == (0, f"tarsier: done: captioned 1; failed 0; with warnings 1 "
                                                      f"(cut_short 1: captioned from damaged files); "
                                                      f"output {out} (1 row)\n")


def test_a_disk_too_full_for_the_settings_stops_in_one_line_before_loading(tiny_model_dir: Path, clip: Path,
                                                                           tmp_path: Path) -> None:
    """RLIMIT_FSIZE fails writes past a size (EFBIG) as a full disk fails them (ENOSPC): the lock file fits under
    it, the settings do not. No model line: the model never loaded."""
    out = tmp_path / "out" / "r.parquet"
    run = start([str(clip), "--model", str(tiny_model_dir), "--out", str(out)], file_size_limit=150)
    _, stderr = run.communicate(timeout=300)
    assert (run.returncode, stderr) == (2, f"Error: cannot write --out {out}: File too large; free space on its "
                                           f"disk and run the same command again\n")
    assert list(out.parent.iterdir()) == []   # no output, no empty work folder, no stand-in, no lock


def test_a_disk_that_fills_while_loading_stops_in_one_line_and_leaves_no_empty_work_folder(
        tiny_model_dir: Path, clip: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(store: ResultStore, provenance: dict) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResultStore, "record_provenance", disk_full)
    out = tmp_path / "r.parquet"
    done = caption(str(clip), "--model", str(tiny_model_dir), "--out", str(out), "--quiet")
    assert done.exit_code == 2
    assert done.output == (f"Error: cannot write --out {out}: No space left on device; free space on its disk and "
                           f"run the same command again\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in"]


def test_a_full_disk_at_the_start_keeps_the_rows_of_earlier_runs(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=1)
    store.begin({"settings": {}}, fresh=False)
    store.add({"path": "/a"})
    parts = sorted(store.work_dir.iterdir())

    def disk_full(store: ResultStore, provenance: dict) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResultStore, "record_provenance", disk_full)
    with pytest.raises(OutputError, match="No space left on device; free space on its disk"):
        ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns()).begin({"settings": {}}, fresh=False)
    assert sorted(store.work_dir.iterdir()) == parts and len(parts) == 2   # the settings and the part
