"""Video files like a user's, made on the spot: H.264 MP4s at 1080p30 with a keyframe every 250 frames.

Nothing can be downloaded on the device machine, so the files are drawn and encoded there with PyAV's
libx264 on the CPU, one process per core. Each file is a camera panning over its own textured scene
(smooth colour fields and fine still grain, different per file) with three shapes crossing it: a
decoder has real work (every frame differs from the one before, the grain keeps the bit rate up, and
a keyframe comes only every 250 frames, as in a camera's or a site's encode), while a frame costs only
a slice, a copy and three filled rectangles to draw.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GOP = 250
PAN = 2   # pixels the camera moves per frame, across and down


@dataclass(frozen=True)
class VideoSpec:
    """One file to make: where, how long, its size and rate, and the seed its scene is drawn from."""

    path: Path
    seconds: float
    width: int
    height: int
    fps: int
    seed: int
    first_frame: int = 0   # of a piece of a longer file: where in that file the piece starts


def scene(seed: int, width: int, height: int) -> np.ndarray:
    """The file's scene, (height + margin, width + margin, 3) uint8: smooth fields plus still grain."""
    rng = np.random.default_rng(seed)
    margin_rows, margin_columns = height + PAN * 64, width + PAN * 64
    down = np.linspace(0, 1, margin_rows, dtype=np.float32)[:, None]
    across = np.linspace(0, 1, margin_columns, dtype=np.float32)[None, :]
    waves = rng.uniform(2, 9, size=(3, 2)).astype(np.float32)
    phases = rng.uniform(0, 6.3, size=3).astype(np.float32)
    field = np.stack([np.sin(waves[channel, 0] * 6.3 * across + phases[channel])
                      * np.cos(waves[channel, 1] * 6.3 * down) for channel in range(3)], axis=-1)
    grain = rng.integers(-24, 25, size=(margin_rows, margin_columns, 1), dtype=np.int16)
    return (128 + 70 * field + grain).clip(0, 255).astype(np.uint8)


def frame_at(background: np.ndarray, spec: VideoSpec, index: int) -> np.ndarray:
    """Frame `index`: the camera's window on the scene (panning back and forth) and three shapes crossing it."""
    span_rows = background.shape[0] - spec.height
    span_columns = background.shape[1] - spec.width
    index += spec.first_frame
    step = index * PAN
    top = step % (2 * span_rows)
    left = step % (2 * span_columns)
    top = top if top <= span_rows else 2 * span_rows - top
    left = left if left <= span_columns else 2 * span_columns - left
    image = background[top:top + spec.height, left:left + spec.width].copy()
    side = spec.height // 6
    for shape in range(3):
        speed = 3 + 2 * shape + spec.seed % 4
        x = (index * speed + shape * spec.width // 3) % (spec.width - side)
        y = (shape * spec.height // 3 + (spec.seed * 37) % (spec.height // 4)) % (spec.height - side)
        colour = ((spec.seed * 53 + shape * 91) % 256, (spec.seed * 17 + shape * 151) % 256, 255 - 60 * shape)
        image[y:y + side, x:x + side] = colour
    return image


def write_video(spec: VideoSpec) -> Path:
    """Encode `spec` into its MP4 (libx264 on one thread: the files are made one per core); its facts."""
    import av

    spec.path.parent.mkdir(parents=True, exist_ok=True)
    background = scene(spec.seed, spec.width, spec.height)
    frames = round(spec.seconds * spec.fps)
    partial = spec.path.with_name(spec.path.name + ".partial.mp4")
    with av.open(str(partial), "w") as output:
        stream = output.add_stream("libx264", rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.options = {"preset": "superfast", "crf": "20", "threads": "1",
                          "x264-params": f"keyint={GOP}:min-keyint={GOP}:scenecut=0"}
        for index in range(frames):
            picture = av.VideoFrame.from_ndarray(frame_at(background, spec, index), format="rgb24")
            for packet in stream.encode(picture):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    partial.rename(spec.path)   # a file that exists is whole: a later call reuses it
    return spec.path


def pieces(spec: VideoSpec, folder: Path) -> list[VideoSpec]:
    """`spec` cut at keyframes into pieces of a few GOPs, to encode in parallel and join (`join_pieces`)."""
    frames, per_piece = round(spec.seconds * spec.fps), 2 * GOP
    return [VideoSpec(folder / f"{spec.path.stem}.piece{start // per_piece:03d}.mp4",
                      min(per_piece, frames - start) / spec.fps, spec.width, spec.height, spec.fps, spec.seed,
                      spec.first_frame + start)
            for start in range(0, frames, per_piece)]


def join_pieces(parts: list[Path], path: Path) -> Path:
    """The pieces' packets, one after the other, in one file: each piece starts with a keyframe, so no frame is
    encoded again and the file is what one encoder would have written, GOP for GOP."""
    import av

    partial = path.with_name(path.name + ".partial.mp4")
    with av.open(str(partial), "w") as output:
        stream = None
        offset = 0
        for part in parts:
            with av.open(str(part)) as piece:
                source = piece.streams.video[0]
                if stream is None:
                    stream = output.add_stream_from_template(source)
                last = offset
                for packet in piece.demux(source):
                    if packet.dts is None:   # the demuxer's empty packet at the end
                        continue
                    packet.pts += offset
                    packet.dts += offset
                    last = max(last, packet.pts + packet.duration)
                    packet.stream = stream
                    output.mux(packet)
                offset = last
    partial.rename(path)
    for part in parts:
        part.unlink()
    return path


def clip_lengths(count: int, shortest: float, longest: float) -> list[float]:
    """`count` lengths spread evenly from `shortest` to `longest` seconds, in a mixed order."""
    lengths = [round(shortest + (longest - shortest) * index / max(1, count - 1), 1) for index in range(count)]
    random.Random(count).shuffle(lengths)
    return lengths


def make_videos(specs: list[VideoSpec], processes: int | None = None) -> dict:
    """Every file of `specs` that is not there yet, in parallel processes (a long file in pieces joined after);
    the set's facts."""
    missing = [spec for spec in specs if not spec.path.exists()]
    processes = processes or len(os.sched_getaffinity(0))
    work = {spec.path: pieces(spec, spec.path.parent) for spec in missing}
    jobs = sorted((piece for parts in work.values() for piece in parts), key=lambda spec: -spec.seconds)
    if jobs:
        with ProcessPoolExecutor(min(processes, len(jobs))) as pool:
            list(pool.map(write_video, jobs))
    for path, parts in work.items():
        if len(parts) == 1:
            parts[0].path.rename(path)
        else:
            join_pieces([part.path for part in parts], path)
    sizes = [spec.path.stat().st_size for spec in specs]
    seconds = [spec.seconds for spec in specs]
    return {"files": len(specs), "made": len(missing), "processes": processes, "seconds": seconds,
            "total_bytes": sum(sizes), "mbit_per_s": round(sum(sizes) * 8 / sum(seconds) / 1e6, 2),
            "width": specs[0].width, "height": specs[0].height, "fps": specs[0].fps, "gop": GOP}
