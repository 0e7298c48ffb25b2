"""Long videos as clips: memory, decoding time and end-to-end time of `--segments fixed` against cutting the
video into files first.

    python bench/bench_segments.py [--minutes 10] [--height 720] [--fps 30] [--window 10] [--model demo]

Makes (in a temporary folder) a long H.264 video and a 1-minute one of the same encoding (a keyframe every
2 s, as cameras and encoders commonly write), then:

- memory: the peak resident set of the whole run (the CLI process and its decoding workers, summed, sampled
  every 50 ms) of `tarsier caption LONG --segments fixed:WINDOW` against the same on the 1-minute file.
  Memory must not grow with the file's length: target ratio <= 1.2;
- decode: seconds to decode and preprocess one window's frames (the checkpoint's own processor, in this
  process) as a span of the long file, against the same frames as a file of their own (the video cut at
  its keyframes, as `ffmpeg -f segment -c copy` cuts: no re-encoding). Target ratio <= 1.5;
- end to end: the cut-then-caption way (cut into files with PyAV, then `tarsier caption` on the folder)
  against `tarsier caption LONG --segments fixed:WINDOW`, same model, same run, repeats interleaved.
  Target: the second at least as fast (ratio >= 1.0), with no intermediate files;
- scene detection: frames per second of `--segments scenes`' detection pass over the long file, in this
  process (what a probe worker runs), when PySceneDetect is installed.

Prints JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import av
import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.families.loading import load_processor  # noqa: E402
from tarsier_batch.media import MediaType, Span, frame_starts  # noqa: E402
from tarsier_batch.model.checkpoints import resolve_model  # noqa: E402
from tarsier_batch.workers.scenes import cut_times  # noqa: E402


def write_video(path: Path, seconds: float, height: int, fps: int) -> Path:
    """Moving bands (cheap to draw, real motion to encode), H.264, a keyframe every 2 s."""
    width = height * 16 // 9 // 2 * 2
    base = (np.indices((height, width)).sum(axis=0) % 256).astype(np.uint8)
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(2 * fps), "keyint_min": str(2 * fps),
                          "sc_threshold": "0"}
        for index in range(round(seconds * fps)):
            grey = np.roll(base, index * 3, axis=1)
            frame = av.VideoFrame.from_ndarray(np.stack([grey, np.roll(grey, 40, axis=0), 255 - grey], axis=2),
                                               format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


def cut_at_keyframes(source: Path, window_s: float, folder: Path) -> list[Path]:
    """`source` cut into files of about `window_s` seconds, each starting at the first keyframe at or after its
    window's start, packets copied (what `ffmpeg -f segment -segment_time W -c copy` writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    pieces: list[Path] = []
    with av.open(str(source)) as container:
        stream = container.streams.video[0]
        output = None
        out_stream = None
        for packet in container.demux(stream):
            if packet.dts is None:
                continue
            seconds = float(packet.pts * stream.time_base)
            if packet.is_keyframe and (output is None or seconds >= len(pieces) * window_s):
                if output is not None:
                    output.close()
                pieces.append(folder / f"piece-{len(pieces):05d}.mp4")
                output = av.open(str(pieces[-1]), "w")
                out_stream = output.add_stream_from_template(stream)
                offset = packet.pts
            packet.pts -= offset
            packet.dts -= offset
            packet.stream = out_stream
            output.mux(packet)
        if output is not None:
            output.close()
    return pieces


def peak_rss(command: list[str]) -> tuple[float, float]:
    """(peak MB of the process tree's summed resident sets, seconds) of running `command`."""
    process = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                tree = [process, *process.children(recursive=True)]
                peak = max(peak, sum(member.memory_info().rss for member in tree))
            except psutil.Error:
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    start = time.perf_counter()
    sampler.start()
    _, err = process.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command} failed: {err.decode()[-2000:]}")
    return peak / 1e6, seconds


