"""Tarsier2 behind the family interface: a CPU prompt processor and a device model."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from ...errors import UNDECODABLE, ItemError
from ...media import (
    MAX_IMAGE_PIXELS,
    FrameCount,
    Media,
    MediaType,
    Span,
    frame_indices_without_repeats,
    load_media,
)
from ..base import ProcessedPrompt, VisionBlock
from ..catalog import TARSIER2
from ..qwen_vl.network import LineageCaptionModel
from ..qwen_vl.patches import merged_vector_changes, vision_run_start
from ..qwen_vl.positions import VisionSpan, mrope_positions
from ..weights import load_weights
from .modeling import Tarsier2Config, Tarsier2Model
from .processing import DEFAULT_INSTRUCTION, FramePatches, Tarsier2Processor, with_temporal_copies


class Tarsier2PromptProcessor(Tarsier2Processor):
    """Media and instruction -> the prompt, one vision block per frame, M-RoPE positions (CPU only)."""

    default_frames = TARSIER2.default_frames

    def __init__(self, model_dir: Path, config: Tarsier2Config):
        super().__init__(model_dir)
        self.config = config
        self.image_token_id = config.image_token_id

    def load_media(self, path: str, media_type: MediaType, num_frames: FrameCount,
                   max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
        """Tarsier2 sampling (a clip of at most `num_frames` frames gives all of them, no repeats)."""
        transform = functools.partial(self.frame_patches, media_type=media_type)
        return load_media(path, media_type, num_frames, frame_transform=transform,
                          sampler=frame_indices_without_repeats, max_image_pixels=max_image_pixels, span=span)

    def vision_changes(self, prompt: ProcessedPrompt) -> list[torch.Tensor | None]:
        """Per merged token, from the pixels of the patches it covers."""
        return merged_vector_changes(prompt.pixel_values, prompt.vision_blocks[0].grid, self.merge_size)

    def process(self, media: Media, instruction: str | None) -> ProcessedPrompt:
        """`media.frames` must hold `frame_patches` results, all of one size (one clip)."""
        text = instruction if instruction is not None else DEFAULT_INSTRUCTION
        frames: list[FramePatches] = list(media.frames)
        grid_h, grid_w = frames[0].grid_h, frames[0].grid_w
        if any((frame.grid_h, frame.grid_w) != (grid_h, grid_w) for frame in frames):
            raise ItemError(UNDECODABLE, "the clip's frames change size")
        merged_h, merged_w = grid_h // self.merge_size, grid_w // self.merge_size
        per_frame = merged_h * merged_w
        ids = torch.tensor(self.prompt_ids(media.media_type, per_frame * len(frames), text), dtype=torch.long)
        start = vision_run_start(ids, self.image_token_id, per_frame * len(frames), self.config.vision_start_token_id)
        blocks = [VisionBlock(start + index * per_frame, per_frame, (1, grid_h, grid_w))
                  for index in range(len(frames))]
        positions, next_position = mrope_positions(len(ids), [VisionSpan(start, (len(frames), merged_h, merged_w))])
        return ProcessedPrompt(instruction=text, token_ids=ids, positions=positions, next_position=next_position,
                               vision_blocks=blocks, pixel_values=torch.stack([frame.patches for frame in frames]))


class Tarsier2CaptionModel(LineageCaptionModel):
    """A Tarsier2 checkpoint loaded for captioning."""

    family = TARSIER2

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.config = Tarsier2Config.from_file(model_dir / "config.json")
        self.processor = Tarsier2PromptProcessor(model_dir, self.config)
        with no_init_weights():
            model = Tarsier2Model(self.config)
        load_weights(model, model_dir, dtype, device, "Tarsier2")
        self.model = model.to(device).eval()
        self.dtype, self.device = dtype, device
        self.merge_size = self.processor.merge_size
        self.read_generation(model_dir, self.processor.tokenizer.eos_token_id, self.config.text)

    def block_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """Each frame fills its temporal patch twice (on the device: a frame crosses to a GPU once, not twice)."""
        return with_temporal_copies(pixels, self.processor.temporal_patch_size)
