"""`tarsier report` over many rows: failures by kind, a sample or the first items, strips decoded once per file and
kept beside the page; and the rows an unfinished run has saved so far, read by report and peek without its lock."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from awkward_media import H, frame_number, numbered, write_video
from tarsier_batch.cli import app
from tarsier_batch.outputs.formats import OutputTarget, with_metadata
from tarsier_batch.outputs.schema import OutputColumns
from tarsier_batch.outputs.store import ResultStore
from tarsier_batch.review import thumbnails
from tarsier_batch.review.results import Results, figures
from tarsier_batch.review.selection import select_items
from tarsier_batch.review.thumbnails import StripJob, make_strip, make_strips
from test_resume_cli import many  # noqa: F401  (a fixture: twelve small media files)

runner = CliRunner()
PROVENANCE = {"model": "m", "model_family": "Tarsier2", "settings": {"model": "m"}}


def row(path: str, caption: str | None = "a caption", error: str | None = None, kind: str | None = None,
        indices: list[int] | None = None) -> dict:
    return {"path": path, "key": path, "media_type": "video", "model": "m", "caption": None if error else caption,
            "error": error, "error_kind": kind, "frame_indices": None if error else indices,
            "finish_reason": "error" if error else "eos", "elapsed_s": 0.1}


def write_results(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=with_metadata(OutputColumns().schema(), PROVENANCE, {})), path)
    return path


def page_data(page: Path) -> dict:
    return json.loads(re.search(r'<script type="application/json" id=data>(.*?)</script>', page.read_text(),
                                re.S).group(1))


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_video(tmp_path_factory.mktemp("clip") / "numbered.mp4", "libx264", frames=30, picture=numbered)


def test_failures_are_grouped_by_kind_not_by_their_exact_text(tmp_path: Path) -> None:
    """A thousand files cut short at different sizes are one cause: one group, a few examples, the full count."""
    rows = [row(f"/v/cut{n}.mp4", error=f"cannot decode video: truncated after {1000 + n} of 5000 bytes",
                kind="undecodable") for n in range(5)]
    rows += [row("/v/gone.mp4", error="the file no longer exists", kind="not_found"), row("/v/ok.mp4")]
    groups = figures(Results(rows, {}, {})).errors
    assert [(group.kind, group.count) for group in groups] == [("undecodable", 5), ("not_found", 1)]
    assert groups[0].examples == [(f"/v/cut{n}.mp4", f"cannot decode video: truncated after {1000 + n} of 5000 bytes")
                                  for n in range(3)]
    page = tmp_path / "report.html"
    made = runner.invoke(app, ["report", str(write_results(tmp_path / "r.parquet", rows)), "-o", str(page),
                               "--workers", "0"])
    assert made.exit_code == 0, made.output
    header = page.read_text().split("<div class=controls>")[0]
    assert "6 failed items: undecodable 5, not_found 1" in header
    assert "<b>5 ×</b> <code>undecodable</code>" in header and "… and 2 more" in header
    assert "truncated after 1002 of 5000 bytes" in header and "truncated after 1003 of 5000" not in header


def test_a_sample_keeps_rare_failures_is_seeded_and_the_figures_count_every_row(tmp_path: Path) -> None:
    rows = [row(f"/v/{n}.mp4") for n in range(5000)]
    for n in range(0, 5000, 250):   # 20 cut short, 3 vanished: 0.46 % of the rows
        rows[n] = row(f"/v/{n}.mp4", error=f"cut at {n}", kind="undecodable")
    for n in (101, 2102, 4103):
        rows[n] = row(f"/v/{n}.mp4", error="gone", kind="not_found")
    chosen = select_items(rows, sample=100, seed=7)
    statuses = [rows[index]["error_kind"] or "captioned" for index in chosen.indices]
    assert len(chosen.indices) == 100 and chosen.indices == sorted(chosen.indices)
    assert statuses.count("not_found") == 3 and statuses.count("undecodable") == 10
    assert chosen.indices == select_items(rows, sample=100, seed=7).indices
    assert chosen.indices != select_items(rows, sample=100, seed=8).indices
    assert select_items(rows, limit=30).indices == list(range(30))
    assert len(select_items(rows).indices) == 1000   # many rows and nothing asked: a default sample
    assert len(select_items(rows, sample=0).indices) == 5000 and select_items(rows[:50]).how is None

    results = write_results(tmp_path / "r.parquet", rows)
    page = tmp_path / "report.html"
    made = runner.invoke(app, ["report", str(results), "-o", str(page), "--sample", "100", "--seed", "7",
                               "--workers", "0"])
    assert made.exit_code == 0, made.output
    assert "5,000 items, 100 shown" in made.output
    text = page.read_text()
    assert "showing 100 of 5,000 items, sampled" in text and "23 failed items: undecodable 20, not_found 3" in text
    assert [item["path"] for item in page_data(page)["items"]] == [rows[index]["path"] for index in chosen.indices]
    first = tmp_path / "first.html"
    assert runner.invoke(app, ["report", str(results), "-o", str(first), "--limit", "30"]).exit_code == 0
    assert "showing 30 of 5,000 items, the first" in first.read_text() and len(page_data(first)["items"]) == 30
    both = runner.invoke(app, ["report", str(results), "-o", str(first), "--limit", "3", "--sample", "3"])
    assert both.exit_code == 2 and "give --sample or --limit, not both" in both.output


def test_a_files_segments_are_decoded_in_one_pass(clip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each segment row reopened and decoded its file again: a long video's 200 segments cost 200 decodings."""
    calls = []
    real = thumbnails.load_media

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(thumbnails, "load_media", counted)
    wanted = [(0, 4), (10, 14), (20, 29), (0, 4)]
    jobs = [StripJob(str(clip), "video", indices, H) for indices in wanted]
    strips = make_strips(jobs, workers=0)
    assert len(calls) == 1
    assert strips[0] is strips[3]   # the same frames: one strip
    for strip, indices in zip(strips, wanted):
        assert strip.jpeg == make_strip(StripJob(str(clip), "video", indices, H)).jpeg
    gone = make_strips([StripJob(str(clip.parent / "gone.mp4"), "video", (0,), H)] * 2 +
                       [StripJob(str(clip), "video", (1,), H)], workers=1)
    assert [strip.problem for strip in gone] == ["the file no longer exists"] * 2 + [None]
    assert frame_number_of(gone[2].jpeg) == [1]


