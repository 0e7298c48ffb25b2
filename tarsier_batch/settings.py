"""Every setting of a captioning run, each rule checked once, and the records made from them.

`CaptionSettings` decides what a loaded model produces and how it runs (it is what a `Captioner`
and a Ray actor are built from); `RunSettings` adds what a run does with its output (resume,
limits, flushing). Both check their rules when made, so a bad value is refused before any file
is read or any model loaded. A `SettingsError` names settings by their field names; the CLI
shows the same message in its own words, its flags (`SettingsError.worded`).

`resume_settings` is the one place that says which settings decide a caption: they are stored
with the output, and a later run must match them to continue it.

No torch here: the CLI checks its flags through this module before importing anything heavy.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .families.catalog import DEFAULT_MODEL, DEFAULT_PRUNE_LAYER
from .inputs.prompt_sets import PromptSetError, Question, check_prompt_set
from .inputs.segments import Segmenting
from .media import MAX_IMAGE_PIXELS

if TYPE_CHECKING:
    from .inputs.sharding import Shard

PRUNE_METHODS = ("fastv", "temporal")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")
KEY_MODES = ("path", "sha256")
# Finished rows reach a part file within about a second (at once when they come slower than that), and
# fast rows share one: a part per second at most, so a `kill -9` loses about a second of work.
FLUSH_SECONDS = 1.0
FLUSH_ROWS = 4096        # and at most this many rows per part (one Parquet row group)


class SettingsError(ValueError):
    """A setting, or a combination of settings, that cannot work.

    The message names settings by their field names (`top_p`); `worded` names them in a caller's
    own words (`--top-p`). Its template holds each name as `{field}`.
    """

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.worded({}))

    def worded(self, words: Mapping[str, str]) -> str:
        """The message with each setting named as `words` says (a field it lacks keeps its name)."""
        return self.template.format_map(_Words(words))


class _Words(dict):  # type: ignore[type-arg]
    def __missing__(self, name: str) -> str:
        return name


def shown(value: Any) -> str:
    """`value` as it goes into a message template (its braces are not placeholders)."""
    return str(value).replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops. Temperature 0 means greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float | None = None  # None: the checkpoint's generation_config.json value

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

    model: str = DEFAULT_MODEL
    prompt: str | None = None          # replaces the default instruction
    prompt_set: tuple[Question, ...] = ()   # several named questions per item, each answer in its own columns
    frames: int | None = None          # None: the family's default (Tarsier2: 16, v1: 8)
    batch_size: int | None = None      # rows running at once; None: chosen for the device
    max_batch_tokens: int = 4096       # positions computed per engine step (decode tokens + prefill chunks)
    prefill_chunk: int = 2048          # 0: prefill each prompt whole
    kv_cache_gb: float | None = None   # None: what the device can spare (CUDA), up to 4 GiB (CPU)
    offload_kv: bool = False           # keep prefilling rows' KV in host memory
    prefix_cache: bool = True          # reuse computed prompt pages seen earlier (the same captions either way)
    prune_vision: float = 0.0          # share of each row's vision tokens dropped after prune_layer (0: off)
    prune_layer: int | None = None     # None: DEFAULT_PRUNE_LAYER (when pruning with fastv)
    # PRUNE_METHODS: before the LM by frame change, or after layer K by attention. None: temporal, which keeps the
    # captions (the demo model at R = 0.5: 98 % right, fastv 89 %), or fastv when prune_layer is given (its K).
    prune_method: str | None = None
    compile_step: bool = False         # the layers and the decode attention through torch.compile
    cuda_graphs: bool = True           # on CUDA, decode steps recorded and replayed as CUDA graphs
    fused_attention: bool = True       # on CUDA with Triton, decode attention in one fused kernel
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"
    device: str = "auto"
    workers: int | None = None         # processes decoding and preprocessing media; None: default_workers()
    decode_timeout_s: float | None = 120.0  # an item decoding longer fails (its worker is killed)
    decode_memory_gb: float | None = 8.0    # memory limit of one decoding worker
    max_image_pixels: int | None = MAX_IMAGE_PIXELS   # larger images fail undecoded (None: no limit)
    preflight: bool = True             # check the model and the run fit in memory before loading (preflight.py)
    isolate_decoding: bool = True      # False: decode in threads (no crash or hang protection; for benchmarks
                                       # and callers that isolate already)

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


@dataclass(frozen=True)
class RunSettings:
    """A run's settings: the captioning ones, and what the run does with its output."""

    caption: CaptionSettings = field(default_factory=CaptionSettings)
    with_token_ids: bool = False     # a generated_ids column
    long: bool = False               # with a prompt set, the output holds a row per (item, question)
    key: str = "path"                # what identifies a finished item: path (+ size, mtime) or sha256 (content)
    shard: Shard | None = None       # caption only this shard of the items
    overwrite: bool = False          # start from scratch: replace the output
    retry_errors: bool = False       # caption again the items whose stored rows are errors
    prune_missing: bool = False      # drop stored rows of files that no longer exist
    limit: int | None = None         # caption at most this many items (the first that need it)
    fail_on_empty: bool = False      # a run over inputs with no media fails
    flush_rows: int = FLUSH_ROWS     # save finished rows every this many rows...
    flush_seconds: float = FLUSH_SECONDS   # ...or this long after the last save
    segments: Segmenting = field(default_factory=Segmenting)   # a row per file, or per window or scene of a video

    def __post_init__(self) -> None:
        if self.key not in KEY_MODES:
            raise SettingsError(f"{{key}} {shown(repr(self.key))}: use {' or '.join(KEY_MODES)}")
        for name in ("limit", "flush_rows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{{{name}}} {shown(value)}: give at least 1")
        if self.flush_seconds < 0:
            raise SettingsError(f"{{flush_seconds}} {shown(self.flush_seconds)}: give 0 or more")

    def check_streamable(self) -> None:
        """Refuse the settings that continue an output file, for a run that streams its rows instead."""
        given = [f"{{{name}}}" for name in ("overwrite", "retry_errors", "prune_missing") if getattr(self, name)]
        if given:
            raise SettingsError(f"{', '.join(given)} continue an output file; '-o -' streams to stdout and "
                                f"keeps nothing to continue")


