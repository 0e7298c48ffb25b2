"""Qwen3-VL (Qwen/Qwen3-VL-8B-Instruct, -4B-): the Qwen2-VL lineage with DeepStack vision features, interleaved
M-RoPE and frames separated by their timestamps in text. Dense checkpoints only."""

from __future__ import annotations

import functools

from ..catalog import QWEN3_VL
from ..qwen2_vl import load_lineage_model, load_lineage_processor
from ..qwen2_vl.modeling import QWEN3_VL as QWEN3_VL_VARIANT
from .family import Qwen3VLCaptionModel, Qwen3VLPromptProcessor

# The catalog's entry points: (model_dir, dtype, device) -> model, and (model_dir) -> processor.
load_qwen3_vl = functools.partial(load_lineage_model, QWEN3_VL_VARIANT, QWEN3_VL, Qwen3VLCaptionModel)
load_qwen3_vl_processor = functools.partial(load_lineage_processor, QWEN3_VL_VARIANT, QWEN3_VL, Qwen3VLPromptProcessor)

__all__ = ["QWEN3_VL_VARIANT", "Qwen3VLCaptionModel", "Qwen3VLPromptProcessor", "load_qwen3_vl",
           "load_qwen3_vl_processor"]
