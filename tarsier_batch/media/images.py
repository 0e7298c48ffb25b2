"""Images and animations (GIF, animated WebP and PNG) through Pillow, with the checks against image bombs."""

from __future__ import annotations

import contextlib
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

from ..errors import TOO_LARGE, UNDECODABLE, ItemError, plain_message
from .frames import FrameTransform, Media, finish_frame
from .kinds import MediaType
from .memory import return_freed_memory
from .sampling import FrameCount, FrameSampler, by_rate, frames_for

# Pillow's own limit (89 Mpx: a warning, twice that: an error) is set aside while opening: the
# caller's `max_image_pixels` decides, and its message names the option.
MAX_IMAGE_PIXELS = 250_000_000
# A JPEG above Pillow's limit is read reduced by 1/2, 1/4 or 1/8 as it is decoded (Pillow's draft
# mode: the full image is never allocated), to this many pixels or fewer: still several times what
# any model of ours takes per frame. Below the limit an image is read whole, as the official
# loaders read it.
DRAFT_ABOVE_PIXELS = int(1024 * 1024 * 1024 // 4 // 3)   # Pillow's default MAX_IMAGE_PIXELS (89,478,485)
DRAFT_TO_PIXELS = 16_000_000
_EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_PILLOW_LIMIT = threading.Lock()
# Pillow also warns from its own checks elsewhere (a GIF frame growing while seeking); the limit above decides.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def load_gif(path: str, num_frames: FrameCount, transform: FrameTransform | None, sampler: FrameSampler,
             max_pixels: int | None) -> Media:
    # Like the official loader, walk the frames once and keep those whose index was sampled:
    # repeated indices collapse, so a short GIF yields fewer frames than requested.
    with open_image(path, max_pixels) as gif:
        return _sample_animation(path, gif, num_frames, transform, sampler, lambda frame: frame.convert("RGB"))


def _sample_animation(path: str, animation: Image.Image, num_frames: FrameCount, transform: FrameTransform | None,
                      sampler: FrameSampler, to_rgb: Callable[[Image.Image], Image.Image]) -> Media:
    frames: list[Any] = []
    kept: list[int] = []
    duration_ms = 0
    with _pillow_damage_undecodable("the animation", seeking_frames=True):
        frame_count = animation.n_frames   # counting the frames reads them all
    # Sampled by rate, an animation counts its frames by its own rate (FFmpeg's, which Media.fps records): its
    # frames' durations, read in a first walk; without durations, the fixed count.
    rate = _average_rate(frame_count, sum(_frame_durations_ms(animation))) if by_rate(num_frames) else None
    wanted = set(sampler(frame_count, frames_for(num_frames, frame_count, rate)))
    for index, frame in enumerate(_animation_frames(animation)):
        duration_ms += _duration_ms(frame)
        if index in wanted:
            with _pillow_damage_undecodable("the animation"):
                rgb = to_rgb(frame)
            frames.append(finish_frame(rgb, transform, len(wanted)))
            kept.append(index)
            if transform is not None:
                return_freed_memory()
    width, height = animation.size
    if not frames:
        raise ItemError(UNDECODABLE, "the animation has no readable frames")
    return Media(path, MediaType.GIF, frames, kept, width, height,
                 duration_ms / 1000 if duration_ms else None, "pillow", fps=_average_rate(frame_count, duration_ms))


def _average_rate(frame_count: int, duration_ms: float) -> float | None:
    """An animation's average rate, as FFmpeg reads it (integers divided once: exactly its float); None: its
    frames have no durations."""
    return frame_count * 1000 / duration_ms if duration_ms else None


def _duration_ms(frame: Image.Image) -> float:
    return frame.info.get("duration", 0) or 0


def _frame_durations_ms(animation: Image.Image) -> Iterator[float]:
    return (_duration_ms(frame) for frame in _animation_frames(animation))


def open_image(path: str, max_pixels: int | None) -> Image.Image:
    """Open an image (lazily: its size is known, no pixel is decoded), refusing one above `max_pixels`."""
    with _PILLOW_LIMIT:   # Pillow's limit is a module global: set it aside for this open only
        pillows, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            with _pillow_damage_undecodable("the image"):   # a header cut short ("Truncated File Read")
                image = Image.open(path)
        except UnidentifiedImageError:
            raise ItemError(UNDECODABLE, "not an image: Pillow recognises no image format in its bytes") from None
        finally:
            Image.MAX_IMAGE_PIXELS = pillows
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        raise ItemError(TOO_LARGE, f"image too large: {width}x{height} = {width * height / 1e6:.3g} Mpx, above "
                         f"max_image_pixels ({max_pixels / 1e6:.3g} Mpx)")
    return image


