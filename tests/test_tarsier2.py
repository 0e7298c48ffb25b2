"""Tarsier2: checkpoint layout, official processing and positions, and the engine against transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import RepetitionPenaltyLogitsProcessor
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.engine import Engine, EngineConfig, SamplingParams, Sequence
from tarsier_batch.engine.sampling import select_tokens
from tarsier_batch.families.base import ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tarsier2 import Tarsier2CaptionModel, VisionSpan, mrope_positions
from tarsier_batch.families.tarsier2.processing import pixel_cap, shrink_to_pixels, with_temporal_copies
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import MediaType, frame_indices_without_repeats, media_type_of
from tarsier_batch.outputs.schema import PROVENANCE_KEY

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from official_baseline import generate_tarsier2, qwen2_vl_for_generation  # noqa: E402

MAX_NEW = 24
# Videos of 84, 75 and 5 frames, GIFs of 12, 5 and 8 frames, a landscape JPEG, a portrait PNG.
NAMES = ["demo_test.mp4", "tarsier_logo.jpg", "clip_5f.gif", "portrait_25fps.mp4", "portrait_200x333.png",
         "short_5f.mp4", "clip_12f.gif", "demo_test_8frames.gif"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tarsier2"), "tiny", seed=0, family="tarsier2")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Tarsier2CaptionModel:
    loaded = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    assert isinstance(loaded, Tarsier2CaptionModel)
    return loaded


def process(model: Tarsier2CaptionModel, path: Path, frames: int = 16,
            instruction: str | None = None) -> ProcessedPrompt:
    media = model.processor.load_media(str(path), media_type_of(path), frames)
    return model.processor.process(media, instruction)


@pytest.fixture(scope="module")
def prompts(model: Tarsier2CaptionModel, shared_media: Path) -> list[ProcessedPrompt]:
    return [process(model, shared_media / name) for name in NAMES]


def run(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt], max_new: list[int] | None = None,
        sampling: SamplingParams | None = None, seeds: list[int] | None = None, **config) -> list[Sequence]:
    engine = Engine(model, EngineConfig(**config), sampling or SamplingParams(max_new_tokens=MAX_NEW))
    rows = [engine.add(prompt, max_new_tokens=max_new[index] if max_new else None,
                       seed=seeds[index] if seeds else None)
            for index, prompt in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return rows


def alone(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt], **kwargs) -> list[list[int]]:
    max_new, seeds = kwargs.pop("max_new", None), kwargs.pop("seeds", None)
    return [run(model, [prompt], [max_new[i]] if max_new else None, seeds=[seeds[i]] if seeds else None,
                max_rows=1, prefill_chunk=0, **kwargs)[0].output_ids for i, prompt in enumerate(prompts)]


@pytest.fixture(scope="module")
def reference(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    return alone(model, prompts)


# -- checkpoint layout and family detection --------------------------------------------------------

def test_tiny_checkpoint_has_the_official_layout(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llava" and config["text_config"]["model_type"] == "qwen2_vl"
    text = config["text_config"]
    assert config["image_token_index"] == text["image_token_id"]
    assert text["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert "auto_map" in config["vision_config"] and "auto_map" in text
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert {"vision_tower.patch_embed.proj.weight", "vision_tower.merger.ln_q.weight",
            "vision_tower.merger.mlp.0.weight", "vision_tower.merger.mlp.2.bias",
            "vision_tower.blocks.0.attn.qkv.weight", "language_model.model.embed_tokens.weight",
            "language_model.model.layers.0.self_attn.q_proj.bias", "language_model.model.norm.weight",
            "language_model.lm_head.weight"} <= keys
    assert all(key.split(".")[0] in {"vision_tower", "language_model"} for key in keys)
    preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"min_pixels": 3136, "max_pixels": 12544}
    assert json.loads((model_dir / "generation_config.json").read_text())["repetition_penalty"] == 1.05
    template = json.loads((model_dir / "chat_template.json").read_text())["chat_template"]
    assert "strip_final_eos" in template
    assert json.loads((model_dir / "processor_config.json").read_text())["image_token"] == "<|image_pad|>"


def test_special_tokens_follow_qwen2_vl_order(model: Tarsier2CaptionModel, model_dir: Path) -> None:
    tokenizer = model.processor.tokenizer
    first = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    order = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
             "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert [tokenizer.convert_tokens_to_ids(token) for token in order] == list(range(first, first + 14))
    assert first + 14 == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and model.eos_token_ids == {first, first + 2}
    assert model.repetition_penalty == 1.05


def test_unknown_checkpoint_layout_is_one_clear_line(model_dir: Path, tmp_path: Path, shared_media: Path) -> None:
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    (odd / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["caption", str(shared_media / "clip_5f.gif"), "--model", str(odd),
                                      "-o", str(tmp_path / "r.parquet")])
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.count("\n") == 0 and "'mistral'" in message and "'qwen2_vl'" in message and "'llama'" in message


# -- processing the official way -------------------------------------------------------------------

@pytest.mark.parametrize(("total", "wanted", "expected"), [
    (84, 16, [0, 6, 11, 17, 22, 28, 33, 39, 44, 50, 55, 61, 66, 72, 77, 83]),   # demo_test.mp4
    (84, 4, [0, 28, 55, 83]),
    (12, 16, list(range(12))), (5, 16, [0, 1, 2, 3, 4]), (16, 16, list(range(16))),  # short clips: all frames
    (9, 5, [0, 2, 4, 6, 8]), (11, 5, [0, 2, 5, 8, 10]),  # 2.5 rounds half to even
    (10, 1, [0]),
])
def test_frame_indices_follow_the_official_sampler(total: int, wanted: int, expected: list[int]) -> None:
    assert frame_indices_without_repeats(total, wanted) == expected


def test_portrait_clip_samples_as_the_facts_say(model: Tarsier2CaptionModel, shared_media: Path) -> None:
    media = model.processor.load_media(str(shared_media / "portrait_25fps.mp4"), MediaType.VIDEO, 16)
    assert media.frame_indices[6:9] == [30, 35, 39] and 44 in media.frame_indices and len(media.frames) == 16


def test_pixel_budget_and_pre_resize() -> None:
    assert pixel_cap(MediaType.VIDEO, 16, 2) == 460_800       # 18,874,368 // 32 frames is larger
    assert pixel_cap(MediaType.VIDEO, 20, 2) == 460_800
    assert pixel_cap(MediaType.VIDEO, 32, 2) == 294_912       # 18,874,368 // 64
    assert pixel_cap(MediaType.IMAGE, 1, 2) == 460_800
    frame = Image.new("RGB", (1920, 800))
    assert shrink_to_pixels(frame, 460_800).size == (1051, 438)
    small = Image.new("RGB", (640, 360))
    assert shrink_to_pixels(small, 460_800) is small


def test_real_geometry_gives_608_vectors_per_frame(shared_media: Path, tmp_path: Path) -> None:
    """With Qwen2-VL's own max_pixels (12,845,056), demo_test.mp4 (1920x800) becomes 1064x448: grid 16 x 32 x 76."""
    small = load_caption_model(make_tiny_model(tmp_path / "small", "small", family="tarsier2"), torch.float32,
                               torch.device("cpu"))
    assert small.processor.image_processor.size.longest_edge == 12_845_056
    prompt = process(small, shared_media / "demo_test.mp4")
    assert [block.grid for block in prompt.vision_blocks] == [(1, 32, 76)] * 16
    assert sum(block.length for block in prompt.vision_blocks) == 9728
    assert prompt.pixel_values.shape == (16, 32 * 76, 3 * 14 * 14)


