"""The official scripts' way of captioning, as a baseline: one item at a time, transformers' generate.

    OMP_NUM_THREADS=1 python bench/official_baseline.py --size bench --threads 1 \\
        --max-new-tokens 128 --disable-eos ../shared/media sample_data

For each item, as the official Tarsier scripts do: decode the media, build the prompt and the
pixels, then one `generate` call (greedy, a batch of one, transformers' own KV cache and logits
processors). Tarsier v1: our vision tower and merge make the prompt's input embeddings (matched
token for token with the official implementation) and the Llama's `generate` runs from them.
Tarsier2: transformers' own Qwen2-VL model, sharing our loaded modules, runs the whole item from
the prompt ids and pixels (vision tower included); only its position ids are swapped for the
official ones, which transformers 5 computes differently for videos. Qwen2-VL and Qwen2.5-VL: their own
transformers models, the same way. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from measured_on import measured_on

from tarsier_batch.families.base import CaptionModel, embed_whole_prompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.qwen2_vl import QwenVLCaptionModel
from tarsier_batch.families.tarsier2 import Tarsier2CaptionModel
from tarsier_batch.families.tarsier2.processing import with_temporal_copies
from tarsier_batch.families.tiny import make_tiny_model, sizes
from tarsier_batch.inputs.sources import MediaItem, discover

if TYPE_CHECKING:  # only the adapters below know the family API's types
    from tarsier_batch.families.base import ProcessedPrompt

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUTS = [REPO.parent / "shared" / "media", REPO / "sample_data"]


@dataclass
class BaselineItem:
    """One item's greedy ids (the stop token included, as our pipeline reports them) and timings."""

    path: str
    prompt_tokens: int
    generated_ids: list[int]
    load_s: float     # decode the media, tokenise, preprocess the pixels
    embed_s: float    # vision tower, projector, merge into the prompt embeddings
    prefill_s: float  # generate() up to the first token's logits
    decode_s: float   # generate() after that: one step per further token


def prepare_item(model: CaptionModel, item: MediaItem, frames: int) -> ProcessedPrompt:
    """Decode the media and make the prompt tokens and pixels (CPU), the family's way."""
    media = model.processor.load_media(item.path, item.media_type, frames)
    return model.processor.process(media, item.prompt)


class _PrefillClock(LogitsProcessor):
    """Notes when generate() first asks for a token, i.e. when the prefill is done; leaves the scores alone."""

    def __init__(self) -> None:
        self.first_logits_at: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.first_logits_at is None:
            self.first_logits_at = time.perf_counter()
        return scores


def stop_ids(model: CaptionModel, vocab_size: int, disable_eos: bool) -> list[int]:
    # With EOS disabled, stop only on an id past the vocabulary, which can never be chosen: every
    # item then does max_new_tokens steps and its ids are those of a free run. (`min_new_tokens`
    # would instead mask </s> and so change the ids after the first </s>.)
    return [vocab_size] if disable_eos else sorted(model.eos_token_ids)


def qwen2_vl_for_generation(model: Tarsier2CaptionModel) -> Qwen2VLForConditionalGeneration:
    """transformers' own Qwen2-VL (forward, KV cache, generate) around our loaded modules, shared, not copied."""
    config = model.config
    hf_config = Qwen2VLConfig(text_config=config.text.to_dict(), vision_config=config.vision.to_dict(),
                              image_token_id=config.image_token_id,
                              vision_start_token_id=config.vision_start_token_id)
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen2VLForConditionalGeneration(hf_config)
    hf.model.visual = model.model.vision_tower
    hf.model.language_model = model.model.language_model.model
    hf.lm_head = model.model.language_model.lm_head
    return hf.eval()


def generate_tarsier2(model: Tarsier2CaptionModel, hf: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt,
                      max_new_tokens: int, disable_eos: bool,
                      logits_processor: LogitsProcessorList | None = None) -> list[int]:
    """One item through transformers' Qwen2-VL generate: prompt ids, every frame's pixels (duplicated
    into its temporal patch, as the official processor does), the official M-RoPE positions and the
    checkpoint's repetition penalty over prompt and generated ids."""
    pixels = torch.cat([with_temporal_copies(frame, model.processor.temporal_patch_size)
                        for frame in prompt.pixel_values])
    _, grid_h, grid_w = prompt.vision_blocks[0].grid
    vision = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[len(prompt.vision_blocks), grid_h, grid_w]])}
    return _generate_mrope(model, hf, prompt, vision, model.config.image_token_id, 1, True,
                           GenerateLimits(max_new_tokens, disable_eos, logits_processor))


