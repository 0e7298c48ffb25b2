"""The `tarsier` command: a thin layer over the library API."""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .version import __version__
from .catalog import DEFAULT_MODEL, DEFAULT_PRUNE_LAYER, families, family_named
from .checkpoints import DEMO_ALIAS, ModelNotFoundError, needs_building, tiny_model_dir
from .config import ConfigError, config_defaults
from .job import CaptionJob
from .manifest import ManifestError, check_manifest_path, read_manifest
from .outputs.formats import OutputError, OutputTarget
from .outputs.lock import OutputLock, OutputLockedError
from .outputs.resume import Plan, SettingsMismatchError, check_settings, describe_plan, plan_run, prune_setting
from .outputs.schema import RESERVED_NAMES, OutputColumns
from .outputs.store import FLUSH_ROWS, FLUSH_SECONDS, OutputWriteError, ResultStore, StoredRows
from .outputs.stream import JsonLinesStream
from .progress import LineLog, RunStats, make_reporters, plural, print_summary, summary_line, summary_rows
from .sharding import Shard, ShardError
from .sources import Discovery, InputNotFoundError, MediaItem, discover
from .text import one_line

if TYPE_CHECKING:
    from .api import Captioner

# torch and transformers are imported inside the commands, after the arguments are checked,
# so that a bad flag or a missing input is answered at once.

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_CRASHED = 0, 1, 2, 3
EXIT_LOCKED = 75  # EX_TEMPFAIL: try again later
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
app = typer.Typer(
    help="Batch-caption videos and images with Tarsier video-language models.",
    rich_markup_mode=None, pretty_exceptions_enable=False, no_args_is_help=True, context_settings=CONTEXT)
