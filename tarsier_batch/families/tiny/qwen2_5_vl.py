"""Deterministic random-weight Qwen2.5-VL checkpoints (`qwen2_vl`'s builder with the Qwen2.5-VL variant)."""

from __future__ import annotations

from pathlib import Path

from ..qwen2_vl import QWEN2_5_VL_VARIANT
from . import qwen2_vl

SIZES = qwen2_vl.SIZES


def build(out_dir: Path, size: str, seed: int) -> None:
    """Write a random-weight Qwen2.5-VL checkpoint of `size` (a key of SIZES) into `out_dir`."""
    qwen2_vl.build(out_dir, size, seed, QWEN2_5_VL_VARIANT)
