"""The figures of the real-size model in the engine: its clips, prefill alone, transformers' one-at-a-time generate
beside it, decode steps against their floor, a profile of steps; and Qwen2.5-VL-7B beside Tarsier2-7B."""

from __future__ import annotations

import json
import time

import real_size
import step_profile
import torch
import workload
from run_plan import DTYPE
from run_state import Bench, release

from tarsier_batch.engine import Engine
from tarsier_batch.engine.attention import SplitDecodeAttention
from tarsier_batch.engine.decode_step import DecodeStep
from tarsier_batch.model.preflight import MemoryEstimate


def run_engine(bench: Bench) -> None:
    captioner = bench.loaded()
    prompts = bench.clip_prompts()
    info = bench.stage("engine")
    profile = bench.profile
    run = real_size.engine_pass(captioner.engine, prompts, profile.new_tokens)
    (bench.workdir / "engine_ids.json").write_text(json.dumps(run.pop("ids")))
    info["eager"] = run
    info["prefill_only"] = prefill_figures(bench, captioner.engine, prompts)
    if captioner.memory is not None:
        info["preflight"] = preflight_figures(bench, captioner.memory)


def preflight_figures(bench: Bench, memory: MemoryEstimate) -> dict:
    """The memory check's estimate, and on CUDA against the peak allocated since the last reset."""
    figures = {"weights": memory.weights, "kv_cache": memory.kv_cache, "activations": memory.activations,
               "estimated_peak": memory.peak}
    if bench.device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(bench.device)
        reserved = torch.cuda.max_memory_reserved(bench.device)
        figures.update({"max_memory_allocated": allocated, "max_memory_reserved": reserved,
                        "estimate_over_allocated": round(memory.peak / allocated, 4),
                        "estimate_over_reserved": round(memory.peak / reserved, 4)})
    return figures


def prefill_figures(bench: Bench, engine: Engine, prompts: list) -> dict:
    """Prefill alone of the first `prefill_clips` clips, which the engine has computed already (so with the
    prefix cache off): positions/s and the share of the card's bfloat16 peak (MFU)."""
    distinct = prompts[:bench.profile.prefill_clips]
    prefill = real_size.prefill_pass(engine, distinct)
    flops = real_size.prefill_flops(bench.loaded().model, distinct)
    measured_matmul = bench.results["stages"].get("env", {}).get("matmul_flop_per_s", float("nan"))
    peak, peak_source = bench.bf16_peak()
    flop_per_s = flops / prefill["seconds"]
    return {**prefill, "prompt_positions_per_s": round(sum(p.length for p in distinct) / prefill["seconds"], 1),
            "flop": flops, "flop_per_s": flop_per_s, "mfu": round(flop_per_s / peak, 4), "mfu_against": peak_source,
            "share_of_measured_matmul": round(flop_per_s / measured_matmul, 4)}


def run_baseline(bench: Bench) -> None:
    captioner = bench.loaded()
    profile = bench.profile
    prompts = bench.clip_prompts()[:profile.baseline_clips]
    if captioner.engine is not None:
        captioner.engine.abort_all()
    captioner.model.eos_token_ids = bench.eos_token_ids   # its pad id; EOS stays off (disable_eos)
    try:
        run = real_size.baseline_pass(captioner.model, prompts, profile.new_tokens)
    finally:
        captioner.model.eos_token_ids = frozenset()
    ids, margins = run.pop("ids"), run.pop("margins")
    info = bench.stage("baseline")
    info["one_at_a_time"] = run
    engine_ids_file = bench.workdir / "engine_ids.json"
    if engine_ids_file.exists():
        engine_ids = json.loads(engine_ids_file.read_text())[:len(ids)]
        info["bf16_engine_vs_transformers"] = real_size.agreement(ids, engine_ids, margins)
    (bench.workdir / "baseline_ids.json").write_text(json.dumps(ids))
    (bench.workdir / "baseline_margins.json").write_text(json.dumps(margins))


