"""The `tarsier` command: a thin layer over the library API."""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional, TypeVar

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.traceback import Traceback

from . import (
    DEFAULT_MODEL,
    DEMO_ACCURACY,
    DEMO_ALIAS,
    DTYPES,
    FLUSH_ROWS,
    FLUSH_SECONDS,
    MAX_IMAGE_PIXELS,
    PRUNE_METHODS,
    RESERVED_NAMES,
    Backend,
    CaptionRun,
    CaptionSettings,
    Discovery,
    InputNotFoundError,
    LineLog,
    LoadingCrashed,
    Manifest,
    ManifestError,
    ModelNotFoundError,
    OutputError,
    OutputLockedError,
    OutputTarget,
    OutputWriteError,
    PromptSetError,
    Question,
    RaySettings,
    RemoteOutput,
    Reporter,
    RunOutcome,
    RunReporter,
    RunSettings,
    RunStats,
    SamplingParams,
    Segmenting,
    SegmentsError,
    SettingsError,
    SettingsMismatchError,
    Shard,
    ShardError,
    Status,
    StorageError,
    Terminated,
    __version__,
    check_manifest_path,
    discover,
    family_named,
    install_extra_command,
    is_shard,
    make_reporters,
    model_families,
    model_reference_problem,
    output_at,
    parse_asks,
    plural,
    print_summary,
    read_manifest,
    read_prompt_set,
    sibling_columns,
)
from .config import ConfigError, config_defaults

T = TypeVar("T")

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


DType = Enum("DType", {name: name for name in DTYPES}, type=str)   # typer shows the choices
PruneMethod = Enum("PruneMethod", {name: name for name in PRUNE_METHODS}, type=str)


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
  tarsier caption ./videos -o s3://bucket/captions.parquet
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


class OutFormat(str, Enum):
    parquet = "parquet"
    webdataset = "webdataset"


