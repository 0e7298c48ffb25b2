"""`tarsier report`: the page's content, its frames, its escaping, and how it behaves in a real browser."""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from awkward_media import H, W, frame_number, numbered, write_video
from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.families.catalog import family_named
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.outputs.formats import with_metadata
from tarsier_batch.outputs.schema import OutputColumns
from tarsier_batch.review.thumbnails import StripJob, make_strip, shown_indices

runner = CliRunner()
CHROMIUM = "/usr/bin/chromium"
HOSTILE = 'a </script><img src=x onerror="document.title=1"> <!-- & "quoted" \u00e9\u4e2d'


def chromium(*args: str, tmp_path: Path) -> str:
    """Headless Debian Chromium (no network, a fresh profile); returns what it printed on stdout."""
    if not Path(CHROMIUM).exists():
        pytest.fail("the report's browser test needs Chromium: apt-get install chromium (.ci/run does)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    printed, errors = tmp_path / f"{profile.name}.out", tmp_path / f"{profile.name}.err"
    # Output to files and Chromium in a session of its own: on a timeout the whole group is killed; with
    # pipes, a helper process that outlived the browser would keep them open and the wait would never end.
    with printed.open("wb") as out, errors.open("wb") as err:
        browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                    "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
                                    *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = browser.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait()
            pytest.fail(f"Chromium did not finish within 180 s: {errors.read_text(errors='replace')[-2000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)   # helpers it left behind
    assert returncode == 0, errors.read_text(errors="replace")[-2000:]
    return printed.read_text(errors="replace")


def body_data(dom: str) -> dict[str, str]:
    """The data-* attributes the page's script sets on <body> once it has rendered."""
    body = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))


@pytest.fixture(scope="module")
def numbered_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_video(tmp_path_factory.mktemp("clip") / "numbered.mp4", "libx264", frames=30, picture=numbered)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, shared_media: Path, numbered_clip: Path) -> Path:
    """A results file as `tarsier caption` writes it: 60 captioned items, 3 failures, one hostile caption."""
    folder = tmp_path_factory.mktemp("results")
    columns = OutputColumns()
    rows = []
    sources = [(numbered_clip, "video", [0, 4, 8, 12, 17, 21, 25, 29]),
               (shared_media / "clip_5f.gif", "gif", [0, 1, 2, 3, 4]),
               (shared_media / "tarsier_logo.jpg", "image", [0])]
    for index in range(60):
        path, kind, indices = sources[index % 3]
        rows.append({"path": str(path), "key": f"k{index}", "media_type": kind, "model": "m", "prompt": "Describe.",
                     "caption": HOSTILE if index == 0 else f"caption number {index} " + "word " * (index % 7),
                     "num_frames": len(indices), "frame_indices": indices, "width": W, "height": H,
                     "decoder": "decord", "prompt_tokens": 100, "generated_tokens": 10, "finish_reason": "eos",
                     "elapsed_s": 0.5})
    for index, (error, kind) in enumerate([("cannot decode video: decord: Error reading {path}...", "undecodable")] * 2
                                          + [("the file no longer exists", "not_found")]):
        path = str(folder / f"bad{index}.mp4")
        rows.append({"path": path, "key": f"b{index}", "media_type": "video", "error": error.format(path=path),
                     "error_kind": kind, "finish_reason": "error", "elapsed_s": 0.0})
    provenance = {"model": "m", "model_family": "Tarsier2", "frames": 8, "settings": {},
                  "generation": {"max_new_tokens": 8}}
    out = folder / "r.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=with_metadata(columns.schema(), provenance,
                                                                   {"items_per_s": 2.0, "tokens_per_s": 20.0})), out)
    return out


def test_strips_are_the_recorded_frames(numbered_clip: Path) -> None:
    indices = [0, 7, 13, 29]
    strip = make_strip(StripJob(str(numbered_clip), "video", tuple(indices), H))
    image = Image.open(io.BytesIO(base64.b64decode(strip.uri.split(",", 1)[1]))).convert("RGB")
    assert image.size == (len(indices) * W + 2 * (len(indices) - 1), H)
    tiles = [image.crop((i * (W + 2), 0, i * (W + 2) + W, H)) for i in range(len(indices))]
    assert [frame_number(tile) for tile in tiles] == indices
    assert shown_indices(list(range(16)), 8) == [0, 2, 4, 6, 9, 11, 13, 15] and shown_indices([3, 5], 8) == [3, 5]
    gone = make_strip(StripJob(str(numbered_clip.parent / "gone.mp4"), "video", (0,), H))
    assert gone.uri is None and gone.problem == "the file no longer exists"


