"""The clips every GPU measurement runs on: synthetic frames at the official frame size, made on the spot.

Nothing can be downloaded on the device machine and only the repository travels, so the clips are drawn
there: each clip is a smooth colour field that drifts from frame to frame with a square crossing it and a
little noise (so that no two frames or clips are alike). At 1920 x 800, the size of the official demo clip,
Tarsier2's processor gives each frame 608 vision positions (9,728 for 16 frames), as the facts file says of
the real clip.

Two forms: `ProcessedPrompt`s made by the family's own processor from the frames (what the engine and the
one-at-a-time baseline are fed, so both sides see the same pixels), and MP4 files of the same frames for the
runs that go through decoding, the CLI and an output file.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from tarsier_batch.families.base import ProcessedPrompt
from tarsier_batch.families.tarsier2 import Tarsier2PromptProcessor
from tarsier_batch.media import Media, MediaType

FPS = 8


def frame(clip: int, index: int, frames: int, width: int, height: int) -> np.ndarray:
    """Frame `index` of clip `clip`: (height, width, 3) uint8, the same on every machine."""
    rng = np.random.default_rng(clip * 1000 + index)
    t = index / max(1, frames - 1)
    across = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    down = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    phase = 0.37 * clip + t
    field = np.stack([np.sin(6.3 * (across + phase)) + np.cos(4.1 * down),
                      np.sin(5.1 * (down - phase)) + np.cos(3.3 * across),
                      np.sin(4.7 * (across + down) + 2 * phase)], axis=-1)
    image = (127 + 60 * field).astype(np.float32)
    image += rng.normal(0, 6, size=(height, width, 1)).astype(np.float32)
    side = height // 4
    left = int((width - side) * t)
    top = int((height - side) * ((clip % 5) / 4))
    image[top:top + side, left:left + side] = (40 + 40 * (clip % 3), 200, 255 - 30 * (clip % 4))
    return image.clip(0, 255).astype(np.uint8)


def prompts(processor: Tarsier2PromptProcessor, clips: int, frames: int, width: int, height: int,
            threads: int = 16) -> list[ProcessedPrompt]:
    """`clips` distinct clips of `frames` frames through the family's processor (frames in parallel threads)."""
    def patches(key: tuple[int, int]):
        clip, index = key
        image = Image.fromarray(frame(clip, index, frames, width, height), "RGB")
        return processor.frame_patches(image, frames, MediaType.VIDEO)

    keys = [(clip, index) for clip in range(clips) for index in range(frames)]
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(patches, keys))
    out = []
    for clip in range(clips):
        media = Media(f"synthetic-{clip}.mp4", MediaType.VIDEO, done[clip * frames:(clip + 1) * frames],
                      list(range(frames)), width, height, frames / FPS, "synthetic")
        out.append(processor.process(media, None))
    return out


def write_clips(folder: Path, clips: int, frames: int, width: int, height: int) -> list[Path]:
    """The same clips as H.264 MP4 files (near-lossless, so that decoding gives nearly the same pixels)."""
    import av

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for clip in range(clips):
        path = folder / f"clip_{clip:03d}.mp4"
        with av.open(str(path), "w") as output:
            stream = output.add_stream("libx264", rate=FPS)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": "12", "preset": "ultrafast"}
            for index in range(frames):
                picture = av.VideoFrame.from_ndarray(frame(clip, index, frames, width, height), format="rgb24")
                for packet in stream.encode(picture):
                    output.mux(packet)
            for packet in stream.encode():
                output.mux(packet)
        paths.append(path)
    return paths
