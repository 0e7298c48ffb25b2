"""What one decode step costs a GPU: kernel-launching ops per step, and CPU ms per step, by rows.

    python bench/bench_step.py [--families tarsier tarsier2] [--rows 1 8 32] [--context 256] [--steps 5]

On a GPU an eager step costs about what the host spends launching its kernels, so the figure that
matters there is how many kernel-launching aten ops a step runs and whether that grows with the
rows. This runs the engine's decode step on the `deep` random checkpoints (a ~100M-parameter
language model at the real depth: Tarsier v1 32 layers, Tarsier2 28 layers with grouped-query
attention), every row a text prompt of --context positions (decode does not care where the
positions came from), EOS off, one torch thread, float32 on the CPU:

- `ops`: aten operations per decode step that would launch a kernel on a GPU
  (`tarsier_batch.engine.profiling.kernel_ops`: not views, not allocations or metadata, not ops
  that only compose others); the median step of --steps profiled steps.
- `aten`: every aten event of the step less the views (composite ops and the ops they call both
  count): an upper bound on launches.
- `all_aten`: every aten event of the step, views included (for reference).
- `ms`: median wall time of a decode step without the profiler.
- `first_decode_step_s`: the first decode step at these sizes (with --compile, mostly compiling;
  the prefill before it compiled the layers already).
- `greedy` uses the checkpoint's settings; `sampled` adds temperature 1, top-p 0.9 and a
  repetition penalty of 1.1 (the penalty and the sampler were per-row work before).

`--mixed` measures instead what prefill chunks add to a step of 8 decoding rows (greedy): the
same ops and ms for steps that also hold 1, 2 or 4 chunks of --context positions, each a new
row's first chunk (attending to its own keys) or a later one (attending to its context in the
cache, --context positions before it), and each figure's excess over the pure decode step.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Inductor's generated CPU kernels show in the profiler only with this, set before torch is imported.
os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from measured_on import measured_on  # noqa: E402

from tarsier_batch.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tarsier_batch.engine.profiling import kernel_ops, non_view_ops  # noqa: E402
from tarsier_batch.families.base import ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model  # noqa: E402
from tarsier_batch.families.tiny import make_tiny_model  # noqa: E402

SAMPLED = dict(temperature=1.0, top_p=0.9, repetition_penalty=1.1)


def text_prompt(vocab: int, components: int, length: int, seed: int) -> ProcessedPrompt:
    """A prompt of `length` text positions (ids drawn from the lower half of the vocabulary)."""
    ids = torch.randint(10, vocab // 2, (length,), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(length).expand(components, -1).clone()
    return ProcessedPrompt("", ids, positions, length, [], torch.empty(0))


def decoding_engine(model, rows: int, context: int, steps: int, sampling: dict, compiled: bool = False,
                    room_for: int = 0) -> Engine:
    """An engine whose `rows` rows have all finished their prefill (the next steps are pure decode), with a
    cache of `room_for` more slots."""
    params = SamplingParams(max_new_tokens=steps * 4 + 16, **sampling)
    extra = {"compile": True} if compiled else {}
    engine = Engine(model, EngineConfig(max_rows=rows, max_batch_tokens=max(4096, rows * context),
                                        prefill_chunk=0, kv_cache_tokens=rows * (context + steps * 4 + 256) + room_for,
                                        **extra),
                    params)
    components = 3 if model.family.name == "tarsier2" else 1
    vocab = model.model.language_model.lm_head.out_features
    for index in range(rows):
        engine.add(text_prompt(vocab, components, context, index), **_seed_argument(engine, index, params))
    while any(seq.in_prefill for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def _seed_argument(engine: Engine, index: int, params: SamplingParams) -> dict:
    """Each row its own sampling stream, in whichever form this checkout's Engine.add takes it."""
    if params.greedy:
        return {}
    import inspect
    if "seed" in inspect.signature(engine.add).parameters:
        return {"seed": params.row_seed(f"row{index}")}
    return {"generator": params.generator_for(f"row{index}")}


