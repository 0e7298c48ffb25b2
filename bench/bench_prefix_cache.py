"""The prefix cache: the engine with it and without it, side by side, on two workloads where prompts repeat.

    python bench/bench_prefix_cache.py [--size bench] [--clips 8] [--frames 16] [--new-tokens 32] [--repeats 2]

- `twice`: every clip captioned twice, the second time decoded afresh (the same file under a second path),
  the second round queued after the first; a cache hit takes all but the last page of the prompt.
- `preempting`: every clip once, 128 new tokens, at batch 8 in a KV cache of 85 % of the prompts' pages:
  the rows that fit are admitted with room for their first tokens only, and growing rows preempt the latest
  admitted; a preempted row coming back takes its prompt's pages back (those not handed out meanwhile).

A random-weight Tarsier2 checkpoint (`bench`: frames of at most 50,176 px, a ~100M-parameter language model;
`wide`: the official 460,800 px, an 8-layer 1024-wide one), clips from ../shared/media and sample_data, EOS
off, float32, the torch threads this machine gives. Prompts are prepared before timing, once for both sides.
Both sides must give the same tokens. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from bench_engine import interleaved, timed, without_eos  # noqa: E402
from bench_tarsier2 import videos  # noqa: E402
from measured_on import measured_on  # noqa: E402

from tarsier_batch import Captioner, CaptionSettings, SamplingParams  # noqa: E402
from tarsier_batch.engine import Engine, EngineConfig, Sequence  # noqa: E402
from tarsier_batch.families.base import ProcessedPrompt  # noqa: E402
from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402

PREEMPTING_ROWS = 8
PREEMPTING_NEW_TOKENS = 128


def prepared(captioner: Captioner, clips: int, frames: int) -> list[ProcessedPrompt]:
    processor = captioner.model.processor
    return [processor.process(processor.load_media(item.path, item.media_type, frames), None)
            for item in videos(clips)]


def run(captioner: Captioner, config: EngineConfig, prompts: list[ProcessedPrompt], new_tokens: int
        ) -> tuple[Engine, list[Sequence]]:
    engine = Engine(captioner.model, config, captioner.engine.sampling)
    rows = [engine.add(prompt, max_new_tokens=new_tokens) for prompt in prompts]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return engine, rows


def workload(captioner: Captioner, config: EngineConfig, prompts: list[ProcessedPrompt], new_tokens: int,
             repeats: int) -> dict:
    """Both sides, interleaved; the last run of each is the one reported."""
    last: dict[str, tuple[Engine, list[Sequence]]] = {}

    def side(name: str, cached: bool):
        return lambda: timed(lambda: last.__setitem__(name, run(captioner, replace(config, prefix_cache=cached),
                                                                prompts, new_tokens)))

    seconds = interleaved({"cache": side("cache", True), "no_cache": side("no_cache", False)}, repeats)
    outputs = {name: [row.output_ids for row in rows] for name, (_, rows) in last.items()}
    assert outputs["cache"] == outputs["no_cache"], "the prefix cache changed a caption"
    counts = last["cache"][0].prefix_counts
    return {"rows": len(prompts), "new_tokens": new_tokens, "batch_size": config.max_rows,
            "kv_cache_tokens": config.kv_cache_tokens,
            "prompt_positions": counts.prompt_positions, "reused_positions": counts.reused_positions,
            "hit_rate": round(counts.hit_rate, 3), "rows_hit": counts.rows_hit,
            "preemptions": {name: sum(row.preemptions for row in rows) for name, (_, rows) in last.items()},
            "seconds": seconds, "speedup": round(seconds["no_cache"] / seconds["cache"], 2), "tokens_equal": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench", choices=["bench", "wide"])
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = make_tiny_model(Path(workdir) / args.size, args.size, seed=0, family="tarsier2")
        captioner = without_eos(Captioner(CaptionSettings(
            model=str(model_dir), device="cpu", dtype="float32", frames=args.frames,
            sampling=SamplingParams(max_new_tokens=args.new_tokens))))
        first, again = prepared(captioner, args.clips, args.frames), prepared(captioner, args.clips, args.frames)
        twice = workload(captioner, captioner.engine_config, first + again, args.new_tokens, args.repeats)
        # Room for most of the prompts, not their growth: rows admitted with room for their first tokens grow by
        # PREEMPTING_NEW_TOKENS each, and growing rows preempt the latest admitted.
        page = captioner.engine_config.kv_page_slots
        held = sum(-(-prompt.length // page) * page for prompt in first[:PREEMPTING_ROWS])
        tight = replace(captioner.engine_config, max_rows=PREEMPTING_ROWS, kv_cache_tokens=held * 85 // 100)
        preempting = workload(captioner, tight, first, PREEMPTING_NEW_TOKENS, args.repeats)
    print(json.dumps({
        **measured_on(), "benchmark": "prefix cache: on against off, same engine, same run",
        "checkpoint": f"tarsier2 {args.size}", "frames": args.frames, "new_tokens": args.new_tokens,
        "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
        "twice": twice, "preempting": preempting}))


if __name__ == "__main__":
    main()
