"""Qwen2-VL and Qwen2.5-VL: checkpoint layout and detection, qwen-vl-utils' frames and sizes, the chat prompt,
M-RoPE positions, and the engine against transformers' own generate."""

from __future__ import annotations

import functools
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.engine import SamplingParams
from tarsier_batch.families.base import ProcessedPrompt
from tarsier_batch.families.catalog import QWEN2_5_VL, QWEN2_VL, TARSIER2, family_of_config
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.qwen2_vl import QwenVLCaptionModel
from tarsier_batch.families.qwen2_vl.family import clip_frames
from tarsier_batch.families.qwen2_vl.processing import (
    resize_for_model,
    seconds_per_temporal_patch,
    temporal_interval,
    video_frame_max_pixels,
)
from tarsier_batch.families.qwen_vl.patches import temporal_patch_of, with_temporal_copies
from tarsier_batch.families.qwen_vl.positions import VisionSpan
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import Media, MediaType, Span, even_frame_indices, load_media
from tarsier_batch.media.sampling import TEMPORAL_PATCH_FRAMES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from official_baseline import GenerateLimits, generate_qwen_vl, qwen_vl_for_generation  # noqa: E402

# The scenarios of Tarsier2's tests with their helpers: the same clips and images, one engine run (`run`), each
# prompt alone (`alone`).
from test_tarsier2 import MAX_NEW, NAMES, alone, process, run  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> QwenVLCaptionModel:
    loaded = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    assert isinstance(loaded, QwenVLCaptionModel)
    return loaded


@pytest.fixture(scope="module")
def prompts(model: QwenVLCaptionModel, shared_media: Path) -> list[ProcessedPrompt]:
    return [process(model, shared_media / name) for name in NAMES]


