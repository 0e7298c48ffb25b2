"""Synthetic clips with their one-sentence captions: a coloured shape moving one way over a still background.

    clip = make_clip(seed=7)
    clip.caption            # "A blue triangle moves from right to left."
    clip.frames             # 16 RGB PIL images, 112 x 112
    write_mp4(clip, "c.mp4")

Everything is drawn here and decided by the seed, so a training set and a held-out set are
just two seed ranges. A clip played backwards is the clip of the opposite motion
(`reversed_clip`), which is how the demo model is checked for frame order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 112          # pixels, square; the demo model sees frames at 84 px, a 6 x 6 grid of patches
FRAMES = 16         # frames per clip; the model samples 8
FPS = 8
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 230), "yellow": (235, 205, 40)}
BACKGROUNDS = {"black": (15, 15, 15), "white": (245, 245, 245), "grey": (128, 128, 128)}   # not in the caption
# The background's faint still texture, in grey levels either side of its colour: like a real
# scene, most of every frame is a textured place that does not change, which is what temporal
# pruning removes; faint enough that a pixel of the shape stays far from every background pixel.
TEXTURE_LEVELS = 8
MOTIONS = ("moves from left to right", "moves from right to left", "moves up", "moves down", "grows", "shrinks",
           "stays still")
OPPOSITE = {"moves from left to right": "moves from right to left",
            "moves from right to left": "moves from left to right",
            "moves up": "moves down", "moves down": "moves up", "grows": "shrinks", "shrinks": "grows",
            "stays still": "stays still"}


@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows; `start`/`end` are the shape's centre and radius in the first and last frame."""

    shape: str
    colour: str
    motion: str
    background: str
    start: tuple[float, float, float]
    end: tuple[float, float, float]
    texture: tuple[float, ...] = (0.0,) * 6   # the background texture's phases and frequencies (`_texture`)

    @property
    def caption(self) -> str:
        return f"A {self.colour} {self.shape} {self.motion}."

    @property
    def still_caption(self) -> str:
        """What one frame shows: the shape without its motion."""
        return f"A {self.colour} {self.shape}."


@dataclass(frozen=True)
class Clip:
    spec: ClipSpec
    frames: list[Image.Image]

    @property
    def caption(self) -> str:
        return self.spec.caption


def clip_spec(seed: int) -> ClipSpec:
    """The clip of `seed`: shape, colour, motion and background uniformly, positions jittered."""
    rng = random.Random(seed)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    motion, background = rng.choice(MOTIONS), rng.choice(list(BACKGROUNDS))
    # A shape covers about 2 x 2 of the model's 36 patches: its outline is visible to the model, and
    # most of the frame is still background, as in a real clip.
    radius = rng.uniform(12, 16)
    low, high = 24.0, SIZE - 24.0          # a shape's centre stays where the whole shape is visible
    x, y = rng.uniform(low + 8, high - 8), rng.uniform(low + 8, high - 8)
    span = rng.uniform(44, high - low)
    start_at, end_at = rng.uniform(low, high - span), 0.0
    end_at = start_at + span
    if motion == "moves from left to right":
        start, end = (start_at, y, radius), (end_at, y, radius)
    elif motion == "moves from right to left":
        start, end = (end_at, y, radius), (start_at, y, radius)
    elif motion == "moves up":
        start, end = (x, end_at, radius), (x, start_at, radius)
    elif motion == "moves down":
        start, end = (x, start_at, radius), (x, end_at, radius)
    elif motion == "grows":
        small, large = rng.uniform(8, 11), rng.uniform(26, 30)
        start, end = (SIZE / 2, SIZE / 2, small), (SIZE / 2, SIZE / 2, large)
    elif motion == "shrinks":
        small, large = rng.uniform(8, 11), rng.uniform(26, 30)
        start, end = (SIZE / 2, SIZE / 2, large), (SIZE / 2, SIZE / 2, small)
    else:
        start = end = (x, y, radius)
    texture = tuple(rng.uniform(0, 6.283) for _ in range(3)) + tuple(rng.uniform(1.5, 4.0) for _ in range(3))
    return ClipSpec(shape, colour, motion, background, start, end, texture)


def make_clip(seed: int, frames: int = FRAMES) -> Clip:
    spec = clip_spec(seed)
    return Clip(spec, [draw_frame(spec, index / (frames - 1)) for index in range(frames)])


def reversed_clip(clip: Clip) -> Clip:
    """The clip played backwards: its caption names the opposite motion."""
    spec = replace(clip.spec, motion=OPPOSITE[clip.spec.motion], start=clip.spec.end, end=clip.spec.start)
    return Clip(spec, clip.frames[::-1])


def draw_frame(spec: ClipSpec, t: float) -> Image.Image:
    """The frame at time `t` in [0, 1]: the shape linearly between its start and end."""
    x, y, r = (a + (b - a) * t for a, b in zip(spec.start, spec.end))
    image = _background(spec)
    draw = ImageDraw.Draw(image)
    colour = COLOURS[spec.colour]
    if spec.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    elif spec.shape == "square":
        # The square around the circle of radius r: its corners stand out from that circle by
        # 0.4 r, which the model sees as a few pixels (a square of side 1.8 r was
        # told from a circle in only two thirds of the held-out clips after 30 minutes of training).
        draw.rectangle((x - r, y - r, x + r, y + r), fill=colour)
    else:
        draw.polygon([(x, y - r), (x + r, y + r * 0.8), (x - r, y + r * 0.8)], fill=colour)
    return image


def _background(spec: ClipSpec) -> Image.Image:
    """The clip's still background: its colour plus a faint texture of three crossing waves (the same in every
    frame)."""
    import numpy as np

    phase_x, phase_y, phase_d, waves_x, waves_y, waves_d = spec.texture
    axis = np.linspace(0, 2 * np.pi, SIZE, endpoint=False)
    across, down = np.meshgrid(axis, axis)
    pattern = (np.sin(waves_x * across + phase_x) + np.sin(waves_y * down + phase_y)
               + np.sin(waves_d * (across + down) / 2 + phase_d)) / 3
    levels = np.asarray(BACKGROUNDS[spec.background], dtype=np.float64) + TEXTURE_LEVELS * pattern[..., None]
    return Image.fromarray(levels.clip(0, 255).round().astype(np.uint8), "RGB")


def write_mp4(clip: Clip, path: str | Path) -> Path:
    """The clip as H.264 in MP4 (yuv420p, every frame a keyframe-free GOP of the default size)."""
    import av
    import numpy as np

    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        for frame in clip.frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return Path(path)