SHARD_ROWS = 10_000
# Options whose relative paths in a --config file are relative to that file's folder.
PATH_SETTINGS = frozenset({"inputs", "out", "out_dir", "manifest", "log_file", "prompts"})


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
    # described in the docstring: help would show a Python type
    inputs: Annotated[Optional[list[str]], typer.Argument(
        metavar="INPUTS", hidden=True, show_default=False)] = None,
    out: Annotated[Optional[str], typer.Option(
        "--out", "-o", metavar="FILE",
        help="Results file to write, or to continue if it exists: .parquet, .jsonl or .csv, a path (missing folders "
             "are made) or an s3://, gs://, az:// URL; '-' streams JSON Lines to stdout.", show_default=False)] = None,
    out_dir: Annotated[Optional[str], typer.Option(
        metavar="DIR",
        help="Write Parquet shards part-00000.parquet, ... to DIR (a folder or an s3://, gs://, az:// prefix) instead "
             "of one --out file (continued like --out).", show_default=False)] = None,
    shard_rows: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", help=f"Rows per shard with --out-dir [default: {SHARD_ROWS}].", show_default=False)] = None,
    out_format: Annotated[Optional[OutFormat], typer.Option(
        case_sensitive=False,
        help="What --out-dir holds: Parquet shards (parquet), or for inputs in WebDataset shards a tar per input "
             "shard, named like it, with each member's row as KEY.json and caption as KEY.txt (webdataset).",
        show_default=False)] = None,
    manifest: Annotated[Optional[str], typer.Option(
        metavar="FILE",
        help="Caption the files listed in a .csv, .tsv, .jsonl or .parquet table, a path or a URL (relative paths: "
             "from its folder); a 'prompt' column gives rows their own prompt, a 'prompts' column (JSON: name -> "
             "question) their own questions.", show_default=False)] = None,
    path_column: Annotated[Optional[str], typer.Option(
        metavar="NAME",
        help="The manifest's column of file paths [default: the first of path, file_name, video, image].",
        show_default=False)] = None,
    keep_columns: Annotated[Optional[str], typer.Option(
        metavar="A,B|all",
        help="Manifest columns to carry into the output; with WebDataset shards, their members' sibling files by "
             "extension (json,txt). A name taken by an output column gets the prefix input_.",
        show_default=False)] = None,
    null_separated: Annotated[bool, typer.Option(
        "-0", "--null", help="Paths on stdin are separated by NUL bytes (find -print0).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run",
        help="List what would be captioned and what skipped, and why; load no model, write nothing.")] = False,
    limit: Annotated[Optional[int], typer.Option(
        min=1, metavar="N",
        help="Caption at most N items this run (the first that need it); a later run does the rest.",
        show_default=False)] = None,
    shard: Annotated[Optional[str], typer.Option(
        metavar="I/N",
        help="Caption only shard I (from 0) of N: a fixed 1/N of the items, by path (Slurm arrays, one process per "
             "GPU); join the outputs with 'tarsier merge'.", show_default=False)] = None,
    config: Annotated[Optional[Path], typer.Option(
        metavar="FILE", envvar="TARSIER_CONFIG", show_envvar=True, is_eager=True, callback=_apply_config,
        help="TOML file of flag values (keys are flag names: model, batch-size, ...); flags and environment variables "
             "win over it.", show_default=False)] = None,
    model: Annotated[str, typer.Option(
        metavar="NAME|DIR", envvar="TARSIER_MODEL", show_envvar=True,
        help="Checkpoint directory, Hugging Face id, the shipped demo model ('demo': captions synthetic clips of "
             "moving shapes, nothing else) or a built-in random model ('tiny-random-tarsier2', 'tiny-random'); see "
             "'tarsier models'.")] = DEFAULT_MODEL,
    prompt: Annotated[Optional[str], typer.Option(
        metavar="TEXT", help="Instruction replacing the model's default ('Describe the video in detail.').",
        show_default=False)] = None,
    ask: Annotated[Optional[list[str]], typer.Option(
        metavar="NAME=TEXT",
        help="Ask each item this question too, its answer in column NAME (repeat for several: the frames are "
             "prefilled once for all of them).", show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option(
        metavar="FILE",
        help="Questions to ask each item, from a TOML or JSON file of name = \"text\" (or name = {text = ..., "
             "max_new_tokens = N}); with --ask, these come first.", show_default=False)] = None,
    long: Annotated[bool, typer.Option(
        "--long",
        help="With --ask/--prompts: one row per file and question (a 'question' column and the single prompt's "
             "columns) instead of one row per file with each question's columns.")] = False,
    segments: Annotated[str, typer.Option(
        metavar="SPEC",
        help="Rows per video, each sampled like a file of its own: 'whole' (one per file); 'fixed:10s', a row per "
             "10 s window (',overlap=2s': windows repeat 2 s; ',min=2s': a shorter last window joins the one "
             "before); 'scenes', a row per shot (the scenes extra; ',threshold=27': higher finds fewer cuts, "
             "',min=0.5s': the shortest shot, ',max=30s': longer shots split evenly).")] = "whole",
    frames: Annotated[Optional[int], typer.Option(
        min=1, metavar="N",
        help="Frames sampled uniformly from each video or GIF [default: 16 for Tarsier2, 8 for Tarsier v1].",
        show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", envvar="TARSIER_BATCH_SIZE", show_envvar=True,
        help="Most items generating at once; a finished item's place is taken at the next step [default: 16 on CPU, "
             "32 on CUDA].", show_default=False)] = None,
    max_batch_tokens: Annotated[int, typer.Option(
        min=1, metavar="N",
        help="Positions computed per model step: one per decoding item, the rest for prefill chunks.")] = 4096,
    prefill_chunk: Annotated[int, typer.Option(
        min=0, metavar="N", help="Prefill long prompts in chunks of at most this many positions (0: whole).")] = 2048,
    kv_cache_gb: Annotated[Optional[float], typer.Option(
        min=0.001, metavar="GIB", envvar="TARSIER_KV_CACHE_GB", show_envvar=True,
        help="KV cache size in GiB [default: what CUDA can spare after loading; on CPU min(4, RAM/4)].",
        show_default=False)] = None,
    offload_kv: Annotated[bool, typer.Option(
        "--offload-kv",
        help="Keep a prefilling item's KV cache in host memory until it decodes (long videos on small GPUs; no effect "
             "on CPU).")] = False,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache",
        help="Keep the computed KV of prompts' full pages, and let an item whose prompt starts the same way (the same "
             "clip and prompt under a second path, an item preempted and coming back) take them instead of computing "
             "them. Same captions either way.")] = True,
    preflight: Annotated[bool, typer.Option(
        "--preflight/--no-preflight",
        help="Before loading, estimate the memory the model and this run need (weights at --dtype, KV cache, "
             "activations) and stop at once with the numbers and a fix if they do not fit.")] = True,
    compile_step: Annotated[bool, typer.Option(
        "--compile",
        help="Run the model's layers, vision blocks and decode attention through torch.compile: fused kernels, after a "
             "start-up compile (tens of seconds; needs a C++ compiler on CPU, Triton on CUDA). Same captions in "
             "float32.")] = False,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="On CUDA, record each decode step as a CUDA graph (once per power-of-two size) and replay it: one "
             "launch instead of ~1,900 kernel launches a step. Same captions in float32.")] = True,
    fused_attention: Annotated[bool, typer.Option(
        "--fused-attention/--no-fused-attention",
        help="On CUDA, decoding rows attend in one fused Triton kernel that reads each row's KV pages where they "
             "lie (otherwise a split attention of torch ops). Same captions in float32.")] = True,
    prune_vision: Annotated[float, typer.Option(
        metavar="R",
        help="Drop this share of each item's vision tokens (by --prune-method): a faster prefill and a smaller KV "
             "cache, but not the official output (0: off).")] = 0.0,
    prune_layer: Annotated[Optional[int], typer.Option(
        metavar="K",
        help="With --prune-method fastv: the first language-model layer that sees only the kept vision tokens, 1 <= K "
             "< layers [default: 2].", show_default=False)] = None,
    prune_method: Annotated[Optional[PruneMethod], typer.Option(
        case_sensitive=False,
        help="temporal: before the language model, drop the vision tokens that changed least since the previous "
             "frame (the first frame stays whole); fastv: drop the vision tokens the last prompt token attends to "
             "least, after --prune-layer [default: temporal, which keeps captions closer to unpruned; fastv with "
             "--prune-layer].", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most tokens generated per caption.")] = 512,
    temperature: Annotated[float, typer.Option(
        min=0.0, metavar="T", help="0 is greedy decoding; above 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(
        metavar="P", help="Nucleus sampling mass in (0, 1] (with --temperature > 0).")] = 1.0,
    repetition_penalty: Annotated[Optional[float], typer.Option(
        min=0.01, metavar="X",
        help="Penalty on tokens already in the prompt or caption (1: none) [default: the checkpoint's "
             "generation_config.json].", show_default=False)] = None,
    seed: Annotated[int, typer.Option(
        min=0, metavar="N", help="Seed for sampling; each file gets its own stream, derived from its key.")] = 0,
    dtype: Annotated[DType, typer.Option(
        envvar="TARSIER_DTYPE", show_envvar=True,
        help="Weights and compute dtype [auto: float32 on CPU, "
             "bfloat16 on CUDA].")] = DType.auto,  # type: ignore[attr-defined]
    device: Annotated[str, typer.Option(
        metavar="DEVICE", envvar="TARSIER_DEVICE", show_envvar=True, help="auto, cpu, cuda or cuda:N.")] = "auto",
    workers: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", envvar="TARSIER_WORKERS", show_envvar=True,
        help="Worker processes decoding media ahead of the model [default: cores - 1, at most 4].",
        show_default=False)] = None,
    decode_timeout: Annotated[float, typer.Option(
        min=0.1, metavar="SECONDS",
        help="Seconds one item may take to decode before its worker is killed and the item fails.")] = 120.0,
    decode_memory_gb: Annotated[float, typer.Option(
        min=0.5, metavar="GIB", help="Memory one decoding worker may use (GiB); an item above it fails.")] = 8.0,
    max_image_pixels: Annotated[int, typer.Option(
        min=1, metavar="N",
        help="Images (and GIFs) of more pixels fail undecoded: decompression bombs. A JPEG above 89 Mpx is read "
             "reduced as it decodes.")] = MAX_IMAGE_PIXELS,
    recursive: Annotated[bool, typer.Option("--recursive/--no-recursive", help="Descend into subdirectories.")] = True,
    with_token_ids: Annotated[bool, typer.Option("--with-token-ids", help="Add a generated_ids column.")] = False,
    key: Annotated[KeyMode, typer.Option(
        help="What identifies a finished item on later runs: 'path' (resolved path, size and mtime) or 'sha256' "
             "(content; reads each file; adds a sha256 column).")] = KeyMode.path,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start from scratch: caption everything again and replace --out.")] = False,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="Caption again the items whose stored rows are errors.")] = False,
    prune_missing: Annotated[bool, typer.Option(
        "--prune-missing", help="Drop stored rows of files that no longer exist (kept by default).")] = False,
    fail_on_empty: Annotated[bool, typer.Option(
        "--fail-on-empty", help="Exit 1 when the inputs hold no media (default: exit 0 with a message).")] = False,
    flush_rows: Annotated[int, typer.Option(
        min=1, metavar="N", help="Save finished rows to disk every this many rows...")] = FLUSH_ROWS,
    flush_seconds: Annotated[float, typer.Option(
        min=0.0, metavar="SECONDS",
        help="...or once this many seconds passed since the last save (a row finishing later than that is saved at "
             "once).")] = FLUSH_SECONDS,
    log_file: Annotated[Optional[Path], typer.Option(
        metavar="FILE", help="Append timestamped plain lines (start, progress, failures, summary) to this file.",
        show_default=False)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display or summary (errors only).")] = False,
    ray: Annotated[Optional[str], typer.Option(
        "--ray", metavar="ADDRESS",
        help="Caption on a Ray cluster: 'auto' (the cluster this machine belongs to), ray://HOST:10001, or 'local' "
             "(start one here). Needs pip install 'tarsier-batch[ray]'.", show_default=False)] = None,
    ray_workers: Annotated[str, typer.Option(
        metavar="N|MIN-MAX",
        help="Captioning actors on the Ray cluster, each loading the model once: N, or MIN-MAX to let Ray scale "
             "between them.")] = "1",
    ray_gpus_per_worker: Annotated[Optional[float], typer.Option(
        min=0.0, metavar="G", help="GPUs per captioning actor [default: 1, or 0 with --device cpu].",
        show_default=False)] = None,
) -> None:
    """Caption every video, GIF and image in INPUTS (or a --manifest) into one row per file, resuming --out if
    it exists.

    INPUTS are media files, directories or glob patterns; '-' reads paths from stdin, one per
    line (-0: NUL-separated).
    """
    console = Console(stderr=True, soft_wrap=True)
    stream = out == "-"
    output = _check_flags(inputs or [], out, out_dir, shard_rows, out_format, manifest, path_column, keep_columns,
                          null_separated, stream)
    target = output.target if isinstance(output, RemoteOutput) else output
    shard_spec = _parse_shard(shard)
    settings = _settings(
        CaptionSettings, model=model, prompt=prompt, prompt_set=_prompt_set(prompts, ask or []), frames=frames,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, kv_cache_gb=kv_cache_gb, offload_kv=offload_kv,
        prefix_cache=prefix_cache,
        prune_vision=prune_vision, prune_layer=prune_layer, prune_method=prune_method.value if prune_method else None,
        compile_step=compile_step, cuda_graphs=cuda_graphs, fused_attention=fused_attention,
        dtype=dtype.value, device=device,
        workers=workers, decode_timeout_s=decode_timeout, decode_memory_gb=decode_memory_gb,
        max_image_pixels=max_image_pixels, preflight=preflight,
        sampling=_settings(SamplingParams, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, repetition_penalty=repetition_penalty))
    if (problem := model_reference_problem(model)) is not None:   # a typo is answered before torch is imported
        _fail(problem)
    settings = _settings(RunSettings, caption=settings, with_token_ids=with_token_ids, long=long, key=key.value,
                         shard=shard_spec, overwrite=overwrite, retry_errors=retry_errors, prune_missing=prune_missing,
                         limit=limit, fail_on_empty=fail_on_empty, flush_rows=flush_rows, flush_seconds=flush_seconds,
                         segments=_segmenting(segments))
    if stream:
        _settings(settings.check_streamable)
    ray_settings = _check_ray_flags(ray, shard_spec, ray_workers, ray_gpus_per_worker, device) \
        if ray is not None else None
    if shard_spec and not stream and (target.shard_rows or target.format not in ("parquet", "webdataset")):
        _fail("--shard writes one Parquet file (or WebDataset folder) per shard for 'tarsier merge': give "
              f"--out shard-{shard_spec.index}.parquet (or --out-dir shard-{shard_spec.index} --out-format webdataset)")
    if target.webdataset and (settings.long or settings.segments.mode != "whole"):
        _fail(f"--out-format webdataset writes one sample per member: not with "
              f"{'--long' if settings.long else '--segments'}")
    found = _find_items(inputs or [], manifest, path_column, keep_columns, null_separated, recursive, key.value)
    if target.webdataset:   # the one output that cannot place every input's row
        try:
            target.kind.check_rows([item.path for item in
                                    (found.discovery if isinstance(found, Manifest) else found).items])
        except OutputError as error:
            _fail(str(error))
    try:
        if log_file:   # its folder is made, as --out's is (shards/shard-0.log beside shards/shard-0.parquet)
            log_file.parent.mkdir(parents=True, exist_ok=True)
        log_handle = open(log_file, "a", encoding="utf-8") if log_file else None
    except OSError as error:
        _fail(f"--log-file {log_file}: {error.strerror or error}")
    log = LineLog(file=log_handle)
    reporter = _CliReporter(console, quiet, log)
    try:
        run = CaptionRun(found, sys.stdout if stream else output, settings, reporter,
                         load=_on_ray(ray_settings, reporter) if ray_settings else None,
                         source=f"--manifest {manifest}" if manifest else " ".join(inputs or []))
        nothing = run.no_media()
        if dry_run:
            raise typer.Exit(_dry_run(run) if nothing is None else _present(nothing, console, quiet, log))
        with _stop_signals():
            outcome = run.execute()
        code = _present(outcome, console, quiet, log)
    except SettingsError as error:
        _fail(error.worded(FLAGS))
    except (OutputError, SettingsMismatchError, ModelNotFoundError, ValueError) as error:
        _fail(str(error))
    except (OutputLockedError, OSError) as error:
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(EXIT_LOCKED if isinstance(error, OutputLockedError) else EXIT_USAGE) from None
    except LoadingCrashed as error:
        traceback.print_exception(error.__cause__ or error)
        console.print(f"tarsier: crashed while loading the model ({error}); nothing was written to {target.shown}",
                      highlight=False, markup=False)
        raise typer.Exit(EXIT_CRASHED) from None
    finally:
        if log_handle:
            log_handle.close()
    raise typer.Exit(code)


