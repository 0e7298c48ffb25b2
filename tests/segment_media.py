"""Long test videos whose frames say their own number, with scene cuts at known times: made here with PyAV.

Frame i carries i in binary as 12 black or white blocks (readable after lossy compression), over a
background whose colour changes at each scene cut.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

W, H = 96, 64
BITS, BLOCK = 12, 8
# Scene colours: each far from the next in hue and in brightness, so that a cut is plain to a content detector.
COLOURS = [(240, 240, 240), (20, 20, 140), (250, 200, 30), (10, 90, 10), (230, 40, 200), (15, 15, 15)]


def picture(index: int, scene: int) -> np.ndarray:
    frame = np.empty((H, W, 3), np.uint8)
    frame[:] = COLOURS[scene % len(COLOURS)]
    for bit in range(BITS):
        frame[H - 2 * BLOCK:H - BLOCK, bit * BLOCK:(bit + 1) * BLOCK] = 255 if index >> bit & 1 else 0
    return frame


def frame_number(frame: Image.Image | np.ndarray) -> int:
    """The number a decoded frame of `write_numbered_video` carries."""
    pixels = np.asarray(frame)
    row = pixels[H - 2 * BLOCK + 2:H - BLOCK - 2]
    return sum(1 << bit for bit in range(BITS) if row[:, bit * BLOCK + 2:(bit + 1) * BLOCK - 2].mean() > 128)


def write_numbered_video(path: Path, seconds: float, fps: int = 10, scene_s: float | None = None,
                         codec: str = "libx264", jump: tuple[float, float] | None = None) -> Path:
    """A `seconds`-long video at `fps`, frames numbered from 0, a new scene every `scene_s` seconds. `jump`:
    (at_s, gap_s): the timestamps of the frames from `at_s` on are `gap_s` later (a paused recording)."""
    frames = round(seconds * fps)
    assert frames < 1 << BITS
    with av.open(str(path), "w") as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for index in range(frames):
            scene = int(index / fps // scene_s) if scene_s else 0
            frame = av.VideoFrame.from_ndarray(picture(index, scene), format="rgb24")
            if jump is not None:
                frame.pts = index + (round(jump[1] * fps) if index >= jump[0] * fps else 0)
                frame.time_base = Fraction(1, fps)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path
