"""Tarsier v1 behind the family interface: a CPU prompt processor and a device model."""

from __future__ import annotations

from pathlib import Path

import torch

from ...media import MAX_IMAGE_PIXELS, FrameCount, Media, MediaType, Span, load_media
from ..base import KVGeometry, LargestItem, ProcessedPrompt, VisionBlock
from ..catalog import TARSIER
from ..decoder import DecoderCaptionModel
from ..generation_config import read_generation_defaults
from ..temporal import ALWAYS_KEPT, vector_changes
from .modeling import TarsierConfig
from .processing import TarsierProcessor, build_prompt, default_instruction
from .weights import load_model


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


class TarsierCaptionModel(DecoderCaptionModel):
    """A Tarsier v1 checkpoint loaded for captioning."""

    family = TARSIER

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.config = TarsierConfig.from_file(model_dir / "config.json")
        self.processor = TarsierPromptProcessor(model_dir, self.config)
        self.model = load_model(model_dir, self.config, dtype, device)
        self.dtype, self.device = dtype, device
        generation = read_generation_defaults(model_dir, self.processor.tokenizer.eos_token_id)
        self.eos_token_ids, self.repetition_penalty = generation.eos_token_ids, generation.repetition_penalty
        text = self.config.text
        self.kv_geometry = KVGeometry(
            num_layers=text.num_hidden_layers,
            kv_heads=text.num_key_value_heads or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    @torch.inference_mode()
    def encode_vision(self, pixels: list[torch.Tensor], blocks: list[VisionBlock]) -> list[torch.Tensor]:
        """Every v1 frame has the same size: the frames go through the tower stacked."""
        return list(self.model.frame_features(torch.stack(pixels).to(self.device, self.dtype)).unbind(0))
