"""Qwen3-VL: checkpoint layout and detection, the prompt with a timestamp before each temporal patch, M-RoPE
positions, DeepStack, what pruning does, and the engine scenarios of the Qwen2 families' tests against
transformers' own Qwen3VLForConditionalGeneration.generate."""
# The Qwen2 families' fixtures are imported and requested by name as test arguments (pytest's injection).
# ruff: noqa: F811

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.engine import SamplingParams
from tarsier_batch.families.base import ProcessedPrompt, embed_whole_prompt
from tarsier_batch.families.catalog import QWEN3_VL, family_of_config
from tarsier_batch.families.qwen3_vl import Qwen3VLCaptionModel
from tarsier_batch.families.qwen3_vl.family import temporal_patch_seconds
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import Media, MediaType, even_frame_indices
from tarsier_batch.media.sampling import TEMPORAL_PATCH_FRAMES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from official_baseline import qwen_vl_for_generation  # noqa: E402

# The Qwen2 families' fixtures and engine scenarios, run here over this module's Qwen3-VL checkpoint.
from test_qwen_vl import (  # noqa: E402, F401
    mixed,
    model,
    prompts,
    reference,
    test_chunked_prefill_equals_unchunked,
    test_cli_captions_with_a_question,
    test_greedy_tokens_equal_transformers_generate,
    test_sampling_differs_from_greedy,
)
from test_tarsier2 import MAX_NEW, alone, run  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_vl"), "tiny", seed=0, family="qwen3_vl")


# -- checkpoint layout and family detection --------------------------------------------------------

def test_tiny_checkpoint_has_the_published_layout(model: Qwen3VLCaptionModel, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["text_config"]["rope_scaling"] == {"rope_type": "default", "mrope_section": [4, 2, 2],
                                                     "mrope_interleaved": True}
    assert config["vision_config"]["patch_size"] == 16 and config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert {"model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
            "model.visual.deepstack_merger_list.1.linear_fc2.bias", "model.visual.merger.linear_fc1.weight",
            "model.language_model.embed_tokens.weight", "model.language_model.layers.0.self_attn.q_norm.weight",
            "model.language_model.norm.weight", "lm_head.weight"} <= keys
    assert all(key.startswith(("model.visual.", "model.language_model.", "lm_head.")) for key in keys)
    assert model.processor.size_factor == 32 and model.processor.patch_size == 16


def test_config_json_names_qwen3_vl_and_moe_checkpoints_are_refused_in_one_line() -> None:
    assert family_of_config({"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text"}}, "c") is QWEN3_VL
    with pytest.raises(ValueError, match="MoE checkpoints are not supported") as refused:
        family_of_config({"model_type": "qwen3_vl_moe"}, "c")
    assert "\n" not in str(refused.value) and "Qwen/Qwen3-VL-8B-Instruct" in str(refused.value)


# -- the prompt and its positions -----------------------------------------------------------------

