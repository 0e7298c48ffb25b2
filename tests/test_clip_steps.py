"""Tarsier v1's frame preprocessing in transformers' image transforms equals its CLIP image processor class.

The reference is `AutoImageProcessor.from_pretrained(dir, backend="pil")`, what the official code's processor is
in transformers 5: every pixel, the dtype and the shape, for the configurations checkpoints are published with
(the modern keys, the legacy integer sizes without `do_convert_rgb` or `rescale_factor`, steps turned off) and
frames of every mode and awkward size. Anything else goes to the class itself.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from tarsier_batch.families.tarsier.processing import (
    ClipFrameSteps,
    ClipProcessorSteps,
    TarsierProcessor,
    stretch_to_square,
)

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# What Tarsier-7b's and LLaVA-1.5's checkpoints carry (336 px), in transformers 5's key layout.
MODERN = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor", "do_resize": True,
          "size": {"shortest_edge": 336}, "resample": 3, "do_center_crop": True,
          "crop_size": {"height": 336, "width": 336}, "do_rescale": True, "rescale_factor": 0.00392156862745098,
          "do_normalize": True, "image_mean": MEAN, "image_std": STD, "do_convert_rgb": True}
# openai/clip-vit-large-patch14-336's own file: a feature extractor, integer sizes, defaults for the rest.
LEGACY = {"feature_extractor_type": "CLIPFeatureExtractor", "crop_size": 336, "do_center_crop": True,
          "do_normalize": True, "do_resize": True, "image_mean": MEAN, "image_std": STD, "resample": 3, "size": 336}
CONFIGS = {
    "modern": MODERN,
    "legacy": LEGACY,
    "class defaults": {"image_processor_type": "CLIPImageProcessor"},
    "small, bilinear": {**MODERN, "size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56},
                        "resample": 2},
    "not cropped": {**MODERN, "do_center_crop": False},
    "not normalised": {**MODERN, "do_normalize": False},
    "not rescaled": {**MODERN, "do_rescale": False},
    "neither": {**MODERN, "do_rescale": False, "do_normalize": False},
    "not resized": {**MODERN, "do_resize": False, "crop_size": {"height": 40, "width": 30}},
    "no RGB conversion": {**MODERN, "do_convert_rgb": False},
}


def frames() -> dict[str, Image.Image]:
    """Frames of each mode a decoder or an image file gives, at sizes that round awkwardly."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (241, 403, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (120, 90, 4), dtype=np.uint8))
    palette = rgb.resize((77, 51)).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 3
    return {"rgb": rgb, "rgb square": stretch_to_square(rgb), "one pixel": rgb.resize((1, 1)),
            "thin": rgb.resize((700, 3)), "grey": rgb.convert("L").resize((333, 500)), "rgba": rgba,
            "palette with transparency": palette, "cmyk": rgb.convert("CMYK")}


def checkpoint(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


def reference(folder: Path, frame: Image.Image) -> torch.Tensor:
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    return processor(images=frame, return_tensors="pt")["pixel_values"][0]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_steps_give_the_processor_class_pixels_bit_for_bit(tmp_path: Path, config: str) -> None:
    folder = checkpoint(tmp_path / "checkpoint", CONFIGS[config])
    steps = ClipFrameSteps.of_checkpoint(folder)
    assert isinstance(steps, ClipFrameSteps)
    for name, frame in frames().items():
        if config == "no RGB conversion" and frame.mode != "RGB":   # the class refuses these unconverted: so do they
            with pytest.raises((ValueError, TypeError)):
                reference(folder, frame)
            with pytest.raises((ValueError, TypeError)):
                steps(frame)
            continue
        expected, pixels = reference(folder, frame), steps(frame)
        assert (pixels.dtype, pixels.shape) == (expected.dtype, expected.shape), name
        assert torch.equal(pixels, expected), f"{config}: {name}"


@pytest.mark.parametrize("config", [
    {**MODERN, "image_processor_type": "SiglipImageProcessor"},   # another processor
    {**MODERN, "do_pad": True},                                    # a key the steps do not follow
    {**MODERN, "size": {"height": 300, "width": 200}},              # an exact size, not a shortest edge
    {**MODERN, "size": {"shortest_edge": 336, "longest_edge": 500}},
    {**MODERN, "do_convert_rgb": None},                             # a null: the class decides what it means
])
def test_a_configuration_the_steps_do_not_follow_goes_to_the_processor_class(tmp_path: Path,
                                                                           config: dict[str, Any]) -> None:
    folder = checkpoint(tmp_path / "checkpoint", config)
    assert ClipFrameSteps.of_checkpoint(folder) is None
    steps = ClipProcessorSteps(folder)
    frame = frames()["rgb"]
    assert torch.equal(steps(frame), reference(folder, frame))
    assert torch.equal(pickle.loads(pickle.dumps(steps))(frame), reference(folder, frame))


def test_a_tarsier_processor_takes_the_steps_of_its_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The built-in checkpoints' configuration is followed step by step; a checkpoint with another goes to the
    class; both preprocess a frame as the class does, and survive the pickling that hands them to workers."""
    frame = frames()["rgb"]
    processor = TarsierProcessor(tiny_model_dir)
    assert isinstance(processor.clip_steps, ClipFrameSteps)
    expected = reference(tiny_model_dir, stretch_to_square(frame))
    assert torch.equal(pickle.loads(pickle.dumps(processor)).frame_pixels(frame), expected)

    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (tiny_model_dir / name).exists():
            (other / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = {**json.loads((tiny_model_dir / "preprocessor_config.json").read_text()), "do_pad": False}
    checkpoint(other, config)
    processor = TarsierProcessor(other)
    assert isinstance(processor.clip_steps, ClipProcessorSteps)
    assert torch.equal(processor.frame_pixels(frame), expected)
