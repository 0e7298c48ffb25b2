"""Qwen2-VL / Qwen2.5-VL input as their official usage builds it: qwen-vl-utils' frame sizes, the checkpoint's
image processor, and the prompt of the checkpoint's chat template with each vision pad expanded.

qwen-vl-utils resizes every image to a multiple of 28 within its pixel budget and every video frame within a
per-frame share of a whole-video budget (so long clips get smaller frames), then the checkpoint's processor
cuts the frames into 14 x 14 patches, two consecutive video frames to a temporal patch (an image fills its
temporal patch with two copies of itself). Images are resized with Pillow's bicubic filter, video frames with
torch's antialiased bicubic in float32 then rounded, as qwen-vl-utils resize them (Pillow's fixed-point filter
differs by one level in about a tenth of a video frame's values). Qwen3-VL's 16-px patches make the side factor
32, and every budget, counted in merged patches, scales with its square (`scaled`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from ...errors import TOO_LARGE, ItemError
from ...media import MediaType
from ...media.sampling import TEMPORAL_PATCH_FRAMES

# qwen-vl-utils' budgets (vision_process.py): sides are multiples of 28 (a merged 2 x 2 block of 14-px patches).
SIZE_FACTOR = 28
IMAGE_MIN_PIXELS = 4 * 28 * 28
IMAGE_MAX_PIXELS = 16384 * 28 * 28
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)   # the whole clip's budget, shared by its frames
# qwen-vl-utils' default sampling rate, used as the sampled rate of clips whose frame rate is unknown.
DEFAULT_FPS = 2.0
# The instructions of the models' own examples.
DEFAULT_VIDEO_INSTRUCTION = "Describe this video."
DEFAULT_IMAGE_INSTRUCTION = "Describe this image."


def scaled(pixels: int, factor: int) -> int:
    """A budget of qwen-vl-utils' at sides of multiples of `factor` rather than 28: the same merged patches."""
    return pixels * factor**2 // SIZE_FACTOR**2


def video_frame_max_pixels(frame_count: int, factor: int = SIZE_FACTOR) -> int:
    """The most pixels one of `frame_count` video frames may keep: its share of the clip's budget, within the
    per-frame bounds."""
    share = scaled(VIDEO_TOTAL_PIXELS, factor) / frame_count * TEMPORAL_PATCH_FRAMES
    return int(max(min(scaled(VIDEO_MAX_PIXELS, factor), share), int(scaled(VIDEO_MIN_PIXELS, factor) * 1.05)))


def pixel_bounds(media_type: MediaType, frame_count: int, factor: int = SIZE_FACTOR) -> tuple[int, int]:
    """(min, max) pixels of one frame after qwen-vl-utils' resize."""
    if media_type is MediaType.IMAGE:
        return scaled(IMAGE_MIN_PIXELS, factor), scaled(IMAGE_MAX_PIXELS, factor)
    return scaled(VIDEO_MIN_PIXELS, factor), video_frame_max_pixels(frame_count, factor)


def resize_for_model(frame: Image.Image, media_type: MediaType, frame_count: int,
                     factor: int = SIZE_FACTOR) -> Image.Image:
    """A frame resized to sides of multiples of `factor` within its pixel bounds (qwen-vl-utils' `smart_resize`)."""
    min_pixels, max_pixels = pixel_bounds(media_type, frame_count, factor)
    width, height = frame.size
    try:
        new_height, new_width = smart_resize(height, width, factor=factor, min_pixels=min_pixels,
                                             max_pixels=max_pixels)
    except ValueError as error:   # an aspect ratio above 200: the file's, not ours
        raise ItemError(TOO_LARGE, str(error)) from None
    if (new_width, new_height) == (width, height):
        return frame
    if media_type is MediaType.IMAGE:
        return frame.resize((new_width, new_height), Image.Resampling.BICUBIC)
    return resize_video_frame(frame, new_width, new_height)


def resize_video_frame(frame: Image.Image, width: int, height: int) -> Image.Image:
    """An RGB frame resized as torchvision's `functional.resize(..., BICUBIC, antialias=True)` resizes a uint8
    tensor, the call qwen-vl-utils makes on a video: interpolated in float32, clamped to 0-255, rounded."""
    pixels = torch.from_numpy(np.array(frame, dtype=np.uint8)).permute(2, 0, 1)[None].float()
    resized = torch.nn.functional.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False,
                                              antialias=True)
    return Image.fromarray(resized.clamp_(0, 255).round_().to(torch.uint8)[0].permute(1, 2, 0).numpy())


def seconds_per_temporal_patch(frame_count: int, clip_frames: int, fps: float | None) -> float:
    """How many seconds one temporal patch of `frame_count` frames sampled from a clip of `clip_frames` frames at
    `fps` spans, with the official usage's operations in their order: qwen-vl-utils' sampled rate
    `nframes / total_frames * video_fps`, then the processor's `temporal_patch_size / rate` (other orders differ in
    the last bit). A clip of unknown rate is taken at qwen-vl-utils' default."""
    rate = frame_count / clip_frames * fps if fps else DEFAULT_FPS
    return TEMPORAL_PATCH_FRAMES / rate


def temporal_interval(frame_count: int, clip_frames: int, fps: float | None, tokens_per_second: float) -> float:
    """Qwen2.5-VL's temporal positions per temporal patch, as transformers computes them: the processor's seconds
    become a float32 tensor (`second_per_grid_ts`), which `get_rope_index` multiplies by the positions per second
    in float32. Exactly a float32 value, so its products with the patch indices are transformers' too."""
    seconds = torch.tensor(seconds_per_temporal_patch(frame_count, clip_frames, fps), dtype=torch.float32)
    return float(tokens_per_second * seconds)


def temporal_patches(frame_count: int) -> int:
    """Temporal patches of `frame_count` video frames (an odd last frame is repeated to fill its patch)."""
    return math.ceil(frame_count / TEMPORAL_PATCH_FRAMES)