def _check_flags(inputs: list[str], out: str | None, out_dir: str | None, shard_rows: int | None,
                 out_format: OutFormat | None, manifest: str | None, path_column: str | None,
                 keep_columns: str | None, null_separated: bool, stream: bool) -> OutputTarget | RemoteOutput:
    """Answer a wrong combination of inputs and outputs at once, before anything is read, loaded or imported
    (the settings check their own rules: `settings.py`)."""
    if (out is None) == (out_dir is None):
        _fail("give --out FILE (.parquet, .jsonl, .csv; '-' for stdout) or --out-dir DIR, one of them"
              if out is None else "give --out or --out-dir, not both")
    if shard_rows is not None and out_dir is None:
        _fail("--shard-rows needs --out-dir")
    if out_format is not None and out_dir is None:
        _fail("--out-format needs --out-dir (the format of an --out file is its suffix)")
    webdataset = out_format is OutFormat.webdataset
    if webdataset and shard_rows is not None:
        _fail("--shard-rows does not apply to --out-format webdataset: it writes one tar per input shard")
    if manifest is None:
        if not inputs:
            _fail("give INPUTS (files, folders, globs, '-' for stdin) or --manifest FILE")
        if path_column is not None:
            _fail("--path-column needs --manifest")
    elif inputs:
        _fail("give INPUTS or --manifest, not both")
    if null_separated and "-" not in inputs:
        _fail("-0 reads NUL-separated paths from stdin; add '-' to INPUTS")
    output = _output(out_dir, None if webdataset else shard_rows or SHARD_ROWS, webdataset) if out_dir is not None \
        else _output(out or "-")
    try:
        if manifest is not None:
            check_manifest_path(manifest)
        if not stream:
            (output.target if isinstance(output, RemoteOutput) else output).check()
    except (ManifestError, OutputError) as error:
        _fail(str(error))
    return output


