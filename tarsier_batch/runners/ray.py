"""Caption on a Ray cluster: `tarsier caption INPUTS --ray ADDRESS --out ...`.

A run (`run.CaptionRun`) plans, resumes and writes as it does in one process; `RayBackend`
only captions its items elsewhere (`CaptionRun(..., load=lambda settings: RayBackend(settings,
RaySettings("auto"), reporter))`). They become a Ray Dataset (one row each: its place among the
inputs and the pickled `MediaItem`). Decoding and preprocessing run as Ray CPU tasks (each Ray
worker keeps an isolated decoding process with the checkpoint's processor, no weights:
`workers.DecodePool`). Captioning runs in an actor pool of `RayModelActor`s, each a `Captioner`
on its own device; an actor takes batches of decoded items, two calls at a time, into one engine
(`api.EngineServer`), so the next batch's rows join as the last one's leave (continuous
batching across batches). The results stream back to this process in input order, and the run
saves them in its part files and writes its output, in any format, as a single run does.

An actor that dies (a crash, a lost node) is restarted by Ray and its batch given to it again
(Ray Data's defaults for actor pools: `max_restarts` and `max_task_retries` -1, unbounded). A
file that crashes or hangs its decoder becomes an error row, as in a single run; a decoding task
that fails anyway (a lost node, past Ray's task retries) fails the run, with the rows already
saved kept for the rerun: nothing is dropped silently.

Tests kill actors on purpose through `faults.maybe_kill_ray_actor`.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from .. import storage
from ..api import Captioner, decode_pool, refuse_for_family
from ..errors import Worded
from ..families.generation_config import read_repetition_penalty
from ..families.loading import load_processor
from ..inputs.sources import MediaItem
from ..model.checkpoints import resolve_model
from ..outputs.results import CaptionResult
from ..progress import plural
from ..run import RunReporter
from ..settings import CaptionSettings, RaySettings, Resolved
from ..version import __version__
from ..workers.faults import maybe_kill_ray_actor
from ..workers.pool import Decoded, DecodePool

CALLS_PER_ACTOR = 2


class RayResourceError(ValueError):
    """The cluster cannot ever run the actors asked for."""


@dataclass(frozen=True)
class RayJob:
    """What every task and actor of a run needs; pickled to each of them."""

    settings: CaptionSettings
    resolved: Resolved               # as this process resolved the model: every actor must agree
    items_per_batch: int             # items in one call of an actor (it runs CALLS_PER_ACTOR at once)


class RayBackend:
    """Captions a run's items on a Ray cluster: what a run uses instead of a Captioner with --ray.

    Made when the run has something to caption: it joins (or starts) the cluster, checks it can
    ever place the actors, and resolves the model as the actors will (its revision, default
    frames and repetition penalty) without loading weights.
    """

    def __init__(self, settings: CaptionSettings, ray_settings: RaySettings, reporter: RunReporter):
        refuse_for_family(settings)   # here, before a cluster starts, not in every actor
        import ray

        self.settings, self.ray, self.reporter = settings, ray_settings, reporter
        address = ray_settings.address
        if not ray.is_initialized():
            # Our own settings and the object stores' endpoints and regions (never credentials: each node
            # has its own, from its environment, profile or instance role) reach every task and actor.
            ray.init(address=None if address == "local" else address, log_to_driver=False,
                     runtime_env={"env_vars": {**{name: value for name, value in os.environ.items()
                                                  if name.startswith("TARSIER")}, **storage.environment()}})
        if ray_settings.gpus_per_actor > 0 and ray.cluster_resources().get("GPU", 0) == 0:
            raise RayResourceError(Worded("the Ray cluster at {address} has no GPUs; pass {device} cpu (or "
                                          "{gpus_per_actor} 0) to caption on its CPUs", address=address))
        self.model = resolve_model(settings.model, weights=False)   # the actors load the weights, not this process
        frames = settings.most_frames(load_processor(self.model.path).default_frames)
        penalty = settings.sampling.repetition_penalty
        self.resolved = Resolved(self.model.revision, frames,
                                 penalty if penalty is not None else read_repetition_penalty(self.model.path))
        self._actor_provenance: dict[str, Any] | None = None

    def resolved_settings(self) -> Resolved:
        return self.resolved

    def prompt_reuse(self) -> None:
        """Not gathered from the actors: each has its own prefix cache."""
        return None

    def provenance(self) -> dict[str, Any]:
        """The actors' account of how they captioned, once one has answered; until then this process's."""
        return self._actor_provenance or {"tool": "tarsier-batch", "tool_version": __version__,
                                          "model": self.settings.model, "model_path": str(self.model.path),
                                          "model_revision": self.model.revision, "frames": self.resolved.frames,
                                          "runner": "ray"}

    def describe(self) -> str:
        low, high = self.ray.actors
        pool = plural(low, "actor") if low == high else f"{low}-{high} actors"
        return (f"{self.settings.model} on Ray ({self.ray.address}: {pool}, {self.ray.gpus_per_actor:g} GPU each, "
                f"{self.resolved.frames} frames)")

    def caption(self, items: Iterable[MediaItem], on_tokens: Callable[[int], None] | None = None,
                in_order: bool = True) -> Iterator[CaptionResult]:
        """Caption `items` on the cluster, yielding their results as they come back (in input order, or in the
        order Ray's batches finish)."""
        import ray

        items = list(items)
        self.reporter.info(f"captioning {plural(len(items), 'item')} on Ray")
        job = RayJob(self.settings, self.resolved, items_per_batch=2 * (self.settings.batch_size or 16))
        dataset = ray.data.from_items([{"position": position, "item": pickle.dumps(item)}
                                       for position, item in enumerate(items)])
        # Decoding tasks spread over the cluster's nodes; the actors are placed by Ray's default. The
        # differing strategies also keep Ray from fusing decoding into the actors, which it does when
        # both ask for the same resources (--device cpu): decoding would then run in the actor's
        # process, one batch after another, instead of beside the model.
        decoded = dataset.map_batches(decode_batch, fn_kwargs={"settings": self.settings}, batch_size=8,
                                      num_cpus=1, scheduling_strategy="SPREAD", batch_format="numpy")
        low, high = self.ray.actors
        # Each actor runs CALLS_PER_ACTOR calls at once (threads), so the next batch's items are in its
        # engine before the last rows of the one before finish: the engine stays full across batches.
        actors = ray.data.ActorPoolStrategy(min_size=low, max_size=high,
                                            max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                                            enable_true_multi_threading=True)
        captioned = decoded.map_batches(
            RayModelActor, fn_constructor_kwargs={"job": job}, batch_size=job.items_per_batch, batch_format="numpy",
            compute=actors, num_gpus=self.ray.gpus_per_actor, num_cpus=1, scheduling_strategy="DEFAULT")
        context = ray.data.DataContext.get_current()
        preserved, context.execution_options.preserve_order = context.execution_options.preserve_order, in_order
        try:
            yield from self._results(captioned, on_tokens)
        finally:   # a process-wide setting: as it was for the caller's own datasets
            context.execution_options.preserve_order = preserved

    def _results(self, captioned: Any, on_tokens: Callable[[int], None] | None) -> Iterator[CaptionResult]:
        for batch in captioned.iter_batches(batch_size=None, batch_format="numpy"):
            self._actor_provenance = self._actor_provenance or pickle.loads(batch["provenance"][0])
            for one in batch["result"]:
                result: CaptionResult = pickle.loads(one)
                if on_tokens is not None:
                    on_tokens(result.generated_tokens or 0)
                yield result
            if on_tokens is not None:
                on_tokens(0)   # the batch's rows are in: save them before waiting for the next batch


@cache
def _decode_pool(settings: CaptionSettings) -> DecodePool:
    """One per Ray worker process, kept for the tasks it runs after: the checkpoint's processor
    (without weights) in one isolated decoding process, as in a single run (a crash, a hang past
    the timeout or the memory limit costs only its item, which becomes an error row)."""
    processor = load_processor(resolve_model(settings.model).path)
    return decode_pool(processor, settings.frame_count(processor.default_frames), settings, 1)


def decode_batch(batch: dict[str, np.ndarray], settings: CaptionSettings) -> dict[str, np.ndarray]:
    """Ray CPU task: decode and preprocess items; a failure is its item's error, as in a single run."""
    pool = _decode_pool(settings)
    loads = [pool.submit(int(position), pickle.loads(item)) for position, item in zip(batch["position"], batch["item"])]
    decoded = [load.result() for load in loads]   # never raises: a failure is the item's error
    return {"position": batch["position"], "decoded": np.array([pickle.dumps(one) for one in decoded], dtype=object)}


class RayModelActor:
    """A Ray actor: one Captioner, loaded once, captioning batches of decoded items."""

    def __init__(self, job: RayJob):
        self.captioner = Captioner(job.settings)
        resolved = self.captioner.resolved_settings()
        if resolved != job.resolved:   # another checkpoint or revision on this node: its rows would not match
            raise ValueError(f"the model on this Ray node resolves to {resolved}, the driver's to {job.resolved}")
        self.service = self.captioner.serve()   # Ray runs CALLS_PER_ACTOR calls at once; they share its engine
        self.provenance = pickle.dumps({**self.captioner.provenance(), "runner": "ray"})

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        decoded: list[Decoded] = [pickle.loads(one) for one in batch["decoded"]]
        maybe_kill_ray_actor([one.item.path for one in decoded])
        results = self.service.caption(decoded)
        return {"result": np.array([pickle.dumps(result) for result in results], dtype=object),
                "provenance": np.array([self.provenance] * len(results), dtype=object)}