@pytest.fixture(scope="module")
def reference(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    return alone(model, prompts)


# -- checkpoint layout and family detection --------------------------------------------------------

def test_tiny_checkpoint_has_the_published_layout(model: QwenVLCaptionModel, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    variant = model.config.variant
    assert config["model_type"] == variant.model_type and "text_config" not in config
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert config["architectures"] == [
        "Qwen2_5_VLForConditionalGeneration" if variant.time_aligned else "Qwen2VLForConditionalGeneration"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert {"visual.patch_embed.proj.weight", "visual.merger.ln_q.weight", "visual.merger.mlp.2.bias",
            "visual.blocks.0.attn.qkv.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
            "model.norm.weight"} <= keys
    assert all(key.split(".")[0] in {"visual", "model", "lm_head"} for key in keys)
    if variant.time_aligned:   # Qwen2.5-VL: SwiGLU and RMSNorm blocks (no norm bias), an output head tied as in the 3B
        assert {"visual.blocks.0.mlp.gate_proj.weight", "visual.blocks.0.norm1.weight"} <= keys
        assert "visual.blocks.0.norm1.bias" not in keys and "lm_head.weight" not in keys
        assert model.model.language_model.lm_head.weight is model.model.language_model.model.embed_tokens.weight
        assert config["vision_config"]["tokens_per_second"] == 2 and model.config.tokens_per_second == 2
    else:
        assert {"visual.blocks.0.mlp.fc1.weight", "visual.blocks.0.norm1.bias", "lm_head.weight"} <= keys
    assert json.loads((model_dir / "generation_config.json").read_text())["repetition_penalty"] == 1.05
    assert model.repetition_penalty == 1.05


def test_config_json_tells_qwen2_vl_from_tarsier2_and_qwen2_5_vl() -> None:
    """Tarsier2's published checkpoints are LLaVA-style around a Qwen2-VL text config; a plain Qwen2-VL names
    itself at the top level."""
    assert family_of_config({"model_type": "qwen2_vl", "vision_config": {}}, "c") is QWEN2_VL
    assert family_of_config({"model_type": "qwen2_5_vl"}, "c") is QWEN2_5_VL
    assert family_of_config({"model_type": "llava", "text_config": {"model_type": "qwen2_vl"}}, "c") is TARSIER2
    with pytest.raises(ValueError, match="'glm4v'.*Qwen2-VL: model_type 'qwen2_vl'"):
        family_of_config({"model_type": "glm4v"}, "c")


# -- frames, sizes and the prompt as the official usage makes them --------------------------------

def test_frame_indices_follow_torch_linspace_over_an_even_count() -> None:
    for total in range(1, 130):
        for wanted in range(1, 40):
            ours = even_frame_indices(total, wanted)
            assert len(ours) % 2 == 0 and len(ours) <= max(2, total)
            assert ours == torch.linspace(0, total - 1, len(ours)).round().long().tolist()
    assert even_frame_indices(84, 16) == [0, 6, 11, 17, 22, 28, 33, 39, 44, 50, 55, 61, 66, 72, 77, 83]
    assert even_frame_indices(84, 5) == [0, 28, 55, 83]   # five rounds (half to even) to four
    assert even_frame_indices(5, 16) == [0, 1, 3, 4]      # five frames: the even four
    assert even_frame_indices(1, 16) == [0, 0]            # one frame fills its temporal patch twice


def test_pixel_budgets_of_qwen_vl_utils() -> None:
    assert video_frame_max_pixels(16) == 768 * 28 * 28                 # the per-frame cap
    assert video_frame_max_pixels(768) == int(128000 * 28 * 28 * 0.9 / 768 * 2)   # a share of the clip's budget
    assert video_frame_max_pixels(100_000) == int(128 * 28 * 28 * 1.05)   # never below the floor
    frame = Image.new("RGB", (1920, 800))
    assert resize_for_model(frame, MediaType.VIDEO, 16).size == (1176, 476)   # <= 602,112 px, sides of 28
    assert resize_for_model(frame, MediaType.IMAGE, 1).size == (1932, 812)    # nearest multiples of 28
    assert seconds_per_temporal_patch(16, 84, 8.0) == 2 / (16 / 84 * 8.0)   # 16 of 84 frames at 8 fps


@pytest.mark.parametrize("name", ["demo_test.mp4", "portrait_25fps.mp4", "clip_12f.gif"])
def test_video_frames_are_resized_as_qwen_vl_utils_resizes_them(shared_media: Path, name: str) -> None:
    """qwen-vl-utils resizes a clip's uint8 frame tensor with torchvision.transforms.functional.resize (BICUBIC,
    antialias=True), which casts to float32, interpolates, clamps and rounds (torchvision 0.28's
    _functional_tensor.resize). Pillow's fixed-point bicubic, and torch's own uint8 kernel (the path of
    torchvision's v2 resize and transformers' video processor on a CPU), land one level off in a tenth or more
    of the values. Images keep Pillow's resize, as qwen-vl-utils' fetch_image does."""
    frame = load_media(str(shared_media / name), MediaType.VIDEO, 2, sampler=even_frame_indices).frames[1]
    ours = resize_for_model(frame, MediaType.VIDEO, 16)
    size = ours.size
    assert size != frame.size and size[0] % 28 == 0 and size[1] % 28 == 0
    tensor = torch.from_numpy(np.array(frame)).permute(2, 0, 1)[None]
    as_float = torch.nn.functional.interpolate(tensor.float(), size=size[::-1], mode="bicubic", align_corners=False,
                                               antialias=True).clamp(0, 255).round().to(torch.uint8)
    as_uint8 = torch.nn.functional.interpolate(tensor, size=size[::-1], mode="bicubic", align_corners=False,
                                               antialias=True)
    ours_tensor = torch.from_numpy(np.array(ours)).permute(2, 0, 1)[None]
    assert torch.equal(ours_tensor, as_float)
    pillow = torch.from_numpy(np.array(frame.resize(size, Image.Resampling.BICUBIC))).permute(2, 0, 1)[None]
    for other in (pillow, as_uint8):
        off = (ours_tensor.int() - other.int()).abs()
        assert int(off.max()) == 1 and float((off > 0).float().mean()) > 0.1
    image = resize_for_model(frame, MediaType.IMAGE, 1)
    assert torch.equal(torch.from_numpy(np.array(image)),
                       torch.from_numpy(np.array(frame.resize(image.size, Image.Resampling.BICUBIC))))


def test_video_frames_equal_torchvisions_resize_where_installed(shared_media: Path) -> None:
    """The call qwen-vl-utils makes, where torchvision can be imported (its CPU build beside a CPU torch)."""
    functional = pytest.importorskip("torchvision.transforms.functional")
    frame = load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, 2, sampler=even_frame_indices).frames[1]
    ours = resize_for_model(frame, MediaType.VIDEO, 16)
    tensor = torch.from_numpy(np.array(frame)).permute(2, 0, 1)[None]
    theirs = functional.resize(tensor, [ours.height, ours.width], interpolation=functional.InterpolationMode.BICUBIC,
                               antialias=True)
    assert torch.equal(torch.from_numpy(np.array(ours)).permute(2, 0, 1)[None], theirs)


def test_a_temporal_patch_holds_two_frames_in_the_processors_layout(model: QwenVLCaptionModel,
                                                                    shared_media: Path) -> None:
    """The image processor fills an image's temporal patch with two copies (channel-major, then time, as its
    patchify orders them); a video's patch holds frame one in the first slot, frame two in the second."""
    processor = model.processor
    with Image.open(shared_media / "demo_test_f40.jpg") as image:
        frame = resize_for_model(image.convert("RGB"), MediaType.IMAGE, 1)
    full = processor.image_processor(images=frame, return_tensors="pt")["pixel_values"]
    kept = processor.frame_patches(frame, 1, MediaType.IMAGE).patches
    assert torch.equal(temporal_patch_of([kept, kept]), full)
    assert torch.equal(with_temporal_copies(kept, 2), full)
    other = kept.flip(0)
    both = temporal_patch_of([kept, other]).view(kept.shape[0], 3, 2, -1)
    assert torch.equal(both[:, :, 0].reshape(kept.shape), kept)
    assert torch.equal(both[:, :, 1].reshape(kept.shape), other)


def test_prompt_comes_from_the_chat_template(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt]) -> None:
    tokenizer = model.processor.tokenizer
    video, image = prompts[0], prompts[1]
    vision = sum(block.length for block in video.vision_blocks)
    assert tokenizer.decode(video.token_ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|video_pad|>" * vision + "<|vision_end|>Describe this video.<|im_end|>\n<|im_start|>assistant\n")
    assert image.instruction == "Describe this image." and "<|image_pad|>" in tokenizer.decode(image.token_ids)
    assert [block.grid for block in video.vision_blocks] == [(1, 4, 12)] * 8     # 16 frames: 8 temporal patches
    assert video.pixel_values.shape == (8, 48, 3 * 2 * 14 * 14)
    assert [block.grid for block in prompts[2].vision_blocks] == [(1, 4, 12)] * 2   # clip_5f.gif: four frames


# -- M-RoPE positions ------------------------------------------------------------------------------

def test_image_positions_agree_with_transformers(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt]) -> None:
    hf = qwen_vl_for_generation(model)
    for image in (prompts[1], prompts[4]):
        _, grid_h, grid_w = image.vision_blocks[0].grid
        types = (image.token_ids == model.config.image_token_id).int()[None]
        theirs, delta = hf.model.get_rope_index(image.token_ids[None], types,
                                                image_grid_thw=torch.tensor([[1, grid_h, grid_w]]))
        assert torch.equal(theirs[:, 0], image.positions)
        assert int(delta) == image.next_position - image.length


def test_video_positions_agree_with_transformers_up_to_the_text_after(model: QwenVLCaptionModel,
                                                                      prompts: list[ProcessedPrompt],
                                                                      shared_media: Path) -> None:
    """The vision block's positions are transformers' (Qwen2.5-VL's spaced by absolute time); the text after it
    resumes one past the block's largest position, where transformers 5 resumes at s + max(h, w)."""
    video = prompts[0]   # demo_test.mp4: 16 frames over 10.5 s, 8 temporal patches of 2 x 6 merged vectors
    hf = qwen_vl_for_generation(model)
    blocks, config = video.vision_blocks, model.config
    types = (video.token_ids == config.video_token_id).int()[None] * 2
    grid = torch.tensor([[len(blocks), *blocks[0].grid[1:]]])
    extra = {}
    interval = 1.0
    if config.variant.time_aligned:
        seconds = seconds_per_temporal_patch(16, 84, 8.0)
        extra["second_per_grid_ts"] = torch.tensor([seconds])
        interval = config.tokens_per_second * seconds
    theirs, _ = hf.model.get_rope_index(video.token_ids[None], types, video_grid_thw=grid, **extra)
    start, end = blocks[0].start, blocks[-1].end
    assert torch.equal(theirs[:, 0, :end], video.positions[:, :end])
    last_time = int(video.positions[0, end - 1]) - start
    assert last_time == int(7 * interval) and video.positions[0, end].item() == start + max(last_time + 1, 6)
    assert theirs[0, 0, end].item() == start + 6


def test_a_spans_temporal_positions_follow_the_spans_own_frame_rate(model: QwenVLCaptionModel,
                                                                   shared_media: Path) -> None:
    """16 frames of seconds 2-6 of demo_test.mp4 (10.5 s): half a second per temporal patch, whatever the file's
    length; Qwen2.5-VL's temporal positions then step by 2 positions a second x 0.5 s, Qwen2-VL's by one."""
    media = model.processor.load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, 16, span=Span(2.0, 6.0))
    assert (media.frame_indices[0], media.frame_indices[-1], media.duration_s) == (16, 47, 10.5)   # 4 s of frames
    prompt = model.processor.process(media, None)
    starts = [block.start for block in prompt.vision_blocks]
    times = [int(prompt.positions[0, start]) - int(prompt.positions[0, starts[0]]) for start in starts]
    assert times == list(range(8))   # 2 x 0.5 = 1 for Qwen2.5-VL, as for Qwen2-VL
    whole = model.processor.process(model.processor.load_media(str(shared_media / "demo_test.mp4"),
                                                               MediaType.VIDEO, 16), None)
    whole_times = [int(whole.positions[0, block.start]) - int(whole.positions[0, whole.vision_blocks[0].start])
                   for block in whole.vision_blocks]
    # 16 frames over 10.5 s: 1.3125 s a patch, 2.625 positions (truncated) for Qwen2.5-VL
    expected = [int(index * 2.625) for index in range(8)] if model.config.variant.time_aligned else list(range(8))
    assert whole_times == expected