@dataclass(frozen=True)
class RaySettings:
    """Where and how wide a run captions on a Ray cluster."""

    address: str                     # 'auto', ray://HOST:10001, or 'local' (start a cluster here)
    actors: tuple[int, int] = (1, 1)   # the captioning actor pool: (N, N), or bounds Ray scales between
    gpus_per_actor: float = 1.0

    def __post_init__(self) -> None:
        low, high = self.actors
        if not 1 <= low <= high:
            raise SettingsError(f"{{actors}} {low}-{high}: give 1 <= MIN <= MAX actors")
        if self.gpus_per_actor < 0:
            raise SettingsError(f"{{gpus_per_actor}} {shown(self.gpus_per_actor)}: give 0 or more")


@dataclass(frozen=True)
class Resolved:
    """What loading the model settles that the settings may leave open."""

    model_revision: str | None
    frames: int
    repetition_penalty: float | None


def resume_settings(settings: RunSettings, resolved: Resolved | None = None) -> dict[str, Any]:
    """The settings that decide a caption, as stored with the output; a later run must match them to continue.

    Without `resolved` (before the model is loaded), only what the settings say: frames and the
    repetition penalty only when given, so that a mismatch is answered before loading. With it,
    every value as the loaded model resolved it.
    """
    caption, sampling = settings.caption, settings.caption.sampling
    decided: dict[str, Any] = {"model": caption.model}
    if resolved is not None:
        decided["model_revision"] = resolved.model_revision
    decided["prompt"] = caption.prompt
    # Names and token limits, not texts: a later run may add questions or change their texts (outputs.resume
    # asks only those), not drop one or change its limit.
    decided["prompt_set"] = {question.name: question.max_new_tokens for question in caption.prompt_set} or None
    frames = resolved.frames if resolved is not None else caption.frames
    if frames is not None:
        decided["frames"] = frames
    decided.update(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                   seed=sampling.seed)
    penalty = resolved.repetition_penalty if resolved is not None else sampling.repetition_penalty
    if resolved is not None or penalty is not None:
        decided["repetition_penalty"] = penalty
    decided.update(prune=caption.pruning, with_token_ids=settings.with_token_ids, key=settings.key,
                   shard=str(settings.shard) if settings.shard else None,
                   segments=None if settings.segments.mode == "whole" else str(settings.segments))
    return decided
