"""Vision-token pruning (`--prune-vision R`, `--prune-method fastv --prune-layer K` or `--prune-method temporal`):
what it saves and what it costs.

    python bench/bench_pruning.py speed [--families tarsier tarsier2] [--frames 8] [--repeats 2]
        [--methods fastv temporal]
    python bench/bench_pruning.py quality [--n 100] [--seed 1] [--methods fastv temporal]
    python bench/bench_pruning.py selectivity [--n 40] [--seed 1]

`speed`: random-weight checkpoints with a ~100M-parameter language model at the real depth
(Tarsier v1: 32 layers; Tarsier2: 28) and the real per-frame geometry (`deep`), on
../shared/media/demo_test.mp4. For R in {0, .25, .5, .75} x (fastv at K in {2, 8}, temporal), side by side
in one run:
the language model's analytic prefill FLOPs, the measured prefill time of one item (median of
--repeats, the settings interleaved), the KV bytes a row holds at its first token, how many such
rows the same KV memory admits, and, in a fresh process per setting, the peak memory of one item
(prefill and first token) above the loaded model and the items/s of 4 items generating 16 tokens
each (EOS off). Two torch threads.

`quality`: the trained demo model (3 layers, so fastv's K in {1, 2}; and temporal) captions --n held-out clips forwards
and backwards (2n clips) through `tarsier caption` per setting: exact-caption accuracy, and against
the unpruned captions the share of identical captions, token F1 and ROUGE-L.

`selectivity`: why quality drops on the demo model. Its frames are 6 x 6 patches (a newline vector
after each row, a separator after the frame): for --n held-out clips, the share of the patches
showing the shape that survive against the share of background patches and of newline/separator
vectors, at R = 0.5 and each K (a score that finds the shape keeps more of its patches).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measured_on import measured_on

REPO = Path(__file__).resolve().parent.parent
VIDEO = REPO.parent / "shared" / "media" / "demo_test.mp4"
sys.path.insert(0, str(REPO))

RATIOS = (0.25, 0.5, 0.75)
TEMPORAL = "temporal"   # in a setting's layer slot: temporal pruning, before the language model
SPEED_LAYERS = (2, 8)
QUALITY_LAYERS = (1, 2)
BATCH, NEW_TOKENS = 4, 16
MAX_NEW_TOKENS_FOR_FIT = 512   # the CLI's default: what a row reserves room to grow to
THREADS = 2

# One setting in a fresh process: the peak memory of one item's prefill and first token above the
# loaded model (KV, kept layer-K inputs, activations), then the items/s of a small batch.
_MEASURE = """
import json, sys, time, torch
from pathlib import Path
sys.path.insert(0, {bench!r})
from bench_pruning import engine_for, prompt_of, pruned, run_rows
from tarsier_batch.families import load_caption_model
torch.set_num_threads({threads})
model = load_caption_model(Path({model_dir!r}), torch.float32, torch.device("cpu"))
model.eos_token_ids = frozenset()
prompt = pruned(model, prompt_of(model, {frames}), {ratio}, {layer!r})
run_rows(engine_for(model, prompt, {ratio}, {layer!r}, rows=1, new_tokens=1), [prompt])   # warm up

