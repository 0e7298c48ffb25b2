"""The summary of a GPU run's results: the figures the README quotes, keyed as the JSON's `summary`, and its table."""

from __future__ import annotations

import json


def summary(results: dict, order: list[str]) -> dict:
    """The figures the README quotes, from whichever stages ran (None where a stage did not); the stages done,
    failed and skipped in `order`."""
    stages = results["stages"]
    env, engine, baseline = stages.get("env", {}), stages.get("engine", {}), stages.get("baseline", {})
    compiled, decode, cli = stages.get("compiled", {}), stages.get("decode", {}), stages.get("cli", {})
    qwen = stages.get("qwen2_5_vl", {})
    official = baseline.get("one_at_a_time", {}).get("items_per_s")
    eager = engine.get("eager", {}).get("items_per_s")
    compiled_rate = compiled.get("engine", {}).get("items_per_s")
    best = max([rate for rate in (eager, compiled_rate) if rate] or [None], key=lambda rate: rate or 0)
    decode_sources = {"compiled": compiled.get("decode"), "graphs": decode.get("graphs"), "eager": decode.get("eager")}
    decode_from = next((name for name, figures in decode_sources.items() if figures), None)
    decode_source = decode_sources.get(decode_from) or {}
    equal = [stage.get("passed") for stage in (stages.get("equality", {}), compiled.get("equality", {}))
             if "passed" in stage]
    agreement = baseline.get("bf16_engine_vs_transformers", {})
    preflight = engine.get("preflight", {})
    cli_runs_done = [run for run in cli.values() if isinstance(run, dict) and "rows_lost" in run]
    commits = sorted(set(results.get("commits", {}).values()))
    return {
        "device": env.get("device_name"), "torch": env.get("torch"),
        "commit": commits[0] if len(commits) == 1 else commits or None,
        "speedup_vs_transformers": round(best / official, 2) if best and official else None,
        "speedup_vs_transformers_eager": round(eager / official, 2) if eager and official else None,
        "speedup_vs_transformers_compiled": round(compiled_rate / official, 2) if compiled_rate and official else None,
        "items_per_s": best, "items_per_s_eager": eager, "items_per_s_compiled": compiled_rate,
        "transformers_items_per_s": official,
        "prefill_mfu": engine.get("prefill_only", {}).get("mfu"),
        "prefill_mfu_compiled": compiled.get("prefill_only", {}).get("mfu"),
        "decode_ms": decode_source.get("ms"), "decode_floor_ms": decode_source.get("floor_ms"),
        "decode_ms_eager": decode.get("eager", {}).get("ms"),
        "decode_ms_graphs": decode.get("graphs", {}).get("ms"),
        "decode_ms_graphs_split_attention": decode.get("graphs_split_attention", {}).get("ms"),
        "decode_attention": decode.get("attention"),
        "cuda_graphs_recorded": decode.get("graphs", {}).get("recorded"),
        "cuda_graphs": results.get("cuda_graphs", True), "cuda_graphs_failure": results.get("cuda_graphs_failure"),
        "decode_from": decode_from,
        "fp32_equality_passed": all(equal) if equal else None,
        "bf16_exact_match_rate": agreement.get("exact_match_rate"),
        "bf16_first_divergence": agreement.get("first_divergence"),
        "preflight_estimate_over_peak": preflight.get("estimate_over_allocated"),
        "preflight_estimate_over_peak_compiled": compiled.get("preflight", {}).get("estimate_over_allocated"),
        "rows_lost": sum(run["rows_lost"] for run in cli_runs_done) if cli_runs_done else None,
        "qwen2_5_vl_items_per_s": qwen.get("engine", {}).get("items_per_s"),
        "qwen2_5_vl_decode_ms": qwen.get("decode", {}).get("ms"),
        "qwen2_5_vl_decode_floor_ms": qwen.get("decode", {}).get("floor_ms"),
        **user_run_summary(stages),
        "stages_done": [name for name in order if name in stages and "error" not in stages[name]
                        and "skipped" not in stages[name]],
        "stages_failed": [name for name in order if "error" in stages.get(name, {})],
        "stages_skipped": [name for name in order if "skipped" in stages.get(name, {})],
    }


def user_run_summary(stages: dict) -> dict:
    """The user's run's figures (bench/gpu/end_to_end.py) and the checks beside it (None where a stage did not run):
    `gpu_busy` and `e2e_over_engine` while captioning (after the model is loaded: loading is not the engine's work),
    the whole run's figures beside them."""
    e2e = stages.get("e2e", {})
    command = e2e.get("command", {})
    segments = stages.get("segments", {}).get("command", {})
    compiled = stages.get("e2e_compiled", {}).get("command", {})
    return {
        "e2e_items_per_s": command.get("items_per_s"),
        "e2e_items_per_s_while_captioning": command.get("items_per_s_while_captioning"),
        "e2e_engine_items_per_s": e2e.get("engine_only", {}).get("items_per_s"),
        "e2e_over_engine": e2e.get("e2e_over_engine"),
        "gpu_busy": command.get("gpu_busy_while_captioning"), "gpu_busy_whole_run": command.get("gpu_busy"),
        "decode_s_per_clip": e2e.get("decode", {}).get("decord_s_per_clip"),
        "e2e_workers": command.get("workers"), "e2e_time_to_first_row_s": command.get("time_to_first_row_s"),
        "e2e_rows_lost": command.get("rows_lost"),
        "e2e_compiled_items_per_s": compiled.get("items_per_s"),
        "e2e_compiled_items_per_s_while_captioning": compiled.get("items_per_s_while_captioning"),
        "segments_rows_per_s": segments.get("items_per_s"),
        "segments_rows_per_s_while_captioning": segments.get("items_per_s_while_captioning"),
        "segments_gpu_busy": segments.get("gpu_busy_while_captioning"),
        "bf16_demo_identical_rate": stages.get("bf16_demo", {}).get("bfloat16", {}).get("identical_rate"),
        "fp16_demo_identical_rate": stages.get("bf16_demo", {}).get("float16", {}).get("identical_rate"),
        "pruned_speedup": stages.get("pruning", {}).get("speedup"),
        "pruned_prefill_mfu": stages.get("pruning", {}).get("prefill_only", {}).get("mfu"),
    }


def table(summary_: dict) -> str:
    keys = ["device", "torch", "fp32_equality_passed", "speedup_vs_transformers", "speedup_vs_transformers_eager",
            "items_per_s", "transformers_items_per_s", "prefill_mfu", "prefill_mfu_compiled", "decode_from",
            "decode_ms", "decode_floor_ms",
            "decode_ms_eager", "decode_attention", "decode_ms_graphs_split_attention", "cuda_graphs_recorded",
            "bf16_exact_match_rate", "preflight_estimate_over_peak", "rows_lost", "e2e_items_per_s",
            "e2e_over_engine", "gpu_busy", "decode_s_per_clip", "e2e_workers", "e2e_time_to_first_row_s",
            "e2e_compiled_items_per_s", "segments_rows_per_s", "bf16_demo_identical_rate", "pruned_speedup",
            "pruned_prefill_mfu", "qwen2_5_vl_items_per_s", "qwen2_5_vl_decode_ms", "qwen2_5_vl_decode_floor_ms",
            "commit", "stages_failed", "stages_skipped"]
    return "\n".join(f"{key:32} {json.dumps(summary_.get(key))}" for key in keys)
