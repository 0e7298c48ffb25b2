"""Tarsier2's official input path: frames, pixel budget, Qwen2-VL patches and the chat prompt.

What the official quick-start path does (../shared/TARSIER2_FACTS.md, section 2 and 3):
every sampled frame is shrunk to a per-frame pixel budget, then processed by the checkpoint's
Qwen2-VL image processor; a video's frames are each duplicated to fill a temporal patch of two,
and the video becomes one `<|vision_start|><|image_pad|>...<|vision_end|>` block of the prompt
rendered by the checkpoint's own chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from ...errors import TOO_LARGE, ItemError
from ...media import MediaType
from ..base import LargestItem

# The official quick start passes its --instruction default for every media type, images included.
DEFAULT_INSTRUCTION = "Describe the video in detail."
# The official default data config (configs/tarser2_default_config.yaml): at most 460,800
# pixels per frame, and the processor's 128 * 384 * 384 pixels per sample, shared by all the
# images it is given (a video counts two per frame once its frames are duplicated).
MAX_PIXELS_PER_FRAME = 460_800
MAX_PIXELS_PER_SAMPLE = 128 * 384 * 384
# Qwen2VLImageProcessor's class defaults (transformers 4.47), used when preprocessor_config.json names neither.
_FALLBACK_MIN_PIXELS, _FALLBACK_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


@dataclass(frozen=True)
class FramePatches:
    """One frame's encoder input: its patches once (the temporal copy is rebuilt when encoding)."""

    patches: torch.Tensor   # (grid_h * grid_w, channels * patch * patch) float32, in merger order
    grid_h: int
    grid_w: int


def with_temporal_copies(patches: torch.Tensor, copies: int) -> torch.Tensor:
    """A frame's kept patches (n, channels * patch * patch) -> the encoder's input, the frame
    repeated `copies` times in each patch's temporal axis: (n, channels * copies * patch * patch)."""
    return patches.view(patches.shape[0], 3, 1, -1).expand(-1, -1, copies, -1).reshape(patches.shape[0], -1)


def pixel_cap(media_type: MediaType, frame_count: int, temporal_patch_size: int) -> int:
    """The most pixels one frame may keep before the image processor sees it."""
    images = temporal_patch_size if media_type is MediaType.IMAGE else 2 * frame_count
    return min(MAX_PIXELS_PER_FRAME, MAX_PIXELS_PER_SAMPLE // images)


def shrink_to_pixels(frame: Image.Image, max_pixels: int) -> Image.Image:
    """Scale down, keeping the aspect ratio, to at most `max_pixels` (the official `resize2pixels`).

    Sides are rounded down after dividing by sqrt(area / max_pixels); Pillow's default filter
    (bicubic for RGB). A frame already within the budget is left as it is.
    """
    width, height = frame.size
    try:
        new_height, new_width = smart_resize(height, width, factor=1, min_pixels=0, max_pixels=max_pixels)
    except ValueError as error:   # Qwen2-VL refuses the shape (an aspect ratio above 200): the file's, not ours
        raise ItemError(TOO_LARGE, str(error)) from None
    if (new_width, new_height) == (width, height):
        return frame
    return frame.resize((new_width, new_height))


class Tarsier2Processor:
    """The checkpoint's tokenizer, chat template and Qwen2-VL image processor (PIL backend)."""

    def __init__(self, model_dir: Path):
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        self.chat_template = _chat_template(model_dir, self.tokenizer)
        self.image_processor = _image_processor(model_dir)
        self.temporal_patch_size: int = self.image_processor.temporal_patch_size
        self.merge_size: int = self.image_processor.merge_size

    def min_vision_positions(self, num_frames: int) -> int:
        """The fewest vision positions `num_frames` frames can take: each is at least `min_pixels` big."""
        merged_patch = self.image_processor.patch_size * self.merge_size
        return num_frames * max(1, self.image_processor.size.shortest_edge // merged_patch**2)

    def largest_item(self, num_frames: int) -> LargestItem:
        """A video's frames at the most pixels each may keep, or one image at its own cap, whichever is more:
        one vision position per merged patch, one float32 copy of each patch kept."""
        patch, most = self.image_processor.patch_size, self.image_processor.size.longest_edge   # longest: max_pixels
        video = num_frames * -(-min(pixel_cap(MediaType.VIDEO, num_frames, self.temporal_patch_size), most) // patch**2)
        image = -(-min(pixel_cap(MediaType.IMAGE, 1, self.temporal_patch_size), most) // patch**2)
        patches = max(video, image)
        return LargestItem(-(-patches // self.merge_size**2), patches * 3 * patch**2 * 4)

    def frame_patches(self, frame: Image.Image, frame_count: int, media_type: MediaType) -> FramePatches:
        """One RGB frame, shrunk to its budget and cut into patches, as the official processor does.

        The processor fills a temporal patch by repeating the frame, which is exactly a video
        frame duplicated; only one copy is kept here (`Tarsier2CaptionModel` rebuilds the other).
        """
        shrunk = shrink_to_pixels(frame, pixel_cap(media_type, frame_count, self.temporal_patch_size))
        out = self.image_processor(images=shrunk, return_tensors="pt")
        _, grid_h, grid_w = (int(value) for value in out["image_grid_thw"][0])
        patches = out["pixel_values"]
        channels_time_patch = patches.shape[1]
        one_copy = patches.view(patches.shape[0], 3, self.temporal_patch_size,
                                channels_time_patch // (3 * self.temporal_patch_size))[:, :, 0]
        return FramePatches(one_copy.reshape(patches.shape[0], -1).clone(), grid_h, grid_w)

    def prompt_ids(self, media_type: MediaType, vision_tokens: int, instruction: str) -> list[int]:
        """The chat prompt with one vision block of `vision_tokens` image-pad tokens, tokenised.

        Messages as the official quick start builds them: a user turn of the media then the
        instruction, and an empty assistant turn that the template leaves open
        (`strip_final_eos`), so the prompt ends with the assistant header.
        """
        media = {"type": "image" if media_type is MediaType.IMAGE else "video", "num_vision_tokens": vision_tokens}
        messages = [{"role": "user", "content": [media, {"type": "text", "text": instruction}]},
                    {"role": "assistant", "content": []}]
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=False, strip_final_eos=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        known = [token for token in token_ids if token < len(self.tokenizer)]
        return self.tokenizer.decode(known, skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _chat_template(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> str:
    """The processor's template (chat_template.json or .jinja), else the tokenizer's, as the official code finds it."""
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    template = template or tokenizer.chat_template
    if not template:
        raise ValueError(f"{model_dir} has no chat template (chat_template.json): cannot build the prompt")
    return template


def _image_processor(model_dir: Path) -> Qwen2VLImageProcessorPil:
    """Qwen2VLImageProcessor from the checkpoint's preprocessor_config.json.

    The official code (transformers 4.47) reads the top-level `min_pixels`/`max_pixels`; the
    Tarsier2 files may only carry them in `size {min_pixels, max_pixels}`, which is honoured too.
    """
    raw = _read_json(model_dir / "preprocessor_config.json")
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    min_pixels = raw.get("min_pixels", size.get("min_pixels", _FALLBACK_MIN_PIXELS))
    max_pixels = raw.get("max_pixels", size.get("max_pixels", _FALLBACK_MAX_PIXELS))
    settings = {key: raw[key] for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                          "image_std", "resample", "rescale_factor", "do_rescale",
                                          "do_normalize", "do_convert_rgb") if key in raw}
    return Qwen2VLImageProcessorPil(min_pixels=int(min_pixels), max_pixels=int(max_pixels), **settings)