def _segmenting(spec: str) -> Segmenting:
    try:
        segmenting = Segmenting.parse(spec)
        segmenting.check_available()
    except SegmentsError as error:
        _fail(str(error))
    return segmenting


def _output(location: str, shard_rows: int | None = None, webdataset: bool = False) -> OutputTarget | RemoteOutput:
    """The output at `location`; a read-only scheme or a missing storage backend stops the command here, before
    anything is loaded."""
    try:
        return output_at(location, shard_rows, webdataset)
    except (OutputError, StorageError) as error:
        _fail(str(error))


# The settings' fields as the CLI names them (a field not listed is its flag with dashes).
FLAGS = {field: "--" + field.replace("_", "-")
         for settings in (CaptionSettings, SamplingParams, RunSettings) for field in settings.__dataclass_fields__}
FLAGS.update(compile_step="--compile", decode_timeout_s="--decode-timeout", preflight="--no-preflight",
             prompt_set="--ask/--prompts")


def _settings(make: Callable[..., T], **values: Any) -> T:
    """`make(**values)`; a setting it refuses stops the command, the message naming flags."""
    try:
        return make(**values)
    except SettingsError as error:
        _fail(error.worded(FLAGS))


def _check_ray_flags(address: str, shard: Shard | None, workers: str, gpus: float | None,
                     device: str) -> RaySettings:
    """Answer wrong --ray flags at once."""
    import importlib.util

    bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", workers.strip())
    low, high = (int(bounds.group(1)), int(bounds.group(2) or bounds.group(1))) if bounds else (0, 0)
    if not 1 <= low <= high:
        _fail(f"--ray-workers {workers!r}: give a number of actors N >= 1, or MIN-MAX with 1 <= MIN <= MAX")
    if shard is not None:
        _fail("--ray spreads the items over the cluster itself; leave out --shard")
    if importlib.util.find_spec("ray") is None:
        _fail(f"--ray needs Ray, an optional extra: {install_extra_command('ray')}")
    return RaySettings(address, (low, high), gpus if gpus is not None else float(device != "cpu"))


