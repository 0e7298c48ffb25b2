"""Qwen2-VL and Qwen2.5-VL behind the family interface: a CPU prompt processor and a device model."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.initialization import no_init_weights

from ...errors import UNDECODABLE, ItemError
from ...media import MAX_IMAGE_PIXELS, FrameCount, Media, MediaType, Span, even_frame_indices, load_media
from ...media.sampling import TEMPORAL_PATCH_FRAMES
from ..base import LargestItem, ProcessedPrompt, VisionBlock
from ..catalog import FamilyInfo
from ..qwen_vl.network import LineageCaptionModel
from ..qwen_vl.patches import (
    FramePatches,
    chat_template,
    decode_text,
    frame_patches,
    image_processor,
    merged_vector_changes,
    temporal_patch_of,
    vision_run_start,
)
from ..qwen_vl.positions import VisionSpan, mrope_positions
from ..weights import load_weights
from .modeling import QwenVLConfig, QwenVLModel, module_key
from .processing import (
    DEFAULT_IMAGE_INSTRUCTION,
    DEFAULT_VIDEO_INSTRUCTION,
    IMAGE_MAX_PIXELS,
    resize_for_model,
    scaled,
    temporal_interval,
    temporal_patches,
    video_frame_max_pixels,
)


def clip_frames(media: Media) -> int:
    """How many frames the clip `media` was sampled from holds: the file's, or a span's (the clip cut from the file,
    as if a file of its own). `even_frame_indices` spreads the samples from the clip's first frame to its last."""
    return media.frame_indices[-1] - media.frame_indices[0] + 1


