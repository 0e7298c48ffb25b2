"""Qwen2-VL (Qwen/Qwen2-VL-7B-Instruct) and Qwen2.5-VL (Qwen/Qwen2.5-VL-7B-Instruct, -3B-) in their own layout."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..catalog import QWEN2_5_VL, QWEN2_VL, FamilyInfo
from .family import QwenVLCaptionModel, QwenVLPromptProcessor
from .modeling import QWEN2_5_VL as QWEN2_5_VL_VARIANT
from .modeling import QWEN2_VL as QWEN2_VL_VARIANT
from .modeling import QwenVLConfig, QwenVLModel, Variant


def load_lineage_model(variant: Variant, family: FamilyInfo, model_class: type[QwenVLCaptionModel], model_dir: Path,
                dtype: torch.dtype, device: torch.device) -> QwenVLCaptionModel:
    return model_class(model_dir, dtype, device, QwenVLConfig.from_file(model_dir / "config.json", variant), family)


def load_lineage_processor(variant: Variant, family: FamilyInfo, processor_class: type[QwenVLPromptProcessor],
                    model_dir: Path) -> QwenVLPromptProcessor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights."""
    return processor_class(model_dir, QwenVLConfig.from_file(model_dir / "config.json", variant), family)


# The catalog's entry points: (model_dir, dtype, device) -> model, and (model_dir) -> processor.
load_qwen2_vl = functools.partial(load_lineage_model, QWEN2_VL_VARIANT, QWEN2_VL, QwenVLCaptionModel)
load_qwen2_5_vl = functools.partial(load_lineage_model, QWEN2_5_VL_VARIANT, QWEN2_5_VL, QwenVLCaptionModel)
load_qwen2_vl_processor = functools.partial(load_lineage_processor, QWEN2_VL_VARIANT, QWEN2_VL, QwenVLPromptProcessor)
load_qwen2_5_vl_processor = functools.partial(load_lineage_processor, QWEN2_5_VL_VARIANT, QWEN2_5_VL,
                                              QwenVLPromptProcessor)

__all__ = ["QWEN2_5_VL_VARIANT", "QWEN2_VL_VARIANT", "QwenVLCaptionModel", "QwenVLConfig", "QwenVLModel",
           "QwenVLPromptProcessor", "Variant", "load_lineage_model", "load_lineage_processor", "load_qwen2_5_vl",
           "load_qwen2_5_vl_processor", "load_qwen2_vl", "load_qwen2_vl_processor"]
