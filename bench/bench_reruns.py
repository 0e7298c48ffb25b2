"""Do-nothing re-runs: `tarsier caption` run again over an output that holds every row, plain files against the same
files in fixed windows (`--segments fixed:WINDOW`).

    python bench/bench_reruns.py [--files 8] [--seconds 200] [--window 10] [--repeats 3] [--model demo]

Makes (in a temporary folder) --files H.264 videos of --seconds each (320 x 180, 10 fps, a keyframe every 2 s),
captions them once whole and once in windows (--seconds / --window windows a file), then times each command in a
fresh process as a user runs it again, the first two interleaved:

- plain: the re-run over the whole-file output;
- windows: the re-run over the windowed output, whose rows count their files' segments (`num_segments`): no video
  is opened. Target: within 1.5x of plain;
- windows_uncounted: the same re-run over the windowed output with `num_segments` dropped (an output written before
  rows counted segments): every video's length is read again in decoding workers, what every re-run cost before.
  The output is written back with the counts, so the column is dropped again before each repeat; these repeats
  come after the others;
- dry_run_plain, dry_run_windows: `--dry-run` towards a new output, plain against windows: every video's length is
  read for the windows, in worker processes (fresh interpreters: what a first run plans before anything loads).

Each figure is the median of the seconds measured around the process (`measured_s`) and the summary's own wall time
(`reported`, whole seconds, from the process's start). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from measured_on import measured_on  # noqa: E402

WIDTH, HEIGHT, FPS = 320, 180, 10
WALL_TIME = re.compile(r"wall time (\d+):(\d\d):(\d\d)")


def write_video(path: Path, seconds: float, seed: int) -> None:
    """Moving bands, a keyframe every 2 s: cheap to make, a real stream to open."""
    base = ((np.indices((HEIGHT, WIDTH)).sum(axis=0) + 37 * seed) % 256).astype(np.uint8)
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(2 * FPS), "keyint_min": str(2 * FPS), "sc_threshold": "0"}
        for index in range(round(seconds * FPS)):
            grey = np.roll(base, index * 3, axis=1)
            frame = av.VideoFrame.from_ndarray(np.stack([grey, 255 - grey, grey // 2], axis=2), format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


def caption(folder: Path, out: Path, model: str, *more: str) -> tuple[float, int, str]:
    """One `tarsier caption` process: seconds measured around it, the summary's wall time in seconds, its summary."""
    command = [sys.executable, "-m", "tarsier_batch", "caption", str(folder), "--model", model, "-o", str(out),
               "--max-new-tokens", "8", *more]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed: {done.stderr[-2000:]}")
    summary = done.stderr.strip().splitlines()[-1]
    hours, minutes, whole = WALL_TIME.search(summary).groups()
    return seconds, 3600 * int(hours) + 60 * int(minutes) + int(whole), summary


def dry_run(folder: Path, out: Path, model: str, *more: str) -> float:
    """Seconds of one `tarsier caption --dry-run` process towards `out`, which does not exist."""
    command = [sys.executable, "-m", "tarsier_batch", "caption", str(folder), "--model", model, "-o", str(out),
               "--dry-run", *more]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - began


def drop_counts(out: Path) -> None:
    """The windowed output as written before rows counted their files' segments."""
    pq.write_table(pq.read_table(out).drop_columns(["num_segments"]), out)


def figures(runs: list[tuple[float, int, str]]) -> dict:
    return {"measured_s": round(statistics.median(run[0] for run in runs), 3),
            "reported_s": statistics.median(run[1] for run in runs), "summary": runs[-1][2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    spec = f"fixed:{args.window:g}s"
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "videos"
        folder.mkdir()
        for number in range(args.files):
            write_video(folder / f"clip-{number:02d}.mp4", args.seconds, number)
        plain, windows = Path(scratch) / "plain.parquet", Path(scratch) / "windows.parquet"
        caption(folder, plain, args.model)
        caption(folder, windows, args.model, "--segments", spec)
        windowed_rows = pq.read_table(windows).num_rows
        timed: dict[str, list[tuple[float, int, str]]] = {"plain": [], "windows": [], "windows_uncounted": []}
        runs = {"plain": lambda: caption(folder, plain, args.model),
                "windows": lambda: caption(folder, windows, args.model, "--segments", spec)}
        for repeat in range(args.repeats):
            for name in ["plain", "windows"] if repeat % 2 == 0 else ["windows", "plain"]:   # neither always first
                timed[name].append(runs[name]())
        # Apart, after: its decoding workers' ends would fall in the next re-run's time.
        for _ in range(args.repeats):
            drop_counts(windows)
            timed["windows_uncounted"].append(caption(folder, windows, args.model, "--segments", spec))
        fresh = Path(scratch) / "new.parquet"
        planned: dict[str, list[float]] = {"dry_run_plain": [], "dry_run_windows": []}
        for repeat in range(args.repeats):
            for name in ["dry_run_plain", "dry_run_windows"] if repeat % 2 == 0 else ["dry_run_windows",
                                                                                      "dry_run_plain"]:
                planned[name].append(dry_run(folder, fresh, args.model, *(
                    ("--segments", spec) if name == "dry_run_windows" else ())))
    result = {name: figures(runs) for name, runs in timed.items()}
    result.update({name: {"measured_s": round(statistics.median(runs), 3)} for name, runs in planned.items()})
    plain_s = result["plain"]["measured_s"]
    print(json.dumps({**measured_on(), "files": args.files, "seconds_per_file": args.seconds, "segments": spec,
                      "windowed_rows": windowed_rows, "repeats": args.repeats, "model": args.model, **result,
                      "windows_over_plain": round(result["windows"]["measured_s"] / plain_s, 2),
                      "uncounted_over_plain": round(result["windows_uncounted"]["measured_s"] / plain_s, 2),
                      "dry_run_windows_over_plain": round(result["dry_run_windows"]["measured_s"]
                                                          / result["dry_run_plain"]["measured_s"], 2),
                      "target_windows_over_plain": 1.5}, indent=2))


if __name__ == "__main__":
    main()
