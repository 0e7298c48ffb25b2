"""bench/official_baseline.py (transformers' generate, one item at a time) agrees with our pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tarsier_batch import Captioner, CaptionResult, CaptionSettings, MediaItem, SamplingParams
from tarsier_batch.media import MediaType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from official_baseline import run_baseline  # noqa: E402

MAX_NEW = 40  # still.png stops at </s> after 37 tokens on the tiny checkpoint; the others run to the limit


@pytest.fixture(scope="module")
def items() -> list[MediaItem]:
    from conftest import SAMPLE_DATA

    return [MediaItem(str(SAMPLE_DATA / "still.png"), MediaType.IMAGE),
            MediaItem(str(SAMPLE_DATA / "ball.gif"), MediaType.GIF),
            MediaItem(str(SAMPLE_DATA / "ball_h264.mp4"), MediaType.VIDEO, "What moves in this clip?")]


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path, items: list[MediaItem]) -> list[CaptionResult]:
    settings = CaptionSettings(model=str(tiny_model_dir), sampling=SamplingParams(max_new_tokens=MAX_NEW),
                               dtype="float32", device="cpu")
    results = list(Captioner(settings).caption(items))
    assert all(result.ok for result in results), [result.error for result in results]
    assert [result.finish_reason for result in results] == ["eos", "length", "length"], "should cover a stop"
    return results


def test_baseline_greedy_ids_equal_the_pipeline(tiny_model_dir: Path, items: list[MediaItem],
                                                pipeline: list[CaptionResult]) -> None:
    baseline = run_baseline(tiny_model_dir, items, MAX_NEW, disable_eos=False)
    assert baseline["generated_ids"] == [result.generated_ids for result in pipeline]
    assert baseline["prompt_tokens"] == [result.prompt_tokens for result in pipeline]
    assert baseline["generated_tokens"] == sum(len(result.generated_ids or []) for result in pipeline)


def test_disabled_eos_runs_to_the_limit(tiny_model_dir: Path, items: list[MediaItem],
                                        pipeline: list[CaptionResult]) -> None:
    running = run_baseline(tiny_model_dir, items[:1], MAX_NEW, disable_eos=True)
    stopped_ids = pipeline[0].generated_ids
    full_ids, = running["generated_ids"]
    assert stopped_ids is not None and len(stopped_ids) < MAX_NEW == len(full_ids)
    assert full_ids[:len(stopped_ids)] == stopped_ids  # the same free run, only not cut at </s>
    assert running["items"] == 1 and running["seconds"] > 0 and running["decode_step_ms"] > 0


@pytest.mark.parametrize(("size", "vectors_per_frame"), [("bench", 73), ("wide", 601)])
def test_benchmark_sizes_have_a_100m_language_model(size: str, vectors_per_frame: int) -> None:
    import torch

    from tarsier_batch.families.tarsier.config import TarsierConfig
    from tarsier_batch.families.tarsier.modeling import TarsierModel
    from tarsier_batch.families.tiny.tarsier import SIZES, _config_dict

    # Ids as in the built checkpoints (702-token tokenizer, table of 704 rows); no weights are made.
    raw = _config_dict(SIZES[size], image_token=700, pad_token=701, newline=702, frame_end=703, vocab=704,
                       init_scale=0.02)
    config = TarsierConfig.from_dict(raw)
    assert config.tokens_per_frame == vectors_per_frame
    with torch.device("meta"):
        language_model = TarsierModel(config).language_model
    assert 95e6 < sum(parameter.numel() for parameter in language_model.parameters()) < 110e6


def test_qwen3_vl_benchmark_size_compares_with_qwen2_vl() -> None:
    """Qwen3-VL's `bench` checkpoint beside Qwen2-VL's: a ~100M-parameter language model of the same width and depth,
    and as many merged patches a frame (16-px patches merged 2 x 2 are 32 px, Qwen2-VL's 14-px ones 28 px)."""
    import torch

    from tarsier_batch.families.qwen2_vl import QwenVLConfig, QwenVLModel
    from tarsier_batch.families.qwen3_vl import QWEN3_VL_VARIANT
    from tarsier_batch.families.tiny import qwen2_vl, qwen3_vl

    qwen3, qwen2 = qwen3_vl.SIZES["bench"], qwen2_vl.SIZES["bench"]
    assert qwen3["max_pixels"] // 32**2 == qwen2["max_pixels"] // 28**2 == 64
    assert all(qwen3[key] == qwen2[key] for key in ("text_hidden", "text_intermediate", "text_layers", "text_heads",
                                                    "text_kv_heads"))
    tokens = ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    raw = qwen3_vl.config_dict(qwen3, {token: 700 + index for index, token in enumerate(tokens)}, vocab=768)
    with torch.device("meta"):
        language_model = QwenVLModel(QwenVLConfig.from_dict(raw, QWEN3_VL_VARIANT)).language_model
    assert 95e6 < sum(parameter.numel() for parameter in language_model.parameters()) < 110e6


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_baseline_of_the_qwen_families_equals_the_pipeline(family: str, items: list[MediaItem],
                                                           tmp_path: Path) -> None:
    """The baseline bench_tarsier2.py --family times runs transformers' own Qwen2-VL / Qwen2.5-VL generate, and
    gives the engine's ids for an image, a GIF and a video with its own prompt."""
    from tarsier_batch.families.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / family, "tiny", seed=0, family=family)
    settings = CaptionSettings(model=str(model_dir), sampling=SamplingParams(max_new_tokens=8), dtype="float32",
                               device="cpu")
    ours = list(Captioner(settings).caption(items))
    baseline = run_baseline(model_dir, items, 8, disable_eos=False)
    assert all(result.ok for result in ours), [result.error for result in ours]
    assert baseline["generated_ids"] == [result.generated_ids for result in ours]
    assert baseline["prompt_tokens"] == [result.prompt_tokens for result in ours]
