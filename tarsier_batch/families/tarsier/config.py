"""What a Tarsier v1 `config.json` says, read without the network's modules.

The decoding workers read it too (the frame size, the placeholder id, the vectors per frame), so it imports only
transformers' configuration classes: its modeling modules bring torch._dynamo, torch.distributed and sympy (seconds
of a worker's start) and nothing here needs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.models.clip.configuration_clip import CLIPVisionConfig

if TYPE_CHECKING:
    from transformers.models.llama.configuration_llama import LlamaConfig

ARCHITECTURE = "TarsierForConditionalGeneration"


@dataclass(frozen=True)
class TarsierConfig:
    """The parts of a Tarsier `config.json` this implementation uses."""

    vision: CLIPVisionConfig
    image_token_index: int
    image_newline_idx: int
    image_new_idx: int
    vision_feature_layer: int
    projector_hidden_act: str
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TarsierConfig:
        if raw.get("model_type") != "llava" or ARCHITECTURE not in raw.get("architectures", []):
            raise ValueError(
                f"not a Tarsier v1 checkpoint: expected model_type 'llava' and architecture "
                f"{ARCHITECTURE}, found {raw.get('model_type')!r} {raw.get('architectures')}")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r} (Tarsier uses 'default')")
        vision = {k: v for k, v in raw["vision_config"].items() if k != "model_type"}
        return cls(
            vision=CLIPVisionConfig(**vision),
            image_token_index=raw.get("image_token_index", 32000),
            image_newline_idx=raw.get("image_newline_idx", 32002),
            image_new_idx=raw.get("image_new_idx", 32003),
            vision_feature_layer=raw.get("vision_feature_layer", -2),
            projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
            raw=raw,
        )

    @classmethod
    def from_file(cls, path: Path) -> TarsierConfig:
        return cls.from_dict(json.loads(path.read_text()))

    @cached_property
    def text(self) -> LlamaConfig:
        """The language model's configuration, made when the network first needs it: transformers' Llama
        configuration imports its activation functions and, through them, torch.distributed and sympy (about a
        second), which the prompt processor in a decoding worker never needs."""
        from transformers.models.llama.configuration_llama import LlamaConfig

        return LlamaConfig(**{k: v for k, v in self.raw["text_config"].items() if k != "model_type"})

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the language model's configuration (a decoding worker unpickles this), made again
        where it is read."""
        return {name: value for name, value in self.__dict__.items() if name != "text"}

    @property
    def patch_grid(self) -> int:
        """Patches along one side of a frame (24 for 336 px and patch 14)."""
        return self.vision.image_size // self.vision.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """Vectors one frame contributes: a row of patches plus a newline, per row, then a separator."""
        grid = self.patch_grid
        return grid * (grid + 1) + 1