def status_kb(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")   # the peak (VmHWM) restarts from here
start_kb = status_kb("VmRSS:")
run_rows(engine_for(model, prompt, {ratio}, {layer!r}, rows=1, new_tokens=1), [prompt])
peak_mb = (status_kb("VmHWM:") - start_kb) / 1024
seconds, _ = run_rows(engine_for(model, prompt, {ratio}, {layer!r}, rows={batch}, new_tokens={new_tokens}),
                      [prompt] * {batch})
print(json.dumps({{"peak_above_loaded_mb": peak_mb, "seconds": seconds}}))
"""


def prompt_of(model, frames: int):
    from tarsier_batch.inputs.sources import MediaType

    return model.processor.process(model.processor.load_media(str(VIDEO), MediaType.VIDEO, frames), None)


def pruned(model, prompt, ratio: float, layer: int | str):
    """`prompt` as the decoding worker hands it to the engine: without its least-changed vision vectors with temporal
    pruning, else whole."""
    from tarsier_batch.families.temporal import drop_static_vision

    if layer != TEMPORAL or not ratio:
        return prompt
    return drop_static_vision(prompt, model.processor.vision_changes(prompt), ratio)


def engine_for(model, prompt, ratio: float, layer: int | str, rows: int, new_tokens: int, kv_rows: int | None = None):
    """An engine with room for `kv_rows` (default `rows`) rows of `prompt`, pruning with fastv if ratio > 0 and a
    layer is given (temporal pruning is in the prompt already: `pruned`)."""
    from tarsier_batch.engine import Engine, EngineConfig, PruneConfig, SamplingParams

    slots = (kv_rows or rows) * (prompt.length + new_tokens + 64)   # a row takes whole pages of 32 slots
    by_attention = ratio and layer != TEMPORAL
    # No prefix cache: the rows are one prompt, which every row would otherwise take computed from the first.
    config = EngineConfig(max_rows=rows, kv_cache_tokens=slots, prefix_cache=False,
                          prune=PruneConfig(ratio, layer) if by_attention else None)
    return Engine(model, config, SamplingParams(max_new_tokens=new_tokens, repetition_penalty=1.0))


def run_rows(engine, prompts) -> tuple[float, list]:
    """Seconds to generate every row, and the finished rows."""
    start = time.perf_counter()
    rows = [engine.add(prompt) for prompt in prompts]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return time.perf_counter() - start, rows


def prefill_flops(layer_params: int, heads: int, head_dim: int, layers: int, prompt: int, survivors: int,
                  prune_layer: int) -> float:
    """Language-model FLOPs of one prefill: 2 per parameter per position, and 4 x heads x head_dim per
    (query, key) pair of causal attention; layers from `prune_layer` on see `survivors` positions."""
    def per_layer(positions: int) -> float:
        return 2 * layer_params * positions + 4 * heads * head_dim * positions * (positions + 1) / 2
    return prune_layer * per_layer(prompt) + (layers - prune_layer) * per_layer(survivors)


def one_family(family: str, frames: int, repeats: int, workdir: Path, methods: list[str]) -> dict:
    import torch

    from tarsier_batch.families.loading import load_caption_model
    from tarsier_batch.families.tiny import make_tiny_model

    model_dir = make_tiny_model(workdir / family, "deep", seed=0, family=family)
    model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    model.eos_token_ids = frozenset()
    prompt = prompt_of(model, frames)
    geometry = model.kv_geometry
    first_layer = model.model.language_model.model.layers[0]
    layer_params = sum(p.numel() for p in first_layer.parameters() if p.dim() == 2)
    heads = first_layer.self_attn.q_proj.out_features // geometry.head_dim
    settings = [(0.0, 0)] + _pruning_settings(methods, SPEED_LAYERS)
    name = {setting: _name(*setting) for setting in settings}
    prompts = {setting: pruned(model, prompt, *setting) for setting in settings}

    run_rows(engine_for(model, prompt, 0.5, 2, rows=1, new_tokens=1), [prompt])   # warm up
    times: dict[tuple[float, int], list[float]] = {setting: [] for setting in settings}
    kv_bytes: dict[tuple[float, int], int] = {}
    for _ in range(repeats):
        for setting in settings:   # interleaved: machine noise hits every setting alike
            engine = engine_for(model, prompts[setting], *setting, rows=1, new_tokens=1)
            seconds, [row] = run_rows(engine, [prompts[setting]])
            times[setting].append(seconds)
            # What the row held at its first token: its computed slots in each cache.
            kv_bytes[setting] = sum(row.slots_used(late=index == 1) * pool.bytes_per_slot
                                    for index, pool in enumerate(engine.pools))

    results = {}
    for setting in settings:
        ratio, layer = setting
        engine = engine_for(model, prompt, ratio, layer, rows=16, new_tokens=MAX_NEW_TOKENS_FOR_FIT, kv_rows=16)
        row = engine.add(prompts[setting])
        survivors = row.pruning.num_survivors if row.pruning is not None else prompts[setting].length
        # Rows of this prompt (room for --max-new-tokens 512) the same KV memory holds at once.
        fit = min(pool.capacity_tokens // row.max_length(late=index == 1) for index, pool in enumerate(engine.pools))
        measured = json.loads(subprocess.run(
            [sys.executable, "-c", _MEASURE.format(bench=str(REPO / "bench"), threads=THREADS, model_dir=str(model_dir),
                                                   frames=frames, ratio=ratio, layer=layer, batch=BATCH,
                                                   new_tokens=NEW_TOKENS)],
            check=True, capture_output=True, text=True).stdout)
        results[name[setting]] = {
            "survivors": survivors,
            "prefill_gflops": round(prefill_flops(layer_params, heads, geometry.head_dim, geometry.num_layers,
                                                  prompt.length, survivors, layer if fastv(setting) else 0) / 1e9, 1),
            "prefill_s": round(statistics.median(times[setting]), 2),
            "prefill_runs_s": [round(t, 2) for t in times[setting]],
            "kv_mb_per_row": round(kv_bytes[setting] / 2**20, 1), "rows_in_kv_of_16_unpruned": fit,
            "peak_above_loaded_mb": round(measured["peak_above_loaded_mb"]),
            f"items_per_s_{BATCH}x{NEW_TOKENS}_tokens": round(BATCH / measured["seconds"], 3),
        }
        print(json.dumps({family: {name[setting]: results[name[setting]]}}), file=sys.stderr, flush=True)
    base = results["unpruned"]
    for values in results.values():
        values["vs_unpruned"] = {
            "prefill_flops": round(values["prefill_gflops"] / base["prefill_gflops"], 3),
            "prefill_time": round(values["prefill_s"] / base["prefill_s"], 3),
            "kv_bytes": round(values["kv_mb_per_row"] / base["kv_mb_per_row"], 3),
            "peak_memory": round(values["peak_above_loaded_mb"] / base["peak_above_loaded_mb"], 3),
            "items_per_s": round(values[f"items_per_s_{BATCH}x{NEW_TOKENS}_tokens"]
                                 / base[f"items_per_s_{BATCH}x{NEW_TOKENS}_tokens"], 3),
        }
    return {"checkpoint": f"{family} deep: {geometry.num_layers} layers, "
                          f"{layer_params * geometry.num_layers / 1e6:.0f}M parameters in the decoder layers",
            "frames": frames, "prompt_tokens": prompt.length,
            "vision_tokens": sum(block.end - block.start for block in prompt.vision_blocks), "settings": results}


def _pruning_settings(methods: list[str], layers: tuple[int, ...]) -> list[tuple[float, int | str]]:
    return [(ratio, layer) for method in methods for layer in (layers if method == "fastv" else (TEMPORAL,))
            for ratio in RATIOS]


def _name(ratio: float, layer: int | str) -> str:
    if not ratio:
        return "unpruned"
    return f"R={ratio},temporal" if layer == TEMPORAL else f"R={ratio},K={layer}"


def fastv(setting: tuple[float, int | str]) -> bool:
    return bool(setting[0]) and setting[1] != TEMPORAL


def speed(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="bench-pruning-") as scratch:
        return {"benchmark": "vision-token pruning: speed and memory", "repeats": args.repeats, "threads": THREADS,
                "families": {family: one_family(family, args.frames, args.repeats, Path(scratch), args.methods)
                             for family in args.families}}


def token_f1(reference: str, candidate: str) -> float:
    from collections import Counter

    ref, cand = reference.split(), candidate.split()
    common = sum((Counter(ref) & Counter(cand)).values())
    if not common:
        return float(ref == cand)
    precision, recall = common / len(cand), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(reference: str, candidate: str) -> float:
    """F-measure of the longest common subsequence of words."""
    ref, cand = reference.split(), candidate.split()
    if not ref or not cand:
        return float(ref == cand)
    previous = [0] * (len(cand) + 1)
    for word in ref:
        current = [0]
        for index, other in enumerate(cand):
            current.append(previous[index] + 1 if word == other else max(previous[index + 1], current[index]))
        previous = current
    lcs = previous[-1]
    if not lcs:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def quality(args: argparse.Namespace) -> dict:
    from tarsier_batch.demo.evaluate import evaluate_demo

    settings = [(0.0, 0)] + _pruning_settings(args.methods, QUALITY_LAYERS)
    results, unpruned = {}, None
    for ratio, layer in settings:
        flags = () if not ratio else ("--prune-vision", str(ratio), "--prune-method", "temporal") if layer == TEMPORAL \
            else ("--prune-vision", str(ratio), "--prune-layer", str(layer))
        start = time.perf_counter()
        evaluation = evaluate_demo(args.n, args.seed, "demo", flags)
        seconds = time.perf_counter() - start
        captions = evaluation.captions
        unpruned = unpruned or captions
        pairs = [(unpruned[name], captions[name]) for name in unpruned]
        result = {"accuracy": round((evaluation.correct + evaluation.reversed_correct) / (2 * args.n), 4),
                  "forwards": round(evaluation.accuracy, 4), "backwards": round(evaluation.reversed_accuracy, 4),
                  "identical_to_unpruned": round(sum(a == b for a, b in pairs) / len(pairs), 4),
                  "token_f1_vs_unpruned": round(statistics.mean(token_f1(a, b) for a, b in pairs), 4),
                  "rouge_l_vs_unpruned": round(statistics.mean(rouge_l(a, b) for a, b in pairs), 4),
                  "seconds": round(seconds, 1)}
        results[_name(ratio, layer)] = result
        print(json.dumps({_name(ratio, layer): result}), file=sys.stderr, flush=True)
    return {"benchmark": "vision-token pruning: demo-model caption quality", "clips": 2 * args.n, "seed": args.seed,
            "settings": results}


def selectivity(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from tarsier_batch.demo import HELD_OUT_SEEDS
    from tarsier_batch.demo.clips import BACKGROUNDS, make_clip, write_mp4
    from tarsier_batch.families.loading import load_caption_model
    from tarsier_batch.inputs.sources import MediaType
    from tarsier_batch.model.checkpoints import resolve_model

    model = load_caption_model(resolve_model("demo").path, torch.float32, torch.device("cpu"))
    size = model.model.vision_tower.config.image_size   # the frames the vision tower sees
    clips = [make_clip(seed) for seed in random.Random(args.seed).sample(range(*HELD_OUT_SEEDS), args.n)]
    prompts = []
    with tempfile.TemporaryDirectory(prefix="bench-pruning-") as scratch:
        for index, clip in enumerate(clips):
            path = write_mp4(clip, Path(scratch) / f"{index}.mp4")
            prompts.append(model.processor.process(model.processor.load_media(str(path), MediaType.VIDEO, 8), None))
    results = {}
    for layer in QUALITY_LAYERS:
        kept = {"shape": [0, 0], "background": [0, 0], "newline_or_separator": [0, 0]}   # kind -> [kept, all]
        for clip, prompt in zip(clips, prompts):
            engine = engine_for(model, prompt, 0.5, layer, rows=1, new_tokens=1)
            _, [row] = run_rows(engine, [prompt])
            survivors = set(row.pruning.survivors.tolist())
            shown = np.linspace(0, len(clip.frames) - 1, len(prompt.vision_blocks)).round().astype(int)
            background = np.array(BACKGROUNDS[clip.spec.background])
            for block, frame_index in zip(prompt.vision_blocks, shown):
                pixels = np.asarray(clip.frames[frame_index].resize((size, size))).astype(int)
                grid = int((block.end - block.start - 1) ** 0.5)   # rows of `grid` patches and a newline, a separator
                patch = size // grid
                for offset in range(block.end - block.start):
                    row_index, column = divmod(offset, grid + 1)
                    if column == grid or row_index == grid:
                        kind = "newline_or_separator"
                    else:
                        cell = pixels[row_index * patch:(row_index + 1) * patch, column * patch:(column + 1) * patch]
                        kind = "shape" if (np.abs(cell - background).sum(-1) > 60).mean() > 0.05 else "background"
                    kept[kind][0] += block.start + offset in survivors
                    kept[kind][1] += 1
        results[f"R=0.5,K={layer}"] = {f"{kind}_kept": round(done / total, 3) for kind, (done, total) in kept.items()}
        print(json.dumps(results), file=sys.stderr, flush=True)
    return {"benchmark": "vision-token pruning: which demo-model vectors survive", "clips": args.n, "seed": args.seed,
            "settings": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    speed_parser = commands.add_parser("speed")
    speed_parser.add_argument("--families", nargs="+", default=["tarsier", "tarsier2"], choices=["tarsier", "tarsier2"])
    speed_parser.add_argument("--frames", type=int, default=8)
    speed_parser.add_argument("--repeats", type=int, default=2)
    speed_parser.add_argument("--methods", nargs="+", default=["fastv", "temporal"], choices=["fastv", "temporal"])
    quality_parser = commands.add_parser("quality")
    quality_parser.add_argument("--n", type=int, default=100)
    quality_parser.add_argument("--seed", type=int, default=1)
    quality_parser.add_argument("--methods", nargs="+", default=["fastv", "temporal"], choices=["fastv", "temporal"])
    selectivity_parser = commands.add_parser("selectivity")
    selectivity_parser.add_argument("--n", type=int, default=40)
    selectivity_parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    measure = {"speed": speed, "quality": quality, "selectivity": selectivity}[args.command]
    print(json.dumps({**measured_on(), **measure(args)}, indent=2))


if __name__ == "__main__":
    main()