def _on_ray(ray: RaySettings, reporter: RunReporter) -> Callable[[CaptionSettings], Backend]:
    """A run's loader that captions on the cluster (Ray is imported only when there is something to caption)."""
    def load(settings: CaptionSettings) -> Backend:
        from . import RayBackend

        return RayBackend(settings, ray, reporter)
    return load


def _prompt_set(path: Path | None, asks: list[str]) -> tuple[Question, ...]:
    """--prompts' questions, then --ask's (their names and texts are checked with the other settings)."""
    try:
        from_file = read_prompt_set(path) if path is not None else ()
    except PromptSetError as error:
        _fail(f"--prompts: {error}")
    try:
        return from_file + parse_asks(asks)
    except PromptSetError as error:
        _fail(f"--ask {error}")


def _parse_shard(text: str | None) -> Shard | None:
    try:
        return Shard.parse(text) if text is not None else None
    except ShardError as error:
        _fail(str(error))


def _find_items(inputs: list[str], manifest: str | None, path_column: str | None, keep_columns: str | None,
                null_separated: bool, recursive: bool, key: str) -> Manifest | Discovery:
    """The items of this run, from INPUTS or the manifest."""
    try:
        if manifest is not None:
            return read_manifest(manifest, key, RESERVED_NAMES, path_column, keep_columns)
        found = discover(inputs, recursive, _stdin_paths(inputs, null_separated), key)
        # Without a manifest, the kept columns are the shards' sibling files (`key.json` beside `key.mp4`).
        return sibling_columns(found, keep_columns, RESERVED_NAMES) if keep_columns is not None else found
    except (InputNotFoundError, ManifestError, OSError) as error:
        _fail(str(error))


