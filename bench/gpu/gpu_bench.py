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

Writes `gpu-<date>-<device>.json` (the figures; the keys of the summary first) and prints a short table
last. Each stage's state (the checkpoint, the results so far) stays in --workdir, so a second call on the
same machine goes on from the first.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

import attention_kernels  # noqa: E402
import cli_runs  # noqa: E402
import end_to_end  # noqa: E402
import equality  # noqa: E402
import real_size  # noqa: E402
import step_profile  # noqa: E402
import summary  # noqa: E402
import workload  # noqa: E402
from demo_bf16 import run_bf16_demo  # noqa: E402
from pruning import run_pruning  # noqa: E402

from tarsier_batch import Captioner, CaptionSettings, SamplingParams  # noqa: E402
from tarsier_batch.engine import Engine  # noqa: E402
from tarsier_batch.engine.attention import SplitDecodeAttention  # noqa: E402
from tarsier_batch.engine.decode_step import DecodeStep  # noqa: E402
from tarsier_batch.model.preflight import MemoryEstimate  # noqa: E402


@dataclass(frozen=True)
class Profile:
    """The sizes of one kind of run: the real ones on a GPU, tiny ones for the CPU dry run."""

    name: str
    device: str
    geometry: dict | None        # the checkpoint's, in the tiny builder's terms (None: Tarsier2-7B's)
    frames: int
    width: int
    height: int
    clips: int                   # the speed workload
    prefill_clips: int           # of them, prefilled alone for the prefill rate
    baseline_clips: int          # transformers' one-at-a-time side
    new_tokens: int
    decode_rows: tuple[int, ...]
    decode_steps: int
    attention_rows: tuple[int, ...]   # FlexAttention compiles once per shape: a few sizes
    attention_repeats: int
    cli_clips: int
    cli_new_tokens: int
    cli_kv_gb: float             # the KV cache of the run without the memory check
    user_files: end_to_end.UserFiles   # the user's run: its files and how they are captioned
    pruning_clips: int           # clips of the workload's kind, run with and without temporal pruning
    pruning_frames: int          # their frames (more than the dry run's 2: at R = 0.5 a block would empty)
    demo_clips: int              # held-out clips of the demo model (each forwards and backwards)
    budget_s: float
    stage_s: dict[str, float] = field(default_factory=dict)   # what each stage needs at most, to plan the budget


GPU = Profile("gpu", "cuda", None, frames=16, width=1920, height=800, clips=64, prefill_clips=16, baseline_clips=8,
              new_tokens=256, decode_rows=(1, 8, 32, 64), decode_steps=20, attention_rows=(8, 32, 64),
              attention_repeats=50, cli_clips=8,
              cli_new_tokens=32, cli_kv_gb=40, user_files=end_to_end.GPU_FILES, pruning_clips=32,
              pruning_frames=16, demo_clips=50,
              budget_s=540,
              stage_s={"env": 15, "equality": 45, "build": 30, "engine": 110, "baseline": 90, "decode": 20,
                       "profile": 40, "attention": 40, "cli": 100, "compiled": 160,
                       "e2e": 180, "bf16_demo": 50, "pruning": 75, "segments": 100, "e2e_compiled": 110,
                       "qwen2_5_vl": 150})
# A 2-layer language model behind the real vision pipeline's pixel budget, bfloat16 as on the GPU.
DRY_GEOMETRY = dict(embed_dim=32, depth=2, vision_heads=2, text_hidden=128, text_intermediate=320, text_layers=2,
                    text_heads=4, text_kv_heads=2, mrope_section=[4, 6, 6], max_pixels=12_845_056)
DRY = Profile("cpu-dry-run", "cpu", DRY_GEOMETRY, frames=2, width=640, height=272, clips=4, prefill_clips=2,
              baseline_clips=2, new_tokens=8, decode_rows=(1, 2, 4), decode_steps=3, attention_rows=(1, 4),
              attention_repeats=3,
              cli_clips=2, cli_new_tokens=4, cli_kv_gb=1, user_files=end_to_end.DRY_FILES, pruning_clips=4,
              pruning_frames=8, demo_clips=2, budget_s=1800)
