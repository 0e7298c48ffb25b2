"""Tarsier v1's CPU side: sampled frames and an instruction turned into prompt tokens and pixel tensors.

The decoding workers run this, so it imports none of the network's modules: transformers' tokenizer and image
transforms, not its modeling utilities (which its image-processor classes import too: torch._dynamo,
torch.distributed and sympy, seconds of a worker's first start).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.image_transforms import (
    center_crop,
    convert_to_rgb,
    get_resize_output_image_size,
    normalize,
    rescale,
    resize,
)
from transformers.image_utils import ChannelDimension
from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from ...media import MAX_IMAGE_PIXELS, FrameCount, Media, MediaType, Span, load_media
from ..base import LargestItem, ProcessedPrompt, VisionBlock
from ..catalog import TARSIER
from ..temporal import ALWAYS_KEPT, vector_changes
from .config import TarsierConfig

IMAGE_PLACEHOLDER = "<image>"
DEFAULT_INSTRUCTIONS = {
    MediaType.VIDEO: "Describe the video in detail.",
    MediaType.GIF: "Describe the video in detail.",
    MediaType.IMAGE: "Describe the image in detail.",
}


def default_instruction(media_type: MediaType) -> str:
    return DEFAULT_INSTRUCTIONS[media_type]


def build_prompt(num_frames: int, instruction: str) -> str:
    """The official prompt: one placeholder per frame, a newline, the instruction, a trailing space."""
    cleaned = instruction.replace(IMAGE_PLACEHOLDER, "").replace("<video>", "")
    return f"USER: {IMAGE_PLACEHOLDER * num_frames}\n{cleaned} ASSISTANT: "


# The official square is as wide as the frame's longer side: a 695-byte 20000 x 10 PNG becomes a
# 20000 x 20000 square (1.2 GB, 5.9 GB at peak). Beyond this side the frame is first shrunk (aspect
# kept) so that the square is at most 8192 px (201 MB); 8K video and photos stay bit-identical.
MAX_SQUARE_SIDE = 8192


def stretch_to_square(frame: Image.Image) -> Image.Image:
    """Stretch (no padding) to a square whose side is the longer side, as the official loader does.

    Frames whose longer side exceeds MAX_SQUARE_SIDE are shrunk to it first (bicubic, aspect
    kept): the CLIP processor brings the square down to 336 px anyway.
    """
    side = max(frame.size)
    if side > MAX_SQUARE_SIDE:
        scale = MAX_SQUARE_SIDE / side
        frame = frame.resize((max(1, round(frame.width * scale)), max(1, round(frame.height * scale))),
                             resample=Image.Resampling.BICUBIC)
        side = MAX_SQUARE_SIDE
    return frame.resize((side, side), resample=Image.Resampling.BICUBIC)


# The processor classes whose steps `ClipFrameSteps` takes (one processor in its backends' names; older
# checkpoints name a feature extractor), and the preprocessor_config.json keys it follows. A checkpoint with any
# other processor or key is preprocessed by transformers' own class.
_CLIP_PROCESSORS = {"CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast", "CLIPFeatureExtractor"}
_CLIP_KEYS = {"image_processor_type", "feature_extractor_type", "processor_class", "do_convert_rgb", "do_resize",
              "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor", "do_normalize",
              "image_mean", "image_std"}
_FIRST = ChannelDimension.FIRST


@dataclass(frozen=True)
class ClipFrameSteps:
    """The checkpoint's CLIP image processor with its PIL backend, step by step in transformers' own image
    transforms: RGB, shortest edge resized, centre crop, rescale, normalise. Equal to
    `AutoImageProcessor.from_pretrained(dir, backend="pil")` bit for bit (its class defaults where a key is
    absent), without importing the image-processor classes."""

    convert_rgb: bool
    shortest_edge: int | None          # None: not resized
    resample: int
    crop: tuple[int, int] | None       # (height, width); None: not cropped
    rescale_factor: float | None       # None: not rescaled
    mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None   # None: not normalised

    @classmethod
    def of_checkpoint(cls, model_dir: Path) -> ClipFrameSteps | None:
        """The steps `model_dir`'s preprocessor_config.json describes; None where it names another processor,
        a key these steps do not follow, a null value, or a size they do not take (transformers' class then runs)."""
        try:
            config: dict[str, Any] = json.loads((model_dir / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return None
        kind = config.get("image_processor_type") or config.get("feature_extractor_type")
        if kind not in _CLIP_PROCESSORS or not set(config) <= _CLIP_KEYS or None in config.values():
            return None   # a null turns a step off or to a default in ways the class decides
        size, crop = config.get("size", 224), config.get("crop_size", 224)   # the class's default: 224 px
        if isinstance(size, dict):
            size = size["shortest_edge"] if set(size) == {"shortest_edge"} else None
        if isinstance(crop, dict):
            crop = (crop["height"], crop["width"]) if set(crop) == {"height", "width"} else None
        else:
            crop = (crop, crop)
        if not isinstance(size, int) or crop is None:
            return None
        normalise = config.get("do_normalize", True)
        return cls(
            convert_rgb=config.get("do_convert_rgb", True),
            shortest_edge=size if config.get("do_resize", True) else None,
            resample=config.get("resample", Image.Resampling.BICUBIC),
            crop=crop if config.get("do_center_crop", True) else None,
            rescale_factor=config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None,
            mean_std=(tuple(config.get("image_mean", OPENAI_CLIP_MEAN)),
                      tuple(config.get("image_std", OPENAI_CLIP_STD))) if normalise else None)

    def __call__(self, frame: Image.Image) -> torch.Tensor:
        """One frame's pixels, channels first."""
        image = convert_to_rgb(frame, return_numpy=True) if self.convert_rgb else np.array(frame)
        image = image[None] if image.ndim == 2 else np.moveaxis(image, -1, 0)
        if self.shortest_edge is not None:
            size = get_resize_output_image_size(image, size=self.shortest_edge, default_to_square=False,
                                                input_data_format=_FIRST)
            image = resize(image, size=size, resample=self.resample, data_format=_FIRST, input_data_format=_FIRST)
        if self.crop is not None:
            image = center_crop(image, size=self.crop, data_format=_FIRST, input_data_format=_FIRST)
        if self.rescale_factor is not None:
            image = rescale(image, scale=self.rescale_factor, data_format=_FIRST, input_data_format=_FIRST)
        if self.mean_std is not None:
            image = normalize(image, *self.mean_std, data_format=_FIRST, input_data_format=_FIRST)
        return torch.from_numpy(np.ascontiguousarray(image))


class ClipProcessorSteps:
    """transformers' CLIP image processor (PIL backend, as upstream), for a configuration `ClipFrameSteps` does not
    take."""

    def __init__(self, model_dir: Path):
        from transformers import AutoImageProcessor  # imports transformers' modeling utilities: only when needed

        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")

    def __call__(self, frame: Image.Image) -> torch.Tensor:
        return self.processor(images=frame, return_tensors="pt")["pixel_values"][0]


def clip_frame_steps(model_dir: Path) -> ClipFrameSteps | ClipProcessorSteps:
    """The checkpoint's CLIP preprocessing of one frame."""
    return ClipFrameSteps.of_checkpoint(model_dir) or ClipProcessorSteps(model_dir)


class TarsierProcessor:
    """The checkpoint's own tokenizer and CLIP image preprocessing (PIL backend, as upstream)."""

    def __init__(self, model_dir: Path):
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        self.clip_steps = clip_frame_steps(model_dir)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Tokenise the whole prompt in one call, with the tokenizer's special tokens (`<s>`)."""
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def frame_pixels(self, frame: Image.Image, frame_count: int = 1) -> torch.Tensor:
        """One RGB frame's pixels for the vision tower, shape (3, size, size), float32.

        Every frame is preprocessed alike whatever the item's `frame_count`.

        Stretch to a square, then the checkpoint's CLIP processor. The PIL backend treats the
        images of a list one by one, so this equals that frame's row of the whole-list result
        bit for bit; `load_media` calls it as each frame is decoded (`frame_transform`), so a
        full-resolution frame (and its 1920x1920 square) never outlives its own preprocessing.
        """
        square = stretch_to_square(frame)
        return self.clip_steps(square)

    def pixel_values(self, frames: list[Image.Image]) -> torch.Tensor:
        """Pixels for the vision tower, shape (frames, 3, size, size), float32."""
        return torch.stack([self.frame_pixels(frame) for frame in frames])

    def decode(self, token_ids: list[int]) -> str:
        """The caption text: one decode call, special tokens skipped, unknown ids dropped."""
        known = [token for token in token_ids if token < len(self.tokenizer)]
        return self.tokenizer.decode(known, skip_special_tokens=True)


def merged_layout(prompt_ids: list[int], image_token_index: int,
                  tokens_per_frame: int) -> tuple[torch.Tensor, list[VisionBlock]]:
    """Expand the i-th image placeholder into frame i's `tokens_per_frame` positions.

    Returns one id per merged position (the placeholder id stands at vision positions) and
    the blocks where each frame's vectors go. Positions then simply run 0..L-1.
    """
    ids: list[int] = []
    blocks: list[VisionBlock] = []
    for token in prompt_ids:
        if token == image_token_index:
            blocks.append(VisionBlock(len(ids), tokens_per_frame))
            ids.extend([token] * tokens_per_frame)
        else:
            ids.append(token)
    return torch.tensor(ids, dtype=torch.long), blocks


class TarsierPromptProcessor(TarsierProcessor):
    """Media and instruction -> the merged prompt layout and per-frame pixels (CPU only)."""

    default_frames = TARSIER.default_frames

    def __init__(self, model_dir: Path, config: TarsierConfig):
        super().__init__(model_dir)
        self.config = config

    def load_media(self, path: str, media_type: MediaType, num_frames: FrameCount,
                   max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
        """v1 sampling (short videos repeat frames, GIFs do not), each frame preprocessed once decoded."""
        return load_media(path, media_type, num_frames, frame_transform=self.frame_pixels,
                          max_image_pixels=max_image_pixels, span=span)

    def min_vision_positions(self, num_frames: int) -> int:
        """Every v1 frame takes the same number of positions."""
        return num_frames * self.config.tokens_per_frame

    def largest_item(self, num_frames: int) -> LargestItem:
        """Every frame is the same size: (3, size, size) float32 pixels."""
        size = self.config.vision.image_size
        return LargestItem(self.min_vision_positions(num_frames), num_frames * 3 * size * size * 4)

    def vision_changes(self, prompt: ProcessedPrompt) -> list[torch.Tensor | None]:
        """Per patch vector, from its patch's pixels; each row's newline and the frame's separator are always kept."""
        frames = prompt.pixel_values
        patch = self.config.vision.patch_size
        grid = frames.shape[-1] // patch
        patches = frames.unfold(2, patch, patch).unfold(3, patch, patch)            # (F, 3, grid, grid, p, p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(frames.shape[0], grid, grid, -1)
        changes: list[torch.Tensor | None] = []
        for change in vector_changes(patches):
            if change is not None:
                rows = torch.cat([change.view(grid, grid), torch.full((grid, 1), ALWAYS_KEPT)], dim=1)
                change = torch.cat([rows.flatten(), torch.tensor([ALWAYS_KEPT])])
            changes.append(change)
        return changes

    def process(self, media: Media, instruction: str | None) -> ProcessedPrompt:
        """`media.frames` must hold `frame_pixels` results (one (3, size, size) tensor each)."""
        text = instruction if instruction is not None else default_instruction(media.media_type)
        prompt_ids = self.prompt_ids(build_prompt(len(media.frames), text))
        token_ids, blocks = merged_layout(prompt_ids, self.config.image_token_index, self.config.tokens_per_frame)
        if len(blocks) != len(media.frames):
            raise ValueError(f"prompt has {len(blocks)} image placeholders for {len(media.frames)} frames")
        length = token_ids.shape[0]
        return ProcessedPrompt(instruction=text, token_ids=token_ids, positions=torch.arange(length)[None],
                               next_position=length, vision_blocks=blocks,
                               pixel_values=torch.stack(list(media.frames)))


def load_processor(model_dir: Path) -> TarsierPromptProcessor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights."""
    return TarsierPromptProcessor(model_dir, TarsierConfig.from_file(model_dir / "config.json"))
