"""Peak memory of decoding and preprocessing one video, whole batch vs frame by frame.

    python bench/bench_media_memory.py [--video ../shared/media/demo_test.mp4] [--frames 8 16 32 64]

Each (path, frame count) runs in a fresh Python process, which reports its resident set right
before loading (imports and the processor loaded) and its peak (VmHWM) after. Paths:

- old: the previous code: decord `get_batch` on all sampled indices at once, PIL frames,
  every frame stretched to a square of its longer side, the CLIP processor on the whole list;
- new: `load_media(..., frame_transform=processor.frame_pixels)`: only each frame's
  (3, size, size) float32 pixels are kept. Frames are decoded one at a time, except that
  sampled frames decord decodes in one pass (no keyframe between them, or adjacent) are
  decoded together and held at full size until preprocessed;
- new_stacked: new, then the frames stacked into one tensor, as the prompt processor does
  (for a moment the list and the stacked copy are both alive).

The processor is the `small` random checkpoint's: the real models' settings (336 px). Per added
frame is the least-squares slope of peak over frame count; seconds are the load and
preprocessing alone. MB are 10^6 bytes. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent
SHARED_MEDIA = REPO.parent / "shared" / "media"
PATHS = ("old", "new", "new_stacked")
MB = 1e6


def status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(path: str, video: str, num_frames: int, model_dir: str) -> None:
    """Load and preprocess once in this (fresh) process; print its memory figures as JSON."""
    import time

    import decord
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    from tarsier_batch.families.tarsier.processing import TarsierProcessor, stretch_to_square
    from tarsier_batch.media import MediaType, frame_indices, load_media

    processor = TarsierProcessor(Path(model_dir))
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")   # the old path's whole-list call
    before_kb = status_kb("VmRSS")
    start = time.perf_counter()
    if path == "old":
        decord.logging.set_level(decord.logging.QUIET)
        reader = decord.VideoReader(video, num_threads=1, ctx=decord.cpu(0))
        batch = reader.get_batch(frame_indices(len(reader), num_frames)).asnumpy()
        frames = [Image.fromarray(array).convert("RGB") for array in batch]
        squares = [stretch_to_square(frame) for frame in frames]
        pixels = image_processor(images=squares, return_tensors="pt")["pixel_values"]
    else:
        media = load_media(video, MediaType.VIDEO, num_frames, frame_transform=processor.frame_pixels)
        pixels = torch.stack(media.frames) if path == "new_stacked" else media.frames
    seconds = time.perf_counter() - start
    count = pixels.shape[0] if isinstance(pixels, torch.Tensor) else len(pixels)
    print(json.dumps({"before_kb": before_kb, "peak_kb": status_kb("VmHWM"), "frames": count, "seconds": seconds}))


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--video", default=str(SHARED_MEDIA / "demo_test.mp4"))
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--child", nargs=4, metavar=("PATH", "VIDEO", "FRAMES", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, video, frames, model_dir = args.child
        child(path, video, int(frames), model_dir)
        return

    from tarsier_batch.families.tiny import make_tiny_model

    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-media-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "small", "small")
        size = json.loads((model_dir / "preprocessor_config.json").read_text())["crop_size"]["height"]
        for path in PATHS:
            peaks: dict[str, float] = {}
            over: dict[str, float] = {}
            seconds: dict[str, float] = {}
            for frames in args.frames:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", path, args.video, str(frames), str(model_dir)],
                    check=True, capture_output=True, text=True).stdout
                figures = json.loads(out.strip().splitlines()[-1])
                peaks[str(frames)] = round(figures["peak_kb"] * 1024 / MB, 1)
                over[str(frames)] = round((figures["peak_kb"] - figures["before_kb"]) * 1024 / MB, 1)
                seconds[str(frames)] = round(figures["seconds"], 2)
            results[path] = {"peak_rss_mb": peaks, "peak_over_start_mb": over,
                             "mb_per_added_frame": round(slope(args.frames, list(peaks.values())), 2),
                             "seconds": seconds}
    print(json.dumps({**measured_on(), "video": args.video, "processor_px": size,
                      "pixel_tensor_mb_per_frame": round(3 * size * size * 4 / MB, 3),
                      "frames": args.frames, "paths": results}))


if __name__ == "__main__":
    main()
