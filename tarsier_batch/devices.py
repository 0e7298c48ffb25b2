"""Device and dtype choice, batch sizing and out-of-memory handling."""

from __future__ import annotations

import re

import torch

from .families import CaptionModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_BATCH_SIZE = 4
MAX_AUTO_BATCH_SIZE = 64
# Activations, the vision tower and allocator slack on top of the KV cache, as a factor.
_MEMORY_HEADROOM = 1.5


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"--device {name}: use auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 (float16 where unsupported) on CUDA."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def auto_batch_size(model: CaptionModel, device: torch.device, frames: int, max_new_tokens: int) -> int:
    """A batch that fits the free accelerator memory with headroom; a small fixed size on the CPU."""
    if device.type != "cuda":
        return CPU_BATCH_SIZE
    free_bytes, _ = torch.cuda.mem_get_info(device)
    tokens = model.estimated_prompt_tokens(frames) + max_new_tokens
    per_item = tokens * model.kv_bytes_per_token() * _MEMORY_HEADROOM
    return max(1, min(MAX_AUTO_BATCH_SIZE, int(free_bytes // per_item)))


def is_out_of_memory(error: BaseException) -> bool:
    """The device (or host) ran out of memory: smaller batches may succeed."""
    return isinstance(error, torch.OutOfMemoryError)


def is_fatal_device_error(error: BaseException) -> bool:
    """An accelerator error after which the device is unusable (e.g. a device-side assert)."""
    return isinstance(error, torch.AcceleratorError) and not is_out_of_memory(error)


def release_cached_memory(device: torch.device) -> None:
    """Return cached blocks to the device after a failed batch."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
