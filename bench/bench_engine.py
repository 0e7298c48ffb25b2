"""Engine benchmarks B1-B5, each comparing its sides in one process and run.

    python bench/bench_engine.py b1 [--repeats 3]      # throughput vs the official one-at-a-time way
    python bench/bench_engine.py b2 [--repeats 3]      # continuous vs closed batches, mixed lengths
    python bench/bench_engine.py b3                    # long videos: peak RSS per frame, chunked vs not
    python bench/bench_engine.py b3-wide               # 64 frames, ~38k prompt positions, chunk 2048 vs 0
    python bench/bench_engine.py b4                    # decode step cost at 1k vs 8k context
    python bench/bench_engine.py b5 [--repeats 3]      # pipeline overlap: end to end vs its parts

Every figure comes from a random-weight Tarsier v1 checkpoint built here (`bench`: a ~100M
parameter Llama with 112 px frames, 73 vectors per frame; `small` and `wide`: the real 336 px
geometry, 601 vectors per frame), on ../shared/media and sample_data, with one torch thread per
side (the stable setting on these shared 2-core machines) and EOS disabled, so that every run
does the same work. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_MEDIA = REPO.parent / "shared" / "media"
sys.path.insert(0, str(REPO / "bench"))

from measured_on import measured_on  # noqa: E402

from tarsier_batch import Captioner, CaptionSettings, MediaItem, SamplingParams, discover  # noqa: E402
from tarsier_batch.engine import Engine, EngineConfig  # noqa: E402
from tarsier_batch.families.base import CaptionModel, ProcessedPrompt  # noqa: E402
from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402
from tarsier_batch.media import load_media  # noqa: E402

NEW_TOKENS = 128


def bench_items(count: int = 16) -> list[MediaItem]:
    """../shared/media and sample_data, repeated from the start until there are `count` items."""
    found = discover([str(SHARED_MEDIA), str(REPO / "sample_data")]).items
    return [found[index % len(found)] for index in range(count)]


def checkpoint(workdir: Path, size: str) -> Path:
    return make_tiny_model(workdir / size, size, seed=0)


def measured_settings(model_dir: Path, **fields) -> CaptionSettings:
    """A Captioner's settings for a timed comparison: on the CPU in float32, and without the prefix cache, which
    keeps a run's computed prompt pages for the next: a Captioner timed again over the same items would take
    its prompts from the cache (B1's items with 4 new tokens: 6.4 s warm against 53.6 s cold), which neither
    one-at-a-time `generate` nor a user's distinct files get."""
    return CaptionSettings(model=str(model_dir), device="cpu", dtype="float32", prefix_cache=False, **fields)


def without_eos(captioner: Captioner) -> Captioner:
    """Every item generates exactly --max-new-tokens: equal work on both sides of a comparison."""
    captioner.model.eos_token_ids = frozenset()
    return captioner


def processed(model: CaptionModel, items: list[MediaItem], frames: int = 8) -> list[ProcessedPrompt]:
    prompts = []
    for item in items:
        media = load_media(item.path, item.media_type, frames, frame_transform=model.processor.frame_pixels)
        prompts.append(model.processor.process(media, None))
    return prompts


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median seconds of each side, the sides alternating so machine noise hits them alike."""
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            runs[name].append(run())
    return {name: round(statistics.median(values), 3) for name, values in runs.items()}


def run_engine(model: CaptionModel, prompts: list[ProcessedPrompt], config: EngineConfig,
               max_new: list[int], closed_batches: bool = False) -> int:
    """Generate for every prompt; returns tokens generated.

    `closed_batches` feeds the engine `max_rows` prompts at a time and waits until all of them
    finish before the next group: rows leave but none join, as an engine without continuous batching does.
    """
    engine = Engine(model, config, SamplingParams(max_new_tokens=max(max_new)))
    group = config.max_rows if closed_batches else len(prompts)
    rows = []
    for first in range(0, len(prompts), group):
        rows += [engine.add(prompt, max_new_tokens=limit)
                 for prompt, limit in zip(prompts[first:first + group], max_new[first:first + group])]
        while engine.has_work:
            engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return sum(len(row.output_ids) for row in rows)


def b1(args: argparse.Namespace, workdir: Path) -> dict:
    """Items/s of the default Captioner vs one item per `generate()` call, same weights and media."""
    from official_baseline import run_baseline

    model_dir = checkpoint(workdir, "bench")
    items = bench_items()
    captioner = without_eos(Captioner(measured_settings(model_dir, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))))

    def ours() -> float:
        results = []
        seconds = timed(lambda: results.extend(captioner.caption(items)))
        assert all(r.ok and r.generated_tokens == NEW_TOKENS for r in results), [r.error for r in results]
        return seconds

    official_stages: dict[str, float] = {}

    def official() -> float:
        figures = run_baseline(model_dir, items, NEW_TOKENS, disable_eos=True)
        official_stages.update(figures["stage_seconds"])
        return figures["seconds"]

    # The same prompts prefilled by our engine, one token each: the part of the work that batching
    # cannot share out (every prompt position is computed once on both sides).
    prompts = processed(captioner.model, items)
    prefill_only = lambda: timed(lambda: run_engine(captioner.model, prompts, captioner.engine_config,  # noqa: E731
                                                    [1] * len(prompts)))
    medians = interleaved({"tarsier_caption": ours, "official_one_at_a_time": official,
                           "ours_prefill_only": prefill_only}, args.repeats)
    return {"benchmark": "B1 throughput vs the official way", "items": len(items), "new_tokens": NEW_TOKENS,
            "batch_size": captioner.batch_size, "prompt_tokens": [prompt.length for prompt in prompts],
            "seconds": medians, "official_stage_seconds_last_run": official_stages,
            "items_per_s": {name: round(len(items) / s, 3) for name, s in medians.items()
                            if name != "ours_prefill_only"},
            "speedup": round(medians["official_one_at_a_time"] / medians["tarsier_caption"], 2), "target": 4.0,
            "speedup_after_prefill": round((medians["official_one_at_a_time"] - official_stages["prefill"]) /
                                           (medians["tarsier_caption"] - medians["ours_prefill_only"]), 2)}


def b2(args: argparse.Namespace, workdir: Path) -> dict:
    """Continuous batching vs closed batches of the same size, per-item limits drawn from 16-256."""
    model_dir = checkpoint(workdir, "bench")
    captioner = without_eos(Captioner(measured_settings(model_dir)))
    items = bench_items(32)
    prompts = processed(captioner.model, items)
    draw = random.Random(0)
    max_new = [draw.randint(16, 256) for _ in prompts]
    config = replace(captioner.engine_config, max_rows=args.batch_size)
    tokens = sum(max_new)
    medians = interleaved({
        "continuous": lambda: timed(lambda: run_engine(captioner.model, prompts, config, max_new)),
        "closed_batches": lambda: timed(lambda: run_engine(captioner.model, prompts, config, max_new, True)),
        # Identical on both sides (each prompt is prefilled once); on a GPU it is a far smaller share.
        "prefill_only": lambda: timed(lambda: run_engine(captioner.model, prompts, config, [1] * len(prompts))),
    }, args.repeats)
    prefill = medians["prefill_only"]
    return {"benchmark": "B2 continuous vs closed batches", "items": len(prompts), "batch_size": args.batch_size,
            "max_new_tokens": max_new, "tokens": tokens, "prompt_tokens": sum(prompt.length for prompt in prompts),
            "seconds": medians,
            "tokens_per_s": {name: round(tokens / s, 1) for name, s in medians.items() if name != "prefill_only"},
            "speedup": round(medians["closed_batches"] / medians["continuous"], 2), "target": 1.3,
            "decode_phase_speedup": round((medians["closed_batches"] - prefill) / (medians["continuous"] - prefill), 2)}


def peak_rss_run(model_dir: Path, frames: int, copies: int, prefill_chunk: int, batch_size: int) -> dict:
    """Caption `copies` of demo_test.mp4 in a fresh process; its peak RSS and RSS after loading."""
    script = f"""
import json, resource, torch
torch.set_num_threads(1)
from tarsier_batch import Captioner, CaptionSettings, MediaItem, SamplingParams
from tarsier_batch.media import MediaType
captioner = Captioner(CaptionSettings(model={str(model_dir)!r}, device="cpu", dtype="float32", frames={frames},
                                      batch_size={batch_size}, prefill_chunk={prefill_chunk},
                                      sampling=SamplingParams(max_new_tokens=8)))
captioner.model.eos_token_ids = frozenset()
def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
loaded = rss_mb("VmRSS:")
items = [MediaItem({str(SHARED_MEDIA / 'demo_test.mp4')!r}, MediaType.VIDEO)] * {copies}
results = list(captioner.caption(items))
assert all(r.ok for r in results), [r.error for r in results]
print(json.dumps({{"loaded_mb": loaded, "peak_mb": rss_mb("VmHWM:"), "prompt_tokens": results[0].prompt_tokens,
                  "ids": [r.generated_ids for r in results]}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    output = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env)
    return json.loads(output.stdout.strip().splitlines()[-1])


def b3(args: argparse.Namespace, workdir: Path) -> dict:
    """Peak RSS as frames grow (real geometry), chunked (2048) and unchunked, four copies at batch 4."""
    model_dir = checkpoint(workdir, "small")
    frame_counts = [8, 16, 32, 64]
    runs = {chunk: {frames: peak_rss_run(model_dir, frames, 4, chunk, 4) for frames in frame_counts}
            for chunk in (2048, 0)}
    same = all(runs[2048][frames]["ids"] == runs[0][frames]["ids"] for frames in frame_counts)
    geometry = Captioner(CaptionSettings(model=str(model_dir), device="cpu", dtype="float32")).model
    kv_per_frame = geometry.kv_geometry.bytes_per_token(torch.float32) * geometry.config.tokens_per_frame
    pixels_per_frame = 3 * 336 * 336 * 4
    must_occupy_mb = (kv_per_frame + pixels_per_frame) / 2**20
    report = {}
    for chunk, by_frames in runs.items():
        peaks = [by_frames[frames]["peak_mb"] for frames in frame_counts]
        slope = _slope(frame_counts, peaks) / 4  # four items each gained the frame
        report[f"chunk_{chunk}"] = {"peak_rss_mb": dict(zip(map(str, frame_counts), [round(p) for p in peaks])),
                                    "peak_mb_per_added_frame_per_item": round(slope, 2),
                                    "ratio_to_what_a_frame_must_occupy": round(slope / must_occupy_mb, 2)}
    return {"benchmark": "B3 long videos", "model": "small (336 px, 601 vectors per frame)",
            "prompt_tokens": {str(f): runs[0][f]["prompt_tokens"] for f in frame_counts},
            "frame_must_occupy_mb": round(must_occupy_mb, 2), **report, "target_ratio": 3.0,
            "chunked_equals_unchunked": same}


def b3_wide(args: argparse.Namespace, workdir: Path) -> dict:
    """64 frames on the ~100M LM at 336 px: peak RSS above the loaded model, chunk 2048 vs unchunked."""
    model_dir = checkpoint(workdir, "wide")
    runs = {chunk: peak_rss_run(model_dir, 64, 1, chunk, 1) for chunk in (2048, 0)}
    above = {chunk: run["peak_mb"] - run["loaded_mb"] for chunk, run in runs.items()}
    return {"benchmark": "B3 wide: 64 frames", "prompt_tokens": runs[0]["prompt_tokens"],
            "peak_above_loaded_mb": {f"chunk_{chunk}": round(mb) for chunk, mb in above.items()},
            "chunked_share_of_unchunked": round(above[2048] / above[0], 3), "target": 0.5,
            "chunked_equals_unchunked": runs[2048]["ids"] == runs[0]["ids"]}


def b4(args: argparse.Namespace, workdir: Path) -> dict:
    """Milliseconds per decode step, batch 8, at 1k and 8k context: transformers' DynamicCache vs ours."""
    from transformers import DynamicCache


    model_dir = checkpoint(workdir, "bench")
    captioner = Captioner(CaptionSettings(model=str(model_dir), device="cpu", dtype="float32", batch_size=8,
                                          kv_cache_gb=6))
    model = captioner.model
    language_model = model.model.language_model
    geometry = model.kv_geometry
    rows, steps = 8, 16
    report: dict[str, dict[str, float]] = {}
    for context in (1024, 8192):
        # transformers' cache, as a plain generate() keeps it: every step concatenates.
        def dynamic_cache_steps() -> float:
            cache = DynamicCache(config=language_model.config)
            shape = (rows, geometry.kv_heads, context, geometry.head_dim)
            for layer in range(geometry.num_layers):
                cache.update(torch.randn(shape), torch.randn(shape), layer)
            mask = torch.ones(rows, context, dtype=torch.long)
            start = time.perf_counter()
            with torch.inference_mode():
                for step in range(steps):
                    mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                    language_model(input_ids=torch.zeros(rows, 1, dtype=torch.long), attention_mask=mask,
                                   position_ids=torch.full((rows, 1), context + step), past_key_values=cache,
                                   use_cache=True, logits_to_keep=1)
            return (time.perf_counter() - start) / steps * 1000

        def engine_steps() -> float:
            engine = captioner.engine
            engine.scheduler.clear()
            prompt = _text_prompt(context)
            sequences = [engine.add(prompt, max_new_tokens=steps + 2) for _ in range(rows)]
            for seq in sequences:  # fill the cache as if prefilled, then time decode steps only
                engine.scheduler.waiting.remove(seq)
                assert engine.scheduler._admit(seq, force=True)
                seq.num_computed_tokens, seq.output_ids = context, [0]
            start = time.perf_counter()
            for _ in range(steps):
                step = engine.scheduler.schedule()
                assert [row.num_tokens for row in step] == [1] * rows
                engine.runner.run(step)
                for row in step:
                    row.seq.num_computed_tokens += 1
                    row.seq.output_ids.append(0)
            elapsed = (time.perf_counter() - start) / steps * 1000
            engine.scheduler.clear()
            return elapsed

        report[str(context)] = interleaved({"dynamic_cache_ms": dynamic_cache_steps, "engine_ms": engine_steps},
                                           args.repeats)
    return {"benchmark": "B4 decode step cost", "rows": rows, "steps_timed": steps, "ms_per_step": report,
            "dynamic_cache_8k_over_1k": round(report["8192"]["dynamic_cache_ms"] / report["1024"]["dynamic_cache_ms"],
                                              2),
            "engine_8k_over_1k": round(report["8192"]["engine_ms"] / report["1024"]["engine_ms"], 2)}


def _text_prompt(length: int) -> ProcessedPrompt:
    return ProcessedPrompt(instruction="", token_ids=torch.zeros(length, dtype=torch.long),
                           positions=torch.arange(length)[None], next_position=length, vision_blocks=[],
                           pixel_values=torch.zeros(0))


def b5(args: argparse.Namespace, workdir: Path) -> dict:
    """End-to-end items/s vs media decoding alone and the model alone, measured in the same run."""
    model_dir = checkpoint(workdir, "bench")
    captioner = without_eos(Captioner(measured_settings(model_dir, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))))
    items = bench_items()
    prompts = processed(captioner.model, items)
    config = captioner.engine_config

    def media_only() -> float:
        with ThreadPoolExecutor(captioner.settings.workers) as pool:
            return timed(lambda: list(pool.map(lambda item: processed(captioner.model, [item]), items)))

    medians = interleaved({
        "end_to_end": lambda: timed(lambda: list(captioner.caption(items))),
        "media_only": media_only,
        "model_only": lambda: timed(lambda: run_engine(captioner.model, prompts, config, [NEW_TOKENS] * len(prompts))),
    }, args.repeats)
    rates = {name: round(len(items) / s, 3) for name, s in medians.items()}
    bound = min(rates["media_only"], rates["model_only"])
    return {"benchmark": "B5 pipeline overlap", "items": len(items), "items_per_s": rates,
            "end_to_end_share_of_slower_part": round(rates["end_to_end"] / bound, 3), "target": 0.85}


def _slope(xs: list[int], ys: list[float]) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


BENCHMARKS = {"b1": b1, "b2": b2, "b3": b3, "b3-wide": b3_wide, "b4": b4, "b5": b5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="B2: rows at once on both sides")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        result = BENCHMARKS[args.benchmark](args, Path(scratch))
    print(json.dumps({**measured_on(), **result, "torch_threads": torch.get_num_threads(), "repeats": args.repeats},
                     indent=2))


if __name__ == "__main__":
    main()
