"""The demo model: a small Tarsier v1 trained here on synthetic clips, shipped with the package (`--model demo`).

Its captions are real ("A red circle moves from left to right." for a clip of that): 99.9 % of
held-out clips exactly. `tools/train_demo_model.py` trains it; `tarsier dev eval-demo` measures it.
"""

from __future__ import annotations

from pathlib import Path

from .clips import COLOURS, MOTIONS, SHAPES

CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
TRAIN_SEEDS = (0, 10_000_000)            # training clips' seeds
HELD_OUT_SEEDS = (10_000_000, 20_000_000)  # evaluation clips' seeds: never trained on
# Tarsier v1 at 84 px: a 6 x 6 patch grid, 43 vectors per frame; a 4-layer, 96-wide CLIP (the
# shapes' outlines are what it has to learn) and a 3-layer, 128-wide Llama.
DEMO_GEOMETRY = dict(image_size=84, patch_size=14, vision_hidden=96, vision_layers=4, vision_heads=4,
                     text_hidden=128, text_intermediate=352, text_layers=3, text_heads=4, text_kv_heads=4)


def caption_vocabulary() -> str:
    """Every caption word in sentences, for the tokenizer to learn them as whole tokens."""
    return "\n" + "\n".join(f"A {colour} {shape} {motion}." for colour in COLOURS for shape in SHAPES
                            for motion in MOTIONS) + "\n"
