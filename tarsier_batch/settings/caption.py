"""The settings of captioning: what a loaded model produces and how it runs.

`CaptionSettings` is what a `Captioner` and a Ray actor are built from. Each field is declared once
(`declaring.setting`: its flag, help, config key, whether it decides a caption); the settings check
their rules when made, so a bad value is refused before any file is read or any model loaded.

No torch here: the CLI checks its flags through this module before importing anything heavy.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from ..families.catalog import DEFAULT_MODEL, DEFAULT_PRUNE_LAYER
from ..inputs.prompt_sets import PromptSetError, Question, check_prompt_set
from ..media import MAX_IMAGE_PIXELS
from ..media.sampling import RATE_MAX_FRAMES, TEMPORAL_PATCH_FRAMES, FrameCount, FramesAtRate
from .declaring import SettingsError, setting, shown

PRUNE_METHODS = ("fastv", "temporal")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops. Temperature 0 means greedy."""

    max_new_tokens: int = setting(512, group="sampling", metavar="N", at_least=1, fingerprint=True,
                                  help="Most tokens generated per caption.")
    temperature: float = setting(0.0, group="sampling", metavar="T", at_least=0.0, fingerprint=True,
                                 help="0 is greedy decoding; above 0 samples.")
    top_p: float = setting(1.0, group="sampling", metavar="P", fingerprint=True,
                           help="Nucleus sampling mass in (0, 1] (with --temperature > 0).")
    seed: int = setting(0, group="sampling", metavar="N", at_least=0, fingerprint=True,
                        help="Seed for sampling; each file gets its own stream, derived from its key.")
    repetition_penalty: float | None = setting(  # None: the checkpoint's generation_config.json value
        None, group="sampling", metavar="X", at_least=0.01, show_default=False, fingerprint=True,
        help="Penalty on tokens already in the prompt or caption (1: none) [default: the checkpoint's "
             "generation_config.json].")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SettingsError(f"{{max_new_tokens}} {shown(self.max_new_tokens)}: give at least 1")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise SettingsError(f"{{repetition_penalty}} {shown(self.repetition_penalty)}: give a positive "
                                f"penalty (1: none)")
        if self.temperature < 0:
            raise SettingsError(f"{{temperature}} {shown(self.temperature)}: give 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise SettingsError(f"{{top_p}} {shown(self.top_p)}: give a probability mass in (0, 1]; "
                                f"1 keeps every token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def row_seed(self, key: str) -> int | None:
        """The seed of one item's sampling stream, from the run seed and the item's key (its path).

        Each item draws from its own stream, so a sampled caption does not depend on which
        other items share its batch, or on the batch size. None when decoding greedily.
        """
        if self.greedy:
            return None
        digest = hashlib.blake2b(f"{self.seed}\0{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1   # 63 bits: a non-negative int64


@dataclass(frozen=True)
class CaptionSettings:
    """Everything that decides what a loaded model produces and how it runs."""

    model: str = setting(
        DEFAULT_MODEL, group="model", provenance="model", metavar="NAME|DIR", env="TARSIER_MODEL", fingerprint=True,
        help="Checkpoint directory, Hugging Face id, the shipped demo model ('demo': captions synthetic clips of "
             "moving shapes, nothing else) or a built-in random model ('tiny-random-tarsier2', 'tiny-random'); see "
             "'tarsier models'.")
    prompt: str | None = setting(
        None, group="prompt", provenance="prompt", metavar="TEXT", show_default=False, fingerprint=True,
        help="Instruction replacing the model's default ('Describe the video in detail.').")
    # Several named questions per item, each answer in its own columns. The command makes it from two flags.
    # In the fingerprint by names and token limits, not texts: a later run may add questions or change their texts
    # (outputs.resume asks only those), not drop one or change its limit. The provenance keeps them whole.
    prompt_set: tuple[Question, ...] = setting(
        (), group="prompt", provenance="prompt_set", flags=None, worded="--ask/--prompts", fingerprint=True,
        record=lambda settings: {question.name: question.max_new_tokens for question in settings.prompt_set} or None)
    frames: int | None = setting(
        None, group="rows", provenance="frames", metavar="N", at_least=1, show_default=False, fingerprint=True,
        help="Frames sampled uniformly from each video or GIF [default: 16 for Tarsier2 and Qwen-VL, 8 for Tarsier "
             f"v1]; with --fps, the most a clip gives [default: {RATE_MAX_FRAMES}].")
    # None: a fixed count per clip (--frames), as before this setting existed, so earlier outputs resume as they are.
    fps: float | None = setting(
        None, group="rows", provenance="fps", metavar="RATE", show_default=False, fingerprint=True,
        help="Qwen-VL families: sample each video at RATE frames a second of it, as qwen-vl-utils does (at least 4 "
             "frames, at most --frames, an even count), instead of one count for every video [default: off].")
    sampling: SamplingParams = field(default_factory=SamplingParams)
    batch_size: int | None = setting(   # rows running at once
        None, group="engine", provenance="batch_size", metavar="N", at_least=1, env="TARSIER_BATCH_SIZE",
        show_default=False,
        help="Most items generating at once; a finished item's place is taken at the next step [default: 16 on CPU, "
             "32 on CUDA].")
    max_batch_tokens: int = setting(
        4096, group="engine", provenance="max_batch_tokens", metavar="N", at_least=1,
        help="Positions computed per model step: one per decoding item, the rest for prefill chunks.")
    prefill_chunk: int = setting(
        2048, group="engine", provenance="prefill_chunk", metavar="N", at_least=0,
        help="Prefill long prompts in chunks of at most this many positions (0: whole).")
    kv_cache_gb: float | None = setting(
        None, group="engine", provenance="kv_cache_tokens", metavar="GIB", at_least=0.001, env="TARSIER_KV_CACHE_GB",
        show_default=False,
        help="KV cache size in GiB [default: what CUDA can spare after loading; on CPU min(4, RAM/4)].")
    offload_kv: bool = setting(
        False, group="engine", provenance="offload_kv",
        help="Keep a prefilling item's KV cache in host memory until it decodes (long videos on small GPUs; no effect "
             "on CPU).")
    prefix_cache: bool = setting(
        True, group="engine", provenance="prefix_cache", flags=("--prefix-cache/--no-prefix-cache",),
        help="Keep the computed KV of prompts' full pages, and let an item whose prompt starts the same way (the same "
             "clip and prompt under a second path, an item preempted and coming back) take them instead of computing "
             "them. Same captions either way.")
    preflight: bool = setting(   # preflight.py
        True, group="engine", flags=("--preflight/--no-preflight",),
        help="Before loading, estimate the memory the model and this run need (weights at --dtype, KV cache, "
             "activations) and stop at once with the numbers and a fix if they do not fit.")
    compile_step: bool = setting(
        False, group="engine", provenance="compile", flags=("--compile",),
        help="Run the model's layers, vision blocks and decode attention through torch.compile: fused kernels, after a "
             "start-up compile (tens of seconds; needs a C++ compiler on CPU, Triton on CUDA). Same captions in "
             "float32.")
    cuda_graphs: bool = setting(
        True, group="engine", provenance="cuda_graphs", flags=("--cuda-graphs/--no-cuda-graphs",),
        help="On CUDA, record each decode step as a CUDA graph (once per power-of-two size) and replay it: one "
             "launch instead of ~1,900 kernel launches a step. Same captions in float32.")
    fused_attention: bool = setting(
        True, group="engine", provenance="fused_attention", flags=("--fused-attention/--no-fused-attention",),
        help="On CUDA, decoding rows attend in one fused Triton kernel that reads each row's KV pages where they "
             "lie (otherwise a split attention of torch ops). Same captions in float32.")
    # Vision-token pruning decides a caption; its three fields are recorded as one value (`pruning`).
    prune_vision: float = setting(
        0.0, group="engine", provenance="prune", metavar="R", fingerprint=True, recorded_as="prune",
        record=lambda settings: settings.pruning,
        help="Drop this share of each item's vision tokens (by --prune-method): a faster prefill and a smaller KV "
             "cache, but not the official output (0: off).")
    prune_layer: int | None = setting(   # None: DEFAULT_PRUNE_LAYER (when pruning with fastv)
        None, group="engine", metavar="K", show_default=False,
        help="With --prune-method fastv: the first language-model layer that sees only the kept vision tokens, 1 <= K "
             "< layers [default: 2].")
    # Before the LM by frame change, or after layer K by attention. None: temporal, which keeps the captions (the
    # demo model at R = 0.5: 98 % right, fastv 89 %), or fastv when prune_layer is given (its K).
    prune_method: str | None = setting(
        None, group="engine", choices=PRUNE_METHODS, show_default=False,
        help="temporal: before the language model, drop the vision tokens that changed least since the previous "
             "frame (the first frame stays whole); fastv: drop the vision tokens the last prompt token attends to "
             "least, after --prune-layer [default: temporal, which keeps captions closer to unpruned; fastv with "
             "--prune-layer].")
    dtype: str = setting(
        "auto", group="media", provenance="dtype", choices=DTYPES, env="TARSIER_DTYPE",
        help="Weights and compute dtype [auto: float32 on CPU, bfloat16 on CUDA].")
    device: str = setting("auto", group="media", provenance="device", metavar="DEVICE", env="TARSIER_DEVICE",
                          help="auto, cpu, cuda or cuda:N.")
    workers: int | None = setting(   # processes decoding and preprocessing media; None: default_workers()
        None, group="media", provenance="decode_workers", metavar="N", at_least=1, env="TARSIER_WORKERS",
        show_default=False,
        help="Worker processes decoding media ahead of the model [default: cores - 1, at most 4 on the CPU, "
             "32 on a GPU].")
    decode_timeout_s: float | None = setting(
        120.0, group="media", provenance="decode_timeout_s", flags=("--decode-timeout",), key="decode_timeout",
        metavar="SECONDS", at_least=0.1,
        help="Seconds one item may take to decode before its worker is killed and the item fails.")
    decode_memory_gb: float | None = setting(
        8.0, group="media", provenance="decode_memory_gb", metavar="GIB", at_least=0.5,
        help="Memory one decoding worker may use (GiB); an item above it fails.")
    max_image_pixels: int | None = setting(   # None: no limit
        MAX_IMAGE_PIXELS, group="media", metavar="N", at_least=1,
        help="Images (and GIFs) of more pixels fail undecoded: decompression bombs. A JPEG above 89 Mpx is read "
             "reduced as it decodes.")
    # False: decode in threads (no crash or hang protection; for benchmarks and callers that isolate already).
    isolate_decoding: bool = setting(True, group="media", flags=None)

    def __post_init__(self) -> None:
        if self.prompt is not None and not self.prompt.strip():
            raise SettingsError("{prompt} is empty; leave it out to use the model's default instruction")
        if self.prompt_set and self.prompt is not None:
            raise SettingsError("{prompt} and {prompt_set} do not go together: make the prompt one question of the set")
        object.__setattr__(self, "prompt_set", tuple(self.prompt_set))   # hashable (Ray caches by settings)
        try:
            check_prompt_set(self.prompt_set)
        except PromptSetError as error:
            raise SettingsError("{prompt_set}: " + shown(error)) from None
        self._check_rate()
        for name in ("frames", "batch_size", "workers", "max_image_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{{{name}}} {shown(value)}: give at least 1")
        if self.max_batch_tokens < 1:
            raise SettingsError(f"{{max_batch_tokens}} {shown(self.max_batch_tokens)}: give at least 1")
        if self.batch_size is not None and self.max_batch_tokens < self.batch_size:
            raise SettingsError(f"{{max_batch_tokens}} {self.max_batch_tokens} is below {{batch_size}} "
                                f"{self.batch_size}: every generating item needs one position per step")
        if self.prefill_chunk < 0:
            raise SettingsError(f"{{prefill_chunk}} {self.prefill_chunk}: give 0 (off) or a positive size")
        for name in ("kv_cache_gb", "decode_timeout_s", "decode_memory_gb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(f"{{{name}}} {shown(value)}: give a positive value")
        self._check_pruning()
        if self.dtype not in DTYPES:
            raise SettingsError(f"{{dtype}} {shown(repr(self.dtype))}: use {', '.join(DTYPES)}")
        if not DEVICE_NAMES.fullmatch(self.device):
            raise SettingsError(f"{{device}} {shown(repr(self.device))}: use auto, cpu, cuda or cuda:N")

    def _check_rate(self) -> None:
        if self.fps is None:
            return
        if not self.fps > 0:
            raise SettingsError(f"{{fps}} {shown(self.fps)}: give a positive rate (frames a second)")
        if self.frames is not None and self.frames < TEMPORAL_PATCH_FRAMES:
            raise SettingsError(f"{{frames}} {self.frames} with {{fps}}: a clip gives at least "
                                f"{TEMPORAL_PATCH_FRAMES} frames (a temporal patch); give {{frames}} 2 or more")

    def most_frames(self, default_frames: int) -> int:
        """The most frames a clip gives, which plans a run's memory: the fixed count (`frames`, else the family's
        `default_frames`), or with `fps` the cap (`frames`, else qwen-vl-utils' own)."""
        return self.frames or (RATE_MAX_FRAMES if self.fps is not None else default_frames)

    def frame_count(self, default_frames: int) -> FrameCount:
        """How many frames each clip gives: the fixed count, or with `fps` its rate up to the cap (a clip of
        unknown rate: the fixed count it would give without `fps`)."""
        most = self.most_frames(default_frames)
        return most if self.fps is None else FramesAtRate(self.fps, most, self.frames or default_frames)

    def _check_pruning(self) -> None:
        if self.prune_method is None:
            object.__setattr__(self, "prune_method", "fastv" if self.prune_layer is not None else "temporal")
        if not 0 <= self.prune_vision < 1:
            raise SettingsError(f"{{prune_vision}} {shown(self.prune_vision)}: give the share of vision tokens "
                                f"to drop, 0 <= R < 1 (0: off)")
        if self.prune_method not in PRUNE_METHODS:
            raise SettingsError(f"{{prune_method}} {shown(repr(self.prune_method))}: use {', '.join(PRUNE_METHODS)}")
        if self.prune_layer is not None and self.prune_vision == 0:
            raise SettingsError("{prune_layer} needs {prune_vision} R > 0 (pruning is off)")
        if self.prune_layer is not None and self.prune_method == "temporal":
            raise SettingsError("{prune_layer} is for {prune_method} fastv; temporal pruning works before the "
                                "language model: leave out one of them")
        if self.prune_layer is not None and self.prune_layer < 1:
            raise SettingsError(f"{{prune_layer}} {self.prune_layer}: the first layer can only see every token; "
                                f"give K >= 1")
        if self.prune_method == "fastv" and self.prune_vision == 0:   # the default method is temporal's
            raise SettingsError("{prune_method} fastv has no effect without {prune_vision} R > 0 (pruning is off)")
        if self.prune_vision > 0 and self.prune_method == "fastv" and self.offload_kv:
            raise SettingsError("{offload_kv} and {prune_vision} with {prune_method} fastv do not work together yet; "
                                "leave one out, or use {prune_method} temporal")

    @property
    def pruning(self) -> dict[str, float | int | str] | None:
        """Vision-token pruning as it is recorded: None when off (also what outputs written before pruning
        existed read as: they were not pruned), else the share dropped and the first layer without them
        (fastv, recorded as before the method could be chosen), or the share and the method (temporal)."""
        if self.prune_vision == 0:
            return None
        if self.prune_method == "temporal":
            return {"vision": self.prune_vision, "method": "temporal"}
        layer = self.prune_layer if self.prune_layer is not None else DEFAULT_PRUNE_LAYER
        return {"vision": self.prune_vision, "layer": layer}

    @property
    def temporal_pruning(self) -> float:
        """The share of vision vectors dropped before the language model (0: none)."""
        return self.prune_vision if self.prune_method == "temporal" else 0.0