def _dry_run(run: CaptionRun) -> int:
    """Print one line per input (what would happen and why) on stdout, the counts on stderr."""
    try:
        lines, counts = run.describe()
    except (OutputError, SettingsMismatchError) as error:
        _fail(str(error))
    sys.stdout.writelines(f"{action}\t{path}\t{reason}\n" for action, path, reason in lines)
    by_action: dict[str, Counter[str]] = {}
    for (action, kind), count in counts.items():
        by_action.setdefault(action, Counter())[kind] += count
    summary = "; ".join(f"{action} {sum(kinds.values())} ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})"
                        for action, kinds in by_action.items())
    typer.echo(f"tarsier: dry run, nothing loaded or written: {summary or 'nothing to do'}", err=True)
    return EXIT_OK


class _CliReporter:
    """A run's reports on stderr (a spinner and a live display on a terminal) and in the --log-file."""

    def __init__(self, console: Console, quiet: bool, log: LineLog):
        self.console, self.quiet, self.log = console, quiet, log

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"tarsier: {message}", highlight=False, markup=False)
        self.log(message)

    def warning(self, message: str) -> None:
        self.console.print(f"tarsier: {message}", highlight=False, markup=False)
        self.log(message)

    def loading(self, model: str) -> AbstractContextManager[object]:
        _quiet_library_logs()
        if self.console.is_terminal and not self.quiet:
            return self.console.status(f"loading {escape(model)}", spinner="dots")
        return nullcontext()

    def progress(self, stats: RunStats) -> list[Reporter]:
        return make_reporters(stats, self.console, self.quiet, self.log.file)


EXIT_CODES = {Status.DONE: EXIT_OK, Status.NO_MEDIA: EXIT_OK, Status.SOME_FAILED: EXIT_SOME_FAILED,
              Status.INTERRUPTED: EXIT_INTERRUPTED, Status.TERMINATED: EXIT_TERMINATED,
              Status.STDOUT_CLOSED: EXIT_BROKEN_PIPE, Status.CRASHED: EXIT_CRASHED}


