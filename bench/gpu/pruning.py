"""Temporal pruning on the real-size checkpoint: the same clips with and without half their vision tokens.

The pruned prompts are made as the command's decoding workers make them with `--prune-vision 0.5` (the
default method, temporal: the vision vectors that changed least since the previous frame are left out before the
language model), from clips of the `engine` stage's kind (bench/gpu/workload.py). Both passes run in one engine,
one after the other, the prefix cache off (the clips' pages may be cached from an earlier stage), EOS off: the same
number of tokens each.
The prefill MFU counts the work done: the vision tower over whole frames, the language model over what is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import workload
from real_size import engine_pass, prefill_flops, prefill_pass, prefix_cache_off

from tarsier_batch.families.temporal import drop_static_vision

if TYPE_CHECKING:
    from run_state import Bench

RATIO = 0.5


def run_pruning(bench: Bench) -> None:
    profile = bench.profile
    captioner = bench.loaded()
    engine = captioner.engine
    processor = captioner.model.processor
    whole = workload.prompts(processor, profile.pruning_clips, profile.pruning_frames, profile.width, profile.height)
    pruned = [drop_static_vision(prompt, processor.vision_changes(prompt), RATIO) for prompt in whole]
    info = bench.stage("pruning")
    info["ratio"] = RATIO
    info["positions"] = {"whole": sum(prompt.length for prompt in whole),
                         "pruned": sum(prompt.length for prompt in pruned)}
    with prefix_cache_off(engine):
        engine_pass(engine, pruned[:2], 2)   # a warm-up: a fresh engine records its CUDA graphs here
        runs = {name: engine_pass(engine, prompts, profile.new_tokens)
                for name, prompts in (("whole", whole), ("pruned", pruned))}
    for name, run in runs.items():
        run.pop("ids")
        info[name] = run
    info["speedup"] = round(runs["pruned"]["items_per_s"] / runs["whole"]["items_per_s"], 4)
    count = profile.prefill_clips
    prefill = prefill_pass(engine, pruned[:count])
    flops = prefill_flops(captioner.model, pruned[:count], encoded=whole[:count])
    flop_per_s = flops / prefill["seconds"]
    peak, source = bench.bf16_peak()
    info["prefill_only"] = {**prefill, "flop": flops, "flop_per_s": flop_per_s, "mfu": round(flop_per_s / peak, 4),
                            "mfu_against": source}