# Two calls on one warm machine. `targets`: the stages whose figures the engine's targets are judged by. The fourth
# run (an H100) took, from run.sh's start: 20 s to start, equality 32, build 20, engine 89, baseline 71, decode 9,
# compiled 129 (with the compiled vision blocks and their prefill), cli 81: ~450 s (profile 31 and attention 27 more,
# measured already: left out unless named). Each allowance above is that pace with a margin of a fifth or more.
# `user`: the user's run and the checks never run on a GPU, most telling first (their allowances are estimates
# until a run measures them); on the same machine it goes on from the first call's checkpoint and results.
# `qwen`: Qwen2.5-VL-7B beside Tarsier2-7B, a call of its own (`targets` has no 150 s left): `env` for the copy rate
# its decode floor is quoted against, then the stage (build ~20 s, load, the 64 clips, the decode steps: an estimate
# from `build`, `engine` and `decode` above, with fewer positions a clip than Tarsier2's).
STAGE_SETS = {"targets": ["env", "equality", "build", "engine", "baseline", "decode", "compiled", "cli"],
              "user": ["e2e", "bf16_demo", "pruning", "segments", "e2e_compiled"],
              "qwen": ["env", "qwen2_5_vl"]}
STAGES = [*STAGE_SETS["targets"], *STAGE_SETS["user"], "qwen2_5_vl", "profile", "attention"]
DEFAULT_STAGES = [*STAGE_SETS["targets"], *STAGE_SETS["user"], "qwen2_5_vl"]
DTYPE = torch.bfloat16


