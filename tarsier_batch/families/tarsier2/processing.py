"""Tarsier2's official input path: frames, pixel budget, Qwen2-VL patches and the chat prompt.

What the official quick-start path does (../shared/TARSIER2_FACTS.md, section 2 and 3):
every sampled frame is shrunk to a per-frame pixel budget, then processed by the checkpoint's
Qwen2-VL image processor; a video's frames are each duplicated to fill a temporal patch of two,
and the video becomes one `<|vision_start|><|image_pad|>...<|vision_end|>` block of the prompt
rendered by the checkpoint's own chat template.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from ...errors import TOO_LARGE, ItemError
from ...media import MediaType
from ..base import LargestItem
from ..qwen_vl.patches import (
    FramePatches,
    chat_template,
    decode_text,
    frame_patches,
    image_processor,
    with_temporal_copies,
)

# The official quick start passes its --instruction default for every media type, images included.
DEFAULT_INSTRUCTION = "Describe the video in detail."
# The official default data config (configs/tarser2_default_config.yaml): at most 460,800
# pixels per frame, and the processor's 128 * 384 * 384 pixels per sample, shared by all the
# images it is given (a video counts two per frame once its frames are duplicated).
MAX_PIXELS_PER_FRAME = 460_800
MAX_PIXELS_PER_SAMPLE = 128 * 384 * 384


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
        self.chat_template = chat_template(model_dir, self.tokenizer)
        self.image_processor = image_processor(model_dir)
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
        return frame_patches(self.image_processor, shrunk)

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
        return decode_text(self.tokenizer, token_ids)


__all__ = ["FramePatches", "Tarsier2Processor", "pixel_cap", "shrink_to_pixels", "with_temporal_copies"]