def qwen_vl_for_generation(model: QwenVLCaptionModel) -> Qwen2VLForConditionalGeneration:
    """transformers' own Qwen2-VL, Qwen2.5-VL or Qwen3-VL (forward, KV cache, generate) around our loaded modules."""
    classes = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
               "qwen3_vl": Qwen3VLForConditionalGeneration}
    with torch.device("meta"):
        hf = classes[model.config.variant.model_type](model.config.full)
    hf.model.visual = model.model.visual
    hf.model.language_model = model.model.language_model.model
    hf.lm_head = model.model.language_model.lm_head
    return hf.eval()


def generate_qwen_vl(model: QwenVLCaptionModel, hf: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt,
                     limits: GenerateLimits) -> list[int]:
    """One item through transformers' generate as the model's processor hands it over: an image's patches with
    its grid, or a clip's temporal patches as one video (`pixel_values_videos`, grid (t, h, w)) over
    `<|video_pad|>` ids. An image's M-RoPE positions are transformers' own; a Qwen2-VL or Qwen2.5-VL video's are
    the prompt's, since transformers 5 resumes the text after a video at s + max(h, w) where the models' own code
    resumes one past the block's largest position (`families.qwen_vl.positions`). Qwen3-VL's video blocks are one
    temporal patch each, the text between them: transformers' positions are its own code's."""
    _, grid_h, grid_w = prompt.vision_blocks[0].grid
    grid = torch.tensor([[len(prompt.vision_blocks), grid_h, grid_w]])
    pixels = torch.cat(list(prompt.pixel_values))
    config = model.config
    if int(prompt.token_ids[prompt.vision_blocks[0].start]) == config.image_token_id:
        return _generate_mrope(model, hf, prompt, {"pixel_values": pixels, "image_grid_thw": grid},
                               config.image_token_id, 1, False, limits)
    return _generate_mrope(model, hf, prompt, {"pixel_values_videos": pixels, "video_grid_thw": grid},
                           config.video_token_id, 2, config.variant.model_type != "qwen3_vl", limits)


@dataclass(frozen=True)
class GenerateLimits:
    """How long generate runs: `max_new_tokens`, and with `disable_eos` never shorter; an extra logits processor."""

    max_new_tokens: int
    disable_eos: bool = False
    logits_processor: LogitsProcessorList | None = None


def _generate_mrope(model: CaptionModel, hf: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt,
                    vision: dict[str, torch.Tensor], pad_id: int, token_type: int, own_positions: bool,
                    limits: GenerateLimits) -> list[int]:
    """generate() of a Qwen2-VL-lineage model over the prompt ids and `vision` inputs, greedy, with the
    checkpoint's repetition penalty; with `own_positions`, the prompt's M-RoPE positions replace transformers'."""
    device = model.device
    ids = prompt.token_ids[None].to(device)
    if own_positions:
        positions = prompt.positions[:, None, :].to(device)
        rope_delta = torch.tensor([[prompt.next_position - prompt.length]], device=device)
        hf.model.get_rope_index = lambda *args, **kwargs: (positions, rope_delta)
    else:   # transformers' own method, should an earlier call have replaced it
        vars(hf.model).pop("get_rope_index", None)
    output = hf.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **{key: value.to(device) for key, value in vision.items()},
        mm_token_type_ids=(ids == pad_id).int() * token_type, max_new_tokens=limits.max_new_tokens,
        do_sample=False, repetition_penalty=model.repetition_penalty,
        eos_token_id=stop_ids(model, model.config.text.vocab_size, limits.disable_eos),
        pad_token_id=sorted(model.eos_token_ids)[0], logits_processor=limits.logits_processor)
    return output[0, prompt.length:].tolist()


def generate_tarsier(model: CaptionModel, embeds: torch.Tensor, max_new_tokens: int, disable_eos: bool,
                     logits_processor: LogitsProcessorList) -> list[int]:
    """Tarsier v1: the Llama's generate from the merged prompt embeddings."""
    language_model = model.model.language_model
    output = language_model.generate(
        inputs_embeds=embeds[None],
        attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long, device=embeds.device),
        max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=stop_ids(model, language_model.config.vocab_size, disable_eos),
        pad_token_id=model.config.raw.get("pad_token_id"), logits_processor=logits_processor)
    # Given inputs_embeds and no input_ids, a decoder-only model's generate returns only the new
    # tokens (transformers 5; checked: the output has at most max_new_tokens columns).
    return output[0].tolist()


# One item's generate through transformers: (prompt, limits) -> the generated ids.
Generate = Callable[["ProcessedPrompt", GenerateLimits], list[int]]