dev_app = typer.Typer(help="Developer tools.", rich_markup_mode=None, no_args_is_help=True, context_settings=CONTEXT)
app.add_typer(dev_app, name="dev")


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tarsier-batch {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """Batch-caption videos and images with Tarsier video-language models."""


EXAMPLES = """\b
Examples:
  tarsier caption ./videos --out results.parquet
  tarsier caption ./videos -o v1.parquet --model omni-research/Tarsier-7b
  tarsier caption 'clips/**/*.mp4' photo.jpg -o out.parquet --model tiny-random-tarsier2
  find /data -name '*.mp4' -print0 | tarsier caption - -0 -o today.parquet
  tarsier caption clips/ -o - --model tiny-random-tarsier2 | jq -r .caption
  tarsier caption --manifest videos.csv --keep-columns all -o captions.jsonl
  tarsier caption --config nightly.toml --dry-run

\b
Running the same command again continues the same --out: finished rows are kept and only
what is missing (new or changed files, items a stopped run did not finish) is captioned.

\b
Exit codes:
  0    every item of this run was captioned (or there was nothing to do)
  1    some items failed (their rows carry an error)
  2    bad usage: flag value, missing input, unusable model or output, other settings than --out's
  3    crashed (a bug, while loading too; a failed device; a full disk); saved rows are resumed by the next run
  75   another run is writing the same --out
  130  interrupted (Ctrl-C); finished rows are saved, run the same command to resume
  143  terminated (SIGTERM); finished rows are saved, run the same command to resume
  141  stdout was closed while streaming with '-o -' (e.g. '| head')
"""


class KeyMode(str, Enum):
    path = "path"
    sha256 = "sha256"


DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")
SHARD_ROWS = 10_000
# Options whose relative paths in a --config file are relative to that file's folder.
PATH_SETTINGS = frozenset({"inputs", "out", "out_dir", "manifest", "log_file"})


def _apply_config(ctx: typer.Context, param: click.Parameter, value: Optional[Path]) -> Optional[Path]:
    """Eager: a --config file's values become the defaults of the other flags (flags and env vars win)."""
    if value is not None and not ctx.resilient_parsing:
        try:
            ctx.default_map = {**(ctx.default_map or {}),
                               **config_defaults(value, ctx.command, "caption", PATH_SETTINGS)}
        except ConfigError as error:
            _fail(str(error))
    return value


@app.command(epilog=EXAMPLES, no_args_is_help=True)
def caption(
    inputs: Annotated[Optional[list[str]], typer.Argument(metavar="INPUTS", hidden=True, show_default=False)] = None,  # described in the docstring: help would show a Python type
    out: Annotated[Optional[str], typer.Option("--out", "-o", metavar="FILE", help="Results file to write, or to continue if it exists: .parquet, .jsonl or .csv; '-' streams JSON Lines to stdout.", show_default=False)] = None,
    out_dir: Annotated[Optional[Path], typer.Option(metavar="DIR", help="Write Parquet shards part-00000.parquet, ... to DIR instead of one --out file (continued like --out).", show_default=False)] = None,
    shard_rows: Annotated[Optional[int], typer.Option(min=1, metavar="N", help=f"Rows per shard with --out-dir [default: {SHARD_ROWS}].", show_default=False)] = None,
    manifest: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Caption the files listed in a .csv, .tsv, .jsonl or .parquet table (relative paths: from its folder); a 'prompt' column gives rows their own prompt.", show_default=False)] = None,
    path_column: Annotated[Optional[str], typer.Option(metavar="NAME", help="The manifest's column of file paths [default: the first of path, file_name, video, image].", show_default=False)] = None,
    keep_columns: Annotated[Optional[str], typer.Option(metavar="A,B|all", help="Manifest columns to carry into the output (a name taken by an output column gets the prefix input_).", show_default=False)] = None,
    null_separated: Annotated[bool, typer.Option("-0", "--null", help="Paths on stdin are separated by NUL bytes (find -print0).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be captioned and what skipped, and why; load no model, write nothing.")] = False,
    limit: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Caption at most N items this run (the first that need it); a later run does the rest.", show_default=False)] = None,
    shard: Annotated[Optional[str], typer.Option(metavar="I/N", help="Caption only shard I (from 0) of N: a fixed 1/N of the items, by path (Slurm arrays, one process per GPU); join the outputs with 'tarsier merge'.", show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option(metavar="FILE", envvar="TARSIER_CONFIG", show_envvar=True, is_eager=True, callback=_apply_config, help="TOML file of flag values (keys are flag names: model, batch-size, ...); flags and environment variables win over it.", show_default=False)] = None,
    model: Annotated[str, typer.Option(metavar="NAME|DIR", envvar="TARSIER_MODEL", show_envvar=True, help="Checkpoint directory, Hugging Face id, or a built-in random model ('tiny-random-tarsier2', 'tiny-random'); see 'tarsier models'.")]
    = DEFAULT_MODEL,
    prompt: Annotated[Optional[str], typer.Option(metavar="TEXT", help="Instruction replacing the model's default ('Describe the video in detail.').", show_default=False)] = None,
    frames: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Frames sampled uniformly from each video or GIF [default: 16 for Tarsier2, 8 for Tarsier v1].", show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option(min=1, metavar="N", envvar="TARSIER_BATCH_SIZE", show_envvar=True, help="Most items generating at once; a finished item's place is taken at the next step [default: 16 on CPU, 32 on CUDA].", show_default=False)] = None,
    max_batch_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Positions computed per model step: one per decoding item, the rest for prefill chunks.")] = 4096,
    prefill_chunk: Annotated[int, typer.Option(min=0, metavar="N", help="Prefill long prompts in chunks of at most this many positions (0: whole).")] = 2048,
    kv_cache_gb: Annotated[Optional[float], typer.Option(min=0.001, metavar="GIB", envvar="TARSIER_KV_CACHE_GB", show_envvar=True, help="KV cache size in GiB [default: what CUDA can spare after loading; on CPU min(4, RAM/4)].", show_default=False)] = None,
    offload_kv: Annotated[bool, typer.Option("--offload-kv", help="Keep a prefilling item's KV cache in host memory until it decodes (long videos on small GPUs; no effect on CPU).")] = False,
    compile_step: Annotated[bool, typer.Option("--compile", help="Compile the step with torch.compile: fused kernels, and each decode step one graph at power-of-two sizes (a CUDA graph on GPUs), after a start-up compile (tens of seconds; needs a C++ compiler on CPU, Triton on CUDA). Same captions in float32.")] = False,
    prune_vision: Annotated[float, typer.Option(metavar="R", help="Drop this share of each item's vision tokens after --prune-layer (FastV): a faster prefill and a smaller KV cache, but not the official output (0: off).")] = 0.0,
    prune_layer: Annotated[Optional[int], typer.Option(metavar="K", help="The first language-model layer that sees only the kept vision tokens, 1 <= K < layers [default: 2].", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most tokens generated per caption.")] = 512,
    temperature: Annotated[float, typer.Option(min=0.0, metavar="T", help="0 is greedy decoding; above 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(metavar="P", help="Nucleus sampling mass in (0, 1] (with --temperature > 0).")] = 1.0,
    repetition_penalty: Annotated[Optional[float], typer.Option(min=0.01, metavar="X", help="Penalty on tokens already in the prompt or caption (1: none) [default: the checkpoint's generation_config.json].", show_default=False)] = None,
    seed: Annotated[int, typer.Option(min=0, metavar="N", help="Seed for sampling; each file gets its own stream, derived from its key.")] = 0,
    dtype: Annotated[DType, typer.Option(envvar="TARSIER_DTYPE", show_envvar=True, help="Weights and compute dtype [auto: float32 on CPU, bfloat16 on CUDA].")] = DType.auto,
    device: Annotated[str, typer.Option(metavar="DEVICE", envvar="TARSIER_DEVICE", show_envvar=True, help="auto, cpu, cuda or cuda:N.")] = "auto",
    workers: Annotated[Optional[int], typer.Option(min=1, metavar="N", envvar="TARSIER_WORKERS", show_envvar=True, help="Worker processes decoding media ahead of the model [default: cores - 1, at most 4].", show_default=False)] = None,
    decode_timeout: Annotated[float, typer.Option(min=0.1, metavar="SECONDS", help="Seconds one item may take to decode before its worker is killed and the item fails.")] = 120.0,
    decode_memory_gb: Annotated[float, typer.Option(min=0.5, metavar="GIB", help="Memory one decoding worker may use (GiB); an item above it fails.")] = 8.0,
    recursive: Annotated[bool, typer.Option("--recursive/--no-recursive", help="Descend into subdirectories.")] = True,
    with_token_ids: Annotated[bool, typer.Option("--with-token-ids", help="Add a generated_ids column.")] = False,
    key: Annotated[KeyMode, typer.Option(help="What identifies a finished item on later runs: 'path' (resolved path, size and mtime) or 'sha256' (content; reads each file; adds a sha256 column).")] = KeyMode.path,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start from scratch: caption everything again and replace --out.")] = False,
    retry_errors: Annotated[bool, typer.Option("--retry-errors", help="Caption again the items whose stored rows are errors.")] = False,
    prune_missing: Annotated[bool, typer.Option("--prune-missing", help="Drop stored rows of files that no longer exist (kept by default).")] = False,
    fail_on_empty: Annotated[bool, typer.Option("--fail-on-empty", help="Exit 1 when the inputs hold no media (default: exit 0 with a message).")] = False,
    flush_rows: Annotated[int, typer.Option(min=1, metavar="N", help="Save finished rows to disk every this many rows...")] = FLUSH_ROWS,
    flush_seconds: Annotated[float, typer.Option(min=0.0, metavar="SECONDS", help="...or once the oldest unsaved row is this many seconds old.")] = FLUSH_SECONDS,
    log_file: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Append timestamped plain lines (start, progress, failures, summary) to this file.", show_default=False)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display or summary (errors only).")] = False,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="Run on a Ray cluster into --out-dir: 'auto' (the cluster this machine belongs to), ray://HOST:10001, or 'local' (start one here). Needs pip install 'tarsier-batch[ray]'.", show_default=False)] = None,
    ray_workers: Annotated[str, typer.Option(metavar="N|MIN-MAX", help="Captioning actors on the Ray cluster, each loading the model once: N, or MIN-MAX to let Ray scale between them.")] = "1",
    ray_gpus_per_worker: Annotated[Optional[float], typer.Option(min=0.0, metavar="G", help="GPUs per captioning actor [default: 1, or 0 with --device cpu].", show_default=False)] = None,
) -> None:
    """Caption every video, GIF and image in INPUTS (or a --manifest) into one row per file, resuming --out if it exists.

    INPUTS are media files, directories or glob patterns; '-' reads paths from stdin, one per
    line (-0: NUL-separated).
    """
    console = Console(stderr=True, soft_wrap=True)
    stream = out == "-"
    target = _check_flags(inputs or [], out, out_dir, shard_rows, manifest, path_column, keep_columns,
                          null_separated, stream, prompt, device, batch_size, max_batch_tokens, top_p,
                          overwrite=overwrite, retry_errors=retry_errors, prune_missing=prune_missing)
    prune_layer = _check_prune_flags(prune_vision, prune_layer, offload_kv)
    shard_spec = _parse_shard(shard)
    actors = _check_ray_flags(out_dir, shard_spec, ray_workers, prune_missing) if ray is not None else (1, 1)
    if shard_spec and not stream and (target.shard_rows or target.format != "parquet"):
        _fail(f"--shard writes one Parquet file per shard for 'tarsier merge': give --out shard-{shard_spec.index}.parquet")
    columns, discovery = _find_items(inputs or [], manifest, path_column, keep_columns, null_separated, recursive,
                                     key.value, with_token_ids, console)
    all_items = discovery.items
    if shard_spec:
        discovery = replace(discovery, items=[item for item in all_items if shard_spec.holds(item)])
    try:
        store = None if stream else ResultStore(target, columns, flush_rows, flush_seconds)
        log_handle = open(log_file, "a", encoding="utf-8") if log_file else None
    except (OutputError, OSError) as error:
        _fail(str(error))
    log = LineLog(file=log_handle)
    if not all_items:
        where = f"--manifest {manifest}" if manifest else " ".join(inputs or [])
        message = f"no supported media in {where} ({plural(discovery.skipped_count, 'other file')} skipped)"
        if log_handle:
            log(message)
        console.print(f"tarsier: {message}", highlight=False, markup=False)
        raise typer.Exit(EXIT_SOME_FAILED if fail_on_empty else EXIT_OK)
    requested = {"model": model, "prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": temperature,
                 "top_p": top_p, "seed": seed, "with_token_ids": with_token_ids, "key": key.value,
                 "shard": str(shard_spec) if shard_spec else None, "prune": prune_setting(prune_vision, prune_layer),
                 **({"frames": frames} if frames is not None else {}),
                 **({"repetition_penalty": repetition_penalty} if repetition_penalty is not None else {})}
    if dry_run:
        raise typer.Exit(_dry_run(discovery, store, requested, overwrite, retry_errors, prune_missing, limit))
    lock = OutputLock(target.path) if store else None
    try:
        if lock:
            target.path.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
    except (OutputLockedError, OSError) as error:
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(EXIT_LOCKED if isinstance(error, OutputLockedError) else EXIT_USAGE) from None
    try:
        stored = StoredRows() if overwrite or store is None else store.read()
        check_settings(stored.settings, requested)
        plan = plan_run(discovery.items, stored, retry_errors, prune_missing)
        if ray is not None:
            raise typer.Exit(_caption_on_ray(
                ray, discovery.items, plan, store, columns, overwrite, limit, console, quiet, log,
                actors, ray_gpus_per_worker if ray_gpus_per_worker is not None else float(device != "cpu"),
                {"with_token_ids": with_token_ids, "key": key.value, "shard": None},
                model=model, prompt=prompt, frames=frames, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                prefill_chunk=prefill_chunk, kv_cache_gb=kv_cache_gb, offload_kv=offload_kv, dtype=dtype.value,
                device=device, prune_vision=prune_vision, prune_layer=prune_layer, compile_step=compile_step,
                sampling=(max_new_tokens, temperature, top_p, seed, repetition_penalty)))
        later = len(plan.limit(limit)) if limit else 0
        for problem in stored.unreadable_parts:
            console.print(f"tarsier: warning: unreadable part file {problem}", highlight=False, markup=False)
        stats = RunStats(total=plan.items_to_caption, skipped=discovery.skipped_count,
                         already_done=len(plan.done), missing_kept=plan.missing_kept,
                         missing_pruned=plan.missing_pruned, left_for_later=later)
        sink = store or JsonLinesStream(plan.captioned_paths(discovery.items), sys.stdout)
        job = CaptionJob(discovery.items, plan, sink, stats, model, columns)
        if plan.todo:
            if needs_building(model) and not quiet:
                console.print(f"tarsier: building the random-weight model {model} (first use; cached in "
                              f"{tiny_model_dir(model)}; its captions are noise)", highlight=False, markup=False)
            captioner = _load_captioner(console, quiet, log, model=model, prompt=prompt, frames=frames,
                                        batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                                        prefill_chunk=prefill_chunk, kv_cache_gb=kv_cache_gb, offload_kv=offload_kv,
                                        prune_vision=prune_vision, prune_layer=prune_layer,
                                        compile_step=compile_step,
                                        dtype=dtype.value, device=device, workers=workers,
                                        decode_timeout_s=decode_timeout, decode_memory_gb=decode_memory_gb,
                                        sampling=(max_new_tokens, temperature, top_p, seed, repetition_penalty))
            provenance = {**captioner.provenance(),
                          "settings": _resume_settings(captioner, with_token_ids, key.value, requested["shard"])}
            check_settings(stored.settings, provenance["settings"])
            code = _run(captioner, job, console, quiet, log,
                        start=(lambda: store.begin(provenance, fresh=overwrite)) if store else (lambda: None))
        else:
            # A shard with no items of its own still writes its (empty) output, for `tarsier merge`.
            provenance, code = stored.provenance or {"settings": requested}, EXIT_OK
        if code in (EXIT_OK, EXIT_SOME_FAILED):
            code = _write_output(job, store, stored, provenance, console, quiet, log, discovery.skipped,
                                 (shard_spec, all_items) if shard_spec else None)
    except (OutputError, SettingsMismatchError, ModelNotFoundError, ValueError) as error:
        _fail(str(error))
    except LoadingCrashed as error:
        console.print(f"tarsier: crashed while loading the model ({error}); {target.path} was not changed",
                      highlight=False, markup=False)
        code = EXIT_CRASHED
    except KeyboardInterrupt:  # while loading the model or writing --out: --out is whole, old or new
        console.print(f"tarsier: interrupted; {target.path} was not changed; run the same command again to continue",
                      highlight=False, markup=False)
        code = EXIT_INTERRUPTED
    finally:
        if lock:
            lock.release()
        if log_handle:
            log_handle.close()
    raise typer.Exit(code)


def _check_flags(inputs: list[str], out: str | None, out_dir: Path | None, shard_rows: int | None,
                 manifest: Path | None, path_column: str | None, keep_columns: str | None, null_separated: bool,
                 stream: bool, prompt: str | None, device: str, batch_size: int | None, max_batch_tokens: int,
                 top_p: float, **resume_flags: bool) -> OutputTarget:
    """Answer every wrong flag or combination at once, before anything is read, loaded or imported."""
    if (out is None) == (out_dir is None):
        _fail("give --out FILE (.parquet, .jsonl, .csv; '-' for stdout) or --out-dir DIR, one of them"
              if out is None else "give --out or --out-dir, not both")
    if shard_rows is not None and out_dir is None:
        _fail("--shard-rows needs --out-dir")
    if stream:
        given = [f"--{name.replace('_', '-')}" for name, on in resume_flags.items() if on]
        if given:
            _fail(f"{', '.join(given)} continue an output file; '-o -' streams to stdout and keeps nothing to continue")
    if manifest is None:
        if not inputs:
            _fail("give INPUTS (files, folders, globs, '-' for stdin) or --manifest FILE")
        for flag, value in (("--path-column", path_column), ("--keep-columns", keep_columns)):
            if value is not None:
                _fail(f"{flag} needs --manifest")
    elif inputs:
        _fail("give INPUTS or --manifest, not both")
    if null_separated and "-" not in inputs:
        _fail("-0 reads NUL-separated paths from stdin; add '-' to INPUTS")
    if prompt is not None and not prompt.strip():
        _fail("--prompt is empty; leave it out to use the model's default instruction")
    if not 0 < top_p <= 1:
        _fail(f"--top-p {top_p}: give a probability mass in (0, 1]; 1 keeps every token")
    if not DEVICE_NAMES.fullmatch(device):
        _fail(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    if batch_size is not None and max_batch_tokens < batch_size:
        _fail(f"--max-batch-tokens {max_batch_tokens} is below --batch-size {batch_size}: "
              f"every generating item needs one position per step")
    target = OutputTarget(out_dir, shard_rows or SHARD_ROWS) if out_dir is not None else OutputTarget(Path(out or "-"))
    try:
        if manifest is not None:
            check_manifest_path(manifest)
        if not stream:
            target.check()
    except (ManifestError, OutputError) as error:
        _fail(str(error))
    return target


def _check_prune_flags(vision: float, layer: int | None, offload_kv: bool) -> int:
    """The pruning layer to use, after checking the pruning flags (the layer's upper bound is checked once the
    model is loaded: it depends on its depth)."""
    if not 0 <= vision < 1:
        _fail(f"--prune-vision {vision}: give the share of vision tokens to drop, 0 <= R < 1 (0: off)")
    if layer is not None and vision == 0:
        _fail("--prune-layer needs --prune-vision R > 0 (pruning is off)")
    if layer is not None and layer < 1:
        _fail(f"--prune-layer {layer}: the first layer can only see every token; give K >= 1")
    if vision > 0 and offload_kv:
        _fail("--offload-kv and --prune-vision do not work together yet; leave one out")
    return layer if layer is not None else DEFAULT_PRUNE_LAYER


def _check_ray_flags(out_dir: Path | None, shard: Shard | None, workers: str, prune_missing: bool) -> tuple[int, int]:
    """Answer wrong --ray flags at once; returns the actor pool's bounds (MIN, MAX) from --ray-workers."""
    import importlib.util

    bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", workers.strip())
    low, high = (int(bounds.group(1)), int(bounds.group(2) or bounds.group(1))) if bounds else (0, 0)
    if not 1 <= low <= high:
        _fail(f"--ray-workers {workers!r}: give a number of actors N >= 1, or MIN-MAX with 1 <= MIN <= MAX")
    if out_dir is None:
        _fail("--ray writes a folder of Parquet part files: give --out-dir DIR instead of --out")
    if shard is not None:
        _fail("--ray spreads the items over the cluster itself; leave out --shard")
    if prune_missing:
        _fail("--ray only adds part files; to drop rows of vanished files, run once without --ray with --prune-missing")
    if importlib.util.find_spec("ray") is None:
        _fail("--ray needs Ray, an optional extra: pip install 'tarsier-batch[ray]'")
    return low, high


def _caption_on_ray(address: str, items: list[MediaItem], plan: Plan, store: ResultStore | None,
                    columns: OutputColumns, overwrite: bool, limit: int | None, console: Console,
                    quiet: bool, log: LineLog, actors: tuple[int, int], gpus_per_actor: float,
                    flag_settings: dict[str, Any],
                    sampling: tuple[int, float, float, int, float | None], **settings: Any) -> int:
    """Caption on a Ray cluster what --out-dir does not hold yet; returns the exit code.

    As in a single run, items sharing content (their key) are captioned once: the cluster gets
    `plan.todo`, and the other paths get copies of its rows in one more part file.
    """
    from .api import CaptionSettings
    from .engine import SamplingParams
    from .runners.ray import RayJob, RayResourceError, add_copies, run_on_ray

    assert store is not None
    if overwrite:
        for part in store.target.shards():
            part.unlink()
    if limit:
        plan.limit(limit)
    by_path = {item.row_path: item for item in items}
    reused = [(plan.done[path], by_path[path]) for path in plan.reused]
    copies = sum(len(more) for more in plan.sharing.values()) + len(reused)
    done = f"{plural(len(plan.done) - len(plan.reused), 'item')} done earlier"
    if not plan.todo:
        added = add_copies(store.out, reused, {}, [], columns)
        message = f"nothing to caption on Ray: {done}; {store.out} holds them"
        if added:
            message += f"; added {plural(added, 'row')} copying captioned content"
        console.print(f"tarsier: {message}", highlight=False, markup=False)
        log(message)
        return EXIT_OK
    _quiet_library_logs()
    job = RayJob(CaptionSettings(sampling=SamplingParams(*sampling), **settings), columns, settings["model"],
                 flag_settings, actors, gpus_per_actor,
                 items_per_batch=2 * (settings["batch_size"] or 16))
    pool = plural(actors[0], "actor") if actors[0] == actors[1] else f"{actors[0]}-{actors[1]} actors"
    message = (f"captioning {plural(len(plan.todo), 'item')} on Ray ({address}: {pool}, "
               f"{gpus_per_actor:g} GPU each; {done})")
    if not quiet:
        console.print(f"tarsier: {message}", highlight=False, markup=False)
    log(message)
    try:
        run = run_on_ray(job, plan.todo, store.out, address)
        add_copies(store.out, reused, plan.sharing, run.parts, columns)
    except RayResourceError as error:
        _fail(str(error))
    except Exception as error:  # a task that failed past its retries, a lost cluster: the parts written stay
        message = (f"the Ray run failed ({one_line(error)}); the rows written so far are kept in {store.out}; "
                   f"run the same command again to resume")
        console.print(f"tarsier: {message}", highlight=False, markup=False)
        log(message)
        return EXIT_CRASHED
    copied = f"; copied {copies} (same content)" if copies else ""
    message = (f"done on Ray: captioned {run.rows - run.failed}; failed {run.failed}{copied}; wall time "
               f"{run.seconds:.1f} s; {run.rows / run.seconds:.3f} items/s; "
               f"{plural(len(run.parts) + bool(copies), 'part file')} added to {store.out}")
    if not quiet:
        console.print(f"tarsier: {message}", highlight=False, markup=False)
    log(message)
    return EXIT_SOME_FAILED if run.failed else EXIT_OK


def _parse_shard(text: str | None) -> Shard | None:
    try:
        return Shard.parse(text) if text is not None else None
    except ShardError as error:
        _fail(str(error))


def _find_items(inputs: list[str], manifest: Path | None, path_column: str | None, keep_columns: str | None,
                null_separated: bool, recursive: bool, key: str, with_token_ids: bool,
                console: Console) -> tuple[OutputColumns, Discovery]:
    """The items of this run, from INPUTS or the manifest, and the columns their rows will have."""
    hashed = key == "sha256"
    try:
        if manifest is not None:
            listed = read_manifest(manifest, key, RESERVED_NAMES, path_column, keep_columns)
            for name, renamed in listed.renamed.items():
                console.print(f"tarsier: manifest column {name!r} is an output column too; kept as {renamed!r}",
                              highlight=False, markup=False)
            return OutputColumns(with_token_ids, hashed, tuple(listed.kept_fields)), listed.discovery
        discovery = discover(inputs, recursive, _stdin_paths(inputs, null_separated), key)
    except (InputNotFoundError, ManifestError, OSError) as error:
        _fail(str(error))
    for problem in discovery.unreadable:
        console.print(f"tarsier: warning: cannot read folder {problem}", highlight=False, markup=False)
    return OutputColumns(with_token_ids, hashed), discovery


def _dry_run(discovery: Discovery, store: ResultStore | None, requested: dict[str, Any], overwrite: bool,
             retry_errors: bool, prune_missing: bool, limit: int | None) -> int:
    """Print one line per input (what would happen and why) on stdout, the counts on stderr."""
    try:
        stored = StoredRows() if overwrite or store is None else store.read()
        check_settings(stored.settings, requested)
    except (OutputError, SettingsMismatchError) as error:
        _fail(str(error))
    plan = plan_run(discovery.items, stored, retry_errors, prune_missing)
    later = {item.row_path for item in plan.limit(limit)} if limit else set()
    lines, counts = describe_plan(discovery, stored, plan, later)
    sys.stdout.writelines(f"{action}\t{path}\t{reason}\n" for action, path, reason in lines)
    by_action: dict[str, Counter[str]] = {}
    for (action, kind), count in counts.items():
        by_action.setdefault(action, Counter())[kind] += count
    summary = "; ".join(f"{action} {sum(kinds.values())} ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})"
                        for action, kinds in by_action.items())
    typer.echo(f"tarsier: dry run, nothing loaded or written: {summary or 'nothing to do'}", err=True)
    return EXIT_OK


class LoadingCrashed(Exception):
    """Loading the model failed on a bug of this tool (its traceback is printed), not on the model given."""


class Terminated(BaseException):
    """SIGTERM arrived (timeout, a scheduler, `docker stop`): stop like Ctrl-C."""


def _resume_settings(captioner: Captioner, with_token_ids: bool, key: str, shard: str | None) -> dict[str, Any]:
    """What decides the captions (compared when a later run continues): the model's part and the flags'."""
    return {**captioner.resume_settings(), "with_token_ids": with_token_ids, "key": key, "shard": shard}


def _load_captioner(console: Console, quiet: bool, log: LineLog, sampling: tuple[int, float, float, int, float | None],
                    **settings: Any) -> Captioner:
    from .api import Captioner, CaptionSettings
    from .engine import SamplingParams

    _quiet_library_logs()
    loading = console.status(f"loading {escape(settings['model'])}", spinner="dots")
    try:
        with loading if console.is_terminal and not quiet else nullcontext():
            captioner = Captioner(CaptionSettings(sampling=SamplingParams(*sampling), **settings))
    except (ModelNotFoundError, ValueError):
        raise
    except (OSError, RuntimeError) as error:   # unreadable files, weights of other shapes, a device too small:
        raise ValueError(one_line(error)) from error   # the user's to fix (exit 2)
    except Exception as error:   # a bug of ours while loading: show where (exit 3)
        traceback.print_exc()
        raise LoadingCrashed(one_line(error)) from error
    engine = captioner.engine
    config = engine.config
    offload = ", KV offloaded during prefill" if config.offload_kv \
        else "; --offload-kv has no effect on the CPU" if settings["offload_kv"] else ""
    slots = " + ".join(f"{pool.capacity_tokens} tokens" + (f" in {_layer_range(pool.layers)}" if len(engine.pools) > 1 else "")
                       for pool in engine.pools)
    pruning = (f", {config.prune.ratio:g} of the vision tokens dropped after layer {config.prune.layer} "
               f"(not the official output)" if config.prune is not None else "")
    pruning += ", compiled step (the first steps compile)" if config.compile else ""
    line = (f"{settings['model']} ({captioner.model.family.name}, {captioner.frames} frames) on "
            f"{captioner.device} ({str(captioner.dtype).removeprefix('torch.')}), batch size {captioner.batch_size}, "
            f"KV cache {slots} ({engine.kv_bytes / 2**30:.2f} GiB), "
            f"{plural(captioner.workers, 'decoding worker')}{offload}{pruning}")
    if not quiet:
        console.print(f"tarsier: {line}", highlight=False, markup=False)
    log(line)
    return captioner


def _layer_range(layers: range) -> str:
    return f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"


@contextmanager
def _stop_signals() -> Iterator[None]:
    """The first Ctrl-C or SIGTERM stops the run cleanly (finished rows are saved); a second exits at once.

    Exiting at once cannot corrupt anything a reader sees: every file is written under a
    temporary name and renamed when complete; a later run resumes from the saved parts.
    """
    def exit_now(signum: int, frame: object) -> None:
        os._exit(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED)

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, exit_now)
        signal.signal(signal.SIGTERM, exit_now)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    previous = {number: signal.signal(number, stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _run(captioner: Captioner, job: CaptionJob, console: Console, quiet: bool, log: LineLog,
         start: Callable[[], None]) -> int:
    """Caption the plan's items, saving rows as they finish; the exit code says how it ended.

    `start` prepares the output's work directory, under the same signal handling as the run:
    once it exists, a stop always saves rows and says how to resume.
    """
    reporters = make_reporters(job.stats, console, quiet, log.file)
    try:
        with _stop_signals(), ExitStack() as display:
            start()
            for reporter in reporters:
                display.enter_context(reporter)
            job.run(captioner, reporters)
            job.store.flush()
        return EXIT_SOME_FAILED if job.stats.failed else EXIT_OK
    except (KeyboardInterrupt, Terminated) as stop:
        reason, code = ("interrupted", EXIT_INTERRUPTED) if isinstance(stop, KeyboardInterrupt) \
            else ("terminated", EXIT_TERMINATED)
    except BrokenPipeError:  # `-o - | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits
        reason, code = "stdout was closed", EXIT_BROKEN_PIPE
    except Exception as error:  # a bug, a dead device or a full disk: keep what finished, say what happened
        if not quiet and not isinstance(error, OutputWriteError):
            console.print_exception()
        reason, code = f"crashed ({error if isinstance(error, OutputWriteError) else one_line(error)})", EXIT_CRASHED
    if not isinstance(job.store, ResultStore):
        message = f"{reason}; {plural(job.store.saved_rows, 'row')} went to stdout"
        console.print(f"tarsier: {message}", highlight=False, markup=False)
        log(message)
        return code
    with _stop_signals():  # a second signal while saving exits at once
        try:
            job.store.flush()
            lost = ""
        except OutputWriteError as error:
            lost = f"; {error}"
    saved = job.store.saved_rows + job.stats.already_done
    message = (f"{reason}{lost}; {plural(saved, 'finished row')} {'is' if saved == 1 else 'are'} saved in "
               f"{job.store.work_dir} "
               f"and {job.store.out} was not changed; run the same command again to resume")
    console.print(f"tarsier: {message}", highlight=False, markup=False)
    log(message)
    return code


def _write_output(job: CaptionJob, store: ResultStore | None, stored: StoredRows, provenance: dict[str, Any],
                  console: Console, quiet: bool, log: LineLog, skipped: Counter[str],
                  shard: tuple[Shard, list[MediaItem]] | None) -> int:
    """Write --out with every row (unless nothing changed) and report; returns the exit code.

    A shard's output also records where its rows go among all the run's items (`shard`: the
    shard and those items), so it is written again whenever it runs: the inputs may have grown.
    """
    stats = job.stats
    if store is None:
        written = f"stdout ({plural(job.store.saved_rows, 'row')})"
    else:
        rows = job.final_rows()
        unchanged = store.target.exists() and not stored.parts and not stats.done and shard is None \
            and [row["path"] for row in rows] == list(stored.rows)
        if shard:
            provenance = {**provenance, "shard": shard[0].provenance(shard[1], rows)}
        if not unchanged:
            try:
                store.commit(rows, provenance, {"complete": True, **stats.as_dict()})
            except OutputWriteError as error:
                message = (f"crashed ({error}); the finished rows are saved in {store.work_dir}; "
                           f"free space and run the same command again to write {store.out}")
                console.print(f"tarsier: {message}", highlight=False, markup=False)
                log(message)
                return EXIT_CRASHED
        written = f"{store.out} ({plural(len(rows), 'row')}{', unchanged' if unchanged else ''})"
    summary = summary_rows(stats, written, ", ".join(f"{count} {suffix}" for suffix, count in sorted(skipped.items())))
    if not quiet:
        if console.is_terminal:
            print_summary(console, summary)
        else:
            console.print(f"tarsier: {summary_line(summary)}", highlight=False, markup=False)
    log(summary_line(summary))
    return EXIT_SOME_FAILED if stats.failed else EXIT_OK


@app.command()
def models() -> None:
    """List the model families, their known checkpoints and their defaults."""
    for family in families():
        default = " (the default --model)" if DEFAULT_MODEL in family.checkpoints else ""
        typer.echo(f"{family.name}{default}\n"
                   f"  config.json:  model_type 'llava', text_config.model_type '{family.text_model_type}'\n"
                   f"  vision:       {family.vision}\n"
                   f"  checkpoints:  {', '.join(family.checkpoints)}\n"
                   f"  frames:       {family.default_frames}\n"
                   f"  instruction:  {family.default_instruction}\n"
                   f"  offline demo: --model {family.tiny_alias} (random weights, captions are noise)\n")
    typer.echo(f"Demo model: --model {DEMO_ALIAS}, a small Tarsier v1 trained by this project on synthetic clips of\n"
               "  moving shapes: it captions such clips ('A red circle moves up.'), nine in ten right; nothing else.")


@app.command("inspect", no_args_is_help=True)
def inspect_command(
    files: Annotated[list[str], typer.Argument(metavar="FILE", hidden=True, show_default=False)],
    model: Annotated[Optional[str], typer.Option(metavar="NAME|DIR", envvar="TARSIER_MODEL", show_envvar=True, help="Sample frames as this model's family does [default: the default model, Tarsier2].", show_default=False)] = None,
    family: Annotated[Optional[str], typer.Option(metavar="NAME", help="Or name the family directly: tarsier (v1), tarsier2 (see 'tarsier models').", show_default=False)] = None,
    frames: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Frames to sample [default: the family's].", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file, one per line.")] = False,
) -> None:
    """What captioning would see in each FILE: type, size, codec, rotation, frame rate, duration, frame count,
    the decoder and why, the frame indices it would sample, and the error it would give.

    Decodes the sampled frames exactly as captioning does, in a child process (a decoder crash or
    hang is reported). Exit code 0 if every file would caption, 1 if some would fail.
    """
    from .inspection import family_for, inspect_file

    if model is not None and family is not None:
        _fail("give --model or --family, not both")
    try:
        chosen = family_named(family) if family else family_for(model or DEFAULT_MODEL)
    except ValueError as error:
        _fail(str(error))
    failed = 0
    for index, path in enumerate(files):
        found = inspect_file(path, chosen, frames)
        failed += not found.ok
        typer.echo(found.as_json() if as_json else ("\n" if index else "") + found.as_text())
    raise typer.Exit(EXIT_SOME_FAILED if failed else EXIT_OK)


@app.command("merge", no_args_is_help=True)
def merge_command(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="FILE", help="The merged results: .parquet, .jsonl or .csv (replaced atomically if it exists).", show_default=False)],
) -> None:
    """Join the outputs of 'tarsier caption --shard I/N' runs in FOLDER into one results file, in input order.

    FOLDER holds one .parquet output per shard (and nothing else ending in .parquet). The
    shards must be one complete set made the same way: every shard of N once, over the same
    inputs, with the same settings and columns. The merged file is what one run over all the
    inputs writes, and a later 'tarsier caption' without --shard can continue it.
    """
    from .outputs.merge import MergeError, merge_shards

    target = OutputTarget(out)
    try:
        target.check()
    except OutputError as error:
        _fail(str(error))
    if out.resolve().parent == folder.resolve() and out.suffix.lower() == ".parquet":
        _fail(f"--out {out} is inside {folder}: a later merge would read it as a shard; write it elsewhere")
    lock = OutputLock(out)
    try:
        merged = merge_shards(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        try:
            ResultStore(target, merged.columns).commit(merged.rows, merged.provenance, merged.summary)
        finally:
            lock.release()
    except (MergeError, OutputLockedError, OutputWriteError, OSError) as error:
        _fail(str(error))
    failed = sum(row["error"] is not None for row in merged.rows)
    typer.echo(f"tarsier: merged {plural(merged.shards, 'shard')} into {out} ({plural(len(merged.rows), 'row')}, "
               f"{failed} failed)", err=True)


@app.command("report", no_args_is_help=True)
def report_command(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", hidden=True, show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="FILE", help="The HTML page to write.", show_default=False)],
    frames_per_item: Annotated[int, typer.Option(min=0, metavar="N", help="Frames shown per item, evenly chosen from those the caption was made from (0: all).")] = 8,
    thumb_height: Annotated[int, typer.Option(min=16, max=512, metavar="PX", help="Height of the frame thumbnails.")] = 72,
    workers: Annotated[Optional[int], typer.Option(min=0, metavar="N", help="Processes extracting frames (0: none, in this process) [default: cores - 1].", show_default=False)] = None,
    title: Annotated[Optional[str], typer.Option(metavar="TEXT", help="Page title [default: from RESULTS' name].", show_default=False)] = None,
) -> None:
    """Write one self-contained HTML page to review RESULTS (a .parquet, .jsonl or .csv file or a folder of shards).

    Per item: the frames the caption was made from (re-extracted from the file at the recorded
    indices), the caption, prompt, model, tokens and timing; failed items grouped by error;
    summary figures and a caption-length histogram. Filter by media type, status and text; the
    page works offline and pages through 10,000 items.
    """
    import time

    from .review import check_results_path, write_report

    if out.is_dir():
        _fail(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
    try:
        check_results_path(results)
    except OutputError as error:
        _fail(str(error))
    console = Console(stderr=True, soft_wrap=True)
    start = time.perf_counter()
    progress = Progress(TextColumn("extracting frames"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=not console.is_terminal)
    task = progress.add_task("frames", total=None)
    try:
        with progress:
            count = write_report(results, out, frames_per_item, thumb_height,
                                 workers if workers is not None else max(1, (os.cpu_count() or 2) - 1), title,
                                 on_strips=lambda done: progress.advance(task, done),
                                 on_total=lambda total: progress.update(task, total=total))
    except (OutputError, OSError) as error:
        _fail(str(error))
    console.print(f"tarsier: wrote {out} ({plural(count, 'item')}, {out.stat().st_size / 2**20:.1f} MB) in "
                  f"{time.perf_counter() - start:.1f} s", highlight=False, markup=False)


@dev_app.command("eval-demo", context_settings={**CONTEXT, "allow_extra_args": True,
                                                 "ignore_unknown_options": True})
def eval_demo_command(
    context: typer.Context,
    n: Annotated[int, typer.Option("--n", min=1, metavar="N", help="Held-out clips to caption (each also played backwards).")] = 200,
    seed: Annotated[int, typer.Option(min=0, metavar="S", help="Which held-out clips.")] = 0,
    model: Annotated[str, typer.Option(metavar="NAME|DIR", help="The checkpoint to measure.")] = "demo",
) -> None:
    """Caption freshly generated held-out clips through `tarsier caption` and print the exact-match accuracy.

    The last line is `accuracy=A n=N`; played backwards, a clip must get the opposite motion
    (`reversed_accuracy`). Exit 1 when either is below 0.95. Options after `--` go to
    `tarsier caption`, to measure what a setting costs: `eval-demo -- --dtype bfloat16`.
    """
    from .demo.evaluate import evaluate

    try:
        result = evaluate(n, seed, model, tuple(context.args))
    except RuntimeError as error:
        _fail(str(error))
    for name, expected, got in result.mistakes[:20]:
        typer.echo(f"{name}: expected {expected!r}, got {got!r}")
    typer.echo(f"reversed_accuracy={result.reversed_accuracy:.3f} n={result.n}")
    typer.echo(f"accuracy={result.accuracy:.3f} n={result.n}")
    raise typer.Exit(EXIT_OK if result.accuracy >= 0.95 and result.reversed_accuracy >= 0.95 else EXIT_SOME_FAILED)


@dev_app.command("make-tiny-model")
def make_tiny_model_command(
    directory: Annotated[Path, typer.Argument(metavar="DIRECTORY", hidden=True, show_default=False)],
    family: Annotated[str, typer.Option(metavar="NAME", help="tarsier (v1) or tarsier2.")] = "tarsier",
    size: Annotated[str, typer.Option(metavar="SIZE", help="tiny (unit tests), small (real frame geometry), bench (a ~100M-parameter LM, small frames) or wide (that LM, real frames).")] = "tiny",
    seed: Annotated[int, typer.Option(min=0, metavar="N", help="Seed of the random weights.")] = 0,
) -> None:
    """Write a deterministic random-weight checkpoint in the family's real format into DIRECTORY (captions are noise)."""
    try:
        family_named(family)
    except ValueError as error:
        _fail(str(error))
    if directory.exists() and any(directory.iterdir()):
        _fail(f"{directory} exists and is not empty")
    from .tiny import make_tiny_model

    try:
        typer.echo(make_tiny_model(directory, size, seed, family))
    except ValueError as error:
        _fail(str(error))


def _stdin_paths(inputs: list[str], null_separated: bool = False) -> list[str]:
    """The paths on standard input if an input is `-`: one per line (blank lines ignored) or NUL-separated.

    Read as bytes: a file name that is not valid UTF-8 still names its file.
    """
    if "-" not in inputs:
        return []
    data = sys.stdin.buffer.read()
    if null_separated:
        return [os.fsdecode(path) for path in data.split(b"\0") if path]
    return [os.fsdecode(line.rstrip(b"\r")) for line in data.split(b"\n") if line.strip()]




def _fail(message: str) -> NoReturn:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _quiet_library_logs() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if __name__ == "__main__":
    app()
