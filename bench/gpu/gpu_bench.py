"""The GPU run: correctness, speed and memory of the engine on one CUDA device, and the user's run of the whole tool,
in two prepared calls.

    bash bench/gpu/run.sh --stages targets     # on the device machine: the engine's targets, within --budget-s
    bash bench/gpu/run.sh --stages user --budget-s 280   # then on the same machine: the user's run and the checks
    bash bench/gpu/run.sh --stages compiled,cli   # what an earlier call had no time left for
    bash bench/gpu/run.sh --stages qwen        # Qwen2.5-VL-7B beside Tarsier2-7B, a call of its own
    bash bench/gpu/run.sh --cpu-dry-run        # here: every stage end to end at tiny sizes, on the CPU

Stages, in the order they run (a stage that would not finish within the budget is skipped and named in
the output, so that a second call can run it; a stage that fails records its error and the rest go on):

- `env`: versions, the device, and its two ceilings measured: a device-to-device copy (bytes read plus
  written per second) and a large bfloat16 matrix product (FLOP/s);
- `equality`: float32 equality of batched, chunked, continuous, preempted, offloaded, forked and sampled
  rows (decode steps as CUDA graphs, the fused decode attention) with rows alone (eager, the split attention of
  torch ops), on the tiny checkpoints of both families (bench/gpu/equality.py), in a child process first: if it
  fails, the rest of the run goes without CUDA graphs and the fused attention (a failed recording leaves torch's
  allocator mid-recording, which a process cannot recover from) and the equality is run again without them;
- `build`: the real-size Tarsier2-7B checkpoint, weights drawn on the device, written to local disk;
- `engine`: loaded by `Captioner` (the memory preflight first), 64 distinct clips of 16 frames at 1920 x
  800, 256 new tokens with EOS off, through the engine as `tarsier caption` drives it (without --compile:
  on CUDA its decode steps replay CUDA graphs); then 16 of the clips prefilled only (one token each, the
  prefix cache off) for the prefill rate and MFU; the preflight's estimate against
  `torch.cuda.max_memory_allocated`;
- `baseline`: transformers' one-at-a-time Qwen2-VL generate on the first clips, same weights: its items/s,
  and how often the engine's bfloat16 ids equal its ids, and where they first part;
- `decode`: ms per decode step at 1, 8, 32 and 64 rows at the clips' context, against the bandwidth floor:
  as the engine runs it (CUDA graphs, the fused decode attention), eager at exact sizes, and as CUDA graphs
  with the split attention of torch ops;
- `compiled`: the same with `--compile` (the layers and the decode attention through torch.compile), in a
  child process stopped at the budget: the 64 clips and the decode steps of the real-size model, then the
  tiny equality scenarios compiled;
- `cli`: `tarsier caption` in a fresh process over MP4 files of the clips: with `--offload-kv`, and with a
  batch too large for the card (a clear refusal or a smaller batch, never lost rows);
- `e2e`: the user's run, `tarsier caption` over 1080p30 H.264 files made on the device, against the engine fed the
  same clips decoded beforehand; the GPU's busy share (bench/gpu/end_to_end.py);
- `bf16_demo`: the trained demo model's captions in bfloat16 and float16, the engine against transformers' generate
  (bench/gpu/demo_bf16.py);
- `pruning`: temporal pruning at R = 0.5 on the real-size checkpoint against unpruned (bench/gpu/pruning.py);
- `segments`, `e2e_compiled`: the user's command over a 5-minute file with `--segments fixed:10s`, and over the
  clips with `--compile`;
- `qwen2_5_vl`: Qwen2.5-VL-7B at its real size beside Tarsier2-7B (random weights drawn on the device, its own
  on-disk layout): the `engine` stage's 64 clips through its processor and the engine (items/s), its decode step
  at 1, 8, 32 and 64 rows against the bandwidth floor, as the engine runs it;
- `profile`: torch.profiler over decode steps (1 and 64 rows) and a prefill of two clips: the top ops by
  device and host time, kernel launches per step, device busy time against wall time; and the lines where a
  prefill of two more clips waits for the device (bench/gpu/step_profile.py);
- `attention`: the decode attention kernels at 7B shapes (bench/gpu/attention_kernels.py).

Without --stages, every stage but `profile` and `attention` (measured already) is asked for.

The budget counts from run.sh's start (`--started-at`).

This module runs the stages in turn and holds the smaller ones; the sizes, stage sets and allowances are in
run_plan.py, the state between stages in run_state.py, the real-size model's figures in engine_stages.py and the
compiled stage in compiled_stage.py.

Writes `gpu-<date>-<device>.json` (the figures; the keys of the summary first) and prints a short table
last. Each stage's state (the checkpoint, the results so far) stays in --workdir, so a second call on the
same machine goes on from the first.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

import attention_kernels  # noqa: E402
import cli_runs  # noqa: E402
import end_to_end  # noqa: E402
import equality  # noqa: E402
import summary  # noqa: E402
import workload  # noqa: E402
from compiled_stage import run_compiled  # noqa: E402
from demo_bf16 import run_bf16_demo  # noqa: E402
from engine_stages import run_baseline, run_decode, run_engine, run_profile, run_qwen2_5_vl  # noqa: E402
from pruning import run_pruning  # noqa: E402
from run_plan import DEFAULT_STAGES, DRY, DTYPE, GPU, STAGE_SETS, STAGES, wanted_stages  # noqa: E402
from run_state import Bench, release, run_in_child  # noqa: E402

# --- stages ------------------------------------------------------------------------------------------------


def run_env(bench: Bench) -> None:
    device = bench.device
    info = bench.stage("env")
    info.update({"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__, "cuda": torch.version.cuda,
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                 or "cpu", "profile": bench.profile.name})
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update({"multiprocessors": properties.multi_processor_count, "memory_gb": round(properties.total_memory
                                                                                              / 1e9, 1)})
        try:
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                                                 "clocks.max.sm,power.limit", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            info["nvidia_smi"] = str(error)
    info["copy_bytes_per_s"] = copy_rate(device, 2**30 if device.type == "cuda" else 2**24)
    info["matmul_flop_per_s"] = matmul_rate(device, 8192 if device.type == "cuda" else 512)
    release(device)


def copy_rate(device: torch.device, nbytes: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of `nbytes`."""
    source = torch.randn(nbytes // DTYPE.itemsize, dtype=DTYPE, device=device)
    target = torch.empty_like(source)
    return 2 * nbytes / (attention_kernels.timed_ms(lambda: target.copy_(source), device, 20) / 1000)


def matmul_rate(device: torch.device, side: int) -> float:
    """FLOP/s of a (side x side) @ (side x side) bfloat16 product on random data."""
    a = torch.randn(side, side, dtype=DTYPE, device=device)
    b = torch.randn(side, side, dtype=DTYPE, device=device)
    return 2 * side**3 / (attention_kernels.timed_ms(lambda: a @ b, device, 10) / 1000)


def run_equality(bench: Bench) -> None:
    if not bench.in_child:
        code = run_in_child(bench, "equality", bench.profile.stage_s.get("equality", 300) * 2)
        info = bench.stage("equality")
        if code == 0 and "error" not in info and "passed" in info:
            return
        bench.results["cuda_graphs"] = bench.cuda_graphs = False
        bench.results["fused_attention"] = bench.fused_attention = False
        bench.results["cuda_graphs_failure"] = info.get("error") or f"the equality child exited with {code}"
    bench.results["stages"]["equality"] = equality.run_equality(bench.workdir, bench.device, compiled=False,
                                                                cuda_graphs=bench.cuda_graphs,
                                                                fused_attention=bench.fused_attention)


def run_attention(bench: Bench) -> None:
    profile = bench.profile
    bench.drop_model()
    real = profile.geometry is None
    heads, kv_heads, dim = (28, 4, 128) if real else (4, 2, 32)
    context = profile.frames * 608 + 128 if real else 300
    bench.results["stages"]["attention"] = attention_kernels.run_kernels(
        list(profile.attention_rows), context, heads, kv_heads, dim, DTYPE, bench.device, profile.attention_repeats,
        compiled=bench.with_compile)


def run_cli(bench: Bench) -> None:
    """A fresh process per run (the parent lets go of the GPU first)."""
    profile = bench.profile
    bench.drop_model()
    bench.built()
    clips = workload.write_clips(bench.workdir / "clips", profile.cli_clips, profile.frames, profile.width,
                                 profile.height)
    many = cli_runs.linked_copies(clips, bench.workdir / "many-clips", 2 * profile.cli_clips)
    common = ["--max-new-tokens", str(profile.cli_new_tokens), "--overwrite", *bench.cli_flags()]
    # Every clip at once, each prompt whole in one step: more than the card holds at once.
    too_large = ["--batch-size", "512", "--prefill-chunk", "0", "--max-batch-tokens", "1000000"]
    info = bench.stage("cli")
    info["help"] = cli_runs.help_names("--device", "--dtype", "--frames", "--offload-kv")
    budget = 200 if bench.device.type == "cuda" else 300
    info["offload_kv"] = cli_runs.caption(bench.checkpoint, clips, bench.workdir / "offload.parquet",
                                          [*common, "--offload-kv"], budget)
    # The memory check should refuse it before loading, in one line...
    info["batch_too_large"] = cli_runs.caption(bench.checkpoint, many, bench.workdir / "too-large.parquet",
                                               [*common, *too_large], budget)
    # ...and without the check, steps that run out of memory are retried smaller: every row still arrives.
    info["batch_too_large_unchecked"] = cli_runs.caption(
        bench.checkpoint, many, bench.workdir / "too-large-unchecked.parquet",
        [*common, *too_large, "--no-preflight", "--kv-cache-gb", str(profile.cli_kv_gb)], budget)


RUNNERS = {"env": run_env, "equality": run_equality, "build": Bench.build, "engine": run_engine,
           "baseline": run_baseline, "decode": run_decode, "profile": run_profile, "attention": run_attention,
           "cli": run_cli, "compiled": run_compiled, "e2e": end_to_end.run_e2e, "bf16_demo": run_bf16_demo,
           "pruning": run_pruning, "segments": end_to_end.run_segments, "e2e_compiled": end_to_end.run_e2e_compiled,
           "qwen2_5_vl": run_qwen2_5_vl}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-bench-out")))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tarsier-gpu-bench"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="every stage at tiny sizes on the CPU")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                        help="comma-separated, of: " + ", ".join(STAGES) + "; or a set of them: " +
                        "; ".join(f"{name} ({', '.join(stages)})" for name, stages in STAGE_SETS.items()))
    parser.add_argument("--commit", default="", help="the commit the repository copy is of (run.sh's)")
    parser.add_argument("--budget-s", type=float, help="skip stages that would end past this (default: the profile's)")
    parser.add_argument("--with-compile", action="store_true", help="compile on the CPU too (minutes)")
    parser.add_argument("--started-at", type=float, help="when the call began, in seconds since the epoch "
                        "(run.sh's; the budget counts from there)")
    parser.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def run_stage(bench: Bench, name: str) -> None:
    """One stage, timed and saved; a stage that fails records its error."""
    print(f"[{time.perf_counter() - bench.started:6.1f} s] {name} ...", flush=True)
    started = time.perf_counter()
    try:
        RUNNERS[name](bench)
    except Exception as error:   # the stage's error goes in the results; the other stages still run
        bench.stage(name)["error"] = f"{type(error).__name__}: {error}"
        bench.stage(name)["traceback"] = traceback.format_exc()[-4000:]
        print(traceback.format_exc(), flush=True)
        if name in ("build", "engine") or isinstance(error, torch.AcceleratorError):
            bench.drop_model()
    bench.stage(name)["stage_s"] = round(time.perf_counter() - started, 1)
    bench.save()
    print(f"[{time.perf_counter() - bench.started:6.1f} s] {name} done in {bench.stage(name)['stage_s']} s"
          f"{' with an error' if 'error' in bench.stage(name) else ''}", flush=True)