def _present(outcome: RunOutcome, console: Console, quiet: bool, log: LineLog) -> int:
    """Show how the run ended; returns the exit code."""
    if outcome.status is Status.STDOUT_CLOSED:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits
    finished = outcome.status in (Status.DONE, Status.SOME_FAILED) and outcome.stats is not None
    if outcome.error is not None and not quiet and not isinstance(outcome.error, OutputWriteError):
        console.print(Traceback.from_exception(type(outcome.error), outcome.error, outcome.error.__traceback__))
    if not finished or not quiet:
        if finished and outcome.summary and console.is_terminal:
            print_summary(console, outcome.summary)
        else:
            console.print(f"tarsier: {outcome.message}", highlight=False, markup=False)
    log(outcome.message)
    return EXIT_CODES[outcome.status]


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


@app.command()
def models() -> None:
    """List the model families, their known checkpoints and their defaults."""
    for family in model_families():
        default = " (the default --model)" if DEFAULT_MODEL in family.checkpoints else ""
        typer.echo(f"{family.name}{default}\n"
                   f"  config.json:  model_type 'llava', text_config.model_type '{family.text_model_type}'\n"
                   f"  vision:       {family.vision}\n"
                   f"  checkpoints:  {', '.join(family.checkpoints)}\n"
                   f"  frames:       {family.default_frames}\n"
                   f"  instruction:  {family.default_instruction}\n"
                   f"  offline demo: --model {family.tiny_alias} (random weights, captions are noise)\n")
    typer.echo(f"Demo model: --model {DEMO_ALIAS}, a small Tarsier v1 trained by this project on synthetic clips of\n"
               f"  moving shapes: it captions such clips ('A red circle moves up.'), {DEMO_ACCURACY}; nothing else.")


