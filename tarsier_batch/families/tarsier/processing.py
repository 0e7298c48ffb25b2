"""Turn sampled frames and an instruction into Tarsier v1 prompt tokens and pixel tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerBase

from ...media import MediaType

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


class TarsierProcessor:
    """The checkpoint's own tokenizer and CLIP image processor (PIL backend, as upstream)."""

    def __init__(self, model_dir: Path):
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")

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
        return self.image_processor(images=square, return_tensors="pt")["pixel_values"][0]

    def pixel_values(self, frames: list[Image.Image]) -> torch.Tensor:
        """Pixels for the vision tower, shape (frames, 3, size, size), float32."""
        return torch.stack([self.frame_pixels(frame) for frame in frames])

    def decode(self, token_ids: list[int]) -> str:
        """The caption text: one decode call, special tokens skipped, unknown ids dropped."""
        known = [token for token in token_ids if token < len(self.tokenizer)]
        return self.tokenizer.decode(known, skip_special_tokens=True)
