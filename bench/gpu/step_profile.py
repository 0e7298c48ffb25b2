"""Where a step's time goes: torch.profiler over the engine's eager decode steps and a prefill.

The decode figures say how far a step is from its floor; this says why. For each profiled piece it keeps the
ops that took the most device time and the most host time (self time, so nothing counts twice), the kernels
launched per step, and the step's wall time against the device's busy time: a step whose device is idle
most of its wall time is bound by the host launching kernels (CUDA graphs are the cure); one whose device
is busy is bound by the kernels themselves (the top device ops say which).
"""

from __future__ import annotations

import collections
import time
import traceback
import warnings
from pathlib import Path

import real_size
import torch
from torch.profiler import ProfilerActivity, profile

from tarsier_batch.engine import Engine
from tarsier_batch.families.base import ProcessedPrompt

TOP = 15
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def decode_steps(engine: Engine, rows: int, context: int, steps: int) -> dict:
    """`steps` eager decode steps of `rows` rows at `context` positions (after two unprofiled ones)."""
    device = engine.model.device
    real_size.admit_decoding(engine, rows, context, steps + 4)
    for _ in range(2):
        engine.step()
    return _profiled(device, steps, engine.step)


def prefill(engine: Engine, prompts: list[ProcessedPrompt]) -> dict:
    """`prompts` prefilled through the engine (one token each): the vision tower, the chunks, the first token."""
    device = engine.model.device

    def run() -> None:
        for index, prompt in enumerate(prompts):
            engine.add(prompt, payload=index, max_new_tokens=1)
        while engine.has_work:
            engine.step()

    return _profiled(device, 1, run)


def prefill_sync_sites(engine: Engine, prompts: list[ProcessedPrompt]) -> list[dict]:
    """Where a prefill of `prompts` makes the host wait for the device: each synchronising op's Python callers
    (torch's sync debug mode), by count. A wait drains the device's queue, which then idles while the host
    launches again; a GPU prefill's idle time is mostly these."""
    device = engine.model.device
    if device.type != "cuda":
        return []
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            frames = [frame for frame in traceback.extract_stack()[:-1] if "/warnings.py" not in frame.filename]
            sites[" <- ".join(f"{Path(frame.filename).name}:{frame.lineno}" for frame in frames[-4:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for index, prompt in enumerate(prompts):
                engine.add(prompt, payload=index, max_new_tokens=1)
            while engine.has_work:
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"site": site, "calls": calls} for site, calls in sites.most_common(2 * TOP)]


def _profiled(device: torch.device, repeats: int, call) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    real_size.synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        real_size.synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1000 / repeats
    averages = prof.key_averages()
    on_gpu = device.type == "cuda"

    def top(attr: str) -> list[dict]:
        ranked = sorted(averages, key=lambda event: getattr(event, attr), reverse=True)[:TOP]
        return [{"name": event.key[:120], "calls_per_repeat": round(event.count / repeats, 1),
                 "ms_per_repeat": round(getattr(event, attr) / 1000 / repeats, 3)} for event in ranked]

    result: dict = {"wall_ms": round(wall_ms, 3), "top_host_ops": top("self_cpu_time_total")}
    if on_gpu:   # on the CPU the host's ops are the device's
        busy_ms = sum(event.self_device_time_total for event in averages
                      if event.device_type == torch.autograd.DeviceType.CUDA) / 1000 / repeats
        result.update({"device_busy_ms": round(busy_ms, 3),
                       "kernel_launches": sum(event.count for event in averages if event.key in LAUNCHES) / repeats,
                       "top_device_ops": top("self_device_time_total")})
    return result