class QwenVLPromptProcessor:
    """Media and instruction -> the prompt, one vision block per temporal patch, M-RoPE positions (CPU only)."""

    def __init__(self, model_dir: Path, config: QwenVLConfig, family: FamilyInfo):
        self.config = config
        self.default_frames = family.default_frames
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        self.chat_template = chat_template(model_dir, self.tokenizer)
        self.image_processor = image_processor(model_dir)
        self.merge_size: int = self.image_processor.merge_size
        self.patch_size: int = self.image_processor.patch_size
        self.size_factor = self.patch_size * self.merge_size   # frame sides are multiples of a merged patch
        if self.image_processor.temporal_patch_size != TEMPORAL_PATCH_FRAMES:
            raise ValueError(f"{model_dir}: temporal_patch_size {self.image_processor.temporal_patch_size} is not "
                             f"the {TEMPORAL_PATCH_FRAMES} frames a temporal patch holds in this lineage")

    def load_media(self, path: str, media_type: MediaType, num_frames: FrameCount,
                   max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
        """An even number of frames spread over the clip; each resized and cut into patches as it is decoded."""
        transform = functools.partial(self.frame_patches, media_type=media_type)
        return load_media(path, media_type, num_frames, frame_transform=transform, sampler=even_frame_indices,
                          max_image_pixels=max_image_pixels, span=span)

    def frame_patches(self, frame: Image.Image, frame_count: int, media_type: MediaType) -> FramePatches:
        """One RGB frame at qwen-vl-utils' size through the checkpoint's image processor (one temporal copy)."""
        return frame_patches(self.image_processor, resize_for_model(frame, media_type, frame_count, self.size_factor))

    def process(self, media: Media, instruction: str | None) -> ProcessedPrompt:
        """`media.frames` must hold `frame_patches` results, all of one size (one clip)."""
        is_image = media.media_type is MediaType.IMAGE
        text = instruction if instruction is not None else (
            DEFAULT_IMAGE_INSTRUCTION if is_image else DEFAULT_VIDEO_INSTRUCTION)
        frames: list[FramePatches] = list(media.frames)
        grid_h, grid_w = frames[0].grid_h, frames[0].grid_w
        if any((frame.grid_h, frame.grid_w) != (grid_h, grid_w) for frame in frames):
            raise ItemError(UNDECODABLE, "the clip's frames change size")
        # An image fills its temporal patch with itself; a clip's odd last frame is repeated (as the processor pads).
        patches = [frame.patches for frame in frames]
        patches += patches[-1:] * (-len(patches) % TEMPORAL_PATCH_FRAMES)
        pixels = torch.stack([temporal_patch_of(patches[i:i + TEMPORAL_PATCH_FRAMES])
                              for i in range(0, len(patches), TEMPORAL_PATCH_FRAMES)])
        merged_h, merged_w = grid_h // self.merge_size, grid_w // self.merge_size
        ids, spans = self.layout(media, text, len(pixels), merged_h, merged_w)
        positions, next_position = mrope_positions(len(ids), spans)
        per_block = merged_h * merged_w
        return ProcessedPrompt(
            instruction=text, token_ids=ids, positions=positions, next_position=next_position, pixel_values=pixels,
            vision_blocks=[VisionBlock(span.start + index * per_block, per_block, (1, grid_h, grid_w))
                           for span in spans for index in range(span.grid[0])])

    def layout(self, media: Media, instruction: str, blocks: int, merged_h: int,
               merged_w: int) -> tuple[torch.Tensor, list[VisionSpan]]:
        """The prompt's ids and where its vision vectors lie: one run of every temporal patch's vectors."""
        is_image = media.media_type is MediaType.IMAGE
        per_block = merged_h * merged_w
        pad_id = self.config.image_token_id if is_image else self.config.video_token_id
        ids = torch.tensor(self.prompt_ids(is_image, per_block * blocks, instruction), dtype=torch.long)
        start = vision_run_start(ids, pad_id, per_block * blocks, self.config.vision_start_token_id)
        interval = 1.0
        if self.config.variant.time_aligned and not is_image:
            interval = temporal_interval(len(media.frames), clip_frames(media), media.fps,
                                         self.config.tokens_per_second)
        return ids, [VisionSpan(start, (blocks, merged_h, merged_w), interval)]

    def prompt_ids(self, is_image: bool, vision_tokens: int, instruction: str) -> list[int]:
        """The official usage's prompt: one user turn of the media then the instruction, the generation prompt
        added; the template's one pad token expanded to `vision_tokens`, as the model's processor does."""
        pad = "<|image_pad|>" if is_image else "<|video_pad|>"
        return self.prompt_with(is_image, instruction, pad, pad * vision_tokens)

    def prompt_with(self, is_image: bool, instruction: str, placeholder: str, replacement: str) -> list[int]:
        """The ids of the chat template's prompt (one user turn: the media, then the instruction; the generation
        prompt added) with its one `placeholder` of the media written as `replacement`."""
        media_type = "image" if is_image else "video"
        messages = [{"role": "user", "content": [{"type": media_type}, {"type": "text", "text": instruction}]}]
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        if text.count(placeholder) != 1:
            raise ValueError(f"the chat template wrote {text.count(placeholder)} {placeholder} for one {media_type}")
        return self.tokenizer(text.replace(placeholder, replacement), add_special_tokens=False)["input_ids"]

    def min_vision_positions(self, num_frames: int) -> int:
        """The fewest vision positions `num_frames` frames can take: each temporal patch at least `min_pixels`."""
        merged_patch = self.patch_size * self.merge_size
        per_block = max(1, self.image_processor.size.shortest_edge // merged_patch**2)
        return temporal_patches(max(num_frames, TEMPORAL_PATCH_FRAMES)) * per_block

    def largest_item(self, num_frames: int) -> LargestItem:
        """The most an item of at most `num_frames` frames can take (a clip sampled by rate gives any even count up
        to its cap): the largest of `largest_of_count` over those counts.

        A clip's frames share its pixel budget, so where the budget binds its vision positions stay about the same
        however many frames it gives; but each frame's share is rounded up to whole patches, so a count a little
        below the cap can take a few positions more than the cap itself (302 frames: 4 more than 306)."""
        counts = {num_frames, *range(TEMPORAL_PATCH_FRAMES, num_frames, TEMPORAL_PATCH_FRAMES)}
        return max((self.largest_of_count(count) for count in counts), key=lambda item: item.vision_positions)

    def largest_of_count(self, num_frames: int) -> LargestItem:
        """A clip's temporal patches at the most pixels a frame may keep, or one image at its cap, whichever is
        more: one vision position per merged patch, both frames of each temporal patch kept in float32."""
        patch, most = self.patch_size, self.image_processor.size.longest_edge   # longest: max_pixels
        frames, factor = max(TEMPORAL_PATCH_FRAMES, num_frames), self.size_factor
        video = temporal_patches(frames) * -(-min(video_frame_max_pixels(frames, factor), most) // patch**2)
        image = -(-min(scaled(IMAGE_MAX_PIXELS, factor), most) // patch**2)
        patches = max(video, image)
        return LargestItem(-(-patches // self.merge_size**2), patches * 3 * TEMPORAL_PATCH_FRAMES * patch**2 * 4)

    def vision_changes(self, prompt: ProcessedPrompt) -> list[torch.Tensor | None]:
        """Per merged token, from the pixels of the patches it covers (both frames of its temporal patch)."""
        return merged_vector_changes(prompt.pixel_values, prompt.vision_blocks[0].grid, self.merge_size)

    def decode(self, token_ids: list[int]) -> str:
        return decode_text(self.tokenizer, token_ids)


class QwenVLCaptionModel(LineageCaptionModel):
    """A Qwen2-VL or Qwen2.5-VL checkpoint loaded for captioning."""

    processor_class: type[QwenVLPromptProcessor] = QwenVLPromptProcessor

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, config: QwenVLConfig,
                 family: FamilyInfo):
        self.family = family
        self.config = config
        self.processor = self.processor_class(model_dir, config, family)
        with no_init_weights():
            model = QwenVLModel(config)
        load_weights(model, model_dir, dtype, device, config.variant.name, module_key, config.variant.checkpoint_key)
        model.language_model.tie()
        self.model = model.to(device).eval()
        self.dtype, self.device = dtype, device
        self.merge_size = self.processor.merge_size
        self.read_generation(model_dir, self.processor.tokenizer.eos_token_id, config.text)

