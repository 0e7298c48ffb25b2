"""Generate a folder of awkward inputs: what users' folders hold besides clean H.264 and JPEG.

`make_awkward_inputs(folder)` writes small files (64 x 48 frames) in a few seconds and returns,
per input, what loading it must give: `Ok(...)` facts, or `Fails(reason, kind)` with a substring of
the one-line error and its `error_kind`. Nothing binary is committed: every file is made here with PyAV and Pillow.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

W, H = 64, 48


@dataclass(frozen=True)
class Ok:
    media_type: str                 # as reported in the row
    size: tuple[int, int]           # displayed width, height
    decoder: str | None = None      # None: either decoder may read it
    frames: int | None = None       # frames kept with 8 requested (v1 sampling), if fixed


@dataclass(frozen=True)
class Fails:
    reason: str
    kind: str                       # the row's error_kind


def halves(width: int = W, height: int = H) -> np.ndarray:
    """Left half red, right half blue: orientation is visible in the pixels."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[:, : width // 2] = (255, 0, 0)
    frame[:, width // 2:] = (0, 0, 255)
    return frame


# Numbered frames: frame i is grey level NUMBER_STEP * i below a fixed noisy top half (the noise
# gives the file a real payload, so a cut leaves whole frames before it).
NUMBER_STEP = 8
_NOISE = np.random.default_rng(0).integers(0, 256, (H // 2, W, 1), dtype=np.uint8).repeat(3, axis=2)


def numbered(index: int) -> np.ndarray:
    frame = np.full((H, W, 3), NUMBER_STEP * index, np.uint8)
    frame[: H // 2] = _NOISE
    return frame


def frame_number(frame: Image.Image) -> int:
    """Which `numbered` frame a decoded frame is (its bottom rows, away from the noise)."""
    return round(float(np.asarray(frame)[H // 2 + 6:].mean()) / NUMBER_STEP)


def write_video(path: Path, codec: str, frames: int = 10, container: str | None = None, rotation: int = 0,
                sar: Fraction | None = None, pts_step: list[int] | None = None, options: dict | None = None,
                pix_fmt: str = "yuv420p", picture: Callable[[int], np.ndarray] = lambda index: halves(),
                codec_options: dict | None = None, bit_rate: int | None = None, first_pts: int = 0,
                last_frame_ms: int | None = None) -> Path:
    """Frames timed by `pts_step` (ms, repeated; else at 10 fps) from `first_pts` (ms, with `pts_step`); the last
    frame shown for `last_frame_ms` where given (its packet's stored duration)."""
    with av.open(str(path), "w", format=container, options=options or {}) as output:
        stream = output.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = W, H, pix_fmt
        stream.options = codec_options or {}
        if bit_rate is not None:
            stream.bit_rate = bit_rate
        if sar is not None:
            stream.codec_context.sample_aspect_ratio = sar
        if rotation:
            stream.set_display_rotation(rotation)
        if pts_step is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        pts = first_pts
        packets = []
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(picture(index), format="rgb24")
            if pts_step is not None:
                frame.pts, frame.time_base = pts, Fraction(1, 1000)
                pts += pts_step[index % len(pts_step)]
            packets += stream.encode(frame)
        packets += stream.encode()
        if last_frame_ms is not None:
            last = max(packets, key=lambda packet: packet.pts)
            last.duration = round(last_frame_ms / 1000 / last.time_base)
        for packet in packets:
            output.mux(packet)
    return path


def write_audio_only(path: Path) -> Path:
    with av.open(str(path), "w") as output:
        stream = output.add_stream("aac", rate=16000)
        samples = np.zeros((1, 1024), np.float32)
        for _ in range(20):
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


def make_awkward_inputs(folder: Path) -> dict[Path, Ok | Fails]:
    folder.mkdir(parents=True, exist_ok=True)
    expect: dict[Path, Ok | Fails] = {}

    def add(path: Path, outcome: Ok | Fails) -> None:
        expect[path] = outcome

    good_mp4 = write_video(folder / "plain_h264.mp4", "libx264")
    add(good_mp4, Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "one_frame.mp4", "libx264", frames=1), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "three_frames.mp4", "libx264", frames=3), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "long.mp4", "libx264", frames=1500), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "rotated_phone.mp4", "libx264", rotation=90), Ok("video", (H, W), "pyav", 8))
    add(write_video(folder / "anamorphic.mp4", "libx264", sar=Fraction(2, 1)), Ok("video", (2 * W, H), "pyav", 8))
    add(write_video(folder / "variable_rate.mkv", "libx264", pts_step=[40, 120, 70]), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "vp9.webm", "libvpx-vp9"), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "live.webm", "libvpx-vp9", options={"live": "1"}), Ok("video", (W, H), "pyav", 8))
    add(write_video(folder / "hevc.mp4", "libx265"), Ok("video", (W, H), "decord", 8))
    add(write_video(folder / "av1.mkv", "libsvtav1"), Ok("video", (W, H), "pyav", 8))  # decord has no AV1 decoder
    add(write_video(folder / "mpeg2.ts", "mpeg2video", container="mpegts"), Ok("video", (W, H), "pyav", 8))
    add(write_video(folder / "legacy.flv", "flv", container="flv"), Ok("video", (W, H), "decord", 8))
    # 30 numbered frames, 12 per GOP, with B-frames: decord's seeking returns other frames than asked
    # in MPEG-TS, MPEG-PS, and AVI or MPEG-4 Part 2 with B-frames; PyAV reads these.
    gop = {"g": "12", "bf": "2"}
    for name, codec, container, decoder in [("numbered_h264.mp4", "libx264", None, "decord"),
                                            ("numbered_h264.ts", "libx264", "mpegts", "pyav"),
                                            ("numbered_mpeg2.mpg", "mpeg2video", "mpeg", "pyav"),
                                            ("numbered_divx.avi", "mpeg4", "avi", "pyav")]:
        add(write_video(folder / name, codec, frames=30, container=container, picture=numbered, codec_options=gop,
                        bit_rate=2_000_000), Ok("video", (W, H), decoder, 8))
    indexed_first = write_video(folder / "indexed_first.mp4", "libx264", frames=30, options={"movflags": "faststart"},
                                picture=numbered, codec_options=gop)
    data = indexed_first.read_bytes()
    indexed_first.unlink()
    (folder / "numbered_cut.mp4").write_bytes(data[: len(data) * 3 // 4])  # index intact, last frames missing
    add(folder / "numbered_cut.mp4", Ok("video", (W, H), "pyav", 8))
    data = good_mp4.read_bytes()
    (folder / "truncated.mp4").write_bytes(data[: len(data) // 2])
    # Both decoders say "Invalid data found when processing input" for these three: the bytes tell them apart.
    add(folder / "truncated.mp4", Fails(f"the video is cut short: the file ends at byte {len(data) // 2:,}, inside",
                                        "undecodable"))
    (folder / "random_bytes.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
    add(folder / "random_bytes.mp4", Fails("not a video: no media stream found (no decoder knows the format",
                                           "undecodable"))
    (folder / "text.mp4").write_text("id,caption\n1,a cat on a mat\n")
    add(folder / "text.mp4", Fails("not a video: no media stream found (the file starts like text)", "undecodable"))
    add(write_audio_only(folder / "audio_only.mp4"), Fails("no video stream (the file holds audio)", "undecodable"))
    (folder / "zero.mp4").touch()
    add(folder / "zero.mp4", Fails("empty file (0 bytes)", "unreadable"))
    (folder / "zero.png").touch()
    add(folder / "zero.png", Fails("empty file (0 bytes)", "unreadable"))

    Image.fromarray(halves()).convert("CMYK").save(folder / "cmyk.jpg")
    add(folder / "cmyk.jpg", Ok("image", (W, H), "pillow", 1))
    levels = np.full((H, W), 0x8000, np.uint16)  # mid grey at 16 bits
    Image.fromarray(levels).save(folder / "grey16.png")
    add(folder / "grey16.png", Ok("image", (W, H), "pillow", 1))
    hidden = np.zeros((H, W, 4), np.uint8)
    hidden[..., 1] = 255  # pure green, fully transparent
    Image.fromarray(hidden, "RGBA").save(folder / "transparent.png")
    add(folder / "transparent.png", Ok("image", (W, H), "pillow", 1))
    palette = Image.fromarray((halves()[..., 2] > 0).astype(np.uint8), "P")  # index 0 left, 1 right
    palette.putpalette([255, 0, 0, 0, 0, 255])  # red, blue
    palette.save(folder / "palette_alpha.png", transparency=0)  # the red entry is transparent
    add(folder / "palette_alpha.png", Ok("image", (W, H), "pillow", 1))
    Image.fromarray(halves()).convert("L").save(folder / "grey.png")
    add(folder / "grey.png", Ok("image", (W, H), "pillow", 1))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: shown rotated 90 degrees clockwise
    Image.fromarray(halves()).save(folder / "exif_rotated.jpg", exif=exif)
    add(folder / "exif_rotated.jpg", Ok("image", (H, W), "pillow", 1))
    animation = [Image.fromarray(np.full((H, W, 3), value, np.uint8)) for value in (0, 100, 200)]
    animation[0].save(folder / "animated.webp", save_all=True, append_images=animation[1:], duration=100, loop=0)
    add(folder / "animated.webp", Ok("gif", (W, H), "pillow", 3))
    preview = Image.fromarray(halves(16, 12))  # a JPEG holding a second picture (camera preview, HDR gain map)
    Image.fromarray(halves()).save(folder / "multi_picture.jpg", "MPO", save_all=True, append_images=[preview])
    add(folder / "multi_picture.jpg", Ok("image", (W, H), "pillow", 1))
    Image.new("RGB", (20000, 10), (10, 200, 30)).save(folder / "strip_20000x10.png")
    add(folder / "strip_20000x10.png", Ok("image", (20000, 10), "pillow", 1))
    Image.new("1", (20000, 15000)).save(folder / "bomb.png")  # 300 Mpx of zeros: a few KB on disk
    add(folder / "bomb.png", Fails("image too large: 20000x15000 = 300 Mpx, above max_image_pixels "
                                   "(250 Mpx)", "too_large"))

    for name in ["with space.mp4", "new\nline.mp4", "ünï ☃.mp4", "-leading-dash.mp4", "pipe:0.mp4"]:
        shutil.copy(good_mp4, folder / name)
        add(folder / name, Ok("video", (W, H), "decord", 8))
    undecodable = folder / os.fsdecode(b"latin1-caf\xe9.mp4")  # not UTF-8: decord cannot open it, PyAV can
    shutil.copy(good_mp4, undecodable)
    add(undecodable, Ok("video", (W, H), "pyav", 8))
    (folder / "link.mp4").symlink_to(good_mp4)
    add(folder / "link.mp4", Ok("video", (W, H), "decord", 8))
    (folder / "loop.mp4").symlink_to(folder / "loop.mp4")
    add(folder / "loop.mp4", Fails("cannot open: Too many levels of symbolic links", "unreadable"))
    (folder / "broken_link.mp4").symlink_to(folder / "nowhere.mp4")
    add(folder / "broken_link.mp4", Fails("broken symbolic link", "not_found"))
    os.mkfifo(folder / "fifo.mp4")
    add(folder / "fifo.mp4", Fails("not a regular file: a FIFO", "unreadable"))
    (folder / "folder.mp4").mkdir()
    add(folder / "folder.mp4", Fails("not a regular file: a directory", "unreadable"))
    (folder / "device.mp4").symlink_to("/dev/zero")
    add(folder / "device.mp4", Fails("not a regular file: a character device", "unreadable"))
    if os.geteuid() != 0:  # root reads any file whatever its mode
        shutil.copy(good_mp4, folder / "unreadable.mp4")
        (folder / "unreadable.mp4").chmod(0)
        add(folder / "unreadable.mp4", Fails("permission denied", "unreadable"))
    return expect
