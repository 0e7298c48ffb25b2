"""Will the model and the run fit in memory? Answered before any weight is read.

Without a check, a checkpoint too big for the machine loads for a while and is then killed without a
word (on the CPU by the kernel's OOM killer, on a GPU by an out-of-memory error mid-load). The estimate here
comes from the checkpoint's own files and the run's settings:

- weights: every tensor in the safetensors headers at the dtype it will be loaded in (integer
  tensors keep theirs), plus the largest one once more in its stored dtype while it is converted;
- the KV cache: on a GPU the whole cache, allocated up front; on the CPU the pages the rows can
  fill (the cache reserves its memory untouched, so only what the batch writes is committed):
  rows at once x (the longest prompt the frames allow + new tokens), up to the cache's size;
- activations of one step (`max_batch_tokens` positions through one layer at a time: hidden
  states, attention and MLP intermediates, the sampled rows' logits) and the vision tower's
  micro-batch of frames, with the DeepStack features its vision vectors carry where the family
  declares them (`FamilyInfo.deepstack_layers_key`);
- decoded items waiting for a row (their preprocessed pixels).

It is compared with what the device can give: free device memory on CUDA, and on the CPU the
kernel's MemAvailable, lowered to the cgroup's remaining limit when the process runs in one (a
container's limit is what the OOM killer enforces).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..families.catalog import family_of_config
from ..families.loading import family_of_checkpoint
from ..families.weights import weight_files
from ..settings import CaptionSettings, SettingsError
from .devices import CUDA_RESERVED_BYTES, kv_cache_bytes

_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                 "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_EMBEDDING_SUFFIX = "embed_tokens.weight"
# Keys older exports saved that the model recomputes (see families.weights.RECOMPUTED_BUFFERS).
_SKIPPED_SUFFIXES = ("position_ids", "rotary_emb.inv_freq")
# What a step keeps alive per position, in hidden-size and MLP-size vectors of the model's dtype: the residual
# stream, the normed input, queries/keys/values and the attention output (~6 hidden), and the MLP's gate, up and
# their product (3 intermediate). Measured against peak RSS on the test and demo checkpoints (see bench/README).
_HIDDEN_VECTORS_PER_POSITION = 6
_MLP_VECTORS_PER_POSITION = 3
# What captioning adds to the process besides the parts estimated: the decoders' and writers' libraries imported on
# the way (~22 MB), threads' allocation arenas, result and transfer buffers. Measured as peak RSS minus the other
# parts on the test and demo checkpoints (75-90 MB; see bench/README).
RUNTIME_BYTES = 100 * 10**6
# Float32 bytes per position per vision hidden unit in one vision micro-batch (patch embeddings, the MLP,
# attention projections), from the same measurements.
_VISION_BYTES_PER_POSITION_UNIT = 4 * 8


class NotEnoughMemory(SettingsError):
    """The model and the run's settings need more memory than the device has: the caller can fix it."""


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run will hold at its peak, in bytes, on top of what the process holds already."""

    weights: int
    kv_cache: int
    activations: int     # one step's, the vision tower's, and the run's own (RUNTIME_BYTES)
    pixels: int          # decoded items waiting for a row or being prefilled
    process: int         # what the process held before loading (on the CPU; what MemAvailable has counted already)

    @property
    def total(self) -> int:
        """What the run adds to the process."""
        return self.weights + self.kv_cache + self.activations + self.pixels

    @property
    def peak(self) -> int:
        """The process's expected peak on the device (on the CPU its resident memory)."""
        return self.process + self.total