@app.command("inspect", no_args_is_help=True)
def inspect_command(
    files: Annotated[list[str], typer.Argument(metavar="FILE", hidden=True, show_default=False)],
    model: Annotated[Optional[str], typer.Option(
        metavar="NAME|DIR", envvar="TARSIER_MODEL", show_envvar=True,
        help="Sample frames as this model's family does [default: the default model, Tarsier2].",
        show_default=False)] = None,
    family: Annotated[Optional[str], typer.Option(
        metavar="NAME", help="Or name the family directly: tarsier (v1), tarsier2 (see 'tarsier models').",
        show_default=False)] = None,
    frames: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", help="Frames to sample [default: the family's].", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file, one per line.")] = False,
) -> None:
    """What captioning would see in each FILE: type, size, codec, rotation, frame rate, duration, frame count,
    the decoder and why, the frame indices it would sample, and the error it would give.

    Decodes the sampled frames exactly as captioning does, in a child process (a decoder crash or
    hang is reported). Exit code 0 if every file would caption, 1 if some would fail.
    """
    from . import family_for, inspect_file

    if model is not None and family is not None:
        _fail("give --model or --family, not both")
    try:
        chosen = family_named(family) if family else family_for(model or DEFAULT_MODEL)
    except ValueError as error:
        _fail(str(error))
    failed = 0
    for index, path in enumerate(member for path in files for member in _members_if_shard(path)):
        found = inspect_file(path, chosen, frames)
        failed += not found.ok
        typer.echo(found.as_json() if as_json else ("\n" if index else "") + found.as_text())
    raise typer.Exit(EXIT_SOME_FAILED if failed else EXIT_OK)


def _members_if_shard(path: str) -> list[str]:
    """A WebDataset shard's media members (`shard.tar#member`), each inspected as captioning would see it; any
    other path as it is."""
    if not is_shard(path):
        return [path]
    try:
        found = discover([path])
    except InputNotFoundError as error:
        _fail(str(error))
    for problem in found.unreadable:
        typer.echo(f"warning: cannot read {problem}", err=True)
    return [item.path for item in found.items]


@app.command("merge", no_args_is_help=True)
def merge_command(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", show_default=False)],
    out: Annotated[Optional[str], typer.Option(
        "--out", "-o", metavar="FILE",
        help="The merged results: .parquet, .jsonl or .csv, a path or an s3://, gs://, az:// URL (replaced atomically "
             "if it exists).", show_default=False)] = None,
    out_dir: Annotated[Optional[str], typer.Option(
        metavar="DIR", help="Write the merged results as shards to DIR (a folder or an s3://, gs://, az:// prefix) "
                            "instead of one --out file, in --out-format.", show_default=False)] = None,
    out_format: Annotated[Optional[OutFormat], typer.Option(
        case_sensitive=False, help="What --out-dir holds: Parquet shards (parquet) or a WebDataset shard per input "
                                   "shard (webdataset).", show_default=False)] = None,
) -> None:
    """Join the outputs of 'tarsier caption --shard I/N' runs in FOLDER into one output, in input order.

    FOLDER holds one output per shard: .parquet files (and nothing else ending in .parquet), or
    folders written with --out-format webdataset. The shards must be one complete set made the
    same way: every shard of N once, over the same inputs, with the same settings and columns.
    The merged output is what one run over all the inputs writes, and a later 'tarsier caption'
    without --shard can continue it.
    """
    from . import MergeError, merge_outputs

    if (out is None) == (out_dir is None):
        _fail("give --out FILE or --out-dir DIR, one of them" if out is None else "give --out or --out-dir, not both")
    if out_format is not None and out_dir is None:
        _fail("--out-format needs --out-dir (the format of an --out file is its suffix)")
    webdataset = out_format is OutFormat.webdataset
    output = _output(out_dir, None if webdataset else SHARD_ROWS, webdataset) if out_dir is not None \
        else _output(str(out))
    try:
        merged = merge_outputs(folder, output)
    except (MergeError, OutputError, OutputLockedError, OutputWriteError, OSError) as error:
        _fail(str(error))
    typer.echo(f"tarsier: merged {plural(merged.shards, 'shard')} into {merged.written} "
               f"({plural(merged.rows, 'row')}, {merged.failed} failed)", err=True)


@app.command("report", no_args_is_help=True)
def report_command(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", hidden=True, show_default=False)],
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="FILE", help="The HTML page to write.", show_default=False)],
    frames_per_item: Annotated[int, typer.Option(
        min=0, metavar="N",
        help="Frames shown per item, evenly chosen from those the caption was made from (0: all).")] = 8,
    thumb_height: Annotated[int, typer.Option(
        min=16, max=512, metavar="PX", help="Height of the frame thumbnails.")] = 72,
    workers: Annotated[Optional[int], typer.Option(
        min=0, metavar="N", help="Processes extracting frames (0: none, in this process) [default: cores - 1].",
        show_default=False)] = None,
    title: Annotated[Optional[str], typer.Option(
        metavar="TEXT", help="Page title [default: from RESULTS' name].", show_default=False)] = None,
) -> None:
    """Write one self-contained HTML page to review RESULTS (a .parquet, .jsonl or .csv file or a folder of shards).

    Per item: the frames the caption was made from (re-extracted from the file at the recorded
    indices), the caption, prompt, model, tokens and timing; failed items grouped by error;
    summary figures and a caption-length histogram. Filter by media type, status and text; the
    page works offline and pages through 10,000 items.
    """
    import time

    from . import check_results_path, write_report

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
    n: Annotated[int, typer.Option(
        "--n", min=1, metavar="N", help="Held-out clips to caption (each also played backwards).")] = 200,
    seed: Annotated[int, typer.Option(min=0, metavar="S", help="Which held-out clips.")] = 0,
    model: Annotated[str, typer.Option(metavar="NAME|DIR", help="The checkpoint to measure.")] = "demo",
) -> None:
    """Caption freshly generated held-out clips through `tarsier caption` and print the exact-match accuracy.

    The last line is `accuracy=A n=N`; played backwards, a clip must get the opposite motion
    (`reversed_accuracy`). Exit 1 when either is below 0.95. Options after `--` go to
    `tarsier caption`, to measure what a setting costs: `eval-demo -- --dtype bfloat16`.
    """
    from . import evaluate_demo

    try:
        result = evaluate_demo(n, seed, model, tuple(context.args))
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
    size: Annotated[str, typer.Option(
        metavar="SIZE",
        help="tiny (unit tests), small (real frame geometry), bench (a ~100M-parameter LM, small frames) or wide "
             "(that LM, real frames).")] = "tiny",
    seed: Annotated[int, typer.Option(min=0, metavar="N", help="Seed of the random weights.")] = 0,
) -> None:
    """Write a deterministic random-weight checkpoint in the family's real format into DIRECTORY (captions are
    noise)."""
    try:
        family_named(family)
    except ValueError as error:
        _fail(str(error))
    if directory.exists() and any(directory.iterdir()):
        _fail(f"{directory} exists and is not empty")
    from . import make_tiny_model

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