def main() -> None:
    args = arguments()
    profile = DRY if args.cpu_dry_run else GPU
    if profile is GPU and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --cpu-dry-run")
    wanted = wanted_stages(args.stages)
    unknown = sorted(set(wanted) - set(STAGES))
    if unknown:
        sys.exit(f"unknown stages: {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or profile.budget_s
    bench = Bench(profile, args.workdir, args.out, with_compile=args.with_compile or profile is GPU, budget_s=budget,
                  in_child=args.in_child, started_at=args.started_at)
    if args.commit:
        bench.results.setdefault("commits", {})[",".join(wanted)] = args.commit
    for name in [stage for stage in STAGES if stage in wanted]:
        elapsed = time.perf_counter() - bench.started
        needs = profile.stage_s.get(name, 0)
        if elapsed + needs > budget and not args.in_child:   # the parent planned the child's stage
            bench.results["stages"][name] = {"skipped": f"{needs:.0f} s needed, {budget - elapsed:.0f} s left"}
            print(f"[{elapsed:6.1f} s] {name}: skipped (not enough time left)", flush=True)
            continue
        bench.results["stages"].pop(name, None)
        run_stage(bench, name)
    path = bench.save()
    if args.in_child:
        return
    remaining = bench.results["summary"]["stages_skipped"] + bench.results["summary"]["stages_failed"]
    print(f"\nwrote {path}")
    if remaining:
        print(f"to run what is missing: bash bench/gpu/run.sh --stages {','.join(remaining)}")
    print(summary.table(bench.results["summary"]))


if __name__ == "__main__":
    main()