FRAME_RATES = [24000 / 1001, 23.976, 24.0, 25.0, 30000 / 1001, 29.97, 30.0, 50.0, 60000 / 1001, 59.94, 60.0]
SAMPLED_COUNTS = [2, 3, 4, 5, 8, 9, 15, 16, 17, 32, 33, 64]


@functools.cache
def rope_index_holder(tokens_per_second: int) -> types.SimpleNamespace:
    """What transformers' `Qwen2_5_VLModel.get_rope_index` reads of the model it is on: its config and its
    `get_vision_position_ids` (no weights)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(vision_config={"tokens_per_second": tokens_per_second, "spatial_merge_size": 2})
    holder = types.SimpleNamespace(config=config)
    holder.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, holder)
    return holder


def official_temporal_positions(frame_count: int, clip_frames: int, fps: float,
                                tokens_per_second: int = 2) -> tuple[list[int], torch.Tensor]:
    """The temporal positions of a video's vision block (from 0) and its interval, by the official chain:
    qwen-vl-utils' `sample_fps = nframes / max(total_frames, 1e-6) * video_fps` (vision_process.py, returned as
    `video_kwargs['fps']`), Qwen2_5_VLProcessor's `second_per_grid_ts = temporal_patch_size / fps` turned into a
    tensor by its BatchFeature (`torch.tensor` of Python floats: float32), and transformers' own
    `Qwen2_5_VLModel.get_rope_index`, which multiplies it by the config's integer `tokens_per_second`."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    sample_fps = frame_count / max(clip_frames, 1e-6) * fps
    second_per_grid_ts = torch.tensor([TEMPORAL_PATCH_FRAMES / sample_fps])
    model = rope_index_holder(tokens_per_second)
    blocks = math.ceil(frame_count / TEMPORAL_PATCH_FRAMES)   # an odd count's last frame fills its patch
    video_types = torch.full((1, blocks), 2)   # one video block of 2 x 2 patches: one merged vector a patch
    positions, _ = Qwen2_5_VLModel.get_rope_index(model, torch.zeros(1, blocks, dtype=torch.long), video_types,
                                                  video_grid_thw=torch.tensor([[blocks, 2, 2]]),
                                                  second_per_grid_ts=second_per_grid_ts)
    return positions[0, 0].tolist(), tokens_per_second * second_per_grid_ts[0]