def test_a_video_is_a_timestamp_and_a_vision_block_per_temporal_patch(model: Qwen3VLCaptionModel,
                                                                      prompts: list[ProcessedPrompt]) -> None:
    """demo_test.mp4: 84 frames over 10.5 s (8 a second), 16 sampled at indices 0, 6, 11, 17, ...: the first
    temporal patch at (0 + 6) / 2 / 8 = 0.375 s, the fourth at (33 + 39) / 2 / 8 = 4.5 s, the last at
    (77 + 83) / 2 / 8 = 10.0 s; each patch 2 x 6 merged vectors."""
    video, image = prompts[0], prompts[1]
    frame = "<|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|>"
    times = ["0.4", "1.8", "3.1", "4.5", "5.9", "7.2", "8.6", "10.0"]
    text = model.processor.tokenizer.decode(video.token_ids)
    assert text.startswith("<|im_start|>user\n<0.4 seconds>" + frame + "<1.8 seconds>")
    assert text == ("<|im_start|>user\n" + "".join(f"<{time} seconds>{frame}" for time in times)
                    + "Describe this video.<|im_end|>\n<|im_start|>assistant\n")
    assert [block.grid for block in video.vision_blocks] == [(1, 4, 12)] * 8
    assert all(later.start - earlier.end > 2 for earlier, later in zip(video.vision_blocks, video.vision_blocks[1:]))
    assert video.pixel_values.shape == (8, 48, 3 * 2 * 16 * 16)
    assert model.processor.tokenizer.decode(image.token_ids) == (   # 6 x 8 patches: 3 x 4 merged vectors
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|>Describe this image.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_positions_are_transformers_own_for_images_and_videos(model: Qwen3VLCaptionModel,
                                                              prompts: list[ProcessedPrompt]) -> None:
    """Each temporal patch its own block at temporal index 0: transformers' get_rope_index (which splits a video
    into its frames) gives every position of the prompt, and the same delta for decoding."""
    hf = qwen_vl_for_generation(model)
    config = model.config
    for prompt in prompts:
        blocks = prompt.vision_blocks
        is_image = int(prompt.token_ids[blocks[0].start]) == config.image_token_id
        grid = torch.tensor([[len(blocks), *blocks[0].grid[1:]]])
        pads = (prompt.token_ids == (config.image_token_id if is_image else config.video_token_id)).int()[None]
        grids = {"image_grid_thw": grid} if is_image else {"video_grid_thw": grid}
        theirs, delta = hf.model.get_rope_index(prompt.token_ids[None], pads * (1 if is_image else 2), **grids)
        assert torch.equal(theirs[:, 0], prompt.positions)
        assert int(delta) == prompt.next_position - prompt.length
    video = prompts[0]
    first, second = video.vision_blocks[:2]
    assert video.positions[0, first.start] == video.positions[0, first.end - 1]   # one temporal index a block
    assert video.positions[0, second.start] == video.positions[0, first.end] + second.start - first.end


# Frame rates as decoders read them: NTSC's 24000/1001, 30000/1001 and 60000/1001, the rounded 23.976 and 29.97
# that some containers declare, and whole rates.
FRAME_RATES = [24000 / 1001, 23.976, 24.0, 25.0, 30000 / 1001, 29.97, 30.0, 50.0, 60000 / 1001, 60.0]


def processors_timestamps(indices: list[int], fps: float) -> list[float]:
    """transformers' Qwen3VLProcessor._calculate_timestamps, which reads nothing of the processor it is on."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor.__new__(Qwen3VLProcessor)._calculate_timestamps(list(indices), fps, TEMPORAL_PATCH_FRAMES)


def test_timestamps_are_the_processors_for_every_frame_rate_and_count() -> None:
    """The processor's times from the same sampled indices and frame rate, to the last bit, so the same
    `<x.x seconds>` text: over frame rates, clip lengths and sampled counts (an odd count padded as it pads).
    A time computed otherwise, as index x duration / frames, differs in the last bit and flips roundings at x.x5
    (41 frames at 30 fps, 32 sampled: 1.0 where the processor writes 1.1)."""
    differing = []
    for fps in FRAME_RATES:
        for total in range(1, 1200, 7):
            for count in (2, 8, 16, 32):
                sampled = even_frame_indices(total, count)
                for indices in (sampled, sampled[:-1]):   # the last left out: an odd count, padded
                    media = Media("v.mp4", MediaType.VIDEO, [None] * len(indices), indices, 1, 1, total / fps,
                                  "decord", fps=fps)
                    ours = temporal_patch_seconds(media, (len(indices) + 1) // TEMPORAL_PATCH_FRAMES)
                    theirs = processors_timestamps(indices, fps)
                    if ours != theirs or [f"{t:.1f}" for t in ours] != [f"{t:.1f}" for t in theirs]:
                        differing.append((fps, total, len(indices)))
    assert differing == []


@pytest.mark.parametrize("container", ["mp4", "mpegts"])
def test_a_decoded_videos_prompt_times_frames_by_the_files_own_rate(model: Qwen3VLCaptionModel, tmp_path: Path,
                                                                    container: str) -> None:
    """67 frames at 30 fps, 16 sampled: the processor writes 1.0 s for the fourth temporal patch (frames 26 and 31,
    (26 / 30 + 31 / 30) / 2 = 0.9500000000000001, where index x duration / frames gives 0.95 - 1 ulp: 0.9).
    The rate is the one transformers' loader for that decoder reads: decord's average rate (MP4) or the stream's
    average rate in PyAV (MPEG-TS, which decord does not read here)."""
    path = tmp_path / f"clip.{'ts' if container == 'mpegts' else container}"
    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for index in range(67):
            picture = np.full((64, 64, 3), index * 3, np.uint8)
            output.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        output.mux(stream.encode())
    media = model.processor.load_media(str(path), MediaType.VIDEO, 16)
    if container == "mp4":
        import decord

        rate, decoder = float(decord.VideoReader(str(path)).get_avg_fps()), "decord"
    else:
        with av.open(str(path)) as opened:
            rate, decoder = float(opened.streams.video[0].average_rate), "pyav"
    assert (media.decoder, media.fps, rate) == (decoder, 30.0, 30.0)
    text = model.processor.tokenizer.decode(model.processor.process(media, None).token_ids)
    written = re.findall(r"<(\d+\.\d) seconds>", text)
    assert written == [f"{t:.1f}" for t in processors_timestamps(media.frame_indices, rate)]
    assert written[3] == "1.0"


def test_an_animations_frames_are_timed_by_its_average_rate(model: Qwen3VLCaptionModel, shared_media: Path) -> None:
    """clip_5f.gif: 5 frames of 120 ms, so 25 / 3 frames a second, as FFmpeg reads its rate; frames 0, 1, 3, 4
    sampled: patches at 0.06 and 0.42 s."""
    media = model.processor.load_media(str(shared_media / "clip_5f.gif"), MediaType.GIF, 16)
    with av.open(str(shared_media / "clip_5f.gif")) as opened:
        assert media.fps == float(opened.streams.video[0].average_rate) == 25 / 3
    text = model.processor.tokenizer.decode(model.processor.process(media, None).token_ids)
    assert re.findall(r"<(\d+\.\d) seconds>", text) == ["0.1", "0.4"]
    assert temporal_patch_seconds(media, 2) == processors_timestamps(media.frame_indices, 25 / 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_rows_joining_leaving_and_preempted_equal_one_at_a_time(model: Qwen3VLCaptionModel,
                                                                mixed: list[ProcessedPrompt], temperature: float,
                                                                no_room_to_grow: None) -> None:
    """The Qwen2 families' scenario of rows joining and leaving, in a cache that holds the longest row and 40
    positions more: the timestamps (about a dozen tokens a temporal patch) make Qwen3-VL's clips' prompts so much
    longer than its images' that a cache of twice the longest row holds every row that may run beside it."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_p=0.9 if temperature else 1.0)
    limits, seeds = [3, 24, 9, 17, 1, 20, 12, 6, 24, 15], list(range(len(mixed)))
    expected = alone(model, mixed, max_new=limits, sampling=sampling, seeds=seeds)
    room = max(prompt.length for prompt in mixed) + MAX_NEW + 40
    rows = run(model, mixed, max_new=limits, sampling=sampling, seeds=seeds, max_rows=4, prefill_chunk=20,
               max_batch_tokens=30, kv_cache_tokens=room, kv_page_slots=8)
    assert [row.output_ids for row in rows] == expected
    assert sum(row.preemptions for row in rows) > 0, "the small cache should force recomputation"


# -- DeepStack and pruning ----------------------------------------------------------------------------

def test_deepstack_features_change_the_tokens(model: Qwen3VLCaptionModel, prompts: list[ProcessedPrompt],
                                              reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the DeepStack features (the vision vectors cut to the hidden size) the tokens differ: the
    equality with transformers' generate above holds only with them added, in every chunk."""
    width = model.config.text.hidden_size
    features = model.model.vision_features
    assert features(prompts[1].pixel_values[0], [prompts[1].vision_blocks[0].grid]).shape == (12, 3 * width)
    monkeypatch.setattr(model.model, "vision_features", lambda *args: features(*args)[:, :width])
    without = [row.output_ids for row in run(model, prompts[:3], max_rows=3, prefill_chunk=0)]
    assert all(ours != theirs for ours, theirs in zip(without, reference[:3]))


def test_layers_run_apart_from_their_deepstack_features_are_refused(model: Qwen3VLCaptionModel,
                                                                    prompts: list[ProcessedPrompt]) -> None:
    """FastV's split at layer K would run the layers after K without the features of layers K and on."""
    image = prompts[1]
    embeds = embed_whole_prompt(model, image)
    assert embeds.shape == (image.length, 3 * model.config.text.hidden_size)

    def attention(*args: object) -> torch.Tensor:
        raise AssertionError("no layer runs")

    for first, end in ((0, 1), (1, 3)):
        with pytest.raises(ValueError, match=f"layers 0 to 1: run them in one call, not layers {first} to {end - 1}"):
            model.run_layers(embeds, image.positions, attention, first, end)


def test_fastv_pruning_is_refused_in_one_line(model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["caption", str(shared_media / "tarsier_logo.jpg"), "--model", str(model_dir),
                                      "-o", str(tmp_path / "r.parquet"), "--prune-vision", "0.5",
                                      "--prune-method", "fastv"])
    assert result.exit_code == 2, result.output
    assert "DeepStack" in result.output and "--prune-method temporal" in result.output
    assert not (tmp_path / "r.parquet").exists()


def test_fastv_pruning_is_refused_before_the_checkpoint_loads(model_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The refusal came after loading the weights (100 s for a real checkpoint); config.json says the family."""
    import tarsier_batch.api as api
    from tarsier_batch.settings import CaptionSettings, SettingsError

    def load(*args: object) -> None:
        raise AssertionError("the checkpoint loads before the refusal")

    monkeypatch.setattr(api, "load_caption_model", load)
    monkeypatch.setattr(api.preflight, "estimate", load)
    settings = CaptionSettings(model=str(model_dir), prune_vision=0.5, prune_method="fastv", isolate_decoding=False)
    with pytest.raises(SettingsError, match="DeepStack"):
        api.Captioner(settings)


# -- the CLI --------------------------------------------------------------------------------------------

def test_make_tiny_model_and_models_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "m"), "--family", "qwen3_vl"])
    assert made.exit_code == 0, made.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3_vl"
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0
    for expected in ("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "model_type 'qwen3_vl'",
                     "tiny-random-qwen3-vl"):
        assert expected in listing.output