@dataclass(frozen=True)
class _Geometry:
    """What the estimate needs of config.json (every family keeps the language model under `text_config`)."""

    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_hidden: int
    deepstack_layers: int   # hidden-size vectors each vision vector carries besides its own (Qwen3-VL's DeepStack)

    @classmethod
    def of(cls, model_dir: Path) -> _Geometry:
        raw = json.loads((model_dir / "config.json").read_text())
        text, vision = raw.get("text_config", raw), raw.get("vision_config", {})
        heads = text["num_attention_heads"]
        deepstack_key = family_of_config(raw, str(model_dir / "config.json")).deepstack_layers_key
        return cls(layers=text["num_hidden_layers"], hidden=text["hidden_size"],
                   intermediate=text["intermediate_size"], kv_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads, vocab=text["vocab_size"],
                   # Qwen2-VL: hidden_size is the merger's output
                   vision_hidden=vision.get("embed_dim") or vision.get("hidden_size") or 0,
                   deepstack_layers=len(vision.get(deepstack_key) or []) if deepstack_key else 0)

    def kv_bytes_per_position(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype.itemsize


def weight_bytes(model_dir: Path, dtype: torch.dtype, device: torch.device) -> int:
    """What the checkpoint's tensors hold on `device` once loaded in `dtype`, and while loading, from the safetensors
    headers alone.

    On the CPU a tensor stored in `dtype` is used where the file is mapped, so the input embedding, read one row
    per token, stays mostly on disk; a tensor converted is a copy, and while its file is read that file's pages are
    mapped too: the largest such file counts once more (measured on a real-size checkpoint, see bench/README). On
    a GPU every tensor is a copy in device memory, and a converted one first arrives as stored.
    """
    total = converting = 0
    for path in weight_files(model_dir):
        file_stored = largest_converted = 0
        for name, entry in _header(path).items():
            if name == "__metadata__" or name.endswith(_SKIPPED_SUFFIXES):
                continue
            count = 1
            for size in entry["shape"]:
                count *= size
            stored = count * _STORED_BYTES.get(entry["dtype"], 4)
            file_stored += stored
            if entry["dtype"] != _SAFETENSORS_NAMES[dtype]:
                total += count * dtype.itemsize
                largest_converted = max(largest_converted, stored)
            elif device.type == "cpu" and name.endswith(_EMBEDDING_SUFFIX):
                continue
            else:
                total += stored
        if largest_converted:
            converting = max(converting, file_stored if device.type == "cpu" else largest_converted)
    return total + converting


def _header(path: Path) -> dict:
    """A safetensors file's header: 8 bytes of length, then that much JSON (no tensor data is read)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def estimate(model_dir: Path, settings: CaptionSettings, dtype: torch.dtype, device: torch.device,
             rows: int, prompt_positions: int, pixel_bytes: int) -> MemoryEstimate:
    """What loading `model_dir` and captioning with `settings` will need on `device`, with `rows` rows at once,
    prompts of at most `prompt_positions` positions, and decoded items' pixels of `pixel_bytes` held at once (in host
    memory: they count on the CPU only)."""
    geometry = _Geometry.of(model_dir)
    per_position = geometry.kv_bytes_per_position(dtype)
    # A prompt set's question may have its own, longer limit.
    longest_answer = max([question.max_new_tokens or 0 for question in settings.prompt_set]
                         + [settings.sampling.max_new_tokens])
    positions_per_row = prompt_positions + longest_answer
    if device.type == "cuda" and settings.kv_cache_gb is None:
        # The cache takes what is left after loading (devices.kv_cache_bytes); it must hold one row at least.
        kv = positions_per_row * per_position + CUDA_RESERVED_BYTES
    else:
        capacity = kv_cache_bytes(device, settings.kv_cache_gb, settings.max_batch_tokens)
        kv = capacity if device.type == "cuda" else min(capacity, rows * positions_per_row * per_position)
    step_positions = settings.max_batch_tokens
    language = step_positions * dtype.itemsize * (_HIDDEN_VECTORS_PER_POSITION * geometry.hidden
                                                  + _MLP_VECTORS_PER_POSITION * geometry.intermediate)
    logits = rows * geometry.vocab * 4 * 2   # the model's logits and their float32 copy for sampling
    vision_positions_per_batch = min(prompt_positions, step_positions * 4)
    vision = vision_positions_per_batch * geometry.vision_hidden * _VISION_BYTES_PER_POSITION_UNIT
    vision += _deepstack_bytes(geometry, dtype, step_positions, vision_positions_per_batch)
    process = 0
    if device.type == "cpu":
        # The model's code imported now rather than by the load: its modules (transformers' modeling and what they
        # import: torch's compiler, its distributed tensors, sympy; ~90 MB) are then part of the resident memory
        # the estimate starts from, as they will be at the peak.
        family_of_checkpoint(model_dir).code("loader")
        process = _resident_bytes()
    return MemoryEstimate(weights=weight_bytes(model_dir, dtype, device), kv_cache=kv,
                          activations=language + logits + vision + RUNTIME_BYTES,
                          pixels=pixel_bytes if device.type == "cpu" else 0,   # decoded pixels wait in host memory
                          process=process)


def _deepstack_bytes(geometry: _Geometry, dtype: torch.dtype, step_positions: int, vision_positions: int) -> int:
    """What DeepStack features add to a step: each vision vector's features (one hidden-size vector per layer that
    takes them) travel with it from the tower to the layers that add them, held for every vector of the blocks the
    step encodes (`vision_positions`) and twice for the step's `step_positions` inputs (the vision vectors gathered,
    then every position's input widened to carry them)."""
    return (vision_positions + 2 * step_positions) * geometry.deepstack_layers * geometry.hidden * dtype.itemsize


