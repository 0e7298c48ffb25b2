"""Regenerate the synthetic media in sample_data/ (needs `pip install av`; the pictures are
deterministic, though container timestamps make some files differ byte-wise).

    python tools/make_sample_data.py

Each file exercises a different path: H.264 in MP4 and MKV containers, a clip shorter than the
default 8 sampled frames, VP9 in WebM, an animated GIF, a PNG and a JPEG with an upper-case
extension. All of them are drawn here; none is taken from elsewhere.

`demo_*.mp4` are held-out clips of the demo model's generator (`--model demo` captions them),
one per kind of motion, named after what they show.
"""

from __future__ import annotations

import math
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

from tarsier_batch.demo import HELD_OUT_SEEDS
from tarsier_batch.demo.clips import MOTIONS, clip_spec, make_clip, write_mp4

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"


def scene(index: int, count: int, width: int, height: int) -> Image.Image:
    """A sky-to-grass gradient with a red ball crossing and a blue square bouncing."""
    t = index / max(count - 1, 1)
    rows = np.linspace(0, 1, height)[:, None]
    sky = np.stack([90 + 60 * rows, 150 + 40 * rows, 230 - 150 * rows], axis=-1)
    canvas = np.broadcast_to(sky, (height, width, 3)).astype(np.uint8)
    image = Image.fromarray(np.ascontiguousarray(canvas))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, int(height * 0.75), width, height], fill=(60, 140, 60))
    radius = height // 8
    x = int(radius + t * (width - 2 * radius))
    y = int(height * 0.75 - radius - abs(math.sin(t * 3 * math.pi)) * height * 0.4)
    draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=(220, 40, 40))
    side = height // 6
    sx = int((1 - t) * (width - side))
    draw.rectangle([sx, height // 10, sx + side, height // 10 + side], fill=(30, 60, 200))
    return image


def write_video(path: Path, codec: str, frames: int, size: tuple[int, int], fps: int) -> None:
    width, height = size
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "32"} if codec == "libx264" else {"crf": "40", "b": "0"}
        for index in range(frames):
            frame = av.VideoFrame.from_image(scene(index, frames, width, height))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def write_demo_clips() -> None:
    """One held-out generator clip per motion, each a different shape or colour from the one before."""
    seed, previous = HELD_OUT_SEEDS[1] - 1, None
    for motion in MOTIONS:
        while (spec := clip_spec(seed)).motion != motion or (spec.shape, spec.colour) == previous:
            seed -= 1
        previous = spec.shape, spec.colour
        words = spec.caption.removeprefix("A ").removesuffix(".").replace(" ", "_")
        write_mp4(make_clip(seed), SAMPLE_DATA / f"demo_{words}.mp4")


def main() -> None:
    write_video(SAMPLE_DATA / "ball_h264.mp4", "libx264", frames=48, size=(320, 192), fps=12)
    write_video(SAMPLE_DATA / "ball_short.mkv", "libx264", frames=4, size=(256, 144), fps=8)
    write_video(SAMPLE_DATA / "ball_vp9.webm", "libvpx-vp9", frames=24, size=(192, 320), fps=12)
    gif_frames = [scene(i, 10, 160, 96).quantize(64) for i in range(10)]
    gif_frames[0].save(SAMPLE_DATA / "ball.gif", save_all=True, append_images=gif_frames[1:], duration=100, loop=0)
    scene(5, 10, 300, 200).save(SAMPLE_DATA / "still.png")
    scene(2, 10, 200, 320).save(SAMPLE_DATA / "portrait.JPG", quality=85)
    write_demo_clips()


if __name__ == "__main__":
    main()
