"""The output store, resume plans, settings checks and the output lock, without a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tarsier_batch.cli_options import in_flags
from tarsier_batch.inputs.sources import MediaItem
from tarsier_batch.media import MediaType
from tarsier_batch.outputs.formats import OutputTarget
from tarsier_batch.outputs.lock import OutputLock, OutputLockedError
from tarsier_batch.outputs.results import CaptionResult
from tarsier_batch.outputs.resume import SettingsMismatchError, check_settings, plan_run
from tarsier_batch.outputs.schema import PROVENANCE_KEY, OutputColumns
from tarsier_batch.outputs.store import OutputError, OutputWriteError, ResultStore, StoredRows

SETTINGS = {"model": "m", "model_revision": None, "prompt": None, "frames": 8, "max_new_tokens": 4,
            "temperature": 0.0, "top_p": 1.0, "seed": 0, "repetition_penalty": 1.0, "with_token_ids": False,
            "key": "path"}


def row(path: str, key: str | None = None, error: str | None = None, caption: str = "c") -> dict:
    result = CaptionResult(path=path, media_type="image", key=key or f"{path}|k", caption=None if error else caption,
                           error=error, error_kind="undecodable" if error else None,
                           finish_reason="error" if error else "stop")
    return OutputColumns().row(result, MediaItem(path, MediaType.IMAGE), "m")


def item(path: str, key: str | None = None) -> MediaItem:
    return MediaItem(path, MediaType.IMAGE, key=key or f"{path}|k")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_parts_are_flushed_every_n_rows_or_t_seconds(tmp_path: Path) -> None:
    clock = Clock()
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=3, flush_seconds=10,
                        clock=clock)
    store.begin({"settings": SETTINGS}, fresh=False)
    store.add(row("/a"))
    store.add(row("/b"))
    assert store.saved_rows == 0 and store.pending_rows == 2
    store.add(row("/c"))  # the third row fills a part
    assert store.saved_rows == 3 and len(list(store.work_dir.glob("part-*.parquet"))) == 1
    store.add(row("/d"))
    clock.now = 9.9
    store.flush_if_due()
    assert store.pending_rows == 1
    clock.now = 10.0  # the oldest waiting row is 10 s old
    store.flush_if_due()
    assert store.saved_rows == 4
    stored = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns()).read()
    assert list(stored.rows) == ["/a", "/b", "/c", "/d"] and stored.parts == 2
    assert stored.settings == {str(store.work_dir): SETTINGS}
    assert not any(path.name.endswith(".tmp") for path in store.work_dir.iterdir())


def test_commit_writes_out_atomically_and_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    store = ResultStore(OutputTarget(out), OutputColumns())
    store.begin({"settings": SETTINGS}, fresh=False)
    store.add(row("/a"))
    store.flush()
    store.commit([row("/a"), row("/b")], {"settings": SETTINGS}, {"complete": True})
    assert pq.read_table(out).column("path").to_pylist() == ["/a", "/b"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.parquet"]
    stored = ResultStore(OutputTarget(out), OutputColumns()).read()
    assert list(stored.rows) == ["/a", "/b"] and stored.settings == {str(out): SETTINGS}
    assert json.loads(pq.read_metadata(out).metadata[PROVENANCE_KEY.encode()])["settings"] == SETTINGS


def test_newer_rows_of_a_path_win_and_parts_left_by_a_killed_run_are_read(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    first = ResultStore(OutputTarget(out), OutputColumns())
    first.begin({"settings": SETTINGS}, fresh=False)
    first.commit([row("/a", error="bad"), row("/b")], {"settings": SETTINGS}, {})
    second = ResultStore(OutputTarget(out), OutputColumns())
    second.begin({"settings": SETTINGS}, fresh=False)
    second.add(row("/a", caption="fixed"))
    second.flush()
    (second.work_dir / ".part-x.parquet.tmp").write_bytes(b"half a part")  # killed mid-write: never read
    stored = ResultStore(OutputTarget(out), OutputColumns()).read()
    assert stored.rows["/a"]["caption"] == "fixed" and stored.rows["/a"]["error"] is None
    assert list(stored.rows) == ["/b", "/a"]
    ResultStore(OutputTarget(out), OutputColumns()).begin({"settings": SETTINGS}, fresh=False)
    assert not (second.work_dir / ".part-x.parquet.tmp").exists()


def test_a_failed_part_write_says_how_many_rows_were_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=100)
    store.begin({"settings": SETTINGS}, fresh=False)
    store.add(row("/a"))
    store.flush()

    def disk_full(table, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")  # what a full disk leaves: a torn temporary file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    store.add(row("/b"))
    store.add(row("/c"))
    with pytest.raises(OutputWriteError, match="cannot save 2 finished rows .*No space left on device"):
        store.flush()
    assert store.saved_rows == 1
    monkeypatch.undo()
    stored = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns()).read()
    assert list(stored.rows) == ["/a"] and not stored.unreadable_parts  # the torn file is not a part


def test_output_not_written_by_this_tool_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa

    foreign = tmp_path / "f.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(OutputError, match="exists and is not the output of a tarsier run"):
        ResultStore(OutputTarget(foreign), OutputColumns()).read()
    old = tmp_path / "old.parquet"   # an early version's output: provenance without the settings resume compares
    pq.write_table(pa.table({"path": ["/a"]}).replace_schema_metadata({"tarsier_batch": '{"model": "m"}'}), old)
    with pytest.raises(OutputError, match="was written by an older version of tarsier-batch"):
        ResultStore(OutputTarget(old), OutputColumns()).read()
    garbage = tmp_path / "g.parquet"
    garbage.write_text("hello")
    with pytest.raises(OutputError, match="not readable parquet results"):
        ResultStore(OutputTarget(garbage), OutputColumns()).read()
    with pytest.raises(OutputError, match="is a directory"):
        ResultStore(OutputTarget(tmp_path), OutputColumns())


def test_settings_mismatch_names_each_difference() -> None:
    check_settings({"r.parquet": SETTINGS}, dict(SETTINGS))
    check_settings({"r.parquet": SETTINGS}, {"model": "m", "seed": 7})  # greedy: the seed changes nothing
    with pytest.raises(SettingsMismatchError) as error:
        check_settings({"r.parquet": SETTINGS}, {**SETTINGS, "frames": 16, "prompt": "Say hi."})
    message = str(error.value)
    assert "r.parquet holds rows made with other settings" in message
    assert "prompt (default) there, 'Say hi.' now" in message and "frames 8 there, 16 now" in message
    assert "pass overwrite to caption everything again, or choose another out" in message   # fields, not flags
    assert "pass --overwrite to caption everything again, or choose another --out" in in_flags(error.value)
    with pytest.raises(SettingsMismatchError, match="seed 0 there, 7 now"):
        check_settings({"r": {**SETTINGS, "temperature": 0.7}}, {"temperature": 0.7, "seed": 7})


def test_plan_resumes_retries_reuses_and_prunes(tmp_path: Path) -> None:
    stored = StoredRows(rows={
        "/done": row("/done"), "/failed": row("/failed", error="boom"), "/changed": row("/changed", key="old"),
        "/gone": row("/gone"), "/elsewhere": row("/elsewhere")})
    items = [item("/new"), item("/done"), item("/failed"), item("/changed"), item("/link", key="/done|k"),
             item("/copy1", key="same"), item("/copy2", key="same")]
    existing = {"/elsewhere"}
    plan = plan_run(items, stored, exists=existing.__contains__)
    assert [i.path for i in plan.todo] == ["/new", "/changed", "/copy1"]
    assert [i.path for i in plan.sharing["same"]] == ["/copy2"]
    assert plan.items_to_caption == 4
    assert plan.done["/link"]["caption"] == "c" and plan.done["/link"]["path"] == "/link"  # same content
    assert plan.done["/failed"]["error"] == "boom" and plan.changed == 1
    assert [r["path"] for r in plan.kept] == ["/gone", "/elsewhere"] and plan.missing_kept == 1
    retry = plan_run(items, stored, retry_errors=True, prune_missing=True, exists=existing.__contains__)
    assert [i.path for i in retry.todo] == ["/new", "/failed", "/changed", "/copy1"] and retry.retried == 1
    assert [r["path"] for r in retry.kept] == ["/elsewhere"] and retry.missing_pruned == 1
    new_rows = {path: row(path) for path in ["/new", "/changed", "/copy1", "/copy2"]}
    ordered = plan.ordered_rows(items, new_rows)
    assert [r["path"] for r in ordered] == [i.path for i in items] + ["/gone", "/elsewhere"]


def test_second_locker_is_refused_and_told_who_holds_it(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    with OutputLock(out):
        with pytest.raises(OutputLockedError, match=rf"another run is writing .*r.parquet \(pid {os.getpid()} on "):
            OutputLock(out).acquire()
    assert not (tmp_path / ".r.parquet.lock").exists()
    with OutputLock(out):  # released: free again
        pass


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib; from tarsier_batch.outputs.lock import OutputLock;"
        f"OutputLock(pathlib.Path({str(out)!r})).acquire(); print('locked', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
        OutputLock(out).acquire()
    holder.kill()  # like kill -9: the lock file stays behind, naming a dead process
    holder.wait()
    assert (tmp_path / ".r.parquet.lock").read_text().startswith(f"pid {holder.pid}")
    lock = OutputLock(out)
    lock.acquire()
    assert (tmp_path / ".r.parquet.lock").read_text().startswith(f"pid {os.getpid()}")
    lock.release()


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".csv"])
def test_every_format_reads_back_what_it_wrote(tmp_path: Path, suffix: str) -> None:
    """Captions with newlines, quotes, commas and any Unicode; lists; nulls; times."""
    from datetime import datetime, timezone

    out = tmp_path / f"r{suffix}"
    store = ResultStore(OutputTarget(out), OutputColumns(with_token_ids=True, hashed=True))
    tricky = row("/a", caption='line one\nline "two", with commas\r\n\u00e9\u4e2d \U0001F600')
    tricky.update(frame_indices=[0, 5, 9], generated_ids=[1, 2], width=640, duration_s=1.5, sha256="ab" * 32,
                  size_bytes=123, mtime=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc))
    failed = row("/b,with comma", error="Decoder: bad\nframe")
    failed.update(frame_indices=None, generated_ids=None, sha256=None, size_bytes=None, mtime=None)
    store.begin({"settings": SETTINGS}, fresh=False)
    store.commit([tricky, failed], {"settings": SETTINGS}, {"complete": True})
    stored = ResultStore(OutputTarget(out), OutputColumns(with_token_ids=True, hashed=True)).read()
    assert list(stored.rows.values()) == [tricky, failed]
    assert stored.settings == {str(out): SETTINGS}


def test_a_slow_row_is_saved_at_once_and_fast_rows_share_a_part(tmp_path: Path) -> None:
    """The default cadence: a row waits at most flush_seconds after the last save, and at most one part is
    written per flush_seconds however fast rows come."""
    clock = Clock()
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=4096, flush_seconds=1.0,
                        clock=clock)
    store.begin({"settings": SETTINGS}, fresh=False)   # at 0 s
    clock.now = 5.0
    store.add(row("/slow"))   # the first row, 5 s after the start: saved at the caller's next check
    store.flush_if_due()
    assert (store.saved_rows, store.pending_rows) == (1, 0)
    for number, now in enumerate([5.1, 5.4, 5.9]):
        clock.now = now
        store.add(row(f"/fast{number}"))
        store.flush_if_due()
    assert (store.saved_rows, store.pending_rows) == (1, 3)   # within a second of the last save
    clock.now = 6.0
    store.flush_if_due()   # a second after the last save
    assert (store.saved_rows, store.pending_rows) == (4, 0)
    assert len(list(store.work_dir.glob("part-*.parquet"))) == 2


def test_the_first_row_is_saved_at_once(tmp_path: Path) -> None:
    """The run's first finished row does not wait for flush_seconds to pass since the start (a quick run's first
    row would sit in memory for up to a second); the rows after it share parts as before."""
    clock = Clock()
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=4096, flush_seconds=1.0,
                        clock=clock)
    store.begin({"settings": SETTINGS}, fresh=False)   # at 0 s
    clock.now = 0.2
    store.add(row("/first"))
    store.flush_if_due()
    assert (store.saved_rows, store.pending_rows) == (1, 0)
    clock.now = 0.5
    store.add(row("/second"))
    store.flush_if_due()
    assert (store.saved_rows, store.pending_rows) == (1, 1)   # within a second of the first part
    clock.now = 1.2
    store.flush_if_due()
    assert (store.saved_rows, store.pending_rows) == (2, 0)


def test_many_parts_are_merged_into_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow rows saved one by one would leave a part per row; every COMPACT_EVERY parts they become one."""
    from tarsier_batch.outputs import store as store_module

    monkeypatch.setattr(store_module, "COMPACT_EVERY", 3)
    store = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns(), flush_rows=1)
    store.begin({"settings": SETTINGS}, fresh=False)
    for name in ("/a", "/b", "/c", "/d"):
        store.add(row(name))   # a part each
    parts = sorted(store.work_dir.glob("part-*.parquet"))
    assert len(parts) == 2 and pq.read_table(parts[0]).num_rows == 3   # /a-/c merged, then /d
    stored = ResultStore(OutputTarget(tmp_path / "r.parquet"), OutputColumns()).read()
    assert list(stored.rows) == ["/a", "/b", "/c", "/d"]
