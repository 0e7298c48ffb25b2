"""Decode media files into RGB frames, sampled the way the official Tarsier loader samples them."""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import re
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, ImageSequence


class MediaType(str, Enum):
    VIDEO = "video"
    GIF = "gif"
    IMAGE = "image"


VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".webm", ".mov", ".mkv", ".wmv", ".ts", ".m4v", ".mpg", ".mpeg",
                              ".3gp", ".flv"})
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})


def media_type_of(path: str | os.PathLike[str]) -> MediaType | None:
    """The media type implied by a file's extension (case-insensitive), or None if unsupported."""
    suffix = Path(path).suffix.lower()
    if suffix == ".gif":
        return MediaType.GIF
    if suffix in VIDEO_EXTENSIONS:
        return MediaType.VIDEO
    if suffix in IMAGE_EXTENSIONS:
        return MediaType.IMAGE
    return None


def frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """Uniform frame indices that include the first and the last frame (Tarsier v1's rule).

    Matches the official formula exactly, including Python's half-to-even `round`; a clip
    shorter than `num_frames` repeats indices, and one requested frame is the first frame.
    """
    _check_counts(total_frames, num_frames)
    if num_frames == 1:
        return [0]
    return [round(i * (total_frames - 1) / (num_frames - 1)) for i in range(num_frames)]


def frame_indices_without_repeats(total_frames: int, num_frames: int) -> list[int]:
    """Tarsier2's rule: v1's uniform indices, but a clip of at most `num_frames` frames gives all of them."""
    _check_counts(total_frames, num_frames)
    if num_frames == 1:
        return [0]
    if total_frames <= num_frames:
        return list(range(total_frames))
    return frame_indices(total_frames, num_frames)


def _check_counts(total_frames: int, num_frames: int) -> None:
    if total_frames < 1:
        raise ValueError("the clip has no frames")
    if num_frames < 1:
        raise ValueError("at least one frame must be requested")


# Chooses `num_frames` frame indices of a clip of `total_frames` frames.
FrameSampler = Callable[[int, int], list[int]]
# Applied to each sampled frame (an RGB PIL image) as soon as it is decoded, e.g. a model's
# preprocessing: then only its (much smaller) result is kept, never all full-resolution frames.
# The second argument is how many frames the item keeps (some models size frames by it).
FrameTransform = Callable[[Image.Image, int], Any]


@dataclass(frozen=True)
class Media:
    """Frames sampled from one file, with the facts about the file that end up in the output.

    `frames` holds RGB PIL images, or whatever the `frame_transform` given to `load_media`
    returned for each of them. Facts (`width`, `height`, ...) are always those of the file.
    """

    path: str
    media_type: MediaType
    frames: list[Any]
    frame_indices: list[int]
    width: int                # as displayed: after rotation and non-square pixels are applied
    height: int
    duration_s: float | None
    decoder: str              # what produced the frames: "decord", "pyav" or "pillow"


def load_media(path: str, media_type: MediaType, num_frames: int,
               frame_transform: FrameTransform | None = None, sampler: FrameSampler = frame_indices) -> Media:
    """Decode `path` and sample `num_frames` frames with `sampler` (images give one frame).

    With `frame_transform`, each sampled frame is transformed soon after it is decoded and only
    the result is kept. Full-resolution frames are released before decoding goes on, except
    that video frames decord must decode in one pass (sampled frames between the same two
    keyframes) are decoded together first. A frame sampled twice (a video shorter than
    `num_frames`) is decoded and transformed once; its result appears at both places.
    """
    _check_regular_file(path)
    if media_type is MediaType.VIDEO:
        return _load_video(path, num_frames, frame_transform, sampler)
    if media_type is MediaType.GIF:
        return _load_gif(path, num_frames, frame_transform, sampler)
    return _load_image(path, num_frames, frame_transform, sampler)


