"""The official scripts' way of captioning, as a baseline: one item at a time, transformers' generate.

    OMP_NUM_THREADS=1 python bench/official_baseline.py --size bench --threads 1 \\
        --max-new-tokens 128 --disable-eos ../shared/media sample_data

For each item, as the official Tarsier scripts do: decode the media, build the prompt and the
pixels, run the vision tower and merge its vectors into the prompt's input embeddings, then call
the language model's `generate` (greedy, a batch of one, transformers' own KV cache). The merged
embeddings come from our model code (matched token for token with the official implementation);
the generation loop is transformers'. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tarsier_batch.families.tarsier import TarsierCaptioner
from tarsier_batch.families.base import embed_whole_prompt
from tarsier_batch.sources import MediaItem, discover
from tarsier_batch.tiny import make_tiny_model
from tarsier_batch.tiny.tarsier import SIZES

if TYPE_CHECKING:  # only the two adapters below know the family API's types
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


# The only two calls into our model-family API.
def prepare_item(model: TarsierCaptioner, item: MediaItem, frames: int) -> ProcessedPrompt:
    """Decode the media and make the prompt tokens and pixels (CPU)."""
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


def generate_greedy(model: TarsierCaptioner, embeds: torch.Tensor, max_new_tokens: int,
                    disable_eos: bool) -> tuple[list[int], float]:
    """transformers' greedy generate on one prompt; returns the new ids and when the prefill ended."""
    language_model = model.model.language_model
    # With EOS disabled, stop only on an id past the vocabulary, which can never be chosen: every
    # item then does max_new_tokens steps and its ids are those of a free run. (`min_new_tokens`
    # would instead mask </s> and so change the ids after the first </s>.)
    eos = [language_model.config.vocab_size] if disable_eos else sorted(model.eos_token_ids)
    clock = _PrefillClock()
    output = language_model.generate(
        inputs_embeds=embeds[None],
        attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long, device=embeds.device),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=model.config.raw.get("pad_token_id"), logits_processor=LogitsProcessorList([clock]))
    assert clock.first_logits_at is not None
    # Given inputs_embeds and no input_ids, a decoder-only model's generate returns only the new
    # tokens (transformers 5; checked: the output has at most max_new_tokens columns).
    return output[0].tolist(), clock.first_logits_at


@torch.inference_mode()
def caption_one(model: TarsierCaptioner, item: MediaItem, max_new_tokens: int, disable_eos: bool,
                frames: int = 8) -> BaselineItem:
    """Caption one item the official way, timing each stage."""
    start = time.perf_counter()
    prepared = prepare_item(model, item, frames)
    loaded = time.perf_counter()
    embeds = embed_whole_prompt(model, prepared)
    embedded = time.perf_counter()
    ids, prefilled = generate_greedy(model, embeds, max_new_tokens, disable_eos)
    end = time.perf_counter()
    return BaselineItem(item.path, embeds.shape[0], ids, load_s=loaded - start, embed_s=embedded - loaded,
                        prefill_s=prefilled - embedded, decode_s=end - prefilled)


def run_baseline(model_dir: Path, items: list[MediaItem], max_new_tokens: int, disable_eos: bool,
                 frames: int = 8) -> dict[str, Any]:
    """Caption `items` one at a time (float32, CPU); returns throughput, a stage split and the ids."""
    model = TarsierCaptioner(model_dir, torch.float32, torch.device("cpu"))
    # Untimed warm-up: the first calls pay for lazy imports, allocator growth and kernel choice.
    caption_one(model, items[0], 2, disable_eos, frames)
    start = time.perf_counter()
    results = [caption_one(model, item, max_new_tokens, disable_eos, frames) for item in items]
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
    parser.add_argument("--size", default="bench", choices=list(SIZES))
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--disable-eos", action="store_true", help="every item generates --max-new-tokens")
    parser.add_argument("--threads", type=int, help="torch threads (also set OMP_NUM_THREADS)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    items = discover(args.inputs).items
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or make_tiny_model(Path(scratch) / "model", args.size, seed=0)
        figures = run_baseline(model_dir, items, args.max_new_tokens, args.disable_eos, args.frames)
    figures.pop("generated_ids")
    model = str(args.model) if args.model else f"random-weight Tarsier v1, size {args.size}"
    print(json.dumps({"benchmark": "bench/official_baseline.py", "model": model, **figures}, indent=2))


if __name__ == "__main__":
    main()
