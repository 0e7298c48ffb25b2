"""The registry of model families: what each is, how a checkpoint's config.json names it, and where its code is.

A family is one package under `families/` (its processor and model), one tiny-checkpoint builder,
and one `FamilyInfo` registered here (`register_family`). The registration names the family's
code by import path ("module:attribute"), imported on first use: this module stays free of torch
and transformers, so that `tarsier models` and flag checks answer at once.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

LLAVA_MODEL_TYPE = "llava"  # Tarsier's and Tarsier2's checkpoints are LLaVA-style


@dataclass(frozen=True)
class FamilyInfo:
    key: str                    # used by `tarsier dev make-tiny-model --family`
    name: str
    text_model_type: str        # config.json: with model_type "llava", this text_config.model_type
    vision: str
    default_frames: int
    default_instruction: str
    checkpoints: tuple[str, ...]  # known Hugging Face ids
    tiny_alias: str             # --model alias of a built-in random-weight checkpoint
    # The family's code, "module:attribute" each:
    loader: str                 # (model_dir, dtype, device) -> CaptionModel
    processor_loader: str       # (model_dir) -> Processor, the CPU side alone
    frame_sampler: str          # (frames in the file, frames wanted) -> indices, as the official code samples
    tiny_builder: str           # a module with SIZES and build(out_dir, size, seed): random-weight checkpoints
    # config.json's model_type: LLaVA-style checkpoints ("llava") are told apart by their text_config's type,
    # checkpoints in their own layout (Qwen2-VL's) by this alone.
    model_type: str = "llava"
    # Why `--prune-method fastv` does not apply to the family's checkpoints; None where it does.
    fastv_refusal: str | None = None
    # Whether its official usage samples a clip by rate (qwen-vl-utils' frames per second, `--fps`); the others
    # sample a fixed count from every clip.
    samples_by_rate: bool = False
    # The vision_config key (config.json) listing the vision layers whose features the language model adds to its
    # first layers' vision positions (DeepStack): each vision vector carries one more hidden-size vector per layer
    # through the prefill, which the memory preflight counts. None where vision vectors carry nothing more.
    deepstack_layers_key: str | None = None

    def matches(self, model_type: object, text_model_type: object) -> bool:
        """Whether a config.json of these types is this family's."""
        if self.model_type != LLAVA_MODEL_TYPE:
            return model_type == self.model_type
        return model_type == LLAVA_MODEL_TYPE and text_model_type == self.text_model_type

    @property
    def config_types(self) -> str:
        """The config.json types of the family's checkpoints, in words."""
        if self.model_type != LLAVA_MODEL_TYPE:
            return f"model_type {self.model_type!r}"
        return f"model_type {LLAVA_MODEL_TYPE!r} with text_config.model_type {self.text_model_type!r}"

    def code(self, part: str) -> Any:
        """One of the family's code entries (`loader`, `processor_loader`, ...), imported."""
        module, _, name = getattr(self, part).partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, name) if name else loaded


TARSIER = FamilyInfo(
    key="tarsier", name="Tarsier v1", text_model_type="llama", vision="CLIP ViT-L/14 at 336 px, 601 vectors per frame",
    default_frames=8, default_instruction="Describe the video in detail. (images: Describe the image in detail.)",
    checkpoints=("omni-research/Tarsier-7b", "omni-research/Tarsier-34b"), tiny_alias="tiny-random",
    loader="tarsier_batch.families.tarsier.family:TarsierCaptionModel",
    processor_loader="tarsier_batch.families.tarsier.processing:load_processor",
    frame_sampler="tarsier_batch.media:frame_indices", tiny_builder="tarsier_batch.families.tiny.tarsier")
TARSIER2 = FamilyInfo(
    key="tarsier2", name="Tarsier2", text_model_type="qwen2_vl",
    vision="Qwen2-VL ViT, dynamic resolution (at most 460,800 px per frame)",
    default_frames=16, default_instruction="Describe the video in detail. (images too, as upstream)",
    checkpoints=("omni-research/Tarsier2-Recap-7b", "omni-research/Tarsier2-7b-0115"),
    tiny_alias="tiny-random-tarsier2",
    loader="tarsier_batch.families.tarsier2:Tarsier2CaptionModel",
    processor_loader="tarsier_batch.families.tarsier2:load_processor",
    frame_sampler="tarsier_batch.media:frame_indices_without_repeats",
    tiny_builder="tarsier_batch.families.tiny.tarsier2")


