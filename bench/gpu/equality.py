"""Float32 equality on a device: every way the engine batches rows gives each row its tokens alone.

The tiny checkpoints of both families (built here, in the official layout) caption real media from
sample_data on `device` in float32. Each scenario runs its rows through one engine (all at once, in
prefill chunks, joining and leaving, preempted, offloaded, forked from a shared prefix, sampled, compiled)
and compares every row with the same prompt in an engine of its own (one row, unchunked).

On the CPU the comparison is the test suite's: the ids must be equal. On CUDA, kernels are chosen by
shape (a batch of 1 and a batch of 7 may reduce in another order), so float32 logits can differ in their
last bits and a near tie can then tip the other way. There a scenario passes when

- every logit the two runs computed for the same row, position and earlier ids differs by at most
  `RELATIVE_GAP` of the largest logit there (a real bug, such as a wrong mask, position or page, moves
  logits by far more), and
- where the ids part (greedy), the two candidates were that close: the reference's margin between
  them, after the repetition penalty, is within twice the gap at that position.

Each scenario reports whether its ids are exact, the largest relative logit gap, and where rows diverge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tarsier_batch.engine import Engine, EngineConfig, SamplingParams
from tarsier_batch.engine.sampling import _penalise_repeats
from tarsier_batch.families.base import CaptionModel, ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import media_type_of

REPO = Path(__file__).resolve().parents[2]
# Real media of different kinds and lengths (an image, a GIF, videos in three containers), in the repository.
MEDIA = ["still.png", "ball.gif", "ball_h264.mp4", "demo_yellow_circle_grows.mp4", "portrait.JPG", "ball_short.mkv"]
MAX_NEW = 20
RELATIVE_GAP = 1e-3
SECOND_QUESTION = "What colours are in it?"


@dataclass
class Generated:
    """One engine run: each row's ids and, per generated index, the logits it was chosen from and the ids a
    repetition penalty looked at then."""

    ids: list[list[int]]
    logits: list[dict[int, tuple[torch.Tensor, list[int]]]] = field(default_factory=list)


def generate(model: CaptionModel, prompts: list[ProcessedPrompt], sampling: SamplingParams, config: EngineConfig,
             max_new: list[int] | None = None, seeds: list[int] | None = None,
             forked_from: list[int | None] | None = None) -> Generated:
    """Every prompt through one engine; `forked_from[i]`: the earlier row whose prefix row i shares."""
    engine = Engine(model, config, sampling)
    captured: list[dict[int, tuple[torch.Tensor, list[int]]]] = [{} for _ in prompts]
    run = engine.runner.run

    def recording(step):
        output = run(step)
        if output.logits is not None:   # copied now: a CUDA graph's output is overwritten by its next replay
            for seq, row in zip(output.sampled, output.logits.float().cpu()):
                captured[seq.payload][len(seq.output_ids)] = (row, seq.seen_ids())
        return output

    engine.runner.run = recording
    rows = []
    for index, prompt in enumerate(prompts):
        source = forked_from[index] if forked_from else None
        rows.append(engine.add(prompt, payload=index, max_new_tokens=max_new[index] if max_new else None,
                               seed=seeds[index] if seeds else None,
                               prefix_source=rows[source] if source is not None else None))
    while engine.has_work:
        engine.step()
    errors = [row.error for row in rows if row.error is not None]
    if errors:
        raise RuntimeError(f"rows failed: {errors}")
    return Generated([row.output_ids for row in rows], captured)


def alone(model: CaptionModel, prompts: list[ProcessedPrompt], sampling: SamplingParams,
          max_new: list[int] | None = None, seeds: list[int] | None = None) -> Generated:
    """The reference: each prompt in an engine of its own, one row, unchunked, eager (no CUDA graphs), decoding
    rows attending with the split attention of torch ops (so a fault of the fused kernel shows as a difference)."""
    config = EngineConfig(max_rows=1, prefill_chunk=0, max_batch_tokens=8192, cuda_graphs=False,
                          fused_attention=False)
    runs = [generate(model, [prompt], sampling, config,
                     [max_new[index]] if max_new else None, [seeds[index]] if seeds else None)
            for index, prompt in enumerate(prompts)]
    return Generated([run.ids[0] for run in runs], [run.logits[0] for run in runs])


def compare(reference: Generated, candidate: Generated, sampling: SamplingParams, exact_only: bool) -> dict:
    """The verdict on one scenario (see the module's docstring)."""
    worst_gap, divergences, unexplained = 0.0, [], []
    penalty = sampling.repetition_penalty
    for row, (want, got) in enumerate(zip(reference.ids, candidate.ids)):
        first = next((index for index, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if first is None and len(want) != len(got):
            first = min(len(want), len(got))
        last = first if first is not None else len(want) - 1
        gap_at = {}
        for index in range(last + 1):
            if index in reference.logits[row] and index in candidate.logits[row]:
                ref, seen = reference.logits[row][index]
                cand, _ = candidate.logits[row][index]
                gap_at[index] = float((ref - cand).abs().max() / ref.abs().max().clamp(min=1e-6))
        worst_gap = max([worst_gap, *gap_at.values()])
        if first is None:
            continue
        divergences.append({"row": row, "position": first, "of": len(want)})
        if exact_only or first not in gap_at:
            unexplained.append(row)
            continue
        if sampling.greedy and first < min(len(want), len(got)):
            ref, seen = reference.logits[row][first]
            if penalty not in (None, 1):
                ref = _penalise_repeats(ref[None], ([0] * len(seen), seen), penalty)[0]
            margin = float((ref[want[first]] - ref[got[first]]) / ref.abs().max())
            if margin > 2 * gap_at[first] + 1e-7:
                unexplained.append(row)
    passed = not unexplained and (exact_only or worst_gap <= RELATIVE_GAP)
    return {"passed": passed, "exact": not divergences, "largest_relative_logit_gap": worst_gap,
            "divergences": divergences, "unexplained_rows": unexplained}


def media_prompts(model: CaptionModel, instruction: str | None = None) -> list[ProcessedPrompt]:
    prompts = []
    for name in MEDIA:
        path = REPO / "sample_data" / name
        media = model.processor.load_media(str(path), media_type_of(path), 8)
        prompts.append(model.processor.process(media, instruction))
    return prompts


def scenarios(prompts: list[ProcessedPrompt], compiled: bool) -> dict[str, dict]:
    """name -> the engine config and what differs from the plain greedy run of every prompt: the eager
    scenarios, or those of `--compile`."""
    longest = max(prompt.length for prompt in prompts)
    limits = [3, 20, 7, 16, 1, 12][:len(prompts)]
    seeds = [11 + index for index in range(len(prompts))]
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)
    if compiled:
        config = EngineConfig(max_rows=4, prefill_chunk=32, max_batch_tokens=40, compile=True)
        return {"compiled_joining_and_leaving": {"config": config, "max_new": limits},
                "compiled_sampled": {"config": config, "sampling": sampled, "max_new": limits, "seeds": seeds}}
    return {
        "batched": {"config": EngineConfig(max_rows=len(prompts), prefill_chunk=0, max_batch_tokens=16384)},
        "chunked_5": {"config": EngineConfig(max_rows=3, prefill_chunk=5, max_batch_tokens=8)},
        "chunked_64": {"config": EngineConfig(max_rows=3, prefill_chunk=64, max_batch_tokens=70)},
        "joining_and_leaving": {"config": EngineConfig(max_rows=3, prefill_chunk=32, max_batch_tokens=40),
                                "max_new": limits},
        "preempted": {"config": EngineConfig(max_rows=len(prompts), prefill_chunk=64, max_batch_tokens=256,
                                             kv_cache_tokens=2 * (longest + MAX_NEW) + 40, kv_page_slots=8)},
        "offloaded_prefill": {"config": EngineConfig(max_rows=3, prefill_chunk=32, max_batch_tokens=40,
                                                     offload_kv=True)},
        "sampled_joining_and_leaving": {"config": EngineConfig(max_rows=3, prefill_chunk=16, max_batch_tokens=24),
                                        "sampling": sampled, "max_new": limits, "seeds": seeds},
        "forked_questions": {"config": EngineConfig(max_rows=4, prefill_chunk=48, max_batch_tokens=64),
                             "forks": True},
    }


def family_equality(family: str, workdir: Path, device: torch.device, compiled: bool, cuda_graphs: bool,
                    fused_attention: bool) -> dict:
    """Every scenario on the tiny checkpoint of `family`. The references first: compiling works in place, so a
    reference computed after a compiled scenario would run compiled layers."""
    model_dir = make_tiny_model(workdir / f"tiny-{family}", "tiny", seed=0, family=family)
    model = load_caption_model(model_dir, torch.float32, device)
    prompts = media_prompts(model)
    questions = media_prompts(model, SECOND_QUESTION)
    exact_only = device.type == "cpu"
    planned = []
    references: dict[tuple, Generated] = {}
    for name, spec in scenarios(prompts, compiled).items():
        sampling = replace(spec.get("sampling", SamplingParams(max_new_tokens=MAX_NEW)),
                           repetition_penalty=model.repetition_penalty)
        rows, forks = (prompts + questions, [None] * len(prompts) + list(range(len(prompts)))) \
            if spec.get("forks") else (prompts, None)
        max_new, seeds = spec.get("max_new"), spec.get("seeds")
        key = (sampling.greedy, tuple(max_new or ()), tuple(seeds or ()), len(rows))
        if key not in references:
            references[key] = alone(model, rows, sampling, max_new, seeds)
        config = replace(spec["config"], cuda_graphs=cuda_graphs, fused_attention=fused_attention)
        planned.append((name, config, sampling, rows, forks, max_new, seeds, references[key]))
    results = {}
    for name, config, sampling, rows, forks, max_new, seeds, reference in planned:
        started = time.perf_counter()
        got = generate(model, rows, sampling, config, max_new, seeds, forks)
        results[name] = {**compare(reference, got, sampling, exact_only), "rows": len(rows),
                         "distinct_reference_outputs": len({tuple(ids) for ids in reference.ids}),
                         "seconds": round(time.perf_counter() - started, 2)}
    return {"checkpoint": f"tiny {family}", "dtype": "float32", "device": str(device),
            "comparison": "ids equal" if exact_only else
            f"logits within {RELATIVE_GAP:g} relative; ids may part only at a tie that close",
            "scenarios": results, "passed": all(result["passed"] for result in results.values())}


def run_equality(workdir: Path, device: torch.device, compiled: bool, cuda_graphs: bool = True,
                 fused_attention: bool = True) -> dict:
    """Both families; float32 with TF32 off everywhere (cuDNN's convolutions use TF32 by default); the scenarios'
    decode steps as CUDA graphs and with the fused decode attention on CUDA unless not `cuda_graphs` or
    `fused_attention` (the references never)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    families = {family: family_equality(family, workdir, device, compiled, cuda_graphs, fused_attention)
                for family in ("tarsier", "tarsier2")}
    gaps = [scenario["largest_relative_logit_gap"] for result in families.values()
            for scenario in result["scenarios"].values()]
    return {"families": families, "passed": all(result["passed"] for result in families.values()),
            "largest_relative_logit_gap": max(gaps),
            "exact_scenarios": sum(scenario["exact"] for result in families.values()
                                   for scenario in result["scenarios"].values()),
            "scenarios": len(gaps)}
