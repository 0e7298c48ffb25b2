"""How `tarsier report` scales: frame extraction per item, and a 10,000-item page's size and opening time in Chromium.

    python bench/bench_report.py [--items 10000] [--decoded 150] [--workers 1]

Rows point at the real shared media (a 1920 x 800 H.264 video, a GIF, a JPEG), so the strips
are real frames. Extraction is timed on `--decoded` rows through `write_report` itself; the
10,000-item page is rendered with strips made once per distinct file (extracting 10,000 times
would only repeat the per-item figure), then opened in headless Chromium: timed as taking a
screenshot of it (load, script, first page rendered), best of 3, next to a blank page, and
checked with --dump-dom (untimed: serialising 100+ MB of DOM takes most of that command's
time) for the items rendered and the images loaded. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.outputs.formats import with_metadata  # noqa: E402
from tarsier_batch.outputs.schema import OutputColumns  # noqa: E402
from tarsier_batch.review import write_report  # noqa: E402
from tarsier_batch.review.page import render  # noqa: E402
from tarsier_batch.review.results import figures, load_results  # noqa: E402
from tarsier_batch.review.thumbnails import StripJob, make_strip, shown_indices  # noqa: E402

MEDIA = REPO.parent / "shared" / "media"
SOURCES = [("demo_test.mp4", "video", [0, 6, 11, 17, 22, 28, 33, 39, 44, 50, 55, 61, 66, 72, 77, 83]),
           ("clip_5f.gif", "gif", [0, 1, 2, 3, 4]), ("tarsier_logo.jpg", "image", [0])]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def results_file(folder: Path, count: int) -> Path:
    """`count` rows cycling over SOURCES, one in 50 a failure, captions of about 60 words."""
    rows = []
    for index in range(count):
        name, kind, indices = SOURCES[index % len(SOURCES)]
        failed = index % 50 == 49
        rows.append({"path": str(MEDIA / name), "key": str(index), "media_type": kind, "model": "bench",
                     "caption": None if failed else f"item {index}: " + "a fairly long caption " * 15,
                     "error": "cannot decode video: bench" if failed else None,
                     "frame_indices": None if failed else indices, "num_frames": len(indices),
                     "finish_reason": "error" if failed else "eos", "generated_tokens": 60, "elapsed_s": 1.0})
    out = folder / f"r{count}.parquet"
    schema = with_metadata(OutputColumns().schema(), {"model": "bench", "settings": {}}, {})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return out


def open_seconds(page: Path, profile: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["/usr/bin/chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1200,1600",
                    f"--screenshot={page.with_suffix('.png')}", page.as_uri()], capture_output=True, timeout=600,
                   check=True)
    return time.perf_counter() - start


def shown(page: Path, profile: Path) -> dict[str, str]:
    """The data-* attributes the page's script sets on <body> once the first page is rendered."""
    done = subprocess.run(["/usr/bin/chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           "--virtual-time-budget=60000", "--dump-dom", page.as_uri()],
                          capture_output=True, timeout=600, check=True)
    body = re.search(r"<body([^>]*)>", done.stdout.decode()).group(1)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--decoded", type=int, default=150)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        start = time.perf_counter()
        write_report(results_file(folder, args.decoded), folder / "small.html", workers=args.workers)
        extract_s = time.perf_counter() - start
        big = load_results(results_file(folder, args.items))
        strips = {name: asdict(make_strip(StripJob(str(MEDIA / name), kind, tuple(shown_indices(indices, 8)), 72)))
                  for name, kind, indices in SOURCES}
        per_row = [strips[Path(row["path"]).name] if not row["error"] else {} for row in big.rows]
        start = time.perf_counter()
        page = folder / "big.html"
        page.write_text(render(big, figures(big), per_row, "bench"), encoding="utf-8")
        render_s = time.perf_counter() - start
        blank = folder / "blank.html"
        blank.write_text("<!doctype html><body></body>")
        blank_s = min(open_seconds(blank, folder / f"profile-blank-{n}") for n in range(3))
        big_s = min(open_seconds(page, folder / f"profile-big-{n}") for n in range(3))
        seen = shown(page, folder / "profile-dom")
        html_mb = round(page.stat().st_size / 2**20, 1)
    print(json.dumps({
        **measured_on(), "extraction": {"rows": args.decoded, "workers": args.workers, "seconds": round(extract_s, 2),
                       "ms_per_row": round(1000 * extract_s / args.decoded, 1)},
        "page": {"items": args.items, "html_mb": html_mb, "render_s": round(render_s, 2),
                 "chromium_open_blank_page_s": round(blank_s, 2), "chromium_open_report_s": round(big_s, 2),
                 "rendered_on_first_page": seen.get("rendered"), "images_loaded": seen.get("images-loaded"),
                 "matching": seen.get("matching")},
    }, indent=2))


if __name__ == "__main__":
    main()
