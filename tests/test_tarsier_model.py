"""The Tarsier v1 parts: checkpoint format, prompt, vision vectors, merge and left padding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import CLIPVisionModel

from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tarsier.config import TarsierConfig
from tarsier_batch.families.tarsier.family import TarsierCaptionModel
from tarsier_batch.families.tarsier.processing import build_prompt, merged_layout, stretch_to_square
from tarsier_batch.families.tarsier.weights import load_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import MediaType, load_media


def test_tiny_checkpoint_has_the_official_layout(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llava"
    assert config["architectures"] == ["TarsierForConditionalGeneration"]
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    assert config["text_config"]["model_type"] == "llama"
    assert (config["vision_feature_layer"], config["vision_feature_select_strategy"]) == (-2, "default")
    assert config["vocab_size"] % 64 == 0
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in keys
    assert "vision_tower.vision_model.post_layernorm.weight" in keys
    assert {"multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.bias",
            "multi_modal_projector.linear_2.weight", "multi_modal_projector.linear_2.bias"} <= keys
    assert "language_model.model.embed_tokens.weight" in keys
    assert "language_model.lm_head.weight" in keys
    assert all(key.split(".")[0] in {"vision_tower", "multi_modal_projector", "language_model"} for key in keys)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).exists()


def test_tiny_checkpoint_suits_the_official_code_too(tiny_model_dir: Path) -> None:
    """Readable by the older transformers/tokenizers the official code pins, and no all-zero embedding row.

    The official decoder treats a cached key of exact zeros as padding, so a zero row (Llama
    zeroes <pad> at initialisation) would make it diverge whenever that token is generated.
    """
    merges = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(merge, str) and merge.count(" ") == 1 for merge in merges)
    text_config = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    assert text_config["rope_theta"] == text_config["rope_parameters"]["rope_theta"]
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:
        embeddings = weights.get_tensor("language_model.model.embed_tokens.weight")
    assert (embeddings.abs().sum(dim=1) > 0).all()


def test_special_ids_follow_the_real_models(tiny_model: TarsierCaptionModel) -> None:
    tokenizer, config = tiny_model.processor.tokenizer, tiny_model.config
    base = len(tokenizer) - 2
    assert tokenizer.convert_tokens_to_ids("<image>") == config.image_token_index == base
    assert tokenizer.pad_token_id == base + 1
    # image_newline and image_new are embedding rows the tokenizer never produces
    assert (config.image_newline_idx, config.image_new_idx) == (len(tokenizer), len(tokenizer) + 1)
    assert config.text.vocab_size > config.image_new_idx


def test_same_seed_gives_the_same_weights(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", seed=3)
    second = make_tiny_model(tmp_path / "b", seed=3)
    other = make_tiny_model(tmp_path / "c", seed=4)
    read = lambda path: (path / "model.safetensors").read_bytes()  # noqa: E731
    assert read(first) == read(second) != read(other)
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()


def test_missing_weight_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["multi_modal_projector.linear_2.bias"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="multi_modal_projector.linear_2.bias"):
        load_caption_model(broken, torch.float32, torch.device("cpu"))


def test_prompt_string_is_the_official_one() -> None:
    assert build_prompt(3, "Describe the video in detail.") == \
        "USER: <image><image><image>\nDescribe the video in detail. ASSISTANT: "
    assert build_prompt(1, "<video>What is this?<image>") == "USER: <image>\nWhat is this? ASSISTANT: "


def test_prompt_is_tokenised_in_one_call_with_bos(tiny_model: TarsierCaptionModel) -> None:
    tokenizer = tiny_model.processor.tokenizer
    prompt = build_prompt(2, "Describe the video in detail.")
    ids = tiny_model.processor.prompt_ids(prompt)
    assert ids == tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
    assert ids.count(tiny_model.config.image_token_index) == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "USER: \nDescribe the video in detail. ASSISTANT: "


def test_frames_are_stretched_to_a_square_without_padding() -> None:
    frame = Image.new("RGB", (200, 50), (255, 0, 0))
    square = stretch_to_square(frame)
    assert square.size == (200, 200)
    assert square.getpixel((100, 0)) == square.getpixel((100, 199)) == (255, 0, 0)


def test_default_instruction_depends_on_media_type(tiny_model: TarsierCaptionModel, shared_media: Path) -> None:
    def process(name: str, media_type: MediaType, instruction: str | None = None):
        media = load_media(str(shared_media / name), media_type, 8, frame_transform=tiny_model.processor.frame_pixels)
        return tiny_model.processor.process(media, instruction)

    video = process("short_5f.mp4", MediaType.VIDEO)
    gif = process("clip_5f.gif", MediaType.GIF)
    image = process("tarsier_logo.jpg", MediaType.IMAGE)
    custom = process("tarsier_logo.jpg", MediaType.IMAGE, "Count.")
    assert (video.instruction, gif.instruction) == ("Describe the video in detail.",) * 2
    assert image.instruction == "Describe the image in detail."
    assert custom.instruction == "Count."
    assert video.pixel_values.shape == (8, 3, 56, 56)
    assert gif.pixel_values.shape[0] == 5 and image.pixel_values.shape[0] == 1
    first = gif.vision_blocks[0].start  # the frames' placeholders stand together after "USER: "
    assert [(block.start - first, block.length) for block in gif.vision_blocks] == [(21 * f, 21) for f in range(5)]
    assert set(gif.token_ids[first:first + 5 * 21].tolist()) == {tiny_model.config.image_token_index}
    assert video.positions.tolist() == [list(range(video.length))] and video.next_position == video.length


def test_vision_vectors_are_the_second_to_last_layer(tiny_model_dir: Path, tiny_model: TarsierCaptionModel) -> None:
    """Dropping the unused last layer gives exactly hidden_states[-2] of the full tower."""
    config = tiny_model.config
    full = CLIPVisionModel(config.vision)
    weights = {}
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as handle:
        for key in handle.keys():
            if key.startswith("vision_tower.vision_model."):
                weights[key.removeprefix("vision_tower.vision_model.")] = handle.get_tensor(key)
    full.load_state_dict(weights)
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        expected = tiny_model.model.multi_modal_projector(expected)
        actual = tiny_model.model.frame_features(pixels)
    grid = config.patch_grid
    assert actual.shape == (3, grid * (grid + 1) + 1, config.text.hidden_size)
    patches = actual[:, :-1].reshape(3, grid, grid + 1, -1)[:, :, :grid].reshape(3, grid * grid, -1)
    torch.testing.assert_close(patches, expected, rtol=0, atol=0)


def test_newline_after_each_row_and_separator_after_each_frame(tiny_model: TarsierCaptionModel) -> None:
    config = tiny_model.config
    grid, hidden = config.patch_grid, config.text.hidden_size
    patches = torch.randn(2, grid * grid, hidden)
    merged = tiny_model.model.add_frame_separators(patches)
    embed = tiny_model.model.language_model.get_input_embeddings().weight
    assert merged.shape == (2, config.tokens_per_frame, hidden)
    for frame in range(2):
        for row in range(grid):
            start = row * (grid + 1)
            torch.testing.assert_close(merged[frame, start:start + grid], patches[frame, row * grid:(row + 1) * grid])
            torch.testing.assert_close(merged[frame, start + grid], embed[config.image_newline_idx])
        torch.testing.assert_close(merged[frame, -1], embed[config.image_new_idx])


def test_real_geometry_has_601_vectors_per_frame(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "small", size="small")
    config = TarsierConfig.from_file(model_dir / "config.json")
    assert (config.vision.image_size, config.vision.patch_size, config.patch_grid) == (336, 14, 24)
    assert config.tokens_per_frame == 601
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        features = model.frame_features(torch.zeros(2, 3, 336, 336))
    assert features.shape == (2, 601, config.text.hidden_size)


def test_each_placeholder_expands_to_its_frames_positions() -> None:
    image = 99
    ids, blocks = merged_layout([1, 5, image, image, 7, 8], image, tokens_per_frame=3)
    assert ids.tolist() == [1, 5, image, image, image, image, image, image, 7, 8]
    assert [(block.start, block.end) for block in blocks] == [(2, 5), (5, 8)]