def tarsier(*args: str) -> list[str]:
    return [sys.executable, "-m", "tarsier_batch.cli", "caption", *args, "--quiet"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--decode-windows", type=int, default=12, help="windows timed for the decode figure")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    spec = f"fixed:{args.window:g}s"
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        started = time.perf_counter()
        long = write_video(folder / "long.mp4", args.minutes * 60, args.height, args.fps)
        short = write_video(folder / "short.mp4", 60, args.height, args.fps)
        made_s = time.perf_counter() - started

        # Memory: the whole run on the long file against the 1-minute one.
        long_mb, long_s = peak_rss(tarsier(str(long), "--segments", spec, "--model", args.model,
                                           "-o", str(folder / "long.parquet")))
        short_mb, short_s = peak_rss(tarsier(str(short), "--segments", spec, "--model", args.model,
                                             "-o", str(folder / "short.parquet")))

        # Decoding one window: a span of the long file against the same window cut into a file.
        processor = load_processor(resolve_model(args.model).path)
        frames = processor.default_frames
        pieces = cut_at_keyframes(long, args.window, folder / "pieces")
        chosen = np.linspace(0, len(pieces) - 2, args.decode_windows).round().astype(int)
        spans = []
        for number in chosen:
            with av.open(str(pieces[number])) as container:   # the piece's own span of the long file
                stream = container.streams.video[0]
                length = float(stream.duration * stream.time_base) if stream.duration else args.window
            spans.append(Span(number * args.window, number * args.window + length))
        # Each side's windows one after another, as a decoding worker takes a file's windows (it keeps the long
        # file open between them: alternating with the pieces would reopen it, and read its index, every time);
        # the sides' blocks interleaved over the repeats.
        span_s, piece_s = [], []
        for _ in range(args.repeats):
            for span in spans:
                began = time.perf_counter()
                processor.load_media(str(long), MediaType.VIDEO, frames, span=span)
                span_s.append(time.perf_counter() - began)
            for number in chosen:
                began = time.perf_counter()
                processor.load_media(str(pieces[number]), MediaType.VIDEO, frames)
                piece_s.append(time.perf_counter() - began)

        # End to end: cut, then caption the pieces; against captioning the long file's windows.
        cut_then_caption, segments = [], []
        for repeat in range(args.repeats):
            began = time.perf_counter()
            pieces = cut_at_keyframes(long, args.window, folder / f"cut-{repeat}")
            subprocess.run(tarsier(str(folder / f"cut-{repeat}"), "--model", args.model,
                                   "-o", str(folder / f"cut-{repeat}.parquet")), check=True)
            cut_then_caption.append(time.perf_counter() - began)
            began = time.perf_counter()
            subprocess.run(tarsier(str(long), "--segments", spec, "--model", args.model,
                                   "-o", str(folder / f"segments-{repeat}.parquet")), check=True)
            segments.append(time.perf_counter() - began)

        scenes: dict[str, object] = {"skipped": "PySceneDetect is not installed (the scenes extra)"}
        if importlib.util.find_spec("scenedetect") is not None:
            began = time.perf_counter()
            cuts = cut_times(str(long), 27.0, 0.5)
            seconds = time.perf_counter() - began
            frames_in_file = len(frame_starts(str(long)))
            scenes = {"frames": frames_in_file, "seconds": round(seconds, 1),
                      "frames_per_s": round(frames_in_file / seconds), "cuts_found": len(cuts)}

    result = {
        "video": {"minutes": args.minutes, "height": args.height, "fps": args.fps, "window_s": args.window,
                  "windows": len(pieces), "model": args.model, "frames": frames, "made_in_s": round(made_s, 1)},
        "memory": {"long_peak_mb": round(long_mb), "one_minute_peak_mb": round(short_mb),
                   "ratio": round(long_mb / short_mb, 3), "target_ratio_at_most": 1.2,
                   "long_run_s": round(long_s, 1), "one_minute_run_s": round(short_s, 1)},
        "decode": {"span_s_per_window": round(statistics.median(span_s), 4),
                   "cut_file_s_per_window": round(statistics.median(piece_s), 4),
                   "ratio": round(statistics.median(span_s) / statistics.median(piece_s), 3),
                   "target_ratio_at_most": 1.5},
        "end_to_end": {"cut_then_caption_s": round(statistics.median(cut_then_caption), 1),
                       "segments_s": round(statistics.median(segments), 1),
                       "speedup": round(statistics.median(cut_then_caption) / statistics.median(segments), 3),
                       "target_speedup_at_least": 1.0},
        "scene_detection": scenes,
    }
    print(json.dumps({**measured_on(), **result}, indent=2))


if __name__ == "__main__":
    main()
