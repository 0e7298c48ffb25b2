"""The library API: load a checkpoint once, then caption media items.

    from tarsier_batch import Captioner, CaptionSettings, discover
    captioner = Captioner(CaptionSettings(model="tiny-random"))
    for result in captioner.caption(discover(["./videos"]).items):
        print(result.path, result.caption)

This is what a run (`run.CaptionRun`, behind `tarsier caption`) and a Ray actor caption with;
a run adds the output, resume and progress around it. Item-level problems (a corrupt file, an item that
does not fit in memory even alone) come back as results with an error; run-level problems (no
such model, bad settings) raise.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .engine import Engine, EngineConfig, PruneConfig, Sequence
from .engine.model_runner import fused_attention_available
from .errors import INTERNAL, Worded
from .families.base import CaptionModel, Processor
from .families.loading import family_of_checkpoint, load_caption_model, load_processor
from .inputs.sources import MediaItem
from .media import FrameCount, decoder_versions, frames_in_words
from .model import preflight
from .model.checkpoints import resolve_model
from .model.collector import collection_paused
from .model.devices import default_max_rows, kv_cache_bytes, resolve_device, resolve_dtype
from .model.preflight import MemoryEstimate
from .outputs.results import Answer, CaptionResult
from .progress import plural
from .settings import CaptionSettings, Resolved, SettingsError
from .settings import provenance as recorded_settings
from .version import __version__
from .workers.fork_server import start_decoding_server
from .workers.pool import Decoded, DecodeJob, DecodePool
from .workers.sizing import default_workers

# Decoded items waiting for the model hold their pixels; stop decoding ahead beyond this much.
LOOKAHEAD_PIXEL_BYTES = 2**30
# The chat template and the default instruction around the vision positions, at most (a --prompt adds its length).
PROMPT_TEXT_POSITIONS = 128
# While the model waits for a decode, the caller hears (`on_tokens(0)`) at least this often.
WAIT_TICK_S = 0.25


class Captioner:
    """A checkpoint loaded on a device, ready to caption media."""

    def __init__(self, settings: CaptionSettings, items: int | None = None):
        """`items`: how many items this Captioner will caption, when known (the memory check then counts only the
        rows they can fill)."""
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        refuse_for_family(settings)   # before a weight is downloaded or read
        self.resolved = resolve_model(settings.model)   # a download, if any, with the collector running
        # From here the model's code is imported and its weights read (model/collector.py).
        with collection_paused():
            # Every running row decodes one position per step, so the step budget also caps the rows.
            self.batch_size = settings.batch_size or min(default_max_rows(self.device), settings.max_batch_tokens)
            self.workers = settings.workers or default_workers(accelerated=self.device.type != "cpu")
            self.memory: MemoryEstimate | None = self._check_memory(items) if settings.preflight else None
            if settings.isolate_decoding:
                start_decoding_server(self.resolved.path)   # its imports overlap the model's load
            self.model: CaptionModel = load_caption_model(self.resolved.path, self.dtype, self.device)
            # The most frames a clip gives plans memory and the KV check; `frame_count` is what each clip gives.
            self.frames = settings.most_frames(self.model.processor.default_frames)
            self.frame_count = settings.frame_count(self.model.processor.default_frames)
            bytes_per_token = self.model.kv_geometry.bytes_per_token(self.dtype)
            kv_tokens = kv_cache_bytes(self.device, settings.kv_cache_gb, settings.max_batch_tokens) // bytes_per_token
            if kv_tokens < 1:
                raise SettingsError(f"no memory left on {self.device} for a KV cache; pass {{kv_cache_gb}}")
            pruning = settings.pruning if settings.prune_method == "fastv" else None   # temporal: the workers prune
            layers = self.model.kv_geometry.num_layers
            if pruning is not None and pruning["layer"] >= layers:
                raise SettingsError(f"{{prune_layer}} {pruning['layer']}: the model has {layers} layers; "
                                    f"give 1 <= K < {layers}")
            self.engine_config = EngineConfig(
                max_rows=self.batch_size, max_batch_tokens=settings.max_batch_tokens,
                prefill_chunk=settings.prefill_chunk, kv_cache_tokens=int(kv_tokens),
                # On the CPU the "device" is host memory already: offloading would only add copies.
                offload_kv=settings.offload_kv and self.device.type != "cpu", prefix_cache=settings.prefix_cache,
                prune=PruneConfig(pruning["vision"], int(pruning["layer"])) if pruning is not None else None,
                compile=settings.compile_step, cuda_graphs=settings.cuda_graphs,
                fused_attention=settings.fused_attention)
            needed = self.model.processor.min_vision_positions(self.frames)
            page = self.engine_config.kv_page_slots
            # Checked here, as the scheduler will (whole pages, one new token at least): otherwise every item would
            # decode its frames, then fail.
            holds = int(kv_tokens) // page * page
            if -(-(needed + 1) // page) * page > holds:
                raise SettingsError(f"{{frames}} {self.frames} needs at least {needed} positions per item, more than "
                                    f"the KV cache holds ({holds}); use fewer {{frames}} or a larger "
                                    f"{{kv_cache_gb}}")
            # Created once: the KV cache is allocated here, not per run.
            self.engine = Engine(self.model, self.engine_config, settings.sampling)
            self.settled = self._settled()

    def _check_memory(self, items: int | None) -> MemoryEstimate | None:
        """Refuse (`NotEnoughMemory`) a model and settings that will not fit, before a weight is read. None when the
        checkpoint's files cannot be read here as this expects (a family keeping its weights elsewhere, a broken
        checkpoint): loading it then does what that family does, or says what is wrong."""
        path = self.resolved.path
        try:
            processor = load_processor(path)
            # A clip sampled by rate takes at most the cap's vision positions (`Processor.largest_item`).
            largest = processor.largest_item(self.settings.most_frames(processor.default_frames))
            # Items decoded ahead wait with their pixels (`_wants_more`), besides the running rows' own.
            held = min(items or self.batch_size + 2 * self.workers, self.batch_size + 2 * self.workers)
            waiting_bytes = min(held * largest.pixel_bytes, LOOKAHEAD_PIXEL_BYTES + largest.pixel_bytes)
            # A prompt set runs a row per question; the rows of one item share its pixels.
            asked = max(1, len(self.settings.prompt_set))
            rows = min(self.batch_size, items * asked) if items else self.batch_size
            longest = max([len(question.text) for question in self.settings.prompt_set]
                          + [len(self.settings.prompt or "")])
            prompt_positions = largest.vision_positions + PROMPT_TEXT_POSITIONS + longest
            needed = preflight.estimate(path, self.settings, self.dtype, self.device, rows, prompt_positions,
                                        waiting_bytes + -(-rows // asked) * largest.pixel_bytes)
        except (OSError, ValueError, KeyError):
            return None
        preflight.check_fits(needed, preflight.available_bytes(self.device), self.device, self.dtype, self.settings,
                             path, rows)
        return needed

    def _settled(self) -> dict[str, Any]:
        """The settings as loading settled them, by field name: what the device, the model and the engine made of
        what the settings left open or cannot do here (the provenance records these)."""
        config = self.engine_config
        return {
            "frames": self.frames, "batch_size": self.batch_size, "kv_cache_gb": config.kv_cache_tokens,
            "offload_kv": config.offload_kv,
            "prompt_set": [asdict(question) for question in self.settings.prompt_set] or None,
            "cuda_graphs": config.cuda_graphs and self.device.type == "cuda",
            "fused_attention": config.fused_attention and fused_attention_available(self.device),
            "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device), "workers": self.workers,
        }

    def provenance(self) -> dict[str, Any]:
        """How this run's captions were made, stored with the output: the checkpoint, the settings the
        provenance records (as loading settled them, `settings.provenance`), the sampler and the decoders."""
        generation = {**asdict(self.engine.sampling), "eos_token_ids": sorted(self.model.eos_token_ids)}
        return {
            "tool": "tarsier-batch", "tool_version": __version__, "model_path": str(self.resolved.path),
            "model_revision": self.resolved.revision, "model_family": self.model.family.name,
            **recorded_settings(self.settings, self.settled), "generation": generation,
            "frame_decoders": decoder_versions(), "torch_version": torch.__version__,
        }

    def describe(self) -> str:
        """One line: the model, its family and frames, the device, the batch and the KV cache."""
        engine, settings = self.engine, self.settings
        config = engine.config
        offload = ", KV offloaded during prefill" if config.offload_kv \
            else Worded("; {offload_kv} has no effect on the CPU") if settings.offload_kv else ""
        slots = " + ".join(f"{pool.capacity_tokens:,} tokens" + (f" in {_layer_range(pool.layers)}"
                                                                 if len(engine.pools) > 1 else "")
                           for pool in engine.pools)
        # On the CPU the pages are reserved untouched and committed as rows fill them, so the peak estimate
        # (which counts the pages the rows will fill) is far below the reservation; on a GPU both are allocated.
        reserved = "reserved, used as rows fill it" if self.device.type == "cpu" else "allocated"
        pruning = (f", {config.prune.ratio:g} of the vision tokens dropped after layer {config.prune.layer} "
                   f"(not the official output)" if config.prune is not None else "")
        if settings.temporal_pruning:
            pruning += (f", the {settings.temporal_pruning:g} of the vision tokens that change least from frame to "
                        f"frame dropped (not the official output)")
        pruning += ", compiled layers (the first steps compile)" if config.compile else ""
        pruning += ", decode steps as CUDA graphs" if self.settled["cuda_graphs"] else ""
        pruning += ", fused decode attention" if self.settled["fused_attention"] else ""
        if self.memory is not None:
            pruning += f", ~{self.memory.peak / 1e9:.2f} GB at the peak (estimated)"
        family = f"{self.model.family.name}, {frames_in_words(self.frame_count)}"
        described = (f"{settings.model} ({family}) on {self.device} ({str(self.dtype).removeprefix('torch.')}), "
                     f"batch size {self.batch_size}, KV cache {slots} "
                     f"({engine.kv_bytes / 2**30:.2f} GiB {reserved}), {plural(self.workers, 'decoding worker')}")
        return Worded("{described}{offload}{pruning}", described=described, offload=offload, pruning=pruning)

    def prompt_reuse(self) -> tuple[int, int, int]:
        """(prompt positions of the rows admitted, how many of them came computed from the prefix cache, how
        many from another question of the clip), since loading."""
        counts = self.engine.prefix_counts
        return counts.prompt_positions, counts.reused_positions, counts.shared_positions

    def resolved_settings(self) -> Resolved:
        """What loading settled that the settings may leave open (see `settings.resume_settings`)."""
        return Resolved(self.resolved.revision, self.frames, self.engine.sampling.repetition_penalty)

    def caption(self, items: Iterable[MediaItem], on_tokens: Callable[[int], None] | None = None,
                in_order: bool = True) -> Iterator[CaptionResult]:
        """Caption `items`, yielding one result per item: in input order, or as each finishes.

        Media are decoded in worker processes while the model works (a worker that crashes,
        hangs past the timeout or runs out of memory costs only its item, which comes back as
        an error); a decoded item joins the running batch as soon as a row frees up. In input
        order, finished rows are held back until every earlier item has been yielded.
        """
        pool = decode_pool(self.model.processor, self.frame_count, self.settings, self.workers)
        try:
            yield from self._caption_loads((pool.submit(index, item) for index, item in enumerate(items)), on_tokens,
                                           in_order)
        finally:  # on Ctrl-C or an abandoned iterator, stop the workers and drop what they had not started
            pool.shutdown()

    def serve(self) -> EngineServer:
        """Caption items decoded elsewhere, handed in by any number of threads at once; see `EngineServer`."""
        return EngineServer(self)

    def _caption_loads(self, loads_in_order: Iterator[Future[Decoded]], on_tokens: Callable[[int], None] | None,
                       in_order: bool) -> Iterator[CaptionResult]:
        """Results (in input order, or as they finish) of decodes that settle in any order; pulls more only as
        the batch needs."""
        loads: deque[Future[Decoded]] = deque()
        more_items = True

        def take(idle: bool) -> list[Decoded] | None:
            nonlocal more_items
            while more_items and self._wants_more(loads):
                load = next(loads_in_order, None)
                if load is None:
                    more_items = False
                else:
                    loads.append(load)
            if not (loads or more_items):
                return None
            arrived = []
            # Every decoded item, in order; wait for one only when the model has nothing to do.
            while loads and (loads[0].done() or (idle and not arrived)):
                if not loads[0].done():
                    futures.wait([loads[0]], timeout=WAIT_TICK_S)
                    if on_tokens is not None:
                        on_tokens(0)   # a tick while the model waits: rows waiting to be saved are saved
                    continue
                arrived.append(loads.popleft().result())
            return arrived

        ready: dict[int, CaptionResult] = {}
        next_index = 0
        for finished in self.drive(take, on_tokens):
            if not in_order:
                yield from finished.values()
                continue
            ready.update(finished)
            while next_index in ready:
                yield ready.pop(next_index)
                next_index += 1

    def drive(self, take: Callable[[bool], list[Decoded] | None],
              on_tokens: Callable[[int], None] | None = None) -> Iterator[dict[int, CaptionResult]]:
        """The loop that drives the engine, for `caption` and for `EngineServer`: admit what `take` hands in,
        step, and yield the results finished in each round by the items' `index`.

        `take(idle)` returns the decoded items available now, waiting for at least one when `idle` (the
        engine has nothing to do), or None once no more will come. The loop ends when nothing is left;
        rows still running when it is left early (an error, an abandoned iterator) are dropped."""
        try:
            while True:
                finished: dict[int, CaptionResult] = {}
                arrived = take(not self.engine.has_work)
                if arrived is None and not self.engine.has_work:
                    return
                for decoded in arrived or ():
                    self._admit(decoded, finished)
                if self.engine.has_work:
                    for seq in self.engine.step(on_tokens):
                        self._row_finished(seq, finished)
                yield finished
        finally:
            self.engine.abort_all()

    def _wants_more(self, loads: deque[Future[Decoded]]) -> bool:
        """Decode ahead enough to refill the batch, within a bound on waiting pixels."""
        queued = len(loads) + self.engine.num_waiting
        return queued < self.batch_size + 2 * self.workers and \
            self.engine.waiting_pixel_bytes() < LOOKAHEAD_PIXEL_BYTES

    def _admit(self, decoded: Decoded, finished: dict[int, CaptionResult]) -> None:
        """One row per prompt of the item; a prompt set's later questions fork the first's shared prefix. Every
        row draws from the item's stream, as a run asking that question alone would."""
        if decoded.error is not None or not decoded.prompts:
            finished[decoded.index] = _error_result(decoded, decoded.error or "not processed",
                                                    decoded.error_kind or INTERNAL)
            return
        queued = _Queued(decoded, time.perf_counter(), rows=len(decoded.prompts))
        seed = self.settings.sampling.row_seed(decoded.item.sampling_key)
        limits = {question.name: question.max_new_tokens for question in self.settings.prompt_set}
        first = None
        for position, prompt in enumerate(decoded.prompts):
            question = decoded.questions[position] if decoded.questions else None
            seq = self.engine.add(prompt, payload=(queued, question), max_new_tokens=limits.get(question),
                                  seed=seed, prefix_source=first)
            first = first or seq
            if seq.finish_reason == "error":  # can never fit the KV cache
                self._row_finished(seq, finished)
        decoded.prompts = []  # the sequences hold them now; freed with the sequences

    def _row_finished(self, seq: Sequence, finished: dict[int, CaptionResult]) -> None:
        """Collect a finished row; once every row of its item is done, the item's result."""
        queued, question = seq.payload
        queued.done[question] = seq
        if len(queued.done) == queued.rows:
            finished[queued.decoded.index] = self._result(queued)

    def _result(self, queued: _Queued) -> CaptionResult:
        decoded = queued.decoded
        elapsed = decoded.seconds + time.perf_counter() - queued.since
        if not decoded.questions:
            seq = queued.done[None]
            if seq.error is not None:
                return replace(_error_result(decoded, seq.error, seq.error_kind or INTERNAL), elapsed_s=elapsed)
            return replace(_described(decoded, elapsed), caption=self.model.decode(seq.output_ids),
                           prompt=seq.prompt.instruction, prompt_tokens=seq.prompt.length,
                           generated_tokens=len(seq.output_ids), finish_reason=seq.finish_reason or "error",
                           generated_ids=list(seq.output_ids))
        answers = {question: self._answer(queued.done[question]) for question in decoded.questions}
        failed = [f"{question}: {answer.error}" for question, answer in answers.items() if answer.error is not None]
        # The item's kind is its first failed question's: they mostly fail alike (the item is too large, or the
        # step ran out of memory), and each question's message says what its own failure was.
        kind = next((answer.error_kind for answer in answers.values() if answer.error is not None), None)
        return replace(_described(decoded, elapsed), answers=answers, error="; ".join(failed) or None,
                       error_kind=kind,
                       generated_tokens=sum(answer.generated_tokens for answer in answers.values()),
                       finish_reason="error" if failed else "done")

    def _answer(self, seq: Sequence) -> Answer:
        if seq.error is not None:
            return Answer(seq.prompt.instruction, None, seq.prompt.length, 0, "error", error=seq.error,
                          error_kind=seq.error_kind or INTERNAL)
        return Answer(seq.prompt.instruction, self.model.decode(seq.output_ids), seq.prompt.length,
                      len(seq.output_ids), seq.finish_reason or "error", generated_ids=list(seq.output_ids))


