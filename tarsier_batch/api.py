"""The library API: load a checkpoint once, then caption media items.

    from tarsier_batch import Captioner, CaptionSettings, discover
    captioner = Captioner(CaptionSettings(model="tiny-random"))
    for result in captioner.caption(discover(["./videos"]).items):
        print(result.path, result.caption)

This is what the CLI and a Ray worker call. Item-level problems (a corrupt file, an item that
does not fit in memory even alone) come back as results with an error; run-level problems (no
such model, bad settings) raise.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from . import __version__
from .catalog import DEFAULT_MODEL
from .checkpoints import resolve_model
from .devices import default_max_rows, kv_cache_bytes, resolve_device, resolve_dtype
from .engine import Engine, EngineConfig, SamplingParams, Sequence
from .families import CaptionModel, ProcessedPrompt, load_caption_model
from .media import Media, decoder_versions
from .sources import MediaItem
from .text import one_line, printable

# Decoded items waiting for the model hold their pixels; stop decoding ahead beyond this much.
LOOKAHEAD_PIXEL_BYTES = 2**30


@dataclass(frozen=True)
class CaptionSettings:
    """Everything that decides what a run produces and how it runs."""

    model: str = DEFAULT_MODEL
    prompt: str | None = None          # replaces the default instruction
    frames: int | None = None          # None: the family's default (Tarsier2: 16, v1: 8)
    batch_size: int | None = None      # rows running at once; None: chosen for the device
    max_batch_tokens: int = 4096       # positions computed per engine step (decode tokens + prefill chunks)
    prefill_chunk: int = 2048          # 0: prefill each prompt whole
    kv_cache_gb: float | None = None   # None: what the device can spare (CUDA), up to 4 GiB (CPU)
    offload_kv: bool = False           # keep prefilling rows' KV in host memory
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"
    device: str = "auto"
    workers: int = 2                   # threads decoding and preprocessing media

    def __post_init__(self) -> None:
        if self.frames is not None and self.frames < 1:
            raise ValueError("frames must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("batch size must be at least 1")
        if self.batch_size is not None and self.max_batch_tokens < self.batch_size:
            raise ValueError(f"--max-batch-tokens ({self.max_batch_tokens}) must be at least --batch-size "
                             f"({self.batch_size}): every running row decodes one token per step")
        if self.prefill_chunk < 0:
            raise ValueError("prefill chunk must be 0 (off) or positive")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError("--kv-cache-gb must be positive")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt must not be empty")


@dataclass
class CaptionResult:
    """One output row. `prompt_tokens` counts the merged prefill (text plus vision vectors)."""

    path: str
    media_type: str
    caption: str | None = None
    prompt: str | None = None
    num_frames: int | None = None
    frame_indices: list[int] | None = None
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    finish_reason: str = "error"
    error: str | None = None
    elapsed_s: float = 0.0
    generated_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Loaded:
    """An item after decoding and preprocessing (or the error that stopped it)."""

    index: int
    item: MediaItem
    seconds: float
    media: Media | None = None
    prompt: ProcessedPrompt | None = None
    error: str | None = None
    queued_at: float = 0.0


class Captioner:
    """A checkpoint loaded on a device, ready to caption media."""

    def __init__(self, settings: CaptionSettings):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.resolved = resolve_model(settings.model)
        self.model: CaptionModel = load_caption_model(self.resolved.path, self.dtype, self.device)
        self.frames = settings.frames or self.model.processor.default_frames
        # Every running row decodes one position per step, so the step budget also caps the rows.
        self.batch_size = settings.batch_size or min(default_max_rows(self.device), settings.max_batch_tokens)
        bytes_per_token = self.model.kv_geometry.bytes_per_token(self.dtype)
        kv_tokens = kv_cache_bytes(self.device, settings.kv_cache_gb, settings.max_batch_tokens) // bytes_per_token
        if kv_tokens < 1:
            raise ValueError(f"no memory left on {self.device} for a KV cache; pass --kv-cache-gb")
        self.engine_config = EngineConfig(
            max_rows=self.batch_size, max_batch_tokens=settings.max_batch_tokens,
            prefill_chunk=settings.prefill_chunk, kv_cache_tokens=int(kv_tokens),
            # On the CPU the "device" is host memory already: offloading would only add copies.
            offload_kv=settings.offload_kv and self.device.type != "cpu")
        # Created once: the KV cache is allocated here, not per run.
        self.engine = Engine(self.model, self.engine_config, settings.sampling)

    def provenance(self) -> dict[str, Any]:
        """How this run's captions were made, stored with the output."""
        config = self.engine.config
        generation = {**asdict(self.engine.sampling), "eos_token_ids": sorted(self.model.eos_token_ids)}
        return {
            "tool": "tarsier-batch", "tool_version": __version__,
            "model": self.settings.model, "model_path": str(self.resolved.path),
            "model_revision": self.resolved.revision, "model_family": self.model.family.name,
            "prompt": self.settings.prompt, "frames": self.frames,
            "generation": generation, "batch_size": self.batch_size,
            "max_batch_tokens": config.max_batch_tokens, "prefill_chunk": config.prefill_chunk,
            "kv_cache_tokens": config.kv_cache_tokens, "offload_kv": config.offload_kv,
            "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
            "frame_decoders": decoder_versions(), "torch_version": torch.__version__,
        }

    def caption(self, items: Iterable[MediaItem],
                on_tokens: Callable[[int], None] | None = None) -> Iterator[CaptionResult]:
        """Caption `items`, yielding one result per item in input order.

        Media are decoded in background threads while the model works; a decoded item joins
        the running batch as soon as a row frees up, and finished rows are held back until
        every earlier item has been yielded.
        """
        pool = _loader_pool(self.settings.workers)
        loads: deque[Future[_Loaded]] = deque()
        ready: dict[int, CaptionResult] = {}
        next_index = 0
        items_left = enumerate(iter(items))
        more_items = True
        try:
            while True:
                while more_items and self._wants_more(loads):
                    entry = next(items_left, None)
                    if entry is None:
                        more_items = False
                    else:
                        loads.append(pool.submit(self._load, *entry))
                # Take every decoded item; wait for one only when the model has nothing to do.
                while loads and (loads[0].done() or not self.engine.has_work):
                    self._admit(loads.popleft().result(), ready)
                if self.engine.has_work:
                    for seq in self.engine.step(on_tokens):
                        ready[seq.payload.index] = self._result(seq)
                elif not loads and not more_items:
                    break
                while next_index in ready:
                    yield ready.pop(next_index)
                    next_index += 1
        finally:  # on Ctrl-C or an abandoned iterator, drop the decodes not yet started
            pool.shutdown(wait=True, cancel_futures=True)
            self.engine.abort_all()

    def _wants_more(self, loads: deque[Future[_Loaded]]) -> bool:
        """Decode ahead enough to refill the batch, within a bound on waiting pixels."""
        queued = len(loads) + self.engine.num_waiting
        return queued < self.batch_size + 2 * self.settings.workers and \
            self.engine.waiting_pixel_bytes() < LOOKAHEAD_PIXEL_BYTES

    def _load(self, index: int, item: MediaItem) -> _Loaded:
        start = time.perf_counter()
        try:
            # Each frame is preprocessed as soon as it is decoded, so only its pixels are kept.
            media = self.model.processor.load_media(item.path, item.media_type, self.frames)
            prompt = self.model.processor.process(media, item.prompt or self.settings.prompt)
        except Exception as error:  # any decoder failure is this item's problem only
            return _Loaded(index, item, time.perf_counter() - start, error=one_line(error))
        return _Loaded(index, item, time.perf_counter() - start, replace(media, frames=[]), prompt)

    def _admit(self, loaded: _Loaded, ready: dict[int, CaptionResult]) -> None:
        if loaded.error is not None or loaded.prompt is None:
            ready[loaded.index] = _error_result(loaded, loaded.error or "not processed")
            return
        loaded.queued_at = time.perf_counter()
        seq = self.engine.add(loaded.prompt, payload=loaded,
                              generator=self.settings.sampling.generator_for(loaded.item.path))
        loaded.prompt = None  # the sequence holds it now; freed with the sequence
        if seq.finish_reason == "error":  # can never fit the KV cache
            ready[loaded.index] = self._result(seq)

    def _result(self, seq: Sequence) -> CaptionResult:
        loaded: _Loaded = seq.payload
        elapsed = loaded.seconds + time.perf_counter() - loaded.queued_at
        if seq.error is not None:
            return replace(_error_result(loaded, seq.error), elapsed_s=elapsed)
        media = loaded.media
        assert media is not None
        return CaptionResult(
            path=printable(loaded.item.path), media_type=media.media_type.value,
            caption=self.model.decode(seq.output_ids), prompt=seq.prompt.instruction,
            num_frames=len(media.frame_indices), frame_indices=media.frame_indices,
            width=media.width, height=media.height, duration_s=media.duration_s,
            prompt_tokens=seq.prompt.length, generated_tokens=len(seq.output_ids),
            finish_reason=seq.finish_reason or "error", elapsed_s=elapsed, generated_ids=list(seq.output_ids))


def _loader_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="tarsier-load")


def _error_result(loaded: _Loaded, message: str) -> CaptionResult:
    return CaptionResult(path=printable(loaded.item.path), media_type=loaded.item.media_type.value,
                         error=message, elapsed_s=loaded.seconds)