def decode_figures(bench: Bench, engine: Engine, context: int) -> dict:
    """ms per decode step and its floor, by rows, at `context`, in `engine` (emptied, its cache noise)."""
    profile = bench.profile
    model = engine.model
    copy_rate = bench.results["stages"].get("env", {}).get("copy_bytes_per_s")
    engine.abort_all()
    real_size.fill_with_noise(engine)
    figures: dict = {"context": context, "ms": {}, "floor_ms": {}}
    started = time.perf_counter()
    for rows in profile.decode_rows:
        figures["ms"][str(rows)] = real_size.decode_step_ms(engine, rows, context, profile.decode_steps,
                                                            warmup=5 if engine.runner.decode_step.static_shapes
                                                            else 2)
        if copy_rate:
            figures["floor_ms"][str(rows)] = real_size.decode_floor_ms(model, rows, context, copy_rate)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    figures["over_floor"] = {rows: round(ms / figures["floor_ms"][rows], 2) for rows, ms in figures["ms"].items()
                             if rows in figures["floor_ms"]}
    return figures


def run_decode(bench: Bench) -> None:
    """The decode step as the engine runs it (on CUDA, replayed as CUDA graphs, the fused decode attention), eager
    at exact sizes, and replayed with the split decode attention of torch ops instead of the fused one."""
    engine = bench.loaded().engine
    info = bench.stage("decode")
    step = engine.runner.decode_step
    info["attention"] = type(step.attention).__name__
    if step.graphs is not None:
        info["graphs"] = decode_figures(bench, engine, bench.context())
        info["graphs"]["recorded"] = len(step.graphs.graphs)
    try:
        engine.runner.decode_step = DecodeStep(engine.model, engine.pools, step.attention)
        info["eager"] = decode_figures(bench, engine, bench.context())
        if step.graphs is not None and not isinstance(step.attention, SplitDecodeAttention):
            engine.runner.decode_step = DecodeStep(engine.model, engine.pools, SplitDecodeAttention(), graphs=True)
            info["graphs_split_attention"] = decode_figures(bench, engine, bench.context())
    finally:
        engine.runner.decode_step = step


def run_profile(bench: Bench) -> None:
    """torch.profiler over eager decode steps (fewest and most rows) and a prefill of two clips."""
    captioner = bench.loaded()
    engine = captioner.engine
    prompts = bench.clip_prompts()
    context = bench.context()
    info = bench.stage("profile")
    engine.abort_all()
    real_size.fill_with_noise(engine)
    for rows in sorted({min(bench.profile.decode_rows), max(bench.profile.decode_rows)}):
        info[f"decode_{rows}_rows"] = step_profile.decode_steps(engine, rows, context, steps=3)
        engine.scheduler.clear()
    info["prefill_2_clips"] = step_profile.prefill(engine, prompts[:2])
    info["prefill_sync_sites"] = step_profile.prefill_sync_sites(engine, prompts[2:4])


def run_qwen2_5_vl(bench: Bench) -> None:
    """Qwen2.5-VL-7B at its real size (random weights drawn on the device, its own layout), beside Tarsier2-7B: the
    `engine` stage's clips through its processor and the engine (items/s), and its decode step as the engine runs it
    against the floor, as `engine` and `decode` measure Tarsier2's."""
    profile = bench.profile
    bench.drop_model()   # Tarsier2's weights and KV cache, where an earlier stage loaded them
    info = bench.stage("qwen2_5_vl")
    checkpoint = bench.workdir / "qwen2_5_vl-real-size"
    if not (checkpoint / "model.safetensors.index.json").exists():
        info["build"] = real_size.write_qwen2_5_vl_checkpoint(checkpoint, DTYPE, bench.device, profile.geometry)
    started = time.perf_counter()
    captioner = bench.load(checkpoint)
    captioner.model.eos_token_ids = frozenset()   # every item generates new_tokens: equal work
    info["load_s"] = round(time.perf_counter() - started, 1)
    info["describe"] = captioner.describe()
    started = time.perf_counter()
    prompts = workload.prompts(captioner.model.processor, profile.clips, profile.frames, profile.width,
                               profile.height)
    info["prompt_positions"] = sorted({prompt.length for prompt in prompts})
    info["prompts_s"] = round(time.perf_counter() - started, 1)
    engine = captioner.engine
    run = real_size.engine_pass(engine, prompts, profile.new_tokens)
    run.pop("ids")
    info["engine"] = run
    info["decode"] = decode_figures(bench, engine, max(info["prompt_positions"]))
    info["decode"].update(attention=type(engine.runner.decode_step.attention).__name__,
                          graphs=engine.runner.decode_step.graphs is not None)
    del captioner, engine
    release(bench.device)