def _check_regular_file(path: str) -> None:
    """Fail with a clear reason, before opening, on anything but a readable, non-empty regular file.

    Opening a FIFO named like media would block for ever, and a device would never end.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ValueError("the file no longer exists" if os.path.lexists(path) is False
                         else "broken symbolic link") from None
    except OSError as error:  # ELOOP (a symlink loop), EACCES on a folder on the way, ...
        raise ValueError(f"cannot open: {error.strerror}") from None
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    for test, kind in kinds:
        if test(info.st_mode):
            raise ValueError(f"not a regular file: {kind}")
    if info.st_size == 0:
        raise ValueError("empty file (0 bytes)")
    if not os.access(path, os.R_OK):
        raise ValueError("cannot open: permission denied")


def decoder_versions() -> dict[str, str]:
    """Versions of the frame decoders, recorded in the output's provenance."""
    import decord
    import PIL

    import av

    return {"video": f"decord {decord.__version__}", "video_fallback": f"pyav {av.__version__}",
            "gif": f"pillow {PIL.__version__}", "image": f"pillow {PIL.__version__}"}


def _load_video(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler) -> Media:
    """decord (the official decoder, so the official pixels) where it reads the file correctly; PyAV otherwise.

    decord ignores a display rotation (phone videos) and non-square pixels (anamorphic
    video), and cannot open some files FFmpeg reads (AV1, some MPEG-TS, WebM without a
    duration, damaged files): PyAV decodes those, honouring rotation and pixel aspect.
    """
    if _needs_display_correction(path):
        return _load_video_pyav(path, num_frames, transform, sampler)
    try:
        return _load_video_decord(path, num_frames, transform, sampler)
    except Exception as decord_error:  # noqa: BLE001 - any decord failure gets a second decoder
        try:
            return _load_video_pyav(path, num_frames, transform, sampler)
        except Exception as pyav_error:  # noqa: BLE001
            raise ValueError(f"cannot decode video: decord: {_short(decord_error)}; "
                             f"pyav: {_short(pyav_error)}") from None


def _short(error: BaseException) -> str:
    """An error on one line, without decord's "[12:00:00] /src/video/video_reader.cc:83: " prefix."""
    text = _NATIVE_LOG_PREFIX.sub("", " ".join(str(error).split()))
    return text[:200] or type(error).__name__


_NATIVE_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def _needs_display_correction(path: str) -> bool:
    """Whether the stream is shown rotated or with non-square pixels (which decord would ignore)."""
    import av

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            sar = stream.sample_aspect_ratio
            frame = next(container.decode(stream), None)
            rotation = frame.rotation if frame is not None else 0
    except Exception:  # noqa: BLE001 - not readable here: let the decoders say why
        return False
    return bool(rotation) or (sar is not None and sar != 0 and sar != 1)


def _load_video_pyav(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler) -> Media:
    """Decode with FFmpeg through PyAV: count the frames, then decode once, keeping the sampled ones."""
    import av

    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        # Count by decoding headers-only is not possible in general; demuxing counts packets
        # cheaply, and each video packet is one frame for the codecs in use.
        total = sum(1 for packet in container.demux(stream) if packet.size)
    indices = sampler(total, num_frames)
    wanted = set(indices)
    done: dict[int, Any] = {}
    width = height = 0
    rate: float | None = None
    with av.open(path) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate) if stream.average_rate else None
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                image = _displayed(frame, stream.sample_aspect_ratio)
                width, height = image.size
                done[index] = _finish(image, transform, len(indices))
                if transform is not None:
                    _return_freed_memory()
            if len(done) == len(wanted):
                break
    if not done:
        raise ValueError("no decodable video frames")
    kept = [index for index in indices if index in done]  # a damaged tail can hold fewer frames than packets
    return Media(path, MediaType.VIDEO, [done[index] for index in kept], kept, width, height,
                 total / rate if rate else None, "pyav")