def test_kept_patches_rebuild_the_processors_duplicated_frame(model: Tarsier2CaptionModel, shared_media: Path) -> None:
    """The processor fills each temporal patch with two copies of a frame; one copy is kept and
    the other rebuilt when encoding, bit for bit."""
    processor = model.processor
    with Image.open(shared_media / "demo_test_f40.jpg") as image:
        frame = image.convert("RGB")
    kept = processor.frame_patches(frame, 1, MediaType.IMAGE)
    full = processor.image_processor(images=shrink_to_pixels(frame, 460_800), return_tensors="pt")["pixel_values"]
    assert torch.equal(with_temporal_copies(kept.patches, 2), full)


def test_prompt_comes_from_the_chat_template(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt]) -> None:
    tokenizer = model.processor.tokenizer
    video, image = prompts[0], prompts[1]
    vision = sum(block.length for block in video.vision_blocks)
    assert tokenizer.decode(video.token_ids) == (
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * vision
        + "<|vision_end|>Describe the video in detail.<|im_end|>\n<|im_start|>assistant\n")
    assert image.instruction == "Describe the video in detail."  # upstream's default for images too
    assert [block.grid for block in image.vision_blocks] == [(1, 6, 8)]
    assert [block.grid for block in video.vision_blocks] == [(1, 4, 12)] * 16


# -- M-RoPE positions ------------------------------------------------------------------------------

def test_positions_of_the_facts_example() -> None:
    """demo_test.mp4, 16 frames at 460,800 px: merged grid 16 x 16 x 38 after 5 text tokens."""
    length = 5 + 16 * 16 * 38 + 17
    positions, next_position = mrope_positions(length, [VisionSpan(5, (16, 16, 38))])
    assert positions[:, 4].tolist() == [4, 4, 4]
    assert positions[:, 5].tolist() == [5, 5, 5]
    assert positions[:, 5 + 38].tolist() == [5, 6, 5]               # second row of the first frame
    assert positions[:, 5 + 16 * 38].tolist() == [6, 5, 5]          # second frame
    assert positions[:, 5 + 9727].tolist() == [20, 20, 42]
    assert positions[:, 5 + 9728].tolist() == [43, 43, 43]
    assert positions[:, -1].tolist() == [59, 59, 59] and next_position == 60


