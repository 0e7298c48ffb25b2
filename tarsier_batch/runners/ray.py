"""Caption on a Ray cluster: `tarsier caption INPUTS --ray ADDRESS --out-dir DIR`.

The items become a Ray Dataset (one row each: its place among the inputs and the pickled
`MediaItem`). Decoding and preprocessing run as Ray CPU tasks (each Ray worker keeps an isolated
decoding process with the checkpoint's processor, no weights: `workers.DecodePool`). Captioning
runs in an actor pool of `RayCaptioner`s, each a `Captioner` (the library API the CLI uses) on
its own device; an actor takes batches of decoded items, two calls at a time, into one engine
(`api.CaptionService`), so the next batch's rows join as the last one's leave (continuous
batching across batches). Ray's Parquet writer puts the rows into part files of DIR, with the
schema and provenance of a single-process run. A rerun reads DIR and captions only what it does
not hold yet.

An actor that dies (a crash, a lost node) is restarted by Ray and its batch given to it again
(Ray Data's defaults for actor pools: `max_restarts` and `max_task_retries` -1, unbounded). A
file that crashes or hangs its decoder becomes an error row, as in a single run; a decoding task
that fails anyway (a lost node, past Ray's task retries) fails the run, with the rows already
written kept for the rerun: nothing is dropped silently.

Tests kill actors on purpose through `faults.maybe_kill_ray_actor`.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..api import Captioner, decode_pool
from ..checkpoints import resolve_model
from ..families import load_processor
from ..faults import maybe_kill_ray_actor
from ..outputs.formats import SHARD_PATTERN, with_metadata, write_parquet
from ..outputs.resume import Plan
from ..outputs.schema import OutputColumns
from ..outputs.store import write_atomically
from ..progress import plural
from ..run import CaptionRun, RunOutcome, Status, run_provenance
from ..settings import CaptionSettings, RaySettings, RunSettings
from ..sources import MediaItem
from ..text import one_line
from ..workers import DecodeJob, Decoded, DecodePool

CALLS_PER_ACTOR = 2


class RayResourceError(ValueError):
    """The cluster cannot ever run the actors asked for."""


@dataclass(frozen=True)
class RayJob:
    """What every task and actor of a run needs; pickled to each of them."""

    settings: RunSettings
    columns: OutputColumns
    ray: RaySettings
    items_per_batch: int             # items in one call of an actor (it runs CALLS_PER_ACTOR at once)


@dataclass
class RayRun:
    """What a run wrote: its part files and their row counts."""

    parts: list[Path]
    rows: int
    failed: int
    seconds: float


def caption_on_ray(run: CaptionRun, ray: RaySettings, plan: Plan) -> RunOutcome:
    """Caption on a Ray cluster what the run's output folder does not hold yet (the run planned it).

    As in a single run, items sharing content (their key) are captioned once: the cluster gets
    `plan.todo`, and the other paths get copies of its rows in one more part file.
    """
    store, columns, report = run.store, run.columns, run.reporter
    assert store is not None
    if run.settings.overwrite:
        for part in store.target.shards():
            part.unlink()
    if run.settings.limit:
        plan.limit(run.settings.limit)
    by_path = {item.row_path: item for item in run.items}
    reused = [(plan.done[path], by_path[path]) for path in plan.reused]
    copies = sum(len(more) for more in plan.sharing.values()) + len(reused)
    done = f"{plural(len(plan.done) - len(plan.reused), 'item')} done earlier"
    if not plan.todo:
        added = add_copies(store.out, reused, {}, [], columns)
        message = f"nothing to caption on Ray: {done}; {store.out} holds them"
        if added:
            message += f"; added {plural(added, 'row')} copying captioned content"
        return RunOutcome(Status.DONE, message)
    job = RayJob(run.settings, columns, ray, items_per_batch=2 * (run.settings.caption.batch_size or 16))
    low, high = ray.actors
    pool = plural(low, "actor") if low == high else f"{low}-{high} actors"
    report.info(f"captioning {plural(len(plan.todo), 'item')} on Ray ({ray.address}: {pool}, "
                f"{ray.gpus_per_actor:g} GPU each; {done})")
    try:
        written = run_on_ray(job, plan.todo, store.out)
        add_copies(store.out, reused, plan.sharing, written.parts, columns)
    except RayResourceError:
        raise
    except Exception as error:  # a task that failed past its retries, a lost cluster: the parts written stay
        return RunOutcome(Status.CRASHED, f"the Ray run failed ({one_line(error)}); the rows written so far are "
                                          f"kept in {store.out}; run the same command again to resume")
    copied = f"; copied {copies} (same content)" if copies else ""
    return RunOutcome(Status.SOME_FAILED if written.failed else Status.DONE,
                      f"done on Ray: captioned {written.rows - written.failed}; failed {written.failed}{copied}; "
                      f"wall time {written.seconds:.1f} s; {written.rows / written.seconds:.3f} items/s; "
                      f"{plural(len(written.parts) + bool(copies), 'part file')} added to {store.out}")


def run_on_ray(job: RayJob, items: list[MediaItem], out_dir: Path) -> RayRun:
    """Caption `items` on the cluster of `job.ray` ('local' starts one here) into new part files of `out_dir`."""
    import ray

    start = time.perf_counter()
    address = job.ray.address
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False,
                 runtime_env={"env_vars": {name: value for name, value in os.environ.items()
                                           if name.startswith("TARSIER")}})
    gpus = ray.cluster_resources().get("GPU", 0)
    if job.ray.gpus_per_actor > 0 and gpus == 0:
        raise RayResourceError(f"the Ray cluster at {address} has no GPUs; pass --device cpu (or "
                               f"--ray-gpus-per-worker 0) to caption on its CPUs")
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True   # part files in input order, like a single run's rows
    stamp = f"{time.time_ns():020d}"
    dataset = ray.data.from_items([{"position": position, "item": pickle.dumps(item)}
                                   for position, item in enumerate(items)])
    # Decoding tasks spread over the cluster's nodes; the actors are placed by Ray's default. The
    # differing strategies also keep Ray from fusing decoding into the actors, which it does when
    # both ask for the same resources (--device cpu): decoding would then run in the actor's
    # process, one batch after another, instead of beside the model.
    decoded = dataset.map_batches(decode_batch, fn_kwargs={"settings": job.settings.caption}, batch_size=8,
                                  num_cpus=1, scheduling_strategy="SPREAD", batch_format="numpy")
    low, high = job.ray.actors
    # Each actor runs CALLS_PER_ACTOR calls at once (threads), so the next batch's items are in its
    # engine before the last rows of the one before finish: the engine stays full across batches.
    actors = ray.data.ActorPoolStrategy(min_size=low, max_size=high, max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                                        enable_true_multi_threading=True)
    captioned = decoded.map_batches(
        RayCaptioner, fn_constructor_kwargs={"job": job}, batch_size=job.items_per_batch, batch_format="numpy",
        compute=actors, num_gpus=job.ray.gpus_per_actor, num_cpus=1, scheduling_strategy="DEFAULT")
    out_dir.mkdir(parents=True, exist_ok=True)
    captioned.write_parquet(str(out_dir), filename_provider=part_names(stamp), compression="zstd")
    parts = sorted(out_dir.glob(f"part-{stamp}-*.parquet"))
    errors = [pq.read_table(part, columns=["error"]).column("error") for part in parts]
    return RayRun(parts, sum(len(column) for column in errors),
                  sum(len(column) - column.null_count for column in errors), time.perf_counter() - start)


def add_copies(out_dir: Path, reused: list[tuple[dict[str, Any], MediaItem]], sharing: dict[str, list[MediaItem]],
               parts: list[Path], columns: OutputColumns) -> int:
    """Give the paths that share content with a captioned item their rows, in one more part file of `out_dir`.

    `reused`: rows of earlier runs to copy to their new path; `sharing`: key -> the paths whose row is a
    copy of the row `parts` (this run's) hold for that key. Each copy gets its own file facts and manifest
    columns. Returns the number of rows added.
    """
    rows = [{**row, **columns.item_values(item)} for row, item in reused]
    if sharing:
        captioned = pa.concat_tables(pq.read_table(part, filters=[("key", "in", list(sharing))]) for part in parts)
        by_key = {row["key"]: row for row in captioned.to_pylist()}
        rows += [{**by_key[key], "path": item.row_path, **columns.item_values(item)}
                 for key, items in sharing.items() for item in items]
    if not rows:
        return 0
    newest = sorted(out_dir.glob(SHARD_PATTERN))[-1]   # this run's provenance, or the last run's
    table = pa.Table.from_pylist(rows, schema=pq.read_schema(newest))
    write_atomically(out_dir / f"part-{time.time_ns():020d}-copies.parquet", lambda path: write_parquet(path, table))
    return len(rows)


def part_names(stamp: str) -> Any:
    """`part-<run start>-<write id>-<task>.parquet`: a later run's parts sort after an earlier run's (newest row wins)."""
    from ray.data.datasource import FilenameProvider

    class PartNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"part-{stamp}-{write_uuid}-{task_index:06d}.parquet"

    return PartNames()


@cache
def _decode_pool(settings: CaptionSettings) -> DecodePool:
    """One per Ray worker process, kept for the tasks it runs after: the checkpoint's processor
    (without weights) in one isolated decoding process, as in a single run (a crash, a hang past
    the timeout or the memory limit costs only its item, which becomes an error row)."""
    processor = load_processor(resolve_model(settings.model).path)
    return decode_pool(DecodeJob(processor, settings.frames or processor.default_frames, settings.prompt), settings, 1)


def decode_batch(batch: dict[str, np.ndarray], settings: CaptionSettings) -> dict[str, np.ndarray]:
    """Ray CPU task: decode and preprocess items; a failure is its item's error, as in a single run."""
    pool = _decode_pool(settings)
    loads = [pool.submit(int(position), pickle.loads(item)) for position, item in zip(batch["position"], batch["item"])]
    decoded = [load.result() for load in loads]   # never raises: a failure is the item's error
    return {"position": batch["position"], "decoded": np.array([pickle.dumps(one) for one in decoded], dtype=object)}


class RayCaptioner:
    """A Ray actor: one Captioner, loaded once, captioning batches of decoded items into output rows."""

    def __init__(self, job: RayJob):
        self.job = job
        self.captioner = Captioner(job.settings.caption)
        self.service = self.captioner.serve()   # Ray runs CALLS_PER_ACTOR calls at once; they share its engine
        self.provenance = run_provenance(self.captioner, job.settings, runner="ray")
        self.schema = with_metadata(job.columns.schema(), self.provenance, {"complete": True})

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        decoded: list[Decoded] = [pickle.loads(one) for one in batch["decoded"]]
        maybe_kill_ray_actor([one.item.path for one in decoded])
        results = self.service.caption(decoded)
        rows = [self.job.columns.row(result, one.item, self.job.settings.caption.model)
                for result, one in zip(results, decoded)]
        return pa.Table.from_pylist(rows, schema=self.schema)