def transformers_generate(model: CaptionModel) -> Generate | None:
    """The family's generate through transformers' own model around our loaded modules: Qwen2-VL's for Tarsier2,
    Qwen2-VL's or Qwen2.5-VL's for those; None for Tarsier v1, whose Llama generates from our merged embeddings."""
    if isinstance(model, Tarsier2CaptionModel):
        tarsier2 = qwen2_vl_for_generation(model)
        return lambda prompt, limits: generate_tarsier2(model, tarsier2, prompt, limits.max_new_tokens,
                                                        limits.disable_eos, limits.logits_processor)
    if isinstance(model, QwenVLCaptionModel):
        qwen_vl = qwen_vl_for_generation(model)
        return lambda prompt, limits: generate_qwen_vl(model, qwen_vl, prompt, limits)
    return None


@torch.inference_mode()
def caption_one(model: CaptionModel, generate: Generate | None, item: MediaItem, max_new_tokens: int,
                disable_eos: bool, frames: int) -> BaselineItem:
    start = time.perf_counter()
    prepared = prepare_item(model, item, frames)
    loaded = time.perf_counter()
    clock = _PrefillClock()
    if generate is None:
        embeds = embed_whole_prompt(model, prepared)
        embedded = time.perf_counter()
        ids = generate_tarsier(model, embeds, max_new_tokens, disable_eos, LogitsProcessorList([clock]))
    else:  # the vision tower runs inside generate's prefill
        embedded = loaded
        ids = generate(prepared, GenerateLimits(max_new_tokens, disable_eos, LogitsProcessorList([clock])))
    end = time.perf_counter()
    assert clock.first_logits_at is not None
    return BaselineItem(item.path, prepared.length, ids, load_s=loaded - start, embed_s=embedded - loaded,
                        prefill_s=clock.first_logits_at - embedded, decode_s=end - clock.first_logits_at)


def run_baseline(model_dir: Path, items: list[MediaItem], max_new_tokens: int, disable_eos: bool,
                 frames: int | None = None) -> dict[str, Any]:
    """Caption `items` one at a time (float32, CPU); returns throughput, a stage split and the ids."""
    model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    generate = transformers_generate(model)
    frames = frames or model.processor.default_frames
    # Untimed warm-up: the first calls pay for lazy imports, allocator growth and kernel choice.
    caption_one(model, generate, items[0], 2, disable_eos, frames)
    start = time.perf_counter()
    results = [caption_one(model, generate, item, max_new_tokens, disable_eos, frames) for item in items]
    seconds = time.perf_counter() - start
    tokens = sum(len(result.generated_ids) for result in results)
    decode_steps = tokens - len(results)  # the first token of each item comes from its prefill
    decode_s = sum(result.decode_s for result in results)
    return {
        "items": len(results), "max_new_tokens": max_new_tokens, "disable_eos": disable_eos,
        "frames": frames, "torch_threads": torch.get_num_threads(),
        "seconds": round(seconds, 4), "items_per_s": round(len(results) / seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2), "generated_tokens": tokens,
        "prompt_tokens": [result.prompt_tokens for result in results],
        "stage_seconds": {stage: round(sum(getattr(result, f"{stage}_s") for result in results), 4)
                          for stage in ("load", "embed", "prefill", "decode")},
        "decode_step_ms": round(1000 * decode_s / decode_steps, 3) if decode_steps else None,
        "generated_ids": [result.generated_ids for result in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", default=[str(path) for path in DEFAULT_INPUTS])
    parser.add_argument("--model", type=Path, help="an existing checkpoint; default: build --size")
    parser.add_argument("--family", default="tarsier",
                        choices=["tarsier", "tarsier2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--size", default="bench", choices=sorted(set(sizes("tarsier")) & set(sizes("tarsier2"))))
    parser.add_argument("--frames", type=int, help="default: the family's")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--disable-eos", action="store_true", help="every item generates --max-new-tokens")
    parser.add_argument("--threads", type=int, help="torch threads (also set OMP_NUM_THREADS)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    items = discover(args.inputs).items
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or make_tiny_model(Path(scratch) / "model", args.size, seed=0, family=args.family)
        figures = run_baseline(model_dir, items, args.max_new_tokens, args.disable_eos, args.frames)
    figures.pop("generated_ids")
    model = str(args.model) if args.model else f"random-weight {args.family}, size {args.size}"
    print(json.dumps({**measured_on(), "benchmark": "bench/official_baseline.py", "model": model, **figures}, indent=2))


if __name__ == "__main__":
    main()