def _qwen_vl(key: str, name: str, vision: str, checkpoints: tuple[str, ...], tiny_alias: str,
             package: str = "qwen2_vl") -> FamilyInfo:
    """A Qwen-VL family in its own checkpoint layout (model_type `key`), its code in `families.<package>`.

    Tarsier2 is a Qwen2-VL fine-tune but stored LLaVA-style, so a top-level model_type "qwen2_vl" is a plain
    Qwen2-VL."""
    return FamilyInfo(
        key=key, name=name, text_model_type=key, model_type=key, vision=vision, default_frames=16,
        default_instruction="Describe this video. (images: Describe this image.)", checkpoints=checkpoints,
        tiny_alias=tiny_alias, loader=f"tarsier_batch.families.{package}:load_{key}",
        processor_loader=f"tarsier_batch.families.{package}:load_{key}_processor",
        frame_sampler="tarsier_batch.media:even_frame_indices", tiny_builder=f"tarsier_batch.families.tiny.{key}",
        samples_by_rate=True)


QWEN2_VL = _qwen_vl("qwen2_vl", "Qwen2-VL",
                    "Qwen2-VL ViT, dynamic resolution (qwen-vl-utils budgets), two frames per temporal patch",
                    ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct"), "tiny-random-qwen2-vl")
QWEN2_5_VL = _qwen_vl("qwen2_5_vl", "Qwen2.5-VL",
                      "Qwen2.5-VL ViT (window attention, RMSNorm, SwiGLU), dynamic resolution, time-aligned M-RoPE",
                      ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct"), "tiny-random-qwen2.5-vl")
QWEN3_VL = dataclasses.replace(
    _qwen_vl("qwen3_vl", "Qwen3-VL",
             "Qwen3-VL ViT (16-px patches, DeepStack features into the first decoder layers), dynamic resolution, "
             "interleaved M-RoPE, a timestamp before each temporal patch",
             ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"), "tiny-random-qwen3-vl", package="qwen3_vl"),
    fastv_refusal="Qwen3-VL adds DeepStack vision features in its first decoder layers, which FastV's pruned "
                  "layers would run without; use {prune_method} temporal",
    deepstack_layers_key="deepstack_visual_indexes")
_FAMILIES: list[FamilyInfo] = [TARSIER2, TARSIER, QWEN2_VL, QWEN2_5_VL, QWEN3_VL]
# Checkpoints of a known kind that no family runs, and why.
_REFUSED = {"qwen3_vl_moe": "Qwen3-VL MoE checkpoints are not supported (their mixture-of-experts layers are not "
                            "implemented here); use a dense Qwen3-VL such as Qwen/Qwen3-VL-8B-Instruct"}
DEFAULT_MODEL = TARSIER2.checkpoints[0]
# With --prune-vision: the first layer that sees only the kept vision tokens (FastV's choice).
DEFAULT_PRUNE_LAYER = 2


def register_family(family: FamilyInfo) -> None:
    """Make a family known to every command: detection, loading, `tarsier models`, tiny checkpoints."""
    if any(known.key == family.key for known in _FAMILIES):
        raise ValueError(f"a family {family.key!r} is registered already")
    _FAMILIES.append(family)


def model_families() -> tuple[FamilyInfo, ...]:
    """The registered families, the default model's first."""
    return tuple(_FAMILIES)


def family_named(key: str) -> FamilyInfo:
    for family in _FAMILIES:
        if family.key == key:
            return family
    raise ValueError(f"unknown family {key!r}; choose one of {', '.join(f.key for f in _FAMILIES)}")


def family_of_config(raw: dict[str, Any], where: str) -> FamilyInfo:
    """The family of a checkpoint from its config.json contents (never from `auto_map`)."""
    model_type = raw.get("model_type")
    text_config = raw.get("text_config")
    text_type = text_config.get("model_type") if isinstance(text_config, dict) else None
    for family in _FAMILIES:
        if family.matches(model_type, text_type):
            return family
    if isinstance(model_type, str) and model_type in _REFUSED:
        raise ValueError(f"unsupported checkpoint {where}: {_REFUSED[model_type]}")
    supported = "; ".join(f"{f.name}: {f.config_types}" for f in _FAMILIES)
    raise ValueError(f"unsupported checkpoint {where}: model_type {model_type!r} with text_config.model_type "
                     f"{text_type!r}; supported: {supported}")