@pytest.mark.long
def test_temporal_positions_are_the_official_chains_for_every_frame_rate_and_count() -> None:
    """Frames sampled as qwen-vl-utils samples them (`torch.linspace(first, last, n).round()`), from a whole video
    and from a clip cut from it (frames `start` on, counted as a file of its own), over frame rates, clip lengths and
    sampled counts (odd ones padded as the processor pads): the same interval to the last bit, the same positions.
    Spacing patches by the clip's seconds (`frames / duration`) instead gives the same float32 interval for whole
    videos here, by luck of rounding, and other positions for a segment whose span is not its frames' length."""
    differing = []
    for fps in FRAME_RATES:
        for total in range(1, 1200, 13):
            for count in (count for count in SAMPLED_COUNTS if count <= total):
                sampled = torch.linspace(0, total - 1, count).round().long().tolist()
                start = total // 3
                for indices in (sampled, [start + index for index in sampled]):
                    media = Media("v.mp4", MediaType.VIDEO, [None] * count, indices, 1, 1, (start + total) / fps,
                                  "decord", fps=fps)
                    interval = temporal_interval(count, clip_frames(media), media.fps, 2.0)
                    ours = VisionSpan(0, (math.ceil(count / TEMPORAL_PATCH_FRAMES), 1, 1), interval).offsets()[0]
                    theirs, their_interval = official_temporal_positions(count, total, fps)
                    if ours.tolist() != theirs or interval != float(their_interval):
                        differing.append((fps, total, count, indices[0]))
    assert differing == []


