"""Qwen3-VL behind the family interface: the Qwen2-VL lineage's processor and model, with what Qwen3-VL changes.

- A video's temporal patches are separate vision blocks in the prompt, each after its time as text,
  `<1.3 seconds><|vision_start|>...<|vision_end|>`, with its own M-RoPE positions (temporal index 0, as an image).
- The vision tower's DeepStack mergers turn three of its intermediate layers into vectors that are added to the
  hidden states of the vision positions after the first decoder layers. They travel with the vision vectors,
  appended along the hidden axis (`families.base.widened`), so every chunk of a prefill adds those of its own
  vision positions and text positions add zeros.
- The text model normalises queries and keys per head (`families.decoder`) and interleaves the M-RoPE axes over
  the frequencies (transformers' rotary embedding computes it).
"""

from __future__ import annotations

import torch

from ...media import Media, MediaType
from ...media.sampling import TEMPORAL_PATCH_FRAMES
from ..base import Attention
from ..decoder import run_decoder_layers
from ..qwen2_vl.family import QwenVLCaptionModel, QwenVLPromptProcessor
from ..qwen_vl.positions import VisionSpan

# The chat template's video, replaced whole by the frames' timestamps and blocks, as the model's processor does.
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
# The frame rate transformers' Qwen3VLProcessor times frames by where the video's own is unknown.
UNKNOWN_RATE_FPS = 24.0


def temporal_patch_seconds(media: Media, blocks: int) -> list[float]:
    """Each temporal patch's time, as transformers' Qwen3VLProcessor computes it: a frame's index over the file's
    frame rate (the same float division, so the same `:.1f` text), a patch's first and last frames averaged.

    Indices count from the first sampled frame, which for a whole video is frame 0; a segment's times therefore
    start near 0 s, where qwen-vl-utils' decord and torchcodec readers time a clip cut from a file
    (`video_start`) by its frames' indices in the whole file."""
    first = media.frame_indices[0]
    indices = [index - first for index in media.frame_indices]
    indices += indices[-1:] * (blocks * TEMPORAL_PATCH_FRAMES - len(indices))
    fps = media.fps or UNKNOWN_RATE_FPS
    times = [index / fps for index in indices]
    return [(times[i] + times[i + TEMPORAL_PATCH_FRAMES - 1]) / 2 for i in range(0, len(times), TEMPORAL_PATCH_FRAMES)]


class Qwen3VLPromptProcessor(QwenVLPromptProcessor):
    """Qwen3-VL's prompt: an image as one vision block, a video as one block per temporal patch after its time."""

    def layout(self, media: Media, instruction: str, blocks: int, merged_h: int,
               merged_w: int) -> tuple[torch.Tensor, list[VisionSpan]]:
        if media.media_type is MediaType.IMAGE:
            return super().layout(media, instruction, blocks, merged_h, merged_w)
        per_block = merged_h * merged_w
        frames = "".join(f"<{seconds:.1f} seconds><|vision_start|>{'<|video_pad|>' * per_block}<|vision_end|>"
                         for seconds in temporal_patch_seconds(media, blocks))
        ids = torch.tensor(self.prompt_with(False, instruction, VIDEO_PLACEHOLDER, frames), dtype=torch.long)
        where = (ids == self.config.video_token_id).nonzero().flatten()
        if len(where) != blocks * per_block:
            raise ValueError(f"the prompt holds {len(where)} video pad tokens, expected {blocks} x {per_block}")
        runs = where.view(blocks, per_block)
        if not torch.equal(runs - runs[:, :1], torch.arange(per_block).expand(blocks, -1)):
            raise ValueError("the prompt's video pad tokens do not form one run per temporal patch")
        return ids, [VisionSpan(int(start), (1, merged_h, merged_w)) for start in runs[:, 0]]


class Qwen3VLCaptionModel(QwenVLCaptionModel):
    """A Qwen3-VL checkpoint loaded for captioning."""

    processor_class = Qwen3VLPromptProcessor

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, attention: Attention, first: int,
                   end: int) -> torch.Tensor:
        """Inputs wider than the hidden size carry each token's DeepStack features (zeros at text positions), one
        per layer from the first on, added to that layer's outputs as transformers adds them at vision positions."""
        width = self.config.text.hidden_size
        if hidden.shape[1] == width:
            return super().run_layers(hidden, positions, attention, first, end)
        deepstack = hidden[:, width:].unflatten(1, (-1, width))
        if first != 0 or end < deepstack.shape[1]:   # e.g. FastV's split at a layer K: refused before it gets here
            raise ValueError(f"DeepStack features enter decoder layers 0 to {deepstack.shape[1] - 1}: run them in "
                             f"one call, not layers {first} to {end - 1}")
        hidden = hidden[:, :width].contiguous()
        decoder = self.model.language_model.model
        cos, sin = decoder.rotary_emb(hidden, self.rotary_position_ids(positions))
        added = deepstack.shape[1]
        for index in range(added):
            hidden = run_decoder_layers(decoder.layers[index:index + 1], hidden, cos[0], sin[0], attention, index,
                                        self.layer_steps) + deepstack[:, index]
        return run_decoder_layers(decoder.layers[added:end], hidden, cos[0], sin[0], attention, added,
                                  self.layer_steps)
