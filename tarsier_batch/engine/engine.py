"""The loop: schedule a step, run it, sample, retire finished rows, and recover from failed steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import MODEL_ERROR, OUT_OF_MEMORY, TOO_LARGE, plain_message
from ..families.base import CaptionModel, ProcessedPrompt
from ..model.devices import is_fatal_device_error, is_out_of_memory, release_cached_memory
from .cuda_graphs import CudaGraphError
from .kv_cache import PAGE_SLOTS, KVCache
from .kv_manager import KVManager
from .model_runner import ModelRunner, StepOutput
from .pruning import PruneConfig, row_pruning
from .sampling import SamplingParams, seen_pairs, select_tokens
from .scheduler import PrefixCacheCounts, ScheduledRow, Scheduler, SchedulerConfig
from .sequence import Sequence


@dataclass(frozen=True)
class EngineConfig:
    """How much runs at once: rows, tokens per step, prefill chunk, KV cache size, offload."""

    max_rows: int = 4
    max_batch_tokens: int = 4096
    prefill_chunk: int = 2048      # 0: prefill each prompt whole
    kv_cache_tokens: int = 65536   # slots of the preallocated KV cache (its memory, with pruning)
    offload_kv: bool = False       # keep prefilling rows' KV in host memory
    prune: PruneConfig | None = None   # drop vision tokens after a layer (not the official output)
    kv_page_slots: int = PAGE_SLOTS    # a row's KV is whole pages of this many slots
    prefix_cache: bool = True          # keep computed prompt pages for rows that start the same way
    compile: bool = False              # layers and decode attention through torch.compile (the model's
                                       # layers stay compiled: `CaptionModel.compile` works in place)
    cuda_graphs: bool = True           # on CUDA, decode steps replayed as CUDA graphs (`cuda_graphs`)
    fused_attention: bool = True       # on CUDA with Triton, decode attention in one kernel (`fused_decode`)


class Engine:
    """Generates for any number of rows; rows join as others leave (continuous batching)."""

    def __init__(self, model: CaptionModel, config: EngineConfig, sampling: SamplingParams):
        self.model = model
        self.config = config
        if sampling.repetition_penalty is None:  # the checkpoint's own, as its generate() would apply
            sampling = replace(sampling, repetition_penalty=model.repetition_penalty)
        self.sampling = sampling
        geometry = model.kv_geometry
        if config.prune is None:
            # A compiled step reads the first pages as they lie: kept pages must not push the pages in use up.
            self.pools = [KVCache(geometry, config.kv_cache_tokens, model.dtype, model.device,
                                  page_slots=config.kv_page_slots, lowest_first=config.compile)]
        else:
            # The caller's settings were checked already (settings.py, api.py); this guards the engine's own use.
            if not 1 <= config.prune.layer < geometry.num_layers:
                raise ValueError(f"pruning after layer {config.prune.layer} of a {geometry.num_layers}-layer model")
            # The layers from K on hold only the survivors: their own, smaller cache in the same memory.
            early, late = config.prune.split_kv_slots(config.kv_cache_tokens, geometry.num_layers)
            layer = config.prune.layer
            self.pools = [KVCache(geometry, early, model.dtype, model.device, range(layer), config.kv_page_slots),
                          KVCache(geometry, late, model.dtype, model.device, range(layer, geometry.num_layers),
                                  config.kv_page_slots)]
        self.scheduler = Scheduler(SchedulerConfig(config.max_rows, config.max_batch_tokens,
                                                   config.prefill_chunk, config.offload_kv, config.prefix_cache),
                                   self.pools)
        self.runner = ModelRunner(model, self.pools, config.compile, config.cuda_graphs, config.fused_attention)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def kv(self) -> KVManager:
        """Which KV blocks the rows hold."""
        return self.scheduler.kv

    @property
    def kv_bytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools)

    @property
    def prefix_counts(self) -> PrefixCacheCounts:
        """What the prefix cache saved so far (see `Scheduler.advance`)."""
        return self.scheduler.prefix_counts

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def waiting_pixel_bytes(self) -> int:
        """Pixels held by waiting rows (questions about one clip share theirs)."""
        pixels = {id(seq.prompt.pixel_values): seq.prompt.pixel_values.nbytes for seq in self.scheduler.waiting}
        return sum(pixels.values())

    def add(self, prompt: ProcessedPrompt, payload: Any = None, max_new_tokens: int | None = None,
            seed: int | None = None, prefix_source: Sequence | None = None) -> Sequence:
        """Queue one row; `seed` names its sampling stream (`SamplingParams.row_seed`, needed unless greedy).
        A row that can never fit the KV cache is not queued: it comes back finished with an error.

        `prefix_source`: a row added earlier whose prompt starts like this one (another question about the
        same clip): while it holds that shared prefix computed, this row holds the prefix's KV pages with it
        instead of computing them. The tokens are the same either way. Not with FastV pruning (its survivors
        are chosen by the last prompt token, which differs per question) or offloaded prefill (the prefix is
        not on the device while it is computed): there each row computes its whole prompt."""
        seq = Sequence(prompt, max_new_tokens or self.sampling.max_new_tokens, seed, payload)
        if self.config.prune is not None and prompt.vision_blocks:
            seq.pruning = row_pruning(prompt, self.config.prune)
        if (prefix_source is not None and self.config.prune is None and not self.config.offload_kv
                and self.scheduler.holds(prefix_source)):
            seq.prefix_length = prefix_source.prompt.shared_prefix(prompt)
            seq.prefix_source = prefix_source if seq.prefix_length else None
        problem = self.scheduler.add(seq)
        if problem is not None:
            seq.finish("error", problem, TOO_LARGE)
        elif seq.prefix_source is not None:
            seq.prefix_source.fork_points.add(seq.prefix_length)
        return seq

    def abort_all(self) -> None:
        """Drop every row and free its KV (the caller stopped early)."""
        self.scheduler.clear()
        self._forget_released()

    def step(self, on_tokens: Callable[[int], None] | None = None) -> list[Sequence]:
        """Run one step; returns the rows that finished in it (in no particular order)."""
        try:
            return self._step(on_tokens)
        finally:   # rows finished or preempted in the step
            self._forget_released()

    def _forget_released(self) -> None:
        """What the runner keeps of rows that let go of their KV goes with it (a preempted row starts again)."""
        self.runner.forget(self.scheduler.take_released())

    def _step(self, on_tokens: Callable[[int], None] | None) -> list[Sequence]:
        step = self.scheduler.schedule()
        self._forget_released()   # rows preempted to make room, some perhaps admitted again at once
        if not step:
            if self.scheduler.has_work:
                raise RuntimeError("the scheduler made no progress with rows waiting (a bug)")
            return []
        try:
            output = self.runner.run(step)
        except Exception as error:
            if is_fatal_device_error(error) or _is_compile_error(error) or isinstance(error, CudaGraphError):
                raise
            # Decide here, recover below: until this block ends, the traceback keeps the failed
            # step's tensors alive.
            out_of_memory, message = is_out_of_memory(error), f"the model step failed: {plain_message(error)}"
        else:
            return self._advance(step, output, on_tokens)
        return self._recover(step, out_of_memory, message)

    def _advance(self, step: list[ScheduledRow], output: StepOutput,
                 on_tokens: Callable[[int], None] | None) -> list[Sequence]:
        self.scheduler.advance(step)
        for seq, survivors in output.survivors:
            assert seq.pruning is not None
            seq.pruning.survivors = survivors
        sampled, logits = output.sampled, output.logits
        if logits is None:
            return []
        seen = None
        if self.sampling.repetition_penalty not in (None, 1):
            seen = seen_pairs([seq.prompt_vocabulary(logits.device) for seq in sampled],
                              [seq.output_ids for seq in sampled], logits.device)
        tokens = select_tokens(logits, self.sampling, [seq.seed for seq in sampled],
                               [len(seq.output_ids) for seq in sampled], seen)
        if on_tokens is not None:
            on_tokens(len(tokens))
        finished = []
        for seq, token in zip(sampled, tokens):
            seq.output_ids.append(token)
            if token in self.model.eos_token_ids:
                seq.finish("eos")
            elif len(seq.output_ids) >= seq.max_new_tokens:
                seq.finish("length")
            else:
                continue
            self.scheduler.finish(seq)
            finished.append(seq)
        return finished

    def _recover(self, step: list[ScheduledRow], out_of_memory: bool, message: str) -> list[Sequence]:
        """After a failed step: retry smaller after running out of memory, else find the culprit.

        Nothing of the failed step is kept (positions only count once a step succeeds), so
        retrying recomputes exactly what failed and the outputs do not change.
        """
        if out_of_memory:
            self.runner.release_graphs()
            release_cached_memory(self.model.device)
            if self.scheduler.lower_budget_after_oom():
                return []
            return self._fail(step[0].seq, "the model step ran out of memory even with this item alone", OUT_OF_MEMORY)
        if len(step) == 1:
            return self._fail(step[0].seq, message, MODEL_ERROR)
        # Which row broke the step is unknown: run each of them alone from now on.
        for row in reversed(step):
            row.seq.isolate = True
            self.scheduler.preempt(row.seq)
        return []

    def _fail(self, seq: Sequence, message: str, kind: str) -> list[Sequence]:
        self.scheduler.finish(seq)
        seq.finish("error", message, kind)
        return [seq]


def _is_compile_error(error: BaseException) -> bool:
    """torch.compile failed (e.g. no C++ compiler for inductor on the CPU): every step would fail alike."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))