def test_a_segments_temporal_positions_follow_its_frames_not_the_spans_seconds(model: QwenVLCaptionModel,
                                                                             shared_media: Path) -> None:
    """Seconds 0-3.9 of demo_test.mp4 (84 frames at 8 fps) hold frames 0 to 31, four seconds of them: the clip cut
    from the file is 32 frames, 16 sampled, half a second a temporal patch, positions 0 to 7 for Qwen2.5-VL (the
    span's 3.9 s would give 0.4875 s a patch and positions 0, 0, 1, ... 6)."""
    media = model.processor.load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, 16, span=Span(0.0, 3.9))
    assert (media.frame_indices[0], media.frame_indices[-1], media.fps, len(media.frames)) == (0, 31, 8.0, 16)
    prompt = model.processor.process(media, None)
    times = [int(prompt.positions[0, block.start]) - int(prompt.positions[0, prompt.vision_blocks[0].start])
             for block in prompt.vision_blocks]
    assert times == list(range(8))
    if model.config.variant.time_aligned:
        assert times == official_temporal_positions(16, 32, 8.0)[0]


# -- the engine against transformers and against itself -------------------------------------------

def test_greedy_tokens_equal_transformers_generate(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt],
                                                   reference: list[list[int]]) -> None:
    """transformers' own Qwen2-VL / Qwen2.5-VL (vision tower, forward, cache, repetition penalty) fed the same ids
    and pixels, one item at a time, gives the engine's tokens batched, chunked and continuous; an EOS stop is
    among them."""
    hf = qwen_vl_for_generation(model)
    with torch.inference_mode():
        theirs = [generate_qwen_vl(model, hf, prompt, GenerateLimits(MAX_NEW)) for prompt in prompts]
    ours = [row.output_ids for row in run(model, prompts, max_rows=4, prefill_chunk=40, max_batch_tokens=64)]
    assert ours == theirs == reference
    assert len({tuple(row) for row in reference}) == len(prompts), "inputs should give distinct outputs"


