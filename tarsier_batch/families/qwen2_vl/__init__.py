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


def _load_model(variant: Variant, family: FamilyInfo, model_dir: Path, dtype: torch.dtype,
                device: torch.device) -> QwenVLCaptionModel:
    return QwenVLCaptionModel(model_dir, dtype, device, QwenVLConfig.from_file(model_dir / "config.json", variant),
                              family)


def _load_processor(variant: Variant, family: FamilyInfo, model_dir: Path) -> QwenVLPromptProcessor:
    """The checkpoint's CPU side alone (frames and prompt), without its weights."""
    return QwenVLPromptProcessor(model_dir, QwenVLConfig.from_file(model_dir / "config.json", variant), family)


# The catalog's entry points: (model_dir, dtype, device) -> model, and (model_dir) -> processor.
load_qwen2_vl = functools.partial(_load_model, QWEN2_VL_VARIANT, QWEN2_VL)
load_qwen2_5_vl = functools.partial(_load_model, QWEN2_5_VL_VARIANT, QWEN2_5_VL)
load_qwen2_vl_processor = functools.partial(_load_processor, QWEN2_VL_VARIANT, QWEN2_VL)
load_qwen2_5_vl_processor = functools.partial(_load_processor, QWEN2_5_VL_VARIANT, QWEN2_5_VL)

__all__ = ["QWEN2_5_VL_VARIANT", "QWEN2_VL_VARIANT", "QwenVLCaptionModel", "QwenVLConfig", "QwenVLModel",
           "QwenVLPromptProcessor", "Variant", "load_qwen2_5_vl", "load_qwen2_5_vl_processor", "load_qwen2_vl",
           "load_qwen2_vl_processor"]