def test_report_in_a_real_browser(results: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = runner.invoke(app, ["report", str(results), "-o", str(page), "--workers", "1"])
    assert done.exit_code == 0, done.output
    assert "wrote" in done.output and "63 items" in done.output
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text   # works offline
    assert "3 failed items: undecodable 2, not_found 1" in text
    assert "<b>2 ×</b> <code>undecodable</code>" in text and "<code>cannot decode video: decord: Error reading " in text
    dom = chromium("--dump-dom", page.as_uri(), tmp_path=tmp_path)
    shown = body_data(dom)
    assert (shown["matching"], shown["rendered"]) == ("63", "50")   # the first page of 50
    assert (shown["images-loaded"], shown["images-failed"]) == ("50", "0")   # 50 captioned items on page 1
    assert "<img src=\"x\"" not in dom and "&lt;/script&gt;&lt;img src=x" in dom   # the hostile caption is text
    failed = body_data(chromium("--dump-dom", page.as_uri() + "#status=failed", tmp_path=tmp_path))
    assert (failed["matching"], failed["rendered"], failed["images-loaded"]) == ("3", "3", "0")
    gifs = body_data(chromium("--dump-dom", page.as_uri() + "#type=gif&q=number", tmp_path=tmp_path))
    assert gifs["matching"] == "20"
    screenshot = tmp_path / "report.png"
    chromium("--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={screenshot}", page.as_uri(),
             tmp_path=tmp_path)
    assert Image.open(screenshot).size == (1200, 1600)


def test_a_strip_wider_than_the_page_is_scaled_to_fit_it(results: Path, tmp_path: Path) -> None:
    """An 8-frame strip ran past a narrow page (a fixed height, the width following): it must fit its item."""
    page = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(results), "-o", str(page), "--workers", "1"]).exit_code == 0
    # Measured in the page once it has loaded: how many strips reach past their item's right edge.
    probe = ("<script>window.addEventListener('load', () => { let over = 0;"
             " for (const img of document.querySelectorAll('.strip img'))"
             "   if (img.getBoundingClientRect().right"
             "       > img.closest('.item').getBoundingClientRect().right + 0.5) over++;"
             " document.body.dataset.stripsOver = over;"
             " document.body.dataset.stripsShown = document.querySelectorAll('.strip img').length; });</script>")
    measured = tmp_path / "measured.html"
    measured.write_text(page.read_text().replace("</body>", probe + "</body>"))
    shown = body_data(chromium("--window-size=400,1600", "--dump-dom", measured.as_uri(), tmp_path=tmp_path))
    assert shown["strips-shown"] == "50" and shown["strips-over"] == "0", shown


def test_a_vanished_file_gets_a_placeholder_and_the_report_completes(results: Path, tmp_path: Path,
                                                                      numbered_clip: Path) -> None:
    moved = tmp_path / "moved.mp4"
    shutil.copy(numbered_clip, moved)
    table = pq.read_table(results)
    paths = [str(moved) if row == 0 else path for row, path in enumerate(table.column("path").to_pylist())]
    copy = tmp_path / "r.parquet"
    pq.write_table(table.set_column(0, "path", pa.array(paths)), copy)
    moved.unlink()
    page = tmp_path / "report.html"
    assert runner.invoke(app, ["report", str(copy), "-o", str(page), "--workers", "0"]).exit_code == 0
    data = json.loads(re.search(r'<script type="application/json" id=data>(.*?)</script>', page.read_text(),
                                re.S).group(1))
    first = data["items"][0]
    assert first["strip"] is False and first["stripProblem"] == "the file no longer exists"
    assert first["caption"] == HOSTILE   # the JSON block holds the text unchanged


@pytest.mark.parametrize(("args", "message"), [(["missing.parquet", "-o", "r.html"], "no such file or folder"),
                                               (["notes.txt", "-o", "r.html"], "not results of tarsier caption"),
                                               (["r.parquet", "-o", "."], "is a directory")])
def test_report_usage_errors(tmp_path: Path, monkeypatch, args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "r.parquet").write_text("x")
    done = runner.invoke(app, ["report", *args])
    assert done.exit_code == 2 and message in done.output and len(done.output.splitlines()) == 1, done.output