def measure(model, rows: int, context: int, steps: int, sampling: dict, compiled: bool = False) -> dict:
    engine = decoding_engine(model, rows, context, steps, sampling, compiled)
    start = time.perf_counter()
    engine.step()   # a first decode step (with --compile: it compiles the decode step at these sizes)
    first_step = time.perf_counter() - start
    counts = []
    for _ in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.step()
        events = profile.events()
        counts.append((len(kernel_ops(events)), non_view_ops(events), sum(e.name.startswith("aten::") for e in events)))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    assert all(len(seq.output_ids) > 0 for seq in engine.scheduler.running) and len(engine.scheduler.running) == rows
    ops, aten, all_aten = (int(statistics.median(column)) for column in zip(*counts))
    return {"ops": ops, "aten": aten, "all_aten": all_aten, "ms": round(statistics.median(times) * 1000, 2),
            "first_decode_step_s": round(first_step, 2)}


def measure_mixed(model, rows: int, chunks: int, context: int, later: bool, steps: int) -> dict:
    """A step of `rows` decoding rows and `chunks` prefill chunks of `context` positions (a row's second chunk
    if `later`), profiled as `measure` does; a fresh engine per repeat, since the step is a one-off."""
    counts, times = [], []
    for repeat in range(steps * 2):
        engine = decoding_engine(model, rows, context, steps, {}, room_for=chunks * (2 * context + 64))
        scheduler = engine.scheduler
        scheduler.max_rows, scheduler.prefill_chunk = rows + chunks, context
        scheduler.max_batch_tokens = rows + chunks * context
        components = 3 if model.family.name == "tarsier2" else 1
        vocab = model.model.language_model.lm_head.out_features
        for index in range(chunks):
            engine.add(text_prompt(vocab, components, context * (2 if later else 1) + 1, 1000 + index))
        if later:   # their first chunks, so that the measured step holds their second
            engine.step()
        scheduled, schedule = [], scheduler.schedule
        scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
        if repeat % 2:
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                engine.step()
            counts.append(len(kernel_ops(profile.events())))
        step = scheduled[-1]
        assert sum(row.num_tokens == context for row in step) == chunks and len(step) == rows + chunks
        assert all(row.seq.num_computed_tokens == context * (2 if later else 1)
                   for row in step if row.num_tokens == context)
    return {"ops": int(statistics.median(counts)), "ms": round(statistics.median(times) * 1000, 2)}


def mixed_steps(model, context: int, steps: int, rows: int = 8) -> dict:
    """`measure_mixed` at 0, 1, 2 and 4 chunks, first and later, with each step's excess over the pure decode step."""
    decode = measure_mixed(model, rows, 0, context, False, steps)
    figures: dict = {"layers": model.kv_geometry.num_layers, f"{rows} decoding rows": decode}
    for later in (False, True):
        for chunks in (1, 2, 4):
            mixed = measure_mixed(model, rows, chunks, context, later, steps)
            extra_ops = mixed["ops"] - decode["ops"]
            figures[f"+{chunks} {'later' if later else 'first'} chunks"] = {
                **mixed, "extra_ops": extra_ops,
                "extra_ops_per_chunk_and_layer": round(extra_ops / chunks / model.kv_geometry.num_layers, 1)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["tarsier", "tarsier2"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="the engine with --compile (torch.compile)")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    parser.add_argument("--mixed", action="store_true", help="what prefill chunks add to a step of 8 decoding rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict = {"context": args.context, "threads": 1, "dtype": "float32", "compile": args.compile,
                     "families": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for family in args.families:
            model_dir = make_tiny_model(Path(workdir) / family, "deep", seed=0, family=family)
            model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
            model.eos_token_ids = frozenset()
            if args.mixed:
                results["families"][family] = mixed_steps(model, args.context, args.steps)
                continue
            by_mode = {}
            for mode in args.modes:
                sampling = SAMPLED if mode == "sampled" else {}
                by_rows = {str(rows): measure(model, rows, args.context, args.steps, sampling, args.compile)
                           for rows in args.rows}
                first, last = by_rows[str(args.rows[0])], by_rows[str(args.rows[-1])]
                by_rows[f"ops_{args.rows[-1]}_over_{args.rows[0]}"] = round(last["ops"] / first["ops"], 3)
                by_mode[mode] = by_rows
            results["families"][family] = {"layers": model.kv_geometry.num_layers, **by_mode}
    print(json.dumps({**measured_on(), **results}, indent=1))


if __name__ == "__main__":
    main()
