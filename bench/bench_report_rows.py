"""`tarsier report` over 100,000 rows, and over a long video's segment rows: seconds and page size.

    python bench/bench_report_rows.py [--rows 100000] [--segments 200] [--before DIR]

Builds the outputs with the project's own writer (`ResultStore.commit`: the real schema and
provenance): `--rows` rows cycling over the real shared media (a 1920 x 800 H.264 video, a portrait
MP4, a GIF, a JPEG), one in 40 failed with a kind and a message naming the file and a byte count;
and `--segments` segment rows (1 s windows spread evenly, 8 frames each) over three 20-minute
426 x 240 24 fps H.264 videos made here (a keyframe every 2 s; long files, where opening and
indexing a file costs most, kept small to make). Then times `tarsier report` on
each in a fresh process, with its defaults (a sample of the items, frames extracted by cores - 1
workers), and prints the seconds, the HTML's bytes and the bytes of the strips folder beside it.
`--before DIR` also times the segments' report with the code in DIR (a checkout of an earlier
commit), for a before/after figure: each `--repeats` times, interleaved, the best kept (other work
on a shared machine only ever adds time). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_segments import write_video  # noqa: E402
from measured_on import measured_on  # noqa: E402

from tarsier_batch.outputs.formats import OutputTarget  # noqa: E402
from tarsier_batch.outputs.schema import OutputColumns  # noqa: E402
from tarsier_batch.outputs.store import ResultStore  # noqa: E402

MEDIA = REPO.parent / "shared" / "media"
SOURCES = [("demo_test.mp4", "video", [0, 6, 11, 17, 22, 28, 33, 39, 44, 50, 55, 61, 66, 72, 77, 83]),
           ("portrait_25fps.mp4", "video", [0, 3, 6, 9, 12, 15, 18, 21]),
           ("clip_5f.gif", "gif", [0, 1, 2, 3, 4]), ("tarsier_logo.jpg", "image", [0])]
FAILURES = [("undecodable", "cannot decode video: {path} is cut short after {size:,} of 3,075,695 bytes"),
            ("not_found", "the file no longer exists"), ("timeout", "decoding took longer than 60 s"),
            ("crashed", "the decoder crashed (SIGSEGV)")]
SEGMENT_FPS, SEGMENT_SECONDS, SEGMENT_HEIGHT, SEGMENT_FILES = 24, 1200, 240, 3
PROVENANCE = {"model": "bench", "model_family": "Tarsier2", "frames": 16, "settings": {"model": "bench"},
              "generation": {"max_new_tokens": 128}}


def many_rows(out: Path, count: int) -> Path:
    """`count` rows over SOURCES, one in 40 failed (the kinds in turn), captions of about 60 words."""
    rows = []
    for index in range(count):
        name, kind, indices = SOURCES[index % len(SOURCES)]
        path = str(MEDIA / name)
        row = {"path": path, "key": f"{index:06d}", "media_type": kind, "model": "bench", "num_frames": len(indices),
               "elapsed_s": 1.0}
        if index % 40 == 39:
            error_kind, message = FAILURES[(index // 40) % len(FAILURES)]
            row.update(error=message.format(path=path, size=index * 37), error_kind=error_kind, finish_reason="error")
        else:
            row.update(caption=f"item {index}: " + "a fairly long caption " * 15, frame_indices=indices,
                       finish_reason="eos", generated_tokens=60)
        rows.append(row)
    return written(out, rows, OutputColumns())


def segment_rows(out: Path, folder: Path, count: int) -> Path:
    """`count` 1 s windows, 8 frames each, spread evenly over SEGMENT_FILES long videos."""
    videos = [write_video(folder / f"long{number}.mp4", SEGMENT_SECONDS, SEGMENT_HEIGHT, SEGMENT_FPS)
              for number in range(SEGMENT_FILES)]
    stride = SEGMENT_SECONDS // -(-count // SEGMENT_FILES)
    rows = []
    for index in range(count):
        video, segment = videos[index % len(videos)], index // len(videos)
        start = segment * stride
        first = start * SEGMENT_FPS
        rows.append({"path": str(video), "key": f"{video}#t={start},{start + 1}", "segment": segment,
                     "start_s": float(start), "end_s": float(start + 1), "media_type": "video", "model": "bench",
                     "caption": f"window {segment}", "num_frames": 8,
                     "frame_indices": [first + step * (SEGMENT_FPS - 1) // 7 for step in range(8)],
                     "duration_s": float(SEGMENT_SECONDS), "finish_reason": "eos", "elapsed_s": 0.5})
    return written(out, rows, OutputColumns(spans=True))


def written(out: Path, rows: list[dict], columns: OutputColumns) -> Path:
    ResultStore(OutputTarget(out), columns).commit(rows, PROVENANCE, {"complete": True})
    return out


def timed_report(results: Path, page: Path, code: Path = REPO) -> dict:
    """`tarsier report RESULTS -o PAGE` in a fresh process running the code in `code`: seconds and sizes."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tarsier_batch", "report", str(results), "-o", str(page)], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(code)})
    seconds = time.perf_counter() - start
    folder = page.with_name(f"{page.stem}_files")
    strips = sorted(folder.iterdir()) if folder.is_dir() else []
    return {"seconds": round(seconds, 2), "html_bytes": page.stat().st_size,
            "html_mb": round(page.stat().st_size / 2**20, 2), "strip_files": len(strips),
            "strip_files_bytes": sum(strip.stat().st_size for strip in strips)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--segments", type=int, default=200)
    parser.add_argument("--before", type=Path, help="a checkout of earlier code to time the segments' report with")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        start = time.perf_counter()
        results = many_rows(folder / "many.parquet", args.rows)
        built_s = time.perf_counter() - start
        many = {"rows": args.rows, "results_mb": round(results.stat().st_size / 2**20, 2),
                "build_s": round(built_s, 1), **timed_report(results, folder / "many.html")}
        segments = segment_rows(folder / "segments.parquet", folder, args.segments)
        afters, befores = [], []
        for _ in range(args.repeats):
            afters.append(timed_report(segments, folder / "segments.html"))
            if args.before:
                befores.append(timed_report(segments, folder / "segments-before.html", args.before))
        after = min(afters, key=lambda timed: timed["seconds"])
        before = min(befores, key=lambda timed: timed["seconds"]) if befores else None
    print(json.dumps({
        **measured_on(), "many_rows": many,
        "segments": {"rows": args.segments, "files": SEGMENT_FILES, "repeats": args.repeats, "after": after,
                     "before": before, "all_after_s": [timed["seconds"] for timed in afters],
                     "all_before_s": [timed["seconds"] for timed in befores] or None,
                     "before_code": str(args.before) if args.before else None,
                     "speedup": round(before["seconds"] / after["seconds"], 1) if before else None},
    }, indent=2))


if __name__ == "__main__":
    main()