def _displayed(frame: Any, sar: Any) -> Image.Image:
    """The frame as a player shows it: pixels stretched to their aspect ratio, then rotated."""
    image = frame.to_image()  # RGB
    if sar is not None and sar != 0 and sar != 1:
        image = image.resize((max(1, round(image.width * sar)), image.height), Image.Resampling.BICUBIC)
    if frame.rotation:
        image = image.rotate(frame.rotation, expand=True)  # counter-clockwise degrees, like the display matrix
    return image


def _load_video_decord(path: str, num_frames: int, transform: FrameTransform | None,
                       sampler: FrameSampler) -> Media:
    import decord

    decord.logging.set_level(decord.logging.QUIET)  # FFmpeg's own messages would garble the display
    reader = decord.VideoReader(path, num_threads=1, ctx=decord.cpu(0))
    total = len(reader)
    if total < 1:
        raise ValueError("decord found no frames")
    indices = sampler(total, num_frames)
    keyframes = [int(key) for key in reader.get_key_indices()]
    # decord's get_batch on the whole index list decodes each distinct index in order (seeking
    # unless the reader can simply decode forward to it) and copies repeats. Calling it with
    # one index at a time, in the same order, runs the same decoder steps (plus a seek between
    # runs, where get_batch seeks anyway), so the pixels are the same; but only the frames of
    # one run exist at full resolution at a time, instead of all of them.
    done: dict[int, Any] = {}
    width = height = 0
    for run in _decoder_runs(sorted(set(indices)), keyframes, total):
        arrays = [(index, _video_frame(reader, index)) for index in run]
        height, width = arrays[0][1].shape[:2]
        _stop_read_ahead(reader)
        arrays.reverse()
        while arrays:  # popping frees each full-size frame once it is transformed
            index, array = arrays.pop()
            done[index] = _finish(Image.fromarray(array), transform, len(indices))  # fromarray copies: an RGB image
            del array  # otherwise alive while the next run decodes
            if transform is not None:
                _return_freed_memory()
    frames = [done[index] for index in indices]  # a repeated index reuses its result, as get_batch copies it
    fps = reader.get_avg_fps()
    return Media(path, MediaType.VIDEO, frames, indices, width, height,
                 total / fps if fps > 0 else None, "decord")


def _video_frame(reader: Any, index: int) -> Any:
    """Frame `index` as a (height, width, 3) uint8 RGB array."""
    return reader.get_batch([index]).asnumpy()[0]


def _decoder_runs(indices: list[int], keyframes: list[int], total: int) -> list[list[int]]:
    """Split ascending frame indices where decord's get_batch would seek before the next one.

    After decoding frame i a decord 0.6 reader stands at i + 1; it reaches j by decoding
    forward when j lies in the same keyframe interval as i + 1, and seeks otherwise
    (`VideoReader::SeekAccurate`). Frames of one run must be decoded back to back (see
    `_stop_read_ahead`); between runs the reader would seek anyway. Misjudging a boundary
    costs memory or time, never pixels: decoding from the keyframe gives the same frame.
    """
    runs: list[list[int]] = []
    for index in indices:
        if runs and _keyframe_at(index, keyframes, total) == _keyframe_at(runs[-1][-1] + 1, keyframes, total):
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _keyframe_at(index: int, keyframes: list[int], total: int) -> int:
    """The keyframe decoding of frame `index` starts from, as decord's `LocateKeyframe` finds it."""
    if not keyframes or index <= keyframes[0]:
        return 0
    if index >= total:
        return keyframes[-1]
    return keyframes[bisect.bisect_right(keyframes, index) - 1]


def _stop_read_ahead(reader: Any) -> None:
    """Stop decord's decoder thread and drop the frames it decoded beyond the one asked for.

    To return one frame, decord's reader queues packets until its decoder thread yields a
    frame, often many (up to the rest of the file), and the thread keeps decoding them into
    full-size RGB frames while we preprocess: ~400 MB for the 84-frame 1920x800 demo clip.
    A seek stops the thread and drops its queues. It changes no pixels: get_batch would seek
    before the next run anyway (to frame 0, then to that run's keyframe), and frame 0 is
    where this leaves the reader, so its own seek to 0 becomes a no-op.
    """
    try:
        reader.seek(0)
    except RuntimeError:
        pass  # the thread was stopped all the same; the next get_batch seeks as it would have


