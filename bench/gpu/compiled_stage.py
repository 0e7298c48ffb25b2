"""The `compiled` stage: the real-size model and the tiny equality scenarios through torch.compile, in a child
process stopped at the budget."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import equality
import real_size
import torch
from engine_stages import decode_figures, prefill_figures, preflight_figures
from run_state import Bench, release, run_in_child

from tarsier_batch.engine import Engine


def run_compiled(bench: Bench) -> None:
    """In a child process, stopped when the budget runs out: a compilation that never ends (the first H100
    run's did not within 340 s) still leaves the parts that finished, and the log says which part it was in."""
    info = bench.stage("compiled")
    if not bench.with_compile:
        info["skipped"] = "compiling needs --with-compile on the CPU"
        return
    if bench.in_child:
        compiled_parts(bench)
        return
    bench.drop_model()
    timeout_s = max(bench.budget_s - (time.perf_counter() - bench.started), bench.profile.stage_s.get("compiled", 0))
    code = run_in_child(bench, "compiled", timeout_s)
    info = bench.stage("compiled")
    if code != 0:
        failure = f"timed out after {timeout_s:.0f} s" if code == "timed out" else \
            f"the child process exited with {code}"
        info["error"] = f"{failure}, in the part after {info.get('parts_done') or 'none'}"


def compiled_parts(bench: Bench) -> None:
    """The real-size model compiled (the 64 clips, the decode steps), then the tiny equality scenarios compiled;
    each part saved as it ends."""
    info = bench.stage("compiled")
    info["parts_done"] = []

    def done(part: str, started: float) -> None:
        info["parts_done"].append(part)
        info[f"{part}_s"] = round(time.perf_counter() - started, 1)
        info["dynamo_counters"] = {name: dict(values) for name, values in torch._dynamo.utils.counters.items()
                                   if name in ("stats", "recompiles", "graph_break")}
        bench.save()
        print(f"[{time.perf_counter() - bench.started:6.1f} s]   compiled: {part} done", flush=True)

    captioner = bench.loaded()
    prompts = bench.clip_prompts()
    profile = bench.profile
    captioner.engine = None   # its cache: the compiled engine takes one of the same size
    release(bench.device)
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)   # the compiled engine's peak, against the same estimate
    engine = Engine(captioner.model, replace(captioner.engine_config, compile=True), captioner.settings.sampling)
    started = time.perf_counter()
    real_size.engine_pass(engine, prompts[:2], 4)     # compiles the vision blocks, the layers and the decode step
    done("compile", started)
    started = time.perf_counter()
    info["prefill_only"] = prefill_figures(bench, engine, prompts)
    done("prefill", started)
    started = time.perf_counter()
    run = real_size.engine_pass(engine, prompts, profile.new_tokens)
    ids = run.pop("ids")
    info["engine"] = run
    if captioner.memory is not None:
        info["preflight"] = preflight_figures(bench, captioner.memory)
    engine_ids_file = bench.workdir / "engine_ids.json"
    if engine_ids_file.exists():
        info["bf16_compiled_vs_eager"] = real_size.agreement(json.loads(engine_ids_file.read_text()), ids)
    baseline_file = bench.workdir / "baseline_ids.json"
    if baseline_file.exists():
        baseline = json.loads(baseline_file.read_text())
        margins_file = bench.workdir / "baseline_margins.json"
        margins = json.loads(margins_file.read_text()) if margins_file.exists() else None
        info["bf16_compiled_vs_transformers"] = real_size.agreement(baseline, ids[:len(baseline)], margins)
    done("engine", started)
    started = time.perf_counter()
    info["decode"] = decode_figures(bench, engine, bench.context())
    done("decode", started)
    del engine
    bench.drop_model()
    # Compiled functions recompile for each model; past torch._dynamo's limit of recompilations they would run
    # eager without a word, so the tiny checkpoints start from a clean slate (drop_model reset it).
    started = time.perf_counter()
    info["equality"] = equality.run_equality(bench.workdir, bench.device, compiled=True,
                                             cuda_graphs=bench.cuda_graphs, fused_attention=bench.fused_attention)
    done("equality", started)
