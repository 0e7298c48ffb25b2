"""Tarsier2 behind the family interface: a CPU prompt processor and a device model."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from ...errors import UNDECODABLE, ItemError
from ...media import MAX_IMAGE_PIXELS, Media, MediaType, Span, frame_indices_without_repeats, load_media
from ..base import KVGeometry, ProcessedPrompt, VisionBlock
from ..catalog import TARSIER2
from ..decoder import DecoderCaptionModel
from ..generation_config import read_generation_defaults
from ..temporal import vector_changes
from ..weights import load_weights
from .modeling import Tarsier2Config, Tarsier2Model
from .positions import VisionSpan, mrope_positions
from .processing import DEFAULT_INSTRUCTION, FramePatches, Tarsier2Processor, with_temporal_copies


class Tarsier2PromptProcessor(Tarsier2Processor):
    """Media and instruction -> the prompt, one vision block per frame, M-RoPE positions (CPU only)."""

    default_frames = TARSIER2.default_frames

    def __init__(self, model_dir: Path, config: Tarsier2Config):
        super().__init__(model_dir)
        self.config = config
        self.image_token_id = config.image_token_id

    def load_media(self, path: str, media_type: MediaType, num_frames: int,
                   max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
        """Tarsier2 sampling (a clip of at most `num_frames` frames gives all of them, no repeats)."""
        transform = functools.partial(self.frame_patches, media_type=media_type)
        return load_media(path, media_type, num_frames, frame_transform=transform,
                          sampler=frame_indices_without_repeats, max_image_pixels=max_image_pixels, span=span)

    def vision_changes(self, prompt: ProcessedPrompt) -> list[torch.Tensor | None]:
        """Per merged token, from the pixels of the patches it covers (consecutive in a frame's patches, in the
        merger's order)."""
        grid = prompt.vision_blocks[0].grid
        assert grid is not None
        rows, columns = grid[1] // self.merge_size, grid[2] // self.merge_size
        return vector_changes(prompt.pixel_values.reshape(len(prompt.vision_blocks), rows, columns, -1))

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
        start = _vision_run_start(ids, self.image_token_id, per_frame * len(frames), self.config.vision_start_token_id)
        blocks = [VisionBlock(start + index * per_frame, per_frame, (1, grid_h, grid_w))
                  for index in range(len(frames))]
        positions, next_position = mrope_positions(len(ids), [VisionSpan(start, (len(frames), merged_h, merged_w))])
        return ProcessedPrompt(instruction=text, token_ids=ids, positions=positions, next_position=next_position,
                               vision_blocks=blocks, pixel_values=torch.stack([frame.patches for frame in frames]))


def _vision_run_start(ids: torch.Tensor, image_token_id: int, expected: int, vision_start_id: int) -> int:
    """Where the prompt's one run of image-pad tokens starts; the template must have written exactly that."""
    where = (ids == image_token_id).nonzero().flatten()
    start = int(where[0]) if len(where) else -1
    if len(where) != expected or int(where[-1]) - start + 1 != expected:
        raise ValueError(f"the chat template wrote {len(where)} image tokens, expected one run of {expected}")
    if start == 0 or int(ids[start - 1]) != vision_start_id:
        raise ValueError("the chat template does not open the vision block with <|vision_start|>")
    return start


class Tarsier2CaptionModel(DecoderCaptionModel):
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
        generation = read_generation_defaults(model_dir, self.processor.tokenizer.eos_token_id)
        self.eos_token_ids, self.repetition_penalty = generation.eos_token_ids, generation.repetition_penalty
        text = self.config.text
        self.kv_geometry = KVGeometry(num_layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads,
                                      head_dim=text.hidden_size // text.num_attention_heads)

    @torch.inference_mode()
    def encode_vision(self, pixels: list[torch.Tensor], blocks: list[VisionBlock]) -> list[torch.Tensor]:
        """Frames of any sizes through the tower together; each frame fills its temporal patch twice (on the
        device: a frame crosses to a GPU once, not twice)."""
        patches = torch.cat([with_temporal_copies(frame.to(self.device), self.processor.temporal_patch_size)
                             for frame in pixels])
        vectors = self.model.vision_features(patches, [block.grid for block in blocks])
        merged = self.processor.merge_size ** 2
        return list(vectors.split([math.prod(block.grid) // merged for block in blocks if block.grid is not None]))

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None, :]  # M-RoPE: (3 axes, batch of 1, tokens)

    def compile(self) -> None:
        """The language model's layers and the vision blocks through torch.compile from now on (`--compile`)."""
        super().compile()
        self.model.compile_vision()
