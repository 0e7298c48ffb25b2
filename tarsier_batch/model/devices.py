"""Device and dtype choice, memory budgets and out-of-memory handling."""

from __future__ import annotations

import os

import torch

from ..settings import SettingsError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Rows decoding at once when --batch-size is not given. On CUDA the KV cache decides how many
# rows really fit; the cap bounds the per-step work that does not grow with the GPU.
CPU_MAX_ROWS = 16
CUDA_MAX_ROWS = 32
# The KV cache on the CPU: at most this much, and at most a quarter of the machine's memory.
CPU_KV_CACHE_BYTES = 4 * 2**30
# On CUDA the KV cache takes what is free after loading, less room for the step's activations
# (per token of --max-batch-tokens: hidden states, MLP and attention outputs, logits) and the
# vision tower; the cache itself is allocated once, so this is the only headroom there is.
CUDA_RESERVED_BYTES = 2**30
CUDA_ACTIVATION_BYTES_PER_BATCH_TOKEN = 192 * 2**10
CUDA_KV_SHARE = 0.9


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU (`name` is a checked setting)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(f"{{device}} {name}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SettingsError(f"{{device}} {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 (float16 where unsupported) on CUDA."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[name]   # a checked setting (settings.DTYPES)


def default_max_rows(device: torch.device) -> int:
    return CUDA_MAX_ROWS if device.type == "cuda" else CPU_MAX_ROWS


def kv_cache_bytes(device: torch.device, requested_gb: float | None, max_batch_tokens: int) -> int:
    """Bytes for the KV cache: as requested, else what the device can spare."""
    if requested_gb is not None:
        return int(requested_gb * 2**30)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        activations = CUDA_RESERVED_BYTES + max_batch_tokens * CUDA_ACTIVATION_BYTES_PER_BATCH_TOKEN
        return int(max(0, free_bytes - activations) * CUDA_KV_SHARE)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(CPU_KV_CACHE_BYTES, total // 4)


def is_out_of_memory(error: BaseException) -> bool:
    """The device (or host) ran out of memory: smaller steps may succeed."""
    return isinstance(error, torch.OutOfMemoryError)


def is_fatal_device_error(error: BaseException) -> bool:
    """An accelerator error after which the device is unusable (e.g. a device-side assert)."""
    return isinstance(error, torch.AcceleratorError) and not is_out_of_memory(error)


def release_cached_memory(device: torch.device) -> None:
    """Return cached blocks to the device after a failed step."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