def _resident_bytes() -> int:
    """The process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def available_bytes(device: torch.device) -> int:
    """Memory the run can still take: free device memory on CUDA; on the CPU MemAvailable, or what is left
    under the process's cgroup limit when that is lower."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    left_in_cgroup = _cgroup_room()
    return min(available, left_in_cgroup) if left_in_cgroup is not None else available


def _meminfo_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1), or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        for folder in _cgroup_folders():
            try:
                limit = (folder / limit_file).read_text().strip()
                usage = int((folder / usage_file).read_text())
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= 2**60:   # v1 writes "no limit" as a huge number
                return None
            return int(limit) - usage
    return None


def _cgroup_folders() -> list[Path]:
    """Where this process's memory cgroup is: named in /proc/self/cgroup, mounted under /sys/fs/cgroup."""
    folders = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return folders
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                      # v2: one unified hierarchy
            folders.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):   # v1: the memory controller's own hierarchy
            folders.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return folders


def check_fits(needed: MemoryEstimate, available: int, device: torch.device, dtype: torch.dtype,
               settings: CaptionSettings, model_dir: Path, rows: int) -> None:
    """Raise `NotEnoughMemory` with the numbers and what would make it fit, unless `needed` fits `available`
    (`rows`: the rows the estimate counted at once)."""
    if needed.total <= available:
        return
    fixes = []
    if dtype.itemsize > 2:
        halved = weight_bytes(model_dir, torch.bfloat16, device)
        fixes.append(f"{{dtype}} bfloat16 (weights ~{_gb(halved)})")
    if needed.kv_cache > needed.weights // 8 or settings.kv_cache_gb is not None:
        fixes.append(f"a smaller {{kv_cache_gb}} (the cache needs ~{_gb(needed.kv_cache)})")
    if rows > 1:
        fixes.append("a smaller {batch_size}")
    if settings.fps is not None:   # every plan counts the cap's frames
        fixes.append("a lower {frames} (the most frames a clip gives at {fps})")
    if device.type == "cuda" and not settings.offload_kv:
        fixes.append("{offload_kv}")
    where = "free on " + str(device) if device.type == "cuda" else "available"
    raise NotEnoughMemory(
        f"the model and this run need ~{_gb(needed.total)} in {str(dtype).removeprefix('torch.')} (weights "
        f"{_gb(needed.weights)}, KV cache {_gb(needed.kv_cache)}, activations {_gb(needed.activations)}), "
        f"{_gb(available)} {where}: " + ("try " + " or ".join(fixes) + ", or " if fixes else "")
        + "skip this check with {preflight}")


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"
