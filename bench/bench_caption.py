"""Captioning speed on the CPU, compared side by side in one run.

    python bench/bench_caption.py [--size small] [--repeats 3] [--max-new-tokens 64]

Builds a random-weight checkpoint (`small` has the real token layout: 601 vectors per frame,
about 4,800 prefill tokens for 8 frames) and measures, on the media in ../shared/media:

- engine: the generation loop alone on prompts embedded once, at each batch size, every row
  running to --max-new-tokens (no stop token), so only batching differs;
- pipeline: Captioner end to end (decode, preprocess, vision, generation) at each batch size;
- cli: one whole `tarsier caption ../shared/media` process, start to exit.

Settings are interleaved across repeats so machine noise hits them alike; medians are reported
with ratios against batch size 1. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from tarsier_batch import Captioner, CaptionSettings, SamplingParams, discover
from tarsier_batch.engine import generate
from tarsier_batch.media import load_media
from tarsier_batch.tiny import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
SHARED_MEDIA = REPO.parent / "shared" / "media"


def median_runs(settings: list[int], repeats: int, run: Callable[[int], dict[str, float]]) -> dict[int, dict[str, float]]:
    """Run every setting `repeats` times, interleaved, and keep the median of each figure."""
    runs: dict[int, list[dict[str, float]]] = {setting: [] for setting in settings}
    for _ in range(repeats):
        for setting in settings:
            runs[setting].append(run(setting))
    return {setting: {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}
            for setting, results in runs.items()}


def ratios(medians: dict[int, dict[str, float]], key: str) -> dict[str, float]:
    reference = next(iter(medians.values()))[key]
    return {str(setting): round(figures[key] / reference, 3) for setting, figures in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,4,8")
    args = parser.parse_args()
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    items = discover([str(SHARED_MEDIA)]).items
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        model_dir = make_tiny_model(workdir / "model", args.size, seed=0)
        base = CaptionSettings(model=str(model_dir), dtype="float32", device="cpu", sampling=sampling)
        captioners = {size: Captioner(replace(base, batch_size=size)) for size in batch_sizes}
        model = captioners[batch_sizes[0]].model
        prompts = model.embed_prompts([model.prepare(load_media(item.path, item.media_type, 8), None)
                                       for item in items])

        def engine_run(batch_size: int) -> dict[str, float]:
            start = time.perf_counter()
            tokens = 0
            for first in range(0, len(prompts), batch_size):
                generations = generate(model, prompts[first:first + batch_size], sampling, frozenset())
                tokens += sum(len(generation.token_ids) for generation in generations)
            seconds = time.perf_counter() - start
            return {"seconds": seconds, "tokens_per_s": tokens / seconds}

        def pipeline_run(batch_size: int) -> dict[str, float]:
            start = time.perf_counter()
            results = list(captioners[batch_size].caption(items))
            seconds = time.perf_counter() - start
            assert all(result.ok for result in results), [result.error for result in results]
            tokens = sum(result.generated_tokens for result in results)
            return {"seconds": seconds, "items_per_s": len(items) / seconds, "tokens_per_s": tokens / seconds}

        engine_run(batch_sizes[-1])  # warm-up: allocator, lazy imports, caches
        pipeline_run(batch_sizes[-1])
        engine = median_runs(batch_sizes, args.repeats, engine_run)
        pipeline = median_runs(batch_sizes, args.repeats, pipeline_run)
        command = [sys.executable, "-m", "tarsier_batch.cli", "caption", str(SHARED_MEDIA), "--model",
                   str(model_dir), "--out", str(workdir / "cli.parquet"), "--quiet",
                   "--max-new-tokens", str(args.max_new_tokens)]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        cli_seconds = time.perf_counter() - start

    print(json.dumps({
        "benchmark": "bench/bench_caption.py",
        "model": f"random-weight Tarsier v1, size {args.size}",
        "items": len(items), "prompt_tokens": [prompt.length for prompt in prompts],
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "engine_by_batch_size": engine, "engine_tokens_per_s_vs_batch_1": ratios(engine, "tokens_per_s"),
        "pipeline_by_batch_size": pipeline, "pipeline_items_per_s_vs_batch_1": ratios(pipeline, "items_per_s"),
        "cli_run_of_shared_media_s": round(cli_seconds, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