def test_positions_resume_after_the_frame_count_when_it_is_the_largest(model: Tarsier2CaptionModel) -> None:
    """16 frames of a 2 x 6 merged grid: text resumes at s + 16, where transformers 5 resumes at s + 6."""
    from official_baseline import qwen2_vl_for_generation as build

    positions, next_position = mrope_positions(4 + 192 + 3, [VisionSpan(4, (16, 2, 6))])
    assert positions[:, 4 + 191].tolist() == [4 + 15, 4 + 1, 4 + 5]
    assert positions[:, 4 + 192].tolist() == [20, 20, 20] and next_position == 23
    ids = torch.zeros(1, 199, dtype=torch.long)
    types = torch.zeros(1, 199, dtype=torch.int)
    types[0, 4:196] = 2
    transformers_positions, _ = build(model).model.get_rope_index(
        ids, types, video_grid_thw=torch.tensor([[16, 4, 12]]))
    assert transformers_positions[:, 0, 4 + 192].tolist() == [10, 10, 10]  # s + max(h, w): not the official rule


def test_image_positions_agree_with_transformers(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt]) -> None:
    image = prompts[1]
    _, grid_h, grid_w = image.vision_blocks[0].grid
    types = (image.token_ids == model.config.image_token_id).int()[None]
    theirs, delta = qwen2_vl_for_generation(model).model.get_rope_index(
        image.token_ids[None], types, image_grid_thw=torch.tensor([[1, grid_h, grid_w]]))
    assert torch.equal(theirs[:, 0], image.positions)
    assert int(delta) == image.next_position - image.length


