"""The GPU run's state between stages (the profile, the device, what is loaded, the results so far, saved after
each stage), and a stage run in a child process of its own that takes up what the child saved."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import real_size
import summary
import torch
import workload
from run_plan import DRY, DTYPE, STAGES, Profile

from tarsier_batch import Captioner, CaptionSettings, SamplingParams

# The stage in a child process is run by the entry script, like the stages its parent runs.
ENTRY = Path(__file__).resolve().with_name("gpu_bench.py")


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
            self.build()
        return self.checkpoint

    def build(self) -> None:
        """The `build` stage: the real-size checkpoint, weights drawn on the device, written to the workdir."""
        path, info = real_size.build(self.workdir, self.profile.geometry, None, DTYPE, self.device)
        assert path == self.checkpoint
        self.stage("build").update(info)
        release(self.device)

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


def run_in_child(bench: Bench, stage: str, timeout_s: float) -> int | str:
    """Run `stage` in a child process of its own group (killed past `timeout_s`), with the results so far; then
    take up what it saved. Its exit code, or "timed out"."""
    bench.save()
    command = [sys.executable, str(ENTRY), "--in-child", "--stages", stage,
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
