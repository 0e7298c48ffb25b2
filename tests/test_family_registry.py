"""A model family is one registration: a toy family registered from this file alone (no edit of the package)
is listed by `tarsier models`, built by `tarsier dev make-tiny-model`, detected from its config.json, loaded,
and captions through `tarsier caption` with its own defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.families import catalog
from tarsier_batch.families.catalog import FamilyInfo, register_family
from tarsier_batch.families.tarsier.family import TarsierCaptionModel
from tarsier_batch.families.tarsier.processing import TarsierPromptProcessor, load_processor
from tarsier_batch.families.tiny import make_tiny_model

runner = CliRunner()

# The toy family: Tarsier v1's code under another config.json type, with 3 frames by default.
TOY = FamilyInfo(
    key="toy", name="Toy family", text_model_type="toy_llama", vision="CLIP, as Tarsier v1", default_frames=3,
    default_instruction="Describe the video in detail.", checkpoints=(), tiny_alias="tiny-random-toy",
    loader="test_family_registry:load_toy_model", processor_loader="test_family_registry:load_toy_processor",
    frame_sampler="tarsier_batch.media:frame_indices", tiny_builder="test_family_registry")

SIZES = ("tiny",)   # this module is the toy's tiny-checkpoint builder too


def build(out_dir: Path, size: str, seed: int) -> None:
    """A Tarsier v1 checkpoint in `inner/`, under a config.json that names the toy family."""
    make_tiny_model(out_dir / "inner", size, seed, family="tarsier")
    config = json.loads((out_dir / "inner" / "config.json").read_text())
    config["text_config"]["model_type"] = TOY.text_model_type
    (out_dir / "config.json").write_text(json.dumps(config))


def load_toy_processor(model_dir: Path) -> TarsierPromptProcessor:
    processor = load_processor(model_dir / "inner")
    processor.default_frames = TOY.default_frames
    return processor


def load_toy_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> TarsierCaptionModel:
    model = TarsierCaptionModel(model_dir / "inner", dtype, device)
    model.family = TOY
    model.processor.default_frames = TOY.default_frames
    return model


@pytest.fixture
def toy_registered(monkeypatch) -> None:
    monkeypatch.setattr(catalog, "_FAMILIES", list(catalog.model_families()))   # unregistered again after the test
    register_family(TOY)


def test_a_family_registered_from_outside_captions_through_the_cli(toy_registered, shared_media, tmp_path) -> None:
    listed = runner.invoke(app, ["models"])
    assert listed.exit_code == 0 and "Toy family" in listed.output and "toy_llama" in listed.output
    model_dir = tmp_path / "toy-model"
    made = runner.invoke(app, ["dev", "make-tiny-model", str(model_dir), "--family", "toy"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["caption", str(shared_media / "short_5f.mp4"), "--model", str(model_dir),
                                 "--out", str(out), "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert "(Toy family, 3 frames)" in result.output
    row = pq.read_table(out).to_pylist()[0]
    assert row["error"] is None and row["generated_tokens"] == 3
    assert len(row["frame_indices"]) == 3, "the toy family's default frames, from its registration"
    inspected = runner.invoke(app, ["inspect", "--json", "--family", "toy", str(shared_media / "short_5f.mp4")])
    assert inspected.exit_code == 0 and json.loads(inspected.output)["frames_asked"] == 3


def test_a_family_key_registers_once(toy_registered) -> None:
    with pytest.raises(ValueError, match="a family 'toy' is registered already"):
        register_family(TOY)