@pytest.mark.parametrize("chunk", [1, 7, 48, 0])
def test_chunked_prefill_equals_unchunked(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt],
                                          reference: list[list[int]], chunk: int) -> None:
    """A temporal patch is 48 vectors for demo_test.mp4: chunk 7 splits them, 48 ends chunks at their edges."""
    chunked = run(model, prompts[:3], max_rows=3, prefill_chunk=chunk, max_batch_tokens=max(chunk, 3) + 3)
    assert [row.output_ids for row in chunked] == reference[:3]


@pytest.fixture(scope="module")
def mixed(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt], shared_media: Path) -> list[ProcessedPrompt]:
    """Images and videos of different sizes and frame counts (4 frames: 2 temporal patches), different prompts."""
    return prompts + [process(model, shared_media / "demo_test.mp4", frames=4, instruction="Who hides?"),
                      process(model, shared_media / "tarsier_logo.jpg", instruction="What is written?")]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_rows_joining_leaving_and_preempted_equal_one_at_a_time(model: QwenVLCaptionModel,
                                                                mixed: list[ProcessedPrompt], temperature: float,
                                                                no_room_to_grow: None) -> None:
    """Rows of different limits join a running batch as others leave, prefilled in chunks beside decoding rows;
    the cache holds about two of the longest rows, so rows are preempted mid-decode and recomputed."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_p=0.9 if temperature else 1.0)
    limits = [3, 24, 9, 17, 1, 20, 12, 6, 24, 15]
    seeds = list(range(len(mixed)))
    expected = alone(model, mixed, max_new=limits, sampling=sampling, seeds=seeds)
    longest = max(prompt.length for prompt in mixed)
    rows = run(model, mixed, max_new=limits, sampling=sampling, seeds=seeds, max_rows=4, prefill_chunk=20,
               max_batch_tokens=30, kv_cache_tokens=2 * (longest + MAX_NEW) + 20, kv_page_slots=8)
    assert [row.output_ids for row in rows] == expected
    assert sum(row.preemptions for row in rows) > 0, "the small cache should force recomputation"


def test_sampling_differs_from_greedy(model: QwenVLCaptionModel, prompts: list[ProcessedPrompt],
                                      reference: list[list[int]]) -> None:
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9)
    assert alone(model, prompts[:3], sampling=sampling, seeds=[0, 1, 2]) != reference[:3]


# -- the CLI -----------------------------------------------------------------------------------------

def test_cli_captions_with_a_question(model: QwenVLCaptionModel, model_dir: Path, shared_media: Path,
                                      tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    clips = [str(shared_media / name) for name in ("demo_test.mp4", "tarsier_logo.jpg", "clip_5f.gif")]
    result = CliRunner().invoke(app, ["caption", *clips, "--model", str(model_dir), "-o", str(out),
                                      "--max-new-tokens", "6", "--ask", "what=What happens?", "--with-token-ids"])
    assert result.exit_code == 0, result.output
    assert f"({model.family.name}, 16 frames)" in result.output
    rows = {Path(row["path"]).name: row for row in pq.read_table(out).to_pylist()}
    assert len(rows) == 3 and all(row["error"] is None for row in rows.values())
    video = rows["demo_test.mp4"]
    assert video["num_frames"] == 16 and video["frame_indices"][:3] == [0, 6, 11]
    assert rows["clip_5f.gif"]["frame_indices"] == [0, 1, 3, 4]
    assert video["what_prompt"] == "What happens?"
    expected = process(model, shared_media / "demo_test.mp4", instruction="What happens?")
    assert video["what_prompt_tokens"] == expected.length
    assert video["what_generated_ids"] == run(model, [expected], max_new=[6], max_rows=1)[0].output_ids


def test_make_tiny_model_and_models_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    for family in ("qwen2_vl", "qwen2_5_vl"):
        made = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / family), "--family", family])
        assert made.exit_code == 0, made.output
        assert json.loads((tmp_path / family / "config.json").read_text())["model_type"] == family
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0
    for expected in ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct",
                     "model_type 'qwen2_5_vl'", "tiny-random-qwen2-vl", "tiny-random-qwen2.5-vl",
                     "Describe this video."):
        assert expected in listing.output