class Bench:
    """The run's state between stages: the profile, the device, what is loaded, and the results so far."""

    def __init__(self, profile: Profile, workdir: Path, out: Path, with_compile: bool, budget_s: float,
                 in_child: bool = False, started_at: float | None = None):
        """`started_at`: when the call began (seconds since the epoch; by default now): the budget counts from
        there, so that installing the wheels and starting Python count too."""
        self.profile = profile
        self.budget_s = budget_s
        self.in_child = in_child   # the compiled stage's own process (see run_compiled)
        self.device = torch.device(profile.device)
        self.workdir = workdir
        self.out = out
        self.with_compile = with_compile
        self.state_file = workdir / "results.json"
        self.results: dict = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.results.setdefault("stages", {})
        # False once the equality stage's child failed with CUDA graphs: the later stages (and calls) go without.
        self.cuda_graphs: bool = self.results.get("cuda_graphs", True)
        self.fused_attention: bool = self.results.get("fused_attention", True)   # the same, for the fused kernel
        self.captioner: Captioner | None = None
        self.eos_token_ids: frozenset[int] = frozenset()   # the checkpoint's, while the engine runs without
        self.prompts: list | None = None
        self.started_at = time.time() if started_at is None else started_at
        self.started = time.perf_counter() - max(0.0, time.time() - self.started_at)

    @property
    def checkpoint(self) -> Path:
        return self.workdir / "tarsier2-real-size"

    def built(self) -> Path:
        """The checkpoint, built first if this machine has none yet."""
        if not (self.checkpoint / "model.safetensors.index.json").exists():
            run_build(self)
        return self.checkpoint

    def stage(self, name: str) -> dict:
        return self.results["stages"].setdefault(name, {})

    def save(self) -> Path:
        self.results["summary"] = summary.summary(self.results, STAGES)
        text = json.dumps({"summary": self.results["summary"], **self.results}, indent=1, default=str)
        self.state_file.write_text(text)
        device = self.results["summary"].get("device") or self.profile.name
        # Dated by the call's start: a call running past midnight still writes one file.
        day = date.fromtimestamp(self.started_at).isoformat()
        name = "gpu-{}-{}.json".format(day, re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-"))
        if self.profile.name != "gpu":
            name = name.replace(".json", f"-{self.profile.name}.json")
        path = self.out / name
        path.write_text(text)
        return path

    def load(self, checkpoint: Path) -> Captioner:
        """`checkpoint` loaded by `Captioner` (memory preflight first) for this profile's workload."""
        profile = self.profile
        # Room for the decode timings' most rows (more than the run's batch) at Tarsier2's positions a frame (the
        # most of the families measured): the engine serves both.
        rows = max(profile.decode_rows)
        context = profile.frames * 608 + 128 + profile.new_tokens
        kv_gb = math.ceil(rows * context * kv_bytes_per_position(checkpoint) / 2**30) + 1
        settings = CaptionSettings(model=str(checkpoint), device=profile.device, dtype="bfloat16",
                                   frames=profile.frames, kv_cache_gb=kv_gb, isolate_decoding=False,
                                   cuda_graphs=self.cuda_graphs, fused_attention=self.fused_attention,
                                   sampling=SamplingParams(max_new_tokens=profile.new_tokens))
        release(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return Captioner(settings, items=profile.clips)

    def loaded(self) -> Captioner:
        """The real-size Tarsier2 checkpoint loaded by `Captioner` (memory preflight first), once."""
        if self.captioner is None:
            self.built()
            started = time.perf_counter()
            self.captioner = self.load(self.checkpoint)
            self.eos_token_ids = self.captioner.model.eos_token_ids
            self.captioner.model.eos_token_ids = frozenset()   # every item generates new_tokens: equal work
            self.stage("engine")["load_s"] = round(time.perf_counter() - started, 1)
            self.stage("engine")["describe"] = self.captioner.describe()
        return self.captioner

    def clip_prompts(self) -> list:
        """The workload's prompts: `clips` clips through the checkpoint's processor."""
        if self.prompts is None:
            started = time.perf_counter()
            profile = self.profile
            # Every clip distinct: the prefix cache reuses only the text before the video, as in a real dataset
            # (the first run repeated 16 clips 4 times, and 48 of 64 rows took their whole prompt cached).
            self.prompts = workload.prompts(self.loaded().model.processor, profile.clips, profile.frames,
                                            profile.width, profile.height)
            self.stage("engine")["prompt_positions"] = sorted({prompt.length for prompt in self.prompts})
            self.stage("engine")["prompts_s"] = round(time.perf_counter() - started, 1)
        return self.prompts

    def context(self) -> int:
        """The longest clip prompt's positions: the context the decode steps are timed at."""
        return max(prompt.length for prompt in self.clip_prompts())

    def cli_flags(self) -> list[str]:
        """`tarsier caption`'s flags for this profile. On CUDA the defaults (the device, bfloat16, the frames) as a
        user runs it: the first H100 run's explicit `--device cuda` stopped at "No such option" (the `cli` stage's
        `help` record looks into that). Without CUDA graphs or the fused attention when the equality failed."""
        profile = self.profile
        return [*([] if self.device.type == "cuda" else ["--device", profile.device, "--dtype", "bfloat16",
                                                         "--frames", str(profile.frames)]),
                *([] if self.cuda_graphs else ["--no-cuda-graphs"]),
                *([] if self.fused_attention else ["--no-fused-attention"])]

    def bf16_peak(self) -> tuple[float, str]:
        """The rate an MFU is quoted against (`real_size.bf16_peak`), from the `env` stage's figures."""
        env = self.results["stages"].get("env", {})
        return real_size.bf16_peak(env.get("device_name", ""), env.get("matmul_flop_per_s", float("nan")))

    def drop_model(self) -> None:
        self.captioner = None
        self.prompts = None
        torch._dynamo.reset()   # compiled code and CUDA graphs (and their memory pool) go with the model
        release(self.device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_bytes_per_position(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)   # Qwen2.5-VL keeps its text settings at the top level
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * DTYPE.itemsize


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


def run_in_child(bench: Bench, stage: str, timeout_s: float) -> int | str:
    """Run `stage` in a child process of its own group (killed past `timeout_s`), with the results so far; then
    take up what it saved. Its exit code, or "timed out"."""
    bench.save()
    command = [sys.executable, str(Path(__file__).resolve()), "--in-child", "--stages", stage,
               "--workdir", str(bench.workdir), "--out", str(bench.out), "--started-at", repr(bench.started_at),
               "--budget-s", repr(bench.budget_s), *(["--with-compile"] if bench.with_compile else []),
               *(["--cpu-dry-run"] if bench.profile is DRY else [])]
    child = subprocess.Popen(command, start_new_session=True)   # its own group: inductor's compile workers too
    try:
        code: int | str = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        code = "timed out"
    bench.results = json.loads(bench.state_file.read_text())   # what the child saved
    return code


def run_build(bench: Bench) -> None:
    profile = bench.profile
    path, info = real_size.build(bench.workdir, profile.geometry, None, DTYPE, bench.device)
    assert path == bench.checkpoint
    bench.stage("build").update(info)
    release(bench.device)


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


RUNNERS = {"env": run_env, "equality": run_equality, "build": run_build, "engine": run_engine,
           "baseline": run_baseline, "decode": run_decode, "profile": run_profile, "attention": run_attention,
           "cli": run_cli, "compiled": run_compiled, "e2e": end_to_end.run_e2e, "bf16_demo": run_bf16_demo,
           "pruning": run_pruning, "segments": end_to_end.run_segments, "e2e_compiled": end_to_end.run_e2e_compiled,
           "qwen2_5_vl": run_qwen2_5_vl}


def main() -> None:
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
    args = parser.parse_args()
    profile = DRY if args.cpu_dry_run else GPU
    if profile is GPU and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --cpu-dry-run")
    wanted = [stage for name in args.stages.split(",") if name.strip()
              for stage in STAGE_SETS.get(name.strip(), [name.strip()])]
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
        print(f"[{elapsed:6.1f} s] {name} ...", flush=True)
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
        path = bench.save()
        print(f"[{time.perf_counter() - bench.started:6.1f} s] {name} done in {bench.stage(name)['stage_s']} s"
              f"{' with an error' if 'error' in bench.stage(name) else ''}", flush=True)
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