@contextlib.contextmanager
def _pillow_damage_undecodable(what: str, seeking_frames: bool = False) -> Iterator[None]:
    """Pillow's ways of saying the data is cut short or damaged, as an undecodable item. OSError without an
    errno ("image file is truncated"; one with an errno is the file's reading failing: unreadable, as the
    caller classes it) and SyntaxError are its own. With `seeking_frames` (counting or walking an
    animation's frames, and nothing of ours inside), also IndexError, EOFError and struct.error: reading past
    the end of a cut GIF while seeking its frames, with words ("index out of range", "unpack_from requires a
    buffer of at least 2 bytes") that say nothing to whoever reads the row."""
    cut_while_seeking = (IndexError, EOFError, struct.error) if seeking_frames else ()
    try:
        yield
    except UnidentifiedImageError:   # an OSError without an errno too: the caller says it its own way
        raise
    except (OSError, SyntaxError) as error:
        if isinstance(error, OSError) and error.errno is not None:
            raise
        raise ItemError(UNDECODABLE, f"{what} is damaged or cut short ({plain_message(error)})") from None
    except cut_while_seeking:
        raise ItemError(UNDECODABLE, f"{what} is cut short: its data ends inside a frame") from None


def _animation_frames(animation: Image.Image) -> Iterator[Image.Image]:
    """The frames in order, Pillow's damage as undecodable (only Pillow's seeking is inside: the caller's own
    work on each frame is not)."""
    with _pillow_damage_undecodable("the animation", seeking_frames=True):
        yield from ImageSequence.Iterator(animation)


def _read_reduced_if_huge(image: Image.Image) -> None:
    """Have a huge JPEG decoded at the smallest reduction (1/2, 1/4, 1/8) that brings it to DRAFT_TO_PIXELS."""
    width, height = image.size
    if image.format not in ("JPEG", "MPO") or width * height <= DRAFT_ABOVE_PIXELS:   # MPO: a JPEG with more pictures
        return
    scale = next((scale for scale in (2, 4, 8) if width * height / scale**2 <= DRAFT_TO_PIXELS), 8)
    image.draft(image.mode, (width // scale, height // scale))   # Pillow reduces by size // requested


# Formats whose extra frames are an animation. A JPEG holding more pictures (MPO: a camera's
# preview, a phone's HDR gain map or depth map) and a multi-page TIFF are still images.
_ANIMATED_FORMATS = frozenset({"GIF", "PNG", "WEBP"})


def load_image(path: str, num_frames: FrameCount, transform: FrameTransform | None, sampler: FrameSampler,
               max_pixels: int | None) -> Media:
    """A still image; an animated one (WebP, APNG) is sampled like a GIF (its rows say media_type "gif")."""
    with open_image(path, max_pixels) as image:
        with _pillow_damage_undecodable("the image", seeking_frames=True):   # a GIF under another name: counted
            animated = image.format in _ANIMATED_FORMATS and getattr(image, "n_frames", 1) > 1
        if animated:
            return _sample_animation(path, image, num_frames, transform, sampler, _animation_frame_rgb)
        stored = image.size
        with _pillow_damage_undecodable("the image"):
            _read_reduced_if_huge(image)
            swapped = image.getexif().get(_EXIF_ORIENTATION) in _SWAPPING_ORIENTATIONS
            ImageOps.exif_transpose(image, in_place=True)  # in place: a large photo is not held twice
            frame = _to_rgb(image)
    width, height = reversed(stored) if swapped else stored   # as displayed, at full size
    return Media(path, MediaType.IMAGE, [finish_frame(frame, transform, 1)], [0], width, height, None, "pillow")


def _animation_frame_rgb(frame: Image.Image) -> Image.Image:
    # A copy, not in place: an APNG's next frame is drawn over this one.
    return _to_rgb(ImageOps.exif_transpose(frame))


_SIXTEEN_BIT_GREY = frozenset({"I;16", "I;16B", "I;16L", "I"})
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as a viewer shows it; ordinary 8-bit images are exactly `image.convert("RGB")`, as upstream.

    Where upstream's plain conversion is wrong, this does what a viewer shows: 16-bit grey
    levels are scaled to 8 bits (Pillow's conversion clips them, which turns most photos white;
    32-bit levels are taken as 16-bit ones, clipped to 0-65535); transparent pixels (an alpha
    band, a transparent palette entry or colour key) are composited over white (a plain
    conversion reveals whatever colour hides under them). CMYK, palette and greyscale images
    are converted as Pillow does.
    """
    if image.mode in _SIXTEEN_BIT_GREY:
        import numpy as np

        levels = np.clip(np.asarray(image, dtype=np.int64), 0, 0xFFFF) >> 8
        return Image.fromarray(levels.astype(np.uint8), mode="L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