def test_frame_batched_tower_equals_transformers_tower(model: Tarsier2CaptionModel,
                                                       prompts: list[ProcessedPrompt]) -> None:
    """Frames of two sizes, interleaved (runs of equal lengths batch; a block of two temporal patches counts
    twice): the vision vectors equal transformers' own tower, which attends frame by frame, bit for bit."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    stock = Qwen2VisionTransformerPretrainedModel(model.config.vision).eval()
    stock.load_state_dict(model.model.vision_tower.state_dict())
    assert type(model.model.vision_tower.blocks[0]) is not type(stock.blocks[0])
    landscape, portrait = prompts[1].vision_blocks[0].grid, prompts[4].vision_blocks[0].grid
    assert landscape[1:] != portrait[1:]
    grids = [landscape, landscape, portrait, (2, *landscape[1:]), portrait]
    generator = torch.Generator().manual_seed(0)
    patches = torch.randn(sum(t * h * w for t, h, w in grids), stock.patch_embed.proj.weight[0].numel(),
                          generator=generator)
    with torch.inference_mode():
        theirs = stock(patches, grid_thw=torch.tensor(grids)).pooler_output
        ours = model.model.vision_features(patches, grids)
    assert torch.equal(ours, theirs)


# -- the engine against transformers and against itself -------------------------------------------

@pytest.mark.smoke
def test_greedy_tokens_equal_transformers_qwen2_vl_generate(model: Tarsier2CaptionModel,
                                                            prompts: list[ProcessedPrompt],
                                                            reference: list[list[int]]) -> None:
    """transformers' own Qwen2-VL (vision tower, forward, cache, repetition penalty) fed the same
    ids and pixels with the official positions gives our tokens; an EOS stop is among them."""
    hf = qwen2_vl_for_generation(model)
    with torch.inference_mode():
        theirs = [generate_tarsier2(model, hf, prompt, MAX_NEW, disable_eos=False) for prompt in prompts]
    ours = [row.output_ids for row in run(model, prompts, max_rows=4, prefill_chunk=40, max_batch_tokens=64)]
    assert ours == theirs == reference
    assert any(len(row) < MAX_NEW for row in reference), "one item should stop at an end-of-sequence token"
    assert len({tuple(row) for row in reference}) == len(prompts), "inputs should give distinct outputs"


def test_repetition_penalty_is_applied_and_equals_transformers(model: Tarsier2CaptionModel,
                                                               prompts: list[ProcessedPrompt],
                                                               reference: list[list[int]]) -> None:
    without = alone(model, prompts, sampling=SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.0))
    assert without != reference, "the checkpoint's 1.05 penalty should change some captions"
    logits = torch.randn(2, 50)
    seen = [torch.tensor([3, 7, 7, 49]), torch.tensor([0, 12])]
    pairs = ([row for row, ids in enumerate(seen) for _ in ids], [int(i) for ids in seen for i in ids])
    ours = select_tokens(logits, SamplingParams(repetition_penalty=1.3), [None, None], [0, 0], pairs)
    for row, ids in enumerate(seen):
        expected = RepetitionPenaltyLogitsProcessor(1.3)(ids[None], logits[row:row + 1].clone()).argmax(dim=-1)
        assert ours[row] == int(expected)


@pytest.mark.parametrize("chunk", [1, 7, 12, 50, 0])
def test_chunked_prefill_equals_unchunked(model: Tarsier2CaptionModel, prompts: list[ProcessedPrompt],
                                          reference: list[list[int]], chunk: int) -> None:
    """A frame is 12 vectors here: chunk 7 splits frames, 12 ends chunks at frame edges."""
    chunked = run(model, prompts[:3], max_rows=3, prefill_chunk=chunk, max_batch_tokens=max(chunk, 3) + 3)
    assert [row.output_ids for row in chunked] == reference[:3]


def test_mixed_batch_with_rows_joining_and_leaving_equals_one_at_a_time(model: Tarsier2CaptionModel,
                                                                         prompts: list[ProcessedPrompt],
                                                                         reference: list[list[int]],
                                                                         shared_media: Path,
                                                                         no_room_to_grow: None) -> None:
    """Images and videos of different sizes and frame counts, different prompts and limits."""
    mixed = prompts + [process(model, shared_media / "demo_test.mp4", frames=4, instruction="Who hides?"),
                       process(model, shared_media / "tarsier_logo.jpg", instruction="Describe the image in detail.")]
    max_new = [3, 24, 9, 17, 1, 20, 12, 6, 24, 15]
    expected = alone(model, mixed, max_new=max_new)
    continuous = run(model, mixed, max_new=max_new, max_rows=3, prefill_chunk=32, max_batch_tokens=48)
    assert [row.output_ids for row in continuous] == expected
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9)
    seeds = list(range(len(mixed)))
    sampled_alone = alone(model, mixed, sampling=sampling, seeds=seeds)
    # A cache for about two of the longest rows: rows are preempted mid-decode and recomputed.
    sampled = run(model, mixed, sampling=sampling, seeds=seeds, max_rows=4, prefill_chunk=20,
                  max_batch_tokens=30, kv_cache_tokens=2 * (263 + MAX_NEW) + 20, kv_page_slots=8)
    assert [row.output_ids for row in sampled] == sampled_alone
    assert sampled_alone[:len(reference)] != reference, "sampling should differ from greedy decoding"
    assert sum(row.preemptions for row in sampled) > 0, "the small cache should force recomputation"


# -- the CLI -----------------------------------------------------------------------------------------

def test_cli_captions_shared_media_with_the_v1_schema(model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    from test_cli import COLUMNS

    out = tmp_path / "r.parquet"
    result = CliRunner().invoke(app, ["caption", str(shared_media), "--model", str(model_dir), "-o", str(out),
                                      "--max-new-tokens", "6", "--with-token-ids"])
    assert result.exit_code == 0, result.output
    assert "(Tarsier2, 16 frames)" in result.output
    table = pq.read_table(out)
    assert table.column_names == COLUMNS + ["generated_ids"]
    rows = {Path(row["path"]).name: row for row in table.to_pylist()}
    assert len(rows) == 9 and all(row["error"] is None for row in rows.values())
    video = rows["demo_test.mp4"]
    assert video["num_frames"] == 16 and video["frame_indices"][:3] == [0, 6, 11]
    assert video["prompt_tokens"] == 215  # 16 frames of 12 vectors and 23 text tokens
    assert rows["clip_5f.gif"]["frame_indices"] == [0, 1, 2, 3, 4]
    assert rows["short_5f.mp4"]["num_frames"] == 5  # all five frames, none repeated
    assert rows["tarsier_logo.jpg"]["prompt"] == "Describe the video in detail."
    provenance = json.loads(pq.read_metadata(out).metadata[PROVENANCE_KEY.encode()])
    assert provenance["model_family"] == "Tarsier2" and provenance["frames"] == 16
    assert provenance["generation"]["repetition_penalty"] == 1.05
    assert len(provenance["generation"]["eos_token_ids"]) == 2


def test_make_tiny_model_and_models_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "m"), "--family", "tarsier2"])
    assert made.exit_code == 0, made.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]["model_type"] == "qwen2_vl"
    wrong = runner.invoke(app, ["dev", "make-tiny-model", str(tmp_path / "n"), "--family", "tarsier3"])
    assert wrong.exit_code == 2 and "tarsier3" in wrong.output
    listing = runner.invoke(app, ["models"])
    assert listing.exit_code == 0
    assert "omni-research/Tarsier2-Recap-7b" in listing.output and "omni-research/Tarsier2-7b-0115" in listing.output
    assert "tiny-random-tarsier2" in listing.output and "omni-research/Tarsier-7b" in listing.output