def _finish(frame: Image.Image, transform: FrameTransform | None, frame_count: int) -> Any:
    return frame if transform is None else transform(frame, frame_count)


def _return_freed_memory() -> None:
    """Hand the freed temporaries of the last frame back to the system (glibc only).

    Each kept result (a 1.35 MB pixel tensor at 336 px) is allocated among its frame's
    temporaries (the full frame, its stretched square and their arrays, 5-15 MB each). Once
    those are freed the results split the free space into pieces too small for the next
    frame's temporaries, so the heap grows: measured ~2 MB per frame on top of the results.
    `malloc_trim` releases the free pages (well under a millisecond).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc (musl, macOS) or no C library handle
        return None


def _load_gif(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler) -> Media:
    # Like the official loader, walk the frames once and keep those whose index was sampled:
    # repeated indices collapse, so a short GIF yields fewer frames than requested.
    with _open_image(path) as gif:
        return _sample_animation(path, gif, num_frames, transform, sampler, lambda frame: frame.convert("RGB"))


def _sample_animation(path: str, animation: Image.Image, num_frames: int, transform: FrameTransform | None,
                      sampler: FrameSampler, to_rgb: Callable[[Image.Image], Image.Image]) -> Media:
    wanted = set(sampler(animation.n_frames, num_frames))
    frames: list[Any] = []
    kept: list[int] = []
    duration_ms = 0
    for index, frame in enumerate(ImageSequence.Iterator(animation)):
        duration_ms += frame.info.get("duration", 0) or 0
        if index in wanted:
            frames.append(_finish(to_rgb(frame), transform, len(wanted)))
            kept.append(index)
            if transform is not None:
                _return_freed_memory()
    width, height = animation.size
    if not frames:
        raise ValueError("the animation has no readable frames")
    return Media(path, MediaType.GIF, frames, kept, width, height,
                 duration_ms / 1000 if duration_ms else None, "pillow")


# Pillow warns between MAX_IMAGE_PIXELS and twice that; _open_image refuses those images itself.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def _open_image(path: str) -> Image.Image:
    """Open an image (lazily), refusing decompression bombs with a clear reason instead of Pillow's warning."""
    try:
        image = Image.open(path)
    except Image.DecompressionBombError as error:
        raise ValueError(f"image too large: {error}") from None
    width, height = image.size
    if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
        image.close()
        raise ValueError(f"image too large: {width}x{height} = {width * height / 1e6:.0f} Mpx, above the "
                         f"{Image.MAX_IMAGE_PIXELS / 1e6:.0f} Mpx decompression-bomb limit")
    return image


def _load_image(path: str, num_frames: int, transform: FrameTransform | None, sampler: FrameSampler) -> Media:
    """A still image; an animated one (WebP, APNG) is sampled like a GIF (its rows say media_type "gif")."""
    with _open_image(path) as image:
        if getattr(image, "n_frames", 1) > 1:
            return _sample_animation(path, image, num_frames, transform, sampler, _still_rgb)
        frame = _still_rgb(image)
    width, height = frame.size
    return Media(path, MediaType.IMAGE, [_finish(frame, transform, 1)], [0], width, height, None, "pillow")


def _still_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as displayed; ordinary 8-bit images are exactly `image.convert("RGB")`, as upstream.

    Where upstream's plain conversion is wrong, this does what a viewer shows: the EXIF
    orientation is applied; 16-bit grey levels are scaled to 8 bits (Pillow's conversion clips
    them, which turns most photos white); transparent pixels are composited over white
    (a plain conversion reveals whatever colour hides under alpha 0).
    """
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        import numpy as np

        levels = np.asarray(image, dtype=np.uint32) >> 8  # 16-bit levels to 8-bit
        return Image.fromarray(levels.astype(np.uint8), mode="L").convert("RGB")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or \
        (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