class EngineServer:
    """One Captioner's engine kept busy by callers on other threads (a Ray actor's concurrent calls).

    Each caller hands in a batch of items decoded elsewhere (`workers.decode_item` with this
    checkpoint's processor, frames and prompt) and gets their results in its order. The items join
    the engine's running batch as rows free up, whoever handed them in: a caller whose batch is
    nearly done does not leave the engine half empty while the next caller's items wait, as one
    `caption()` call per batch would.

    One thread (started here, a daemon) owns the engine until `close()`, so a Captioner serves one
    service at a time. A run-level failure (a lost device) is raised to every caller waiting and to
    every later one.
    """

    def __init__(self, captioner: Captioner):
        self._captioner = captioner
        # None asks the engine's thread to stop.
        self._inbox: queue.SimpleQueue[tuple[Decoded, Future[CaptionResult]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()   # orders hand-ins against a failure, so none is left unanswered
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="caption-service", daemon=True)
        self._thread.start()

    def caption(self, decoded: list[Decoded]) -> list[CaptionResult]:
        """Caption `decoded` (their `index` is ignored); blocks until all are done."""
        return [future.result() for future in self.submit(decoded)]

    def submit(self, decoded: list[Decoded]) -> list[Future[CaptionResult]]:
        """Hand in `decoded` without waiting: one future per item, in their order."""
        futures: list[Future[CaptionResult]] = []
        with self._lock:
            if self._failure is not None:
                raise RuntimeError("the caption service stopped earlier") from self._failure
            for one in decoded:
                futures.append(Future())
                self._inbox.put((one, futures[-1]))
        return futures

    def close(self) -> None:
        """Stop the engine's thread and wait for it (then another service may use the Captioner):
        callers still waiting get an error, and so do later ones."""
        self._inbox.put(None)
        self._thread.join()

    def _serve(self) -> None:
        waiting: dict[int, Future[CaptionResult]] = {}   # by the number the service gave the item
        numbers = itertools.count()

        def take(idle: bool) -> list[Decoded]:
            """Everything handed in; waits for a hand-in only when the engine has nothing to do."""
            arrived = []
            while True:
                try:
                    handed_in = self._inbox.get(block=idle and not arrived)
                except queue.Empty:
                    return arrived
                if handed_in is None:
                    raise _Closed("the caption service was closed")
                decoded, future = handed_in
                number = next(numbers)
                waiting[number] = future
                arrived.append(replace(decoded, index=number))

        try:
            for finished in self._captioner.drive(take):
                for number, result in finished.items():
                    waiting.pop(number).set_result(result)
        except BaseException as error:  # noqa: BLE001 - every caller must hear of it, whatever it is
            with self._lock:
                self._failure = error
                while not self._inbox.empty():
                    handed_in = self._inbox.get()
                    if handed_in is not None:
                        waiting[next(numbers)] = handed_in[1]
            for future in waiting.values():
                future.set_exception(error)
        finally:
            # The error is kept (`_failure`, the futures) with its traceback, which holds this frame and `take`'s:
            # their variables must not hold this service (and through it the Captioner), or the three make a
            # reference cycle that keeps the model alive until a full collection. As concurrent.futures' workers do.
            self = waiting = None  # type: ignore[assignment]


class _Closed(RuntimeError):
    """Raised to callers of a closed EngineServer."""


def decode_pool(processor: Processor, frames: FrameCount, settings: CaptionSettings, workers: int) -> DecodePool:
    """Workers decoding items with `processor` as `settings` say: isolated (or not), with their timeout and
    memory limit, refusing images above the pixel limit."""
    memory = settings.decode_memory_gb
    job = DecodeJob(processor, frames, settings.prompt, settings.max_image_pixels, settings.temporal_pruning,
                    settings.prompt_set)
    return DecodePool(job, workers, settings.decode_timeout_s, int(memory * 2**30) if memory else None,
                      isolate=settings.isolate_decoding)


@dataclass
class _Queued:
    """A decoded item in the engine, and since when (its elapsed time counts decoding plus this); its rows (one
    per question of a prompt set) finish in any order."""

    decoded: Decoded
    since: float
    rows: int = 1
    done: dict[str | None, Sequence] = field(default_factory=dict)   # by question (None: no prompt set)


def refuse_for_family(settings: CaptionSettings) -> None:
    """Refuse settings the checkpoint's family cannot run, from its config.json alone (for a Hugging Face id, the
    configuration is fetched without the weights). A checkpoint whose family cannot be read passes: loading it
    says what is wrong."""
    fastv = settings.pruning is not None and settings.prune_method == "fastv"
    if not fastv and settings.fps is None:
        return
    try:
        family = family_of_checkpoint(resolve_model(settings.model, weights=False).path)
    except (OSError, ValueError):
        return
    if fastv and family.fastv_refusal is not None:
        raise SettingsError(f"{{prune_method}} fastv: {family.fastv_refusal}")
    if settings.fps is not None and not family.samples_by_rate:
        raise SettingsError(f"{{fps}}: {family.name} samples a fixed count of frames from every clip, as its "
                            f"official code does; give {{frames}} instead")


def _layer_range(layers: range) -> str:
    return f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"


def _described(decoded: Decoded, elapsed: float) -> CaptionResult:
    """An item's result without its captions: what decoding found out about the file."""
    media = decoded.media
    assert media is not None
    return CaptionResult(
        path=decoded.item.row_path, span=decoded.item.span, media_type=media.media_type.value,
        key=decoded.item.stable_key,
        num_frames=len(media.frame_indices), frame_indices=media.frame_indices, width=media.width,
        height=media.height, duration_s=media.duration_s, decoder=media.decoder,
        warnings=list(media.warnings) or None, elapsed_s=elapsed)


def _error_result(decoded: Decoded, message: str, kind: str) -> CaptionResult:
    return CaptionResult(path=decoded.item.row_path, span=decoded.item.span, media_type=decoded.item.media_type.value,
                         key=decoded.item.stable_key, error=message, error_kind=kind, elapsed_s=decoded.seconds)
