"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL networks in their checkpoints' own layout, from transformers' modules.

The published Qwen2-VL and Qwen2.5-VL checkpoints (Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct, -3B-)
keep a flat config.json (`model_type "qwen2_vl"` / `"qwen2_5_vl"`, the text settings at the top level, a nested
`vision_config`) and weights under `visual.` (the ViT and its patch merger), `model.` (the decoder) and
`lm_head.` (absent where `tie_word_embeddings` is set, as in the 3B). Files written by transformers 5 name them
`model.visual.` and `model.language_model.`: both are read. Qwen3-VL's (Qwen/Qwen3-VL-8B-Instruct, -4B-) nest
a `text_config` and are published with transformers 5's names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLTextModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel, Qwen2VLTextModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLVisionModel

from ..qwen_vl.network import LanguageModel, compile_frame_batched, frame_batched, tower_features

# Keys that only steer transformers' own class loading; this implementation picks its modules and attention.
_LOADER_KEYS = ("architectures", "auto_map", "attn_implementation", "_attn_implementation", "torch_dtype", "dtype")

# Checkpoint key prefixes -> module prefixes: the Qwen2-VL and Qwen2.5-VL layout, then transformers 5's.
_PREFIXES = (("visual.", "visual."), ("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
_NEWER_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model.model."),
                   ("lm_head.", "language_model.lm_head."))


@dataclass(frozen=True)
class Variant:
    """What tells the models of the lineage apart here: transformers' classes, whether the temporal positions
    follow absolute time (`second_per_grid_ts`), and the weight names the published checkpoints use."""

    name: str
    model_type: str
    config_class: type[PretrainedConfig]
    tower_class: type[nn.Module]
    decoder_class: type[nn.Module]
    time_aligned: bool
    published_prefixes: tuple[tuple[str, str], ...] = _PREFIXES

    def checkpoint_key(self, name: str) -> str:
        """This module tree's parameter name -> the published checkpoints' weight name."""
        for stored, module in self.published_prefixes:
            if name.startswith(module):
                return stored + name[len(module):]
        return name


QWEN2_VL = Variant("Qwen2-VL", "qwen2_vl", Qwen2VLConfig, Qwen2VisionTransformerPretrainedModel, Qwen2VLTextModel,
                   time_aligned=False)
QWEN2_5_VL = Variant("Qwen2.5-VL", "qwen2_5_vl", Qwen2_5_VLConfig, Qwen2_5_VisionTransformerPretrainedModel,
                     Qwen2_5_VLTextModel, time_aligned=True)
# Qwen3-VL spaces frames by timestamps written as text between them, not by temporal positions.
QWEN3_VL = Variant("Qwen3-VL", "qwen3_vl", Qwen3VLConfig, Qwen3VLVisionModel, Qwen3VLTextModel, time_aligned=False,
                   published_prefixes=_NEWER_PREFIXES)


@dataclass(frozen=True)
class QwenVLConfig:
    """The parts of a Qwen2-VL / Qwen2.5-VL config.json this implementation uses."""

    variant: Variant
    full: PretrainedConfig       # transformers' own config of the checkpoint
    image_token_id: int          # <|image_pad|>
    video_token_id: int          # <|video_pad|>
    vision_start_token_id: int   # <|vision_start|>, which opens every vision block
    tokens_per_second: float     # Qwen2.5-VL: temporal positions per second of video

    @property
    def vision(self) -> Any:
        return self.full.vision_config

    @property
    def text(self) -> Any:
        return self.full.text_config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], variant: Variant) -> QwenVLConfig:
        if raw.get("model_type") != variant.model_type:
            raise ValueError(f"not a {variant.name} checkpoint: expected model_type {variant.model_type!r}, "
                             f"found {raw.get('model_type')!r}")
        full = variant.config_class(**{key: value for key, value in raw.items() if key not in _LOADER_KEYS})
        # The engine brings its own attention; the vision tower uses PyTorch SDPA.
        full.vision_config._attn_implementation = full.text_config._attn_implementation = "sdpa"
        return cls(variant=variant, full=full, image_token_id=int(full.image_token_id),
                   video_token_id=int(full.video_token_id), vision_start_token_id=int(full.vision_start_token_id),
                   tokens_per_second=float(getattr(full.vision_config, "tokens_per_second", 1)))

    @classmethod
    def from_file(cls, path: Path, variant: Variant) -> QwenVLConfig:
        return cls.from_dict(json.loads(path.read_text()), variant)


class QwenVLModel(nn.Module):
    """Vision tower (ViT + patch merger) and language model, named as the checkpoints' keys
    (`Variant.checkpoint_key`)."""

    def __init__(self, config: QwenVLConfig):
        super().__init__()
        self.config = config
        variant, text = config.variant, config.text
        self.visual = frame_batched(variant.tower_class(config.vision))
        self.language_model = LanguageModel(variant.decoder_class(text), text.hidden_size, text.vocab_size,
                                            tied=bool(config.full.tie_word_embeddings))

    def compile_vision(self) -> None:
        """Run the frame-batched vision blocks' work around their attention through torch.compile from now on."""
        compile_frame_batched(self.visual)

    def vision_features(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged vision vectors (sum of t*h*w/4 over the blocks, hidden, DeepStack features appended along it) for
        the blocks' patches (`tower_features`)."""
        return tower_features(self.visual, patches, grids)


def module_key(key: str) -> str:
    """A checkpoint's weight name (either layout) -> this module tree's."""
    for stored, module in (*_NEWER_PREFIXES, *_PREFIXES):
        if key.startswith(stored):
            return module + key[len(stored):]
    return key