def frame_number_of(jpeg: bytes) -> list[int]:
    import io

    from PIL import Image

    return [frame_number(Image.open(io.BytesIO(jpeg)).convert("RGB"))]


def test_strips_beside_the_page_load_offline_from_wherever_the_pair_is_copied(clip: Path, tmp_path: Path) -> None:
    from test_report import body_data, chromium

    rows = [row(f"{clip}", indices=[n, n + 1]) | {"key": f"k{n}"} for n in range(12)]
    results = write_results(tmp_path / "r.parquet", rows)
    page = tmp_path / "made" / "my report.html"
    page.parent.mkdir()
    made = runner.invoke(app, ["report", str(results), "-o", str(page), "--thumbnails", "folder", "--workers", "0"])
    assert made.exit_code == 0, made.output
    folder = page.with_name("my report_files")
    assert sorted(path.name for path in folder.iterdir()) == [f"{n:06d}.jpg" for n in range(12)]
    text = page.read_text()
    assert "data:image" not in text and "my%20report_files/000011.jpg" in text
    moved = tmp_path / "elsewhere"
    page.parent.rename(moved)
    shown = body_data(chromium("--dump-dom", (moved / "my report.html").as_uri(), tmp_path=tmp_path))
    assert (shown["rendered"], shown["images-loaded"], shown["images-failed"]) == ("12", "12", "0")
    (moved / "my report_files" / "notes.txt").write_text("mine")   # not a folder of ours: never replaced
    again = runner.invoke(app, ["report", str(results), "-o", str(moved / "my report.html"), "--thumbnails", "folder"])
    assert again.exit_code == 2 and "is not the strips folder of an earlier report" in again.output
    inline = tmp_path / "inline.html"
    assert runner.invoke(app, ["report", str(results), "-o", str(inline), "--workers", "0"]).exit_code == 0
    assert inline.read_text().count("data:image/jpeg;base64,") == 12 and not (tmp_path / "inline_files").exists()


