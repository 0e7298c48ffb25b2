"""What decoding a user's clip costs one CPU core: the sampled frames of a 1080p30 H.264 file, keyframes far apart.

    python bench/bench_decode.py [--seconds 20] [--frames 16] [--repeats 3]

Makes one clip the way the GPU run's user stage does (bench/gpu/video_files.py: 1920 x 1080, 30 fps, a keyframe every
250 frames, libx264 superfast CRF 20), then times on one thread, median of --repeats, each with a fresh reader:
decord's `get_batch` of the frames the tool samples (`tarsier_batch.media.frame_indices`), the tool's own
`load_media` (the same frames read in runs between keyframes, as RGB images), and decord decoding every frame. Also
counts the frames a decoder must decode to reach the sampled ones (from the keyframe before each, or from the sampled
frame before it). Prints JSON, with the clips per second 16 such cores would decode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "bench" / "gpu")]

from video_files import GOP, VideoSpec, make_videos  # noqa: E402

from measured_on import measured_on  # noqa: E402

from tarsier_batch.media import MediaType, frame_indices, load_media  # noqa: E402


def median_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 3)


def frames_to_decode(indices: list[int], keyframes: list[int]) -> int:
    """Frames decoded to reach `indices` in order, each from the keyframe at or before it, or on from the last."""
    count, position = 0, -1   # the last frame decoded
    for index in indices:
        keyframe = max(key for key in keyframes if key <= index)
        start = position + 1 if keyframe <= position < index else keyframe
        count += index - start + 1
        position = index
    return count


def measure(path: Path, frames: int, repeats: int) -> dict:
    import decord

    def reader():
        return decord.VideoReader(str(path), num_threads=1, ctx=decord.cpu(0))

    total = len(reader())
    indices = frame_indices(total, frames)
    keyframes = list(reader().get_key_indices())

    def every_frame() -> None:
        video = reader()
        for index in range(total):
            video.next()

    sampled = median_seconds(lambda: reader().get_batch(indices).asnumpy(), repeats)
    return {"frames_in_file": total, "sampled_frames": len(indices), "keyframes": keyframes,
            "frames_decoded_for_the_sampled": frames_to_decode(indices, keyframes),
            "decord_sampled_s": sampled,
            "load_media_s": median_seconds(lambda: load_media(str(path), MediaType.VIDEO, frames), repeats),
            "decord_every_frame_s": median_seconds(every_frame, repeats),
            "clips_per_s_on_16_cores": round(16 / sampled, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as scratch:
        spec = VideoSpec(Path(scratch) / "clip.mp4", args.seconds, 1920, 1080, 30, 1)
        facts = make_videos([spec])
        figures = measure(spec.path, args.frames, args.repeats)
    print(json.dumps({**measured_on(), "benchmark": "bench/bench_decode.py", "seconds": args.seconds, "gop": GOP,
                      "mbit_per_s": facts["mbit_per_s"], "repeats": args.repeats, **figures}, indent=1))


if __name__ == "__main__":
    main()