def test_a_segment_is_an_item_of_its_own_named_by_its_span(numbered_clip: Path, tmp_path: Path) -> None:
    columns = OutputColumns(spans=True)
    rows = [{"path": str(numbered_clip), "key": f"k#t={start},{start + 1}", "segment": number, "start_s": start,
             "end_s": start + 1.0, "media_type": "video", "model": "m", "caption": f"window {number}",
             "num_frames": 2, "frame_indices": [10 * number, 10 * number + 9], "width": W, "height": H,
             "finish_reason": "eos", "elapsed_s": 0.1} for number, start in enumerate([0.0, 1.0, 2.0])]
    results = tmp_path / "segments.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=with_metadata(columns.schema(), {"settings": {}}, {})), results)
    made = runner.invoke(app, ["report", str(results), "-o", str(tmp_path / "report.html"), "--workers", "0"])
    assert made.exit_code == 0, made.output
    data = json.loads(re.search(r'<script type="application/json" id=data>(.*?)</script>',
                                (tmp_path / "report.html").read_text(), re.S).group(1))
    assert [item["path"] for item in data["items"]] == [f"{numbered_clip}#t=0,1", f"{numbered_clip}#t=1,2",
                                                        f"{numbered_clip}#t=2,3"]
    assert all(item["strip"] for item in data["items"])
    # The file's segments on its timeline (a failed one marked), each item pointing at its file and place.
    assert data["files"] == [{"path": str(numbered_clip), "length": 3.0,
                              "segments": [[0.0, 1.0, False, 0], [1.0, 2.0, False, 1], [2.0, 3.0, False, 2]]}]
    assert [(item["file"], item["segment"], item["span"]) for item in data["items"]] == [
        (0, 0, [0.0, 1.0]), (0, 1, [1.0, 2.0]), (0, 2, [2.0, 3.0])]
    # In a browser: one header over the file's segments, and each segment's own place marked on its bar.
    dom = chromium("--dump-dom", (tmp_path / "report.html").as_uri(), tmp_path=tmp_path)
    assert body_data(dom)["file-headers"] == "1"
    assert dom.count('class="seg current"') == 3 and dom.count('class="timeline"') == 4
    assert "segment 1: 1 s - 2 s of 3 s" in dom


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_family_run_renders_with_its_model_family_and_answers(family: str, tmp_path: Path) -> None:
    """A prompt set captioned with a Qwen-family checkpoint: the header names its model and family and lists the
    questions, and each row is an item with its model, its frames' strip and every question's answer."""
    model = make_tiny_model(tmp_path / family, "tiny", seed=0, family=family)
    out, report = tmp_path / "out.parquet", tmp_path / "report.html"
    captioned = runner.invoke(app, [
        "caption", str(SAMPLE_DATA / "ball_h264.mp4"), str(SAMPLE_DATA / "still.png"), "-o", str(out), "--model",
        str(model), "--max-new-tokens", "4", "--ask", "caption=Describe the video.", "--ask", "objects=List them.",
        "-q"])
    assert captioned.exit_code == 0, captioned.output
    made = runner.invoke(app, ["report", str(out), "-o", str(report), "--workers", "0"])
    assert made.exit_code == 0, made.output
    rows = pq.read_table(out).to_pylist()
    provenance = json.loads(pq.read_schema(out).metadata[b"tarsier_batch"])
    assert provenance["model_family"] == family_named(family).name
    page = report.read_text()
    assert f"{provenance['model']} ({family_named(family).name})" in html.unescape(page)
    assert "caption: Describe the video.; objects: List them." in html.unescape(page)
    data = json.loads(re.search(r'<script type="application/json" id=data>(.*?)</script>', page, re.S).group(1))
    assert [(item["path"], item["model"], item["frame_indices"]) for item in data["items"]] == \
        [(row["path"], provenance["model"], row["frame_indices"]) for row in rows]
    assert all(item["strip"] for item in data["items"])
    assert [item["answers"] for item in data["items"]] == \
        [[[name, row[name], row[name + "_prompt"]] for name in ("caption", "objects")] for row in rows]


def test_a_small_page_says_its_size_in_kb(tmp_path: Path) -> None:
    columns = OutputColumns()
    rows = [{"path": str(tmp_path / "gone.mp4"), "key": "g", "media_type": "video",
             "error": "the file no longer exists", "error_kind": "not_found",
             "finish_reason": "error", "elapsed_s": 0.0}]
    results = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=with_metadata(columns.schema(), {"model": "m", "settings": {}},
                                                                   {})), results)
    page = tmp_path / "report.html"
    done = runner.invoke(app, ["report", str(results), "-o", str(page), "--workers", "1"])
    assert done.exit_code == 0, done.output
    size_kb = round(page.stat().st_size / 1024)
    assert 0 < size_kb < 1024 and f"(1 item, {size_kb} KB) in " in done.output, done.output