def stopped_run(out: Path, first: list[dict], second: list[dict]) -> ResultStore:
    """A run stopped before it wrote `out`: two parts saved with the store, never assembled."""
    store = ResultStore(OutputTarget(out), OutputColumns(), flush_rows=10_000)
    store.begin(PROVENANCE, fresh=False)
    for rows in (first, second):
        for one in rows:
            store.add(one)
        store.flush()
    return store


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_report_and_peek_read_the_rows_a_stopped_run_saved_and_change_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run" / "r.parquet"
    out.parent.mkdir()
    store = stopped_run(out, [row(f"/v/{n}.mp4") for n in range(3)],
                        [row("/v/1.mp4", caption="again"), row("/v/9.mp4", error="cut", kind="undecodable")])
    (store.work_dir / ".part-x.parquet.tmp").write_bytes(b"half a part")   # a part still being written
    before = listing(out.parent)
    page = tmp_path / "report.html"
    made = runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"])
    assert made.exit_code == 0, made.output
    assert "unfinished run: 4 rows saved so far" in made.output
    assert "unfinished run: 4 rows saved so far" in page.read_text()
    assert [item["path"] for item in page_data(page)["items"]] == ["/v/0.mp4", "/v/2.mp4", "/v/1.mp4", "/v/9.mp4"]
    assert page_data(page)["items"][2]["caption"] == "again"   # an item's newest row
    peek = runner.invoke(app, ["peek", str(out), "--last", "2"])
    assert peek.exit_code == 0, peek.output
    assert "4 rows, 3 captioned, 1 failed (undecodable 1); unfinished run: 4 rows saved so far in 2 part files" \
        in peek.stderr
    assert peek.stdout.splitlines() == ["captioned    /v/1.mp4  again", "undecodable  /v/9.mp4  cut"]
    as_json = runner.invoke(app, ["peek", str(out), "--last", "1", "--json"])
    assert [json.loads(line)["path"] for line in as_json.stdout.splitlines()] == ["/v/9.mp4"]
    assert listing(out.parent) == before   # no lock file, no part removed, nothing assembled


