"""Frames as the vision tower's patches, and the processor files of a Qwen2-VL-lineage checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..temporal import vector_changes

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


def temporal_patch_of(frames: list[torch.Tensor]) -> torch.Tensor:
    """Kept patches of consecutive frames (n, channels * patch * patch) each -> one temporal patch's encoder
    input (n, channels * len(frames) * patch * patch): frame i in temporal slot i, as the processor lays out
    a video's frames."""
    return torch.stack([frame.view(frame.shape[0], 3, -1) for frame in frames], dim=2).reshape(frames[0].shape[0], -1)


def frame_patches(image_processor: Qwen2VLImageProcessorPil, frame: Any) -> FramePatches:
    """One RGB frame through the image processor, which fills a temporal patch by repeating it; one copy kept."""
    out = image_processor(images=frame, return_tensors="pt")
    _, grid_h, grid_w = (int(value) for value in out["image_grid_thw"][0])
    patches = out["pixel_values"]
    temporal = image_processor.temporal_patch_size
    one_copy = patches.view(patches.shape[0], 3, temporal, -1)[:, :, 0]
    return FramePatches(one_copy.reshape(patches.shape[0], -1).clone(), grid_h, grid_w)


def merged_vector_changes(pixel_values: torch.Tensor, grid: tuple[int, int, int] | None,
                          merge_size: int) -> list[torch.Tensor | None]:
    """Per vision block, per merged vector, how much the pixels of the patches it covers changed since the block
    before (the patches of one merged vector are consecutive, in the merger's order)."""
    assert grid is not None
    rows, columns = grid[1] // merge_size, grid[2] // merge_size
    return vector_changes(pixel_values.reshape(pixel_values.shape[0], rows, columns, -1))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def chat_template(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> str:
    """The processor's template (chat_template.json or .jinja), else the tokenizer's, as the official code finds it."""
    template = read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    template = template or tokenizer.chat_template
    if not template:
        raise ValueError(f"{model_dir} has no chat template (chat_template.json): cannot build the prompt")
    return template


def image_processor(model_dir: Path) -> Qwen2VLImageProcessorPil:
    """Qwen2VLImageProcessor from the checkpoint's preprocessor_config.json.

    transformers 4.47 reads the top-level `min_pixels`/`max_pixels`; some files (Tarsier2's) may carry them only
    in `size {min_pixels, max_pixels}`, and transformers 5 writes `size {shortest_edge, longest_edge}`: all read.
    """
    raw = read_json(model_dir / "preprocessor_config.json")
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    min_pixels = raw.get("min_pixels", size.get("min_pixels", size.get("shortest_edge", _FALLBACK_MIN_PIXELS)))
    max_pixels = raw.get("max_pixels", size.get("max_pixels", size.get("longest_edge", _FALLBACK_MAX_PIXELS)))
    settings = {key: raw[key] for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                          "image_std", "resample", "rescale_factor", "do_rescale",
                                          "do_normalize", "do_convert_rgb") if key in raw}
    return Qwen2VLImageProcessorPil(min_pixels=int(min_pixels), max_pixels=int(max_pixels), **settings)


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """Caption text of generated ids; ids past the tokenizer's vocabulary (the padded embedding rows) dropped."""
    known = [token for token in token_ids if token < len(tokenizer)]
    return tokenizer.decode(known, skip_special_tokens=True)


def vision_run_start(ids: torch.Tensor, pad_token_id: int, expected: int, vision_start_id: int) -> int:
    """Where the prompt's one run of `expected` vision pad tokens starts; the template must have written exactly
    that, right after <|vision_start|>."""
    where = (ids == pad_token_id).nonzero().flatten()
    start = int(where[0]) if len(where) else -1
    if len(where) != expected or int(where[-1]) - start + 1 != expected:
        raise ValueError(f"the chat template wrote {len(where)} vision pad tokens, expected one run of {expected}")
    if start == 0 or int(ids[start - 1]) != vision_start_id:
        raise ValueError("the chat template does not open the vision block with <|vision_start|>")
    return start
