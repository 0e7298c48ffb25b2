"""The library API: load a checkpoint once, then caption media items in batches.

    from tarsier_batch import Captioner, CaptionSettings, discover
    captioner = Captioner(CaptionSettings(model="tiny-random"))
    for result in captioner.caption(discover(["./videos"]).items):
        print(result.path, result.caption)

This is what the CLI and a Ray worker call. Item-level problems (a corrupt file, a batch that
runs out of memory at size one) come back as results with an error; run-level problems (no
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
from .checkpoints import resolve_model
from .devices import (auto_batch_size, is_fatal_device_error, is_out_of_memory, release_cached_memory,
                      resolve_device, resolve_dtype)
from .engine import SamplingParams, generate
from .families import CaptionModel, PreparedInput, load_caption_model
from .media import Media, decoder_versions, load_media
from .sources import MediaItem


@dataclass(frozen=True)
class CaptionSettings:
    """Everything that decides what a run produces and how it runs."""

    model: str = "omni-research/Tarsier-7b"
    prompt: str | None = None          # replaces the default instruction
    frames: int = 8
    batch_size: int | None = None      # None: chosen for the device
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"
    device: str = "auto"
    workers: int = 2                   # threads decoding and preprocessing media

    def __post_init__(self) -> None:
        if self.frames < 1:
            raise ValueError("frames must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("batch size must be at least 1")
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

    item: MediaItem
    seconds: float
    media: Media | None = None
    prepared: PreparedInput | None = None
    error: str | None = None


class Captioner:
    """A checkpoint loaded on a device, ready to caption batches of media."""

    def __init__(self, settings: CaptionSettings):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.resolved = resolve_model(settings.model)
        self.model: CaptionModel = load_caption_model(self.resolved.path, self.dtype, self.device)
        self.batch_size = settings.batch_size or auto_batch_size(
            self.model, self.device, settings.frames, settings.sampling.max_new_tokens)

    def provenance(self) -> dict[str, Any]:
        """How this run's captions were made, stored with the output."""
        return {
            "tool": "tarsier-batch", "tool_version": __version__,
            "model": self.settings.model, "model_path": str(self.resolved.path),
            "model_revision": self.resolved.revision, "model_family": type(self.model).__name__,
            "prompt": self.settings.prompt, "frames": self.settings.frames,
            "generation": asdict(self.settings.sampling), "batch_size": self.batch_size,
            "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
            "frame_decoders": decoder_versions(), "torch_version": torch.__version__,
        }

    def caption(self, items: Iterable[MediaItem],
                on_tokens: Callable[[int], None] | None = None) -> Iterator[CaptionResult]:
        """Caption `items`, yielding one result per item in input order.

        Media are decoded in background threads while the model works on the previous batch.
        """
        pool = ThreadPoolExecutor(self.settings.workers, thread_name_prefix="tarsier-load")
        try:
            window: list[_Loaded] = []
            for loaded in self._load_ahead(pool, items):
                window.append(loaded)
                if len(window) >= self.batch_size:
                    yield from self._run_window(window, on_tokens)
                    window = []
            if window:
                yield from self._run_window(window, on_tokens)
        finally:  # on Ctrl-C or an abandoned iterator, drop the decodes not yet started
            pool.shutdown(wait=True, cancel_futures=True)

    def _load_ahead(self, pool: ThreadPoolExecutor, items: Iterable[MediaItem]) -> Iterator[_Loaded]:
        pending: deque[Future[_Loaded]] = deque()
        lookahead = 2 * self.batch_size + self.settings.workers
        for item in items:
            pending.append(pool.submit(self._load, item))
            if len(pending) >= lookahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def _load(self, item: MediaItem) -> _Loaded:
        start = time.perf_counter()
        try:
            media = load_media(item.path, item.media_type, self.settings.frames)
            prepared = self.model.prepare(media, item.prompt or self.settings.prompt)
        except Exception as error:  # any decoder failure is this item's problem only
            return _Loaded(item, time.perf_counter() - start, error=_one_line(error))
        # Keep the facts, not the full-resolution frames, while the item waits for its batch.
        return _Loaded(item, time.perf_counter() - start, replace(media, frames=[]), prepared)

    def _run_window(self, window: list[_Loaded],
                    on_tokens: Callable[[int], None] | None) -> Iterator[CaptionResult]:
        good = [loaded for loaded in window if loaded.error is None]
        captioned = iter(self._generate(good, on_tokens) if good else [])
        for loaded in window:
            yield next(captioned) if loaded.error is None else _error_result(loaded, loaded.error)

    def _generate(self, batch: list[_Loaded], on_tokens: Callable[[int], None] | None) -> list[CaptionResult]:
        """Caption a batch; after an error, retry in halves down to single items.

        Running out of memory also lowers the batch size for the rest of the run. A device
        error that leaves the accelerator unusable is not an item's fault: it ends the run.
        """
        counter = _TokenCounter(on_tokens)
        try:
            return self._attempt(batch, counter)
        except Exception as error:
            if is_fatal_device_error(error):
                raise
            # Decide here, retry below: until this block ends, the exception's traceback keeps
            # the failed attempt's tensors alive.
            out_of_memory, message = is_out_of_memory(error), _one_line(error)
        counter.retract()
        if out_of_memory:
            release_cached_memory(self.device)
            self.batch_size = max(1, min(self.batch_size, len(batch) // 2))
        if len(batch) == 1:
            return [_error_result(batch[0], "out of memory even alone" if out_of_memory else message)]
        half = len(batch) // 2
        return self._generate(batch[:half], on_tokens) + self._generate(batch[half:], on_tokens)

    def _attempt(self, batch: list[_Loaded], counter: _TokenCounter) -> list[CaptionResult]:
        start = time.perf_counter()
        prompts = self.model.embed_prompts([loaded.prepared for loaded in batch])
        generators = [self.settings.sampling.generator_for(loaded.item.path) for loaded in batch]
        generations = generate(self.model, prompts, self.settings.sampling, self.model.eos_token_ids,
                               generators, counter)
        elapsed = time.perf_counter() - start
        return [self._result(loaded, prompt.length, generation.token_ids, generation.finish_reason,
                             loaded.seconds + elapsed)
                for loaded, prompt, generation in zip(batch, prompts, generations)]

    def _result(self, loaded: _Loaded, prompt_tokens: int, token_ids: list[int], finish_reason: str,
                elapsed: float) -> CaptionResult:
        media, prepared = loaded.media, loaded.prepared
        assert media is not None and prepared is not None
        return CaptionResult(
            path=printable(loaded.item.path), media_type=media.media_type.value,
            caption=self.model.decode(token_ids), prompt=prepared.instruction,
            num_frames=len(media.frame_indices), frame_indices=media.frame_indices,
            width=media.width, height=media.height, duration_s=media.duration_s,
            prompt_tokens=prompt_tokens, generated_tokens=len(token_ids),
            finish_reason=finish_reason, elapsed_s=elapsed, generated_ids=token_ids)


class _TokenCounter:
    """Passes token counts on to the caller and can take them back if the batch is retried."""

    def __init__(self, report: Callable[[int], None] | None):
        self.report = report
        self.count = 0

    def __call__(self, tokens: int) -> None:
        self.count += tokens
        if self.report is not None:
            self.report(tokens)

    def retract(self) -> None:
        if self.report is not None and self.count:
            self.report(-self.count)
        self.count = 0


def printable(text: str) -> str:
    """`text` with undecodable bytes (from non-UTF-8 file names) shown as escapes, never raising."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _error_result(loaded: _Loaded, message: str) -> CaptionResult:
    return CaptionResult(path=printable(loaded.item.path), media_type=loaded.item.media_type.value,
                         error=message, elapsed_s=loaded.seconds)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return printable(f"{type(error).__name__}: {text}"[:500])
