"""`tarsier peek` (and `tarsier report`) on a run that has saved no row yet, running or stopped; the warnings of the
rows peek counts and lists."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.outputs import lock as lock_module
from tarsier_batch.outputs.formats import OutputTarget
from tarsier_batch.outputs.lock import OutputLock
from tarsier_batch.outputs.schema import OutputColumns
from tarsier_batch.outputs.store import ResultStore
from test_report_scale import LOCK_HOLDER, PROVENANCE, listing, row, write_results

runner = CliRunner()


def peek_json(out: Path) -> dict:
    done = runner.invoke(app, ["peek", str(out), "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


@pytest.mark.parametrize("stopped_before", [False, True])
def test_a_run_holding_the_lock_before_its_first_row_is_said_to_be_writing(tmp_path: Path,
                                                                         stopped_before: bool) -> None:
    """Loading its model (a lock, nothing else), or resuming one stopped before its first row (its work folder too)."""
    out = tmp_path / "c.parquet"
    if stopped_before:
        ResultStore(OutputTarget(out), OutputColumns()).begin(PROVENANCE, fresh=False)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = listing(tmp_path)
        peek = runner.invoke(app, ["peek", str(out)])
        assert peek.exit_code == 0, peek.output
        said = peek.stderr.strip()
        assert said.startswith(f"{out}: a run is writing it (pid {holder.pid} on ") and \
            said.endswith("); no row saved yet"), said
        assert peek.stdout == ""
        assert peek_json(out) == {"results": str(out), "rows": 0, "unfinished": True, "running": True,
                                  "holder": said[said.index("(pid") + 1:said.index("); no row")],
                                  "note": said.removeprefix(f"{out}: ")}
        page = tmp_path / "report.html"
        made = runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"])
        assert made.exit_code == 0 and "(0 items," in made.stderr and "no row saved yet" in made.stderr, made.output
        assert "a run is writing it (pid" in page.read_text()
        page.unlink()
        assert listing(tmp_path) == before   # the lock file and the work folder as they were
        taken = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from tarsier_batch.outputs"
                                ".lock import OutputLock; OutputLock(Path(sys.argv[1])).acquire()", str(out)],
                               capture_output=True, text=True)
        assert "another run is writing" in taken.stderr   # still held by the run: peek took nothing from it
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0


@pytest.mark.parametrize("lock_left", [False, True])
def test_a_run_stopped_before_its_first_row_is_said_to_be_resumable(tmp_path: Path, lock_left: bool) -> None:
    """Its work folder holds its settings and no part; a lock file a killed run left behind has no holder."""
    out = tmp_path / "c.parquet"
    ResultStore(OutputTarget(out), OutputColumns()).begin(PROVENANCE, fresh=False)
    if lock_left:
        (tmp_path / ".c.parquet.lock").write_text("pid 999999 on gone, since 2026-01-01 00:00:00\n")
    peek = runner.invoke(app, ["peek", str(out)])
    note = "an unfinished run saved no row yet; run the same command again to resume"
    assert (peek.exit_code, peek.stderr, peek.stdout) == (0, f"{out}: {note}\n", ""), peek.output
    assert peek_json(out) == {"results": str(out), "rows": 0, "unfinished": True, "running": False, "holder": None,
                              "note": note}


@pytest.mark.parametrize("lock_left", [False, True])
def test_nothing_of_a_run_is_still_no_such_output(tmp_path: Path, lock_left: bool) -> None:
    """A wrong name, or a run killed while loading its model (a lock file without a holder, no work folder)."""
    out = tmp_path / "c.parquet"
    if lock_left:
        (tmp_path / ".c.parquet.lock").write_text("pid 999999 on gone, since 2026-01-01 00:00:00\n")
    for command in (["peek", str(out)], ["report", str(out), "-o", str(tmp_path / "r.html")]):
        done = runner.invoke(app, command)
        assert done.exit_code == 2 and "no such file or folder" in done.output, done.output


def test_a_run_taking_the_lock_while_a_reader_asks_who_holds_it_waits_the_reader_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "c.parquet"
    (tmp_path / ".c.parquet.lock").write_text("")
    reader = os.open(tmp_path / ".c.parquet.lock", os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)   # as `holder` holds it, for an instant
    waits = []

    def reader_done(seconds: float) -> None:
        waits.append(seconds)
        os.close(reader)

    monkeypatch.setattr(lock_module.time, "sleep", reader_done)
    taken = OutputLock(out)
    taken.acquire()
    try:
        assert len(waits) == 1 and OutputLock(out).holder().startswith(f"pid {os.getpid()} on ")
    finally:
        taken.release()
    assert OutputLock(out).holder() is None


def warned_rows() -> list[dict]:
    return [{**row("/v/a.mp4"), "warnings": ["corrupt_packets"]},
            {**row("/v/b.mp4", caption="partly"), "warnings": ["corrupt_packets", "cut_short"]},
            {**row("/v/c.mp4"), "warnings": None},
            {**row("/v/d.mp4", error="cut", kind="undecodable"), "warnings": None}]


def test_asking_who_holds_a_lock_this_process_holds_leaves_it_held(tmp_path: Path) -> None:
    """On NFS, flock is emulated with POSIX locks, which belong to the process: a shared lock taken and dropped on
    another descriptor would drop the process's own. This process's lock is named without touching it."""
    out = tmp_path / "r.parquet"
    with OutputLock(out):
        assert OutputLock(out).holder() == f"pid {os.getpid()} on {os.uname().nodename} (this process)"
        with pytest.raises(lock_module.OutputLockedError):
            OutputLock(out).acquire()
    assert OutputLock(out).holder() is None


def test_peek_counts_and_lists_the_rows_warnings(tmp_path: Path) -> None:
    out = write_results(tmp_path / "r.parquet", warned_rows())
    peek = runner.invoke(app, ["peek", str(out), "--last", "3"])
    assert peek.exit_code == 0, peek.output
    assert peek.stderr == (f"{out}: 4 rows, 3 captioned, 1 failed (undecodable 1), with warnings 2 "
                           f"(corrupt_packets 2, cut_short 1); finished output\n")
    assert peek.stdout.splitlines() == [
        "captioned (warnings: corrupt_packets, cut_short)  /v/b.mp4  partly",
        "captioned                                         /v/c.mp4  a caption",
        "undecodable                                       /v/d.mp4  cut"]
    as_json = runner.invoke(app, ["peek", str(out), "--json"])
    assert [json.loads(line)["warnings"] for line in as_json.stdout.splitlines()] == \
        [["corrupt_packets"], ["corrupt_packets", "cut_short"], None, None]


def test_an_output_from_before_warnings_peeks_without_them(tmp_path: Path) -> None:
    out = write_results(tmp_path / "r.parquet", warned_rows())
    table = pq.read_table(out)   # as an older version wrote it: the same file, without the column
    pq.write_table(table.drop_columns(["warnings"]).replace_schema_metadata(table.schema.metadata), out)
    peek = runner.invoke(app, ["peek", str(out), "--last", "1", "--json"])
    assert peek.exit_code == 0, peek.output
    assert peek.stderr == f"{out}: 4 rows, 3 captioned, 1 failed (undecodable 1); finished output\n"
    assert json.loads(peek.stdout)["path"] == "/v/d.mp4" and not json.loads(peek.stdout).get("warnings")


def test_peek_lists_the_last_failed_rows_alone(tmp_path: Path) -> None:
    """What `--quiet` points a cron job to: the failed rows and their errors, however many captioned rows follow."""
    rows = [row("/v/a.mp4", error="cut at 10 %", kind="undecodable"), row("/v/b.mp4"),
            row("/v/c.mp4", error="timed out", kind="timeout"), row("/v/d.mp4"), row("/v/e.mp4")]
    out = write_results(tmp_path / "r.parquet", rows)
    peek = runner.invoke(app, ["peek", str(out), "--failed", "--last", "5"])
    assert peek.exit_code == 0, peek.output
    assert peek.stderr == f"{out}: 5 rows, 3 captioned, 2 failed (timeout 1, undecodable 1); finished output\n"
    assert peek.stdout.splitlines() == ["undecodable  /v/a.mp4  cut at 10 %", "timeout      /v/c.mp4  timed out"]
    last = runner.invoke(app, ["peek", str(out), "--failed", "--last", "1", "--json"])
    assert [json.loads(line)["path"] for line in last.stdout.splitlines()] == ["/v/c.mp4"]