def test_a_resumed_run_that_stopped_shows_the_outputs_rows_and_its_newer_ones(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    ResultStore(OutputTarget(out), OutputColumns()).commit(
        [row("/v/a.mp4"), row("/v/b.mp4", error="cut", kind="undecodable")], PROVENANCE, {"complete": True})
    stopped_run(out, [row("/v/b.mp4", caption="retried")], [row("/v/c.mp4")])
    page = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"]).exit_code == 0
    assert [(item["path"], item["caption"]) for item in page_data(page)["items"]] == [
        ("/v/a.mp4", "a caption"), ("/v/b.mp4", "retried"), ("/v/c.mp4", "a caption")]
    assert "unfinished run: 3 rows saved so far" in page.read_text() and "failed item" not in page.read_text()


@pytest.mark.parametrize("says_so", [True, False])
def test_a_stopped_run_replacing_the_output_shows_its_own_rows_alone(tmp_path: Path, says_so: bool) -> None:
    """An --overwrite run's parts say they replace the output; parts made with other settings than the output's
    (an overwriting run of a version that did not say so) replace it as well."""
    out = tmp_path / "r.parquet"
    ResultStore(OutputTarget(out), OutputColumns()).commit([row("/v/a.mp4"), row("/v/b.mp4")], PROVENANCE,
                                                           {"complete": True})
    store = ResultStore(OutputTarget(out), OutputColumns())
    store.begin(PROVENANCE if says_so else {**PROVENANCE, "settings": {"model": "other"}}, fresh=True,
                replaces_output=says_so)
    store.add(row("/v/b.mp4", caption="anew"))
    store.flush()
    peek = runner.invoke(app, ["peek", str(out), "--last", "5"])
    assert "1 rows, 1 captioned, 0 failed; unfinished run: 1 rows saved so far in 1 part files" in peek.stderr, \
        peek.output
    assert peek.stdout.splitlines() == ["captioned  /v/b.mp4  anew"]
    page = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"]).exit_code == 0
    assert [(item["path"], item["caption"]) for item in page_data(page)["items"]] == [("/v/b.mp4", "anew")]
    assert "unfinished run: 1 rows saved so far" in page.read_text()


def test_a_part_compacted_away_while_it_is_read_is_read_from_the_merged_part(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tarsier_batch.outputs import unfinished

    out = tmp_path / "r.parquet"
    store = stopped_run(out, [row("/v/a.mp4")], [row("/v/b.mp4")])
    real = unfinished.pq.read_table
    compacted = []

    def compacting_first(part: Path, **kwargs):
        if not compacted:   # the running run compacts between the listing and this read
            parts = sorted(store.work_dir.glob("part-*.parquet"))
            merged = store.work_dir / "part-99999999999999999999-1.parquet"
            pq.write_table(pa.concat_tables(real(one) for one in parts), merged)
            for one in parts:
                one.unlink()
            compacted.append(parts)
        return real(part, **kwargs)

    monkeypatch.setattr(unfinished.pq, "read_table", compacting_first)
    saved = unfinished.read_saved_parts(out, OutputColumns())
    assert [one["path"] for one in saved.rows] == ["/v/a.mp4", "/v/b.mp4"] and saved.parts == 1


LOCK_HOLDER = """
import sys
from pathlib import Path
from tarsier_batch.outputs.lock import OutputLock
with OutputLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.readline()   # held until the test closes our stdin
"""


def test_report_and_peek_read_while_another_process_holds_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    stopped_run(out, [row("/v/a.mp4")], [row("/v/b.mp4", error="gone", kind="not_found")])
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        taken = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from tarsier_batch.outputs"
                                ".lock import OutputLock; OutputLock(Path(sys.argv[1])).acquire()", str(out)],
                               capture_output=True, text=True)
        assert "another run is writing" in taken.stderr   # the lock is really held
        peek = runner.invoke(app, ["peek", str(out)])
        assert peek.exit_code == 0 and "2 rows, 1 captioned, 1 failed (not_found 1)" in peek.stderr, peek.output
        page = tmp_path / "report.html"
        made = runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"])
        assert made.exit_code == 0 and "unfinished run: 2 rows saved so far" in page.read_text(), made.output
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0


@pytest.mark.kill
def test_peek_and_report_read_a_real_run_while_it_writes_and_after_it_is_killed(
        many: Path, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811 (the fixture imported above)
    from test_resume_cli import parts, start, wait_for

    def run_writing(out: Path):
        return start([str(many), "--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "4",
                      "--batch-size", "2", "--flush-rows", "1", "--quiet"])

    # Read again and again while the run holds the lock, writes parts and at last assembles its output.
    out = tmp_path / "read-while-running" / "r.parquet"
    out.parent.mkdir()
    run = run_writing(out)
    wait_for(lambda: parts(out) >= 1, run, "a part")
    seen = []
    while run.poll() is None:
        during = runner.invoke(app, ["peek", str(out), "--last", "0"])
        assert during.exit_code == 0, during.output
        seen.append(int(re.search(r": (\d+) rows, ", during.stderr).group(1)))
    assert run.wait() == 0 and seen == sorted(seen) and seen[0] >= 1   # rows only ever added
    done = runner.invoke(app, ["peek", str(out), "--last", "0"])
    assert "12 rows, " in done.stderr and "finished output" in done.stderr, done.output
    page = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(out), "-o", str(page), "--workers", "0"]).exit_code == 0

    # Killed after its first part: what it saved is read, and nothing is changed.
    out = tmp_path / "killed" / "r.parquet"
    out.parent.mkdir()
    run = run_writing(out)
    wait_for(lambda: parts(out) >= 1, run, "a part")
    run.kill()
    run.communicate()
    assert not out.exists()
    saved = sum(pq.read_metadata(part).num_rows for part in (out.parent / ".r.parquet.tarsier").glob("part-*.parquet"))
    before = listing(out.parent)
    after = runner.invoke(app, ["peek", str(out), "--last", "1", "--json"])
    assert f"unfinished run: {saved} rows saved so far" in after.stderr, after.output
    assert len(after.stdout.splitlines()) == 1 and json.loads(after.stdout)["path"].startswith(str(many))
    assert listing(out.parent) == before
