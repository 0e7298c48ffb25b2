"""The `tarsier` command: a thin layer over the library API."""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypeVar

import click
import typer
from rich.console import Console

from . import (
    DEFAULT_MODEL,
    Backend,
    CaptionRun,
    CaptionSettings,
    Discovery,
    InputNotFoundError,
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
    RunReporter,
    RunSettings,
    SettingsError,
    SettingsMismatchError,
    StorageError,
    __version__,
    discover,
    model_families,
    output_at,
    parse_asks,
    read_manifest,
    read_prompt_set,
)
from .cli_options import (
    OUT_FORMATS,
    PATH_SETTINGS,
    SHARD_ROWS,
    CommandOptions,
    caption_parameters,
    check_output_choice,
    from_values,
    in_flags,
)
from .cli_review import peek_command, report_command
from .cli_run import (
    EXIT_CRASHED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    CommandReporter,
    dry_run,
    fail,
    let_waiting_cpu_threads_sleep,
    open_log,
    present,
    stdin_paths,
    stop_signals,
)
from .config import ConfigError, config_defaults
from .families.catalog import family_named
from .inputs.manifest import check_manifest_path, sibling_columns
from .inputs.sources import is_shard
from .model.checkpoints import DEMO_ACCURACY, DEMO_ALIAS, model_reference_problem
from .outputs.remote import RemoteOutput
from .outputs.schema import RESERVED_NAMES
from .progress import LineLog, plural, process_started
from .version import install_extra_command

T = TypeVar("T")

# torch and transformers are imported inside the commands, after the arguments are checked,
# so that a bad flag or a missing input is answered at once.

# The families a flag may name, as `family_named` knows them.
FAMILY_KEYS = ", ".join(family.key for family in model_families()[:-1]) + f" or {model_families()[-1].key}"
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
app = typer.Typer(
    help="Batch-caption videos and images with Tarsier video-language models.",
    rich_markup_mode=None, pretty_exceptions_enable=False, no_args_is_help=True, context_settings=CONTEXT)
dev_app = typer.Typer(help="Developer tools.", rich_markup_mode=None, no_args_is_help=True, context_settings=CONTEXT)
app.add_typer(dev_app, name="dev")


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
  1    some items failed (their rows carry an error), or an input gave none (unreadable, or named without media)
  2    bad usage: flag value, missing input, unusable model or output (a disk too full to start on), other
       settings than --out's
  3    crashed (a bug, while loading too; a failed device; a full disk); saved rows are resumed by the next run
  75   another run is writing the same --out
  130  interrupted (Ctrl-C); finished rows are saved, run the same command to resume
  143  terminated (SIGTERM); finished rows are saved, run the same command to resume
  141  stdout was closed while streaming with '-o -' (e.g. '| head')
"""


def _apply_config(ctx: typer.Context, param: click.Parameter, value: Optional[Path]) -> Optional[Path]:
    """Eager: a --config file's values become the defaults of the other flags (flags and env vars win)."""
    if value is not None and not ctx.resilient_parsing:
        try:
            ctx.default_map = {**(ctx.default_map or {}),
                               **config_defaults(value, ctx.command, "caption", PATH_SETTINGS)}
        except ConfigError as error:
            fail(error)
    return value


def caption(**given: Any) -> None:
    """Caption every video, GIF and image in INPUTS (or a --manifest) into one row per file, resuming --out if
    it exists.

    INPUTS are media files, directories or glob patterns; '-' reads paths from stdin, one per
    line (-0: NUL-separated).
    """
    let_waiting_cpu_threads_sleep()
    options = _settings(from_values, CommandOptions, given)
    output = _output_of(options)
    settings = _settings(from_values, RunSettings,
                         {**given, "prompt_set": _prompt_set(options.prompts, options.ask or [])})
    if (problem := model_reference_problem(settings.caption.model)) is not None:   # before torch is imported
        fail(problem)
    ray_settings = _ray_settings(given, settings)
    if not options.streams:   # checked again by the run, for its other callers
        _settings((output.target if isinstance(output, RemoteOutput) else output).check_settings, settings)
    found = _find_items(options, settings.key)
    console = Console(stderr=True, soft_wrap=True)
    log_handle = open_log(options.log_file)
    log = LineLog(file=log_handle)
    reporter = CommandReporter(console, options.quiet, log)
    try:
        run = CaptionRun(found, sys.stdout if options.streams else output, settings, reporter,
                         load=_on_ray(ray_settings, reporter) if ray_settings else None,
                         source=f"--manifest {options.manifest}" if options.manifest
                         else " ".join(options.inputs or []), started=process_started())
        nothing = run.no_media()
        if options.dry_run:
            raise typer.Exit(dry_run(run) if nothing is None else present(nothing, console, options.quiet, log))
        with stop_signals():
            outcome = run.execute()
        code = present(outcome, console, options.quiet, log)
    except SettingsError as error:
        fail(error)
    except (OutputError, SettingsMismatchError, ModelNotFoundError, ValueError) as error:
        fail(error)
    except (OutputLockedError, OSError) as error:
        typer.echo(f"Error: {in_flags(error)}", err=True)
        raise typer.Exit(EXIT_LOCKED if isinstance(error, OutputLockedError) else EXIT_USAGE) from None
    except LoadingCrashed as error:
        traceback.print_exception(error.__cause__ or error)
        shown = output.target.shown if isinstance(output, RemoteOutput) else output.shown
        console.print(f"tarsier: crashed while loading the model ({error}); nothing was written to {shown}",
                      highlight=False, markup=False)
        raise typer.Exit(EXIT_CRASHED) from None
    finally:
        if log_handle:
            log_handle.close()
    raise typer.Exit(code)


caption.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(caption_parameters(config={"is_eager": True, "callback": _apply_config})))
app.command(epilog=EXAMPLES, no_args_is_help=True)(caption)


def _output_of(options: CommandOptions) -> OutputTarget | RemoteOutput:
    """The output the options name, checked before anything is read, loaded or imported (with the manifest's
    path)."""
    webdataset = options.out_format == "webdataset"
    output = _output(options.out_dir, None if webdataset else options.shard_rows or SHARD_ROWS, webdataset) \
        if options.out_dir is not None else _output(options.out or "-")
    try:
        if options.manifest is not None:
            check_manifest_path(options.manifest)
        if not options.streams:
            (output.target if isinstance(output, RemoteOutput) else output).check()
    except (ManifestError, OutputError) as error:
        fail(error)
    return output


def _output(location: str, shard_rows: int | None = None, webdataset: bool = False) -> OutputTarget | RemoteOutput:
    """The output at `location`; a read-only scheme or a missing storage backend stops the command here, before
    anything is loaded."""
    try:
        return output_at(location, shard_rows, webdataset)
    except (OutputError, StorageError) as error:
        fail(error)


def _settings(make: Callable[..., T], *args: Any, **values: Any) -> T:
    """`make(*args, **values)`; a setting it refuses stops the command, the message naming flags."""
    try:
        return make(*args, **values)
    except SettingsError as error:
        fail(error)


def _ray_settings(given: dict[str, Any], settings: RunSettings) -> RaySettings | None:
    """The Ray settings --ray and its flags give (None without --ray), checked at once."""
    import importlib.util

    if given["ray_gpus_per_worker"] is None:   # a GPU per actor, unless the run is on the CPU
        given = {**given, "ray_gpus_per_worker": float(settings.caption.device != "cpu")}
    ray = _settings(from_values, RaySettings, given) if given["ray"] is not None else None
    if ray is not None:
        _settings(ray.check_run, settings)
        if importlib.util.find_spec("ray") is None:
            fail(f"--ray needs Ray, an optional extra: {install_extra_command('ray')}")
    return ray


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
        fail(f"--prompts: {error}")
    try:
        return from_file + parse_asks(asks)
    except PromptSetError as error:
        fail(f"--ask {error}")


def _find_items(options: CommandOptions, key: str) -> Manifest | Discovery:
    """The items of this run, from INPUTS or the manifest."""
    inputs = options.inputs or []
    try:
        if options.manifest is not None:
            return read_manifest(options.manifest, key, RESERVED_NAMES, options.path_column, options.keep_columns)
        found = discover(inputs, options.recursive, stdin_paths(inputs, options.null_separated), key)
        # Without a manifest, the kept columns are the shards' sibling files (`key.json` beside `key.mp4`).
        return sibling_columns(found, options.keep_columns, RESERVED_NAMES) if options.keep_columns is not None \
            else found
    except (InputNotFoundError, ManifestError, OSError) as error:
        fail(error)


@app.command()
def models() -> None:
    """List the model families, their known checkpoints and their defaults."""
    for family in model_families():
        default = " (the default --model)" if DEFAULT_MODEL in family.checkpoints else ""
        typer.echo(f"{family.name}{default}\n"
                   f"  config.json:  {family.config_types}\n"
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
        metavar="NAME", help=f"Or name the family directly: {FAMILY_KEYS} (see 'tarsier models').",
        show_default=False)] = None,
    frames: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", help="Frames to sample [default: the family's].", show_default=False)] = None,
    fps: Annotated[Optional[float], typer.Option(
        metavar="RATE", help="Sample each video at RATE frames per second, as `caption --fps` does (the Qwen-VL "
        "families; --frames caps the count).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per file, one per line.")] = False,
) -> None:
    """What captioning would see in each FILE: type, size, codec, rotation, frame rate, duration, frame count,
    the decoder and why, the frame indices it would sample, and the error it would give.

    Decodes the sampled frames exactly as captioning does, in a child process (a decoder crash or
    hang is reported). Exit code 0 if every file would caption, 1 if some would fail.
    """
    from . import inspect_file
    from .review.inspection import family_for

    if model is not None and family is not None:
        fail("give --model or --family, not both")
    try:
        chosen = family_named(family) if family else family_for(model or DEFAULT_MODEL)
    except ValueError as error:   # named as this command's own flags
        fail(error, {"model": "--model", "family": "--family"})
    if fps is not None and not chosen.samples_by_rate:
        fail(f"--fps: {chosen.name} samples a fixed count of frames from every clip, as its official code does; "
             f"give --frames instead")
    try:
        count = CaptionSettings(frames=frames, fps=fps).frame_count(chosen.default_frames)
    except SettingsError as error:
        fail(error)
    failed = 0
    for index, path in enumerate(member for path in files for member in _members_if_shard(path)):
        found = inspect_file(path, chosen, count)
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
        fail(error)
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
    out_format: Annotated[Optional[Literal[OUT_FORMATS]], typer.Option(  # type: ignore[valid-type]
        case_sensitive=False, show_default=False,
        help="What --out-dir holds: Parquet shards (parquet) or a WebDataset shard per input shard "
             "(webdataset).")] = None,
) -> None:
    """Join the outputs of 'tarsier caption --shard I/N' runs in FOLDER into one output, in input order.

    FOLDER holds one output per shard: .parquet files (and nothing else ending in .parquet), or
    folders written with --out-format webdataset. The shards must be one complete set made the
    same way: every shard of N once, over the same inputs, with the same settings and columns.
    The merged output is what one run over all the inputs writes, and a later 'tarsier caption'
    without --shard can continue it.
    """
    from . import MergeError, merge_outputs

    _settings(check_output_choice, out, out_dir, out_format, stdout=False)
    webdataset = out_format == "webdataset"
    output = _output(out_dir, None if webdataset else SHARD_ROWS, webdataset) if out_dir is not None \
        else _output(str(out))
    try:
        merged = merge_outputs(folder, output)
    except (MergeError, OutputError, OutputLockedError, OutputWriteError, OSError) as error:
        fail(error)
    typer.echo(f"tarsier: merged {plural(merged.shards, 'shard')} into {merged.written} "
               f"({plural(merged.rows, 'row')}, {merged.failed} failed)", err=True)


app.command("report", no_args_is_help=True)(report_command)
app.command("peek", no_args_is_help=True)(peek_command)


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
    from .demo.evaluate import evaluate_demo

    try:
        result = evaluate_demo(n, seed, model, tuple(context.args))
    except RuntimeError as error:
        fail(error)
    for name, expected, got in result.mistakes[:20]:
        typer.echo(f"{name}: expected {expected!r}, got {got!r}")
    typer.echo(f"reversed_accuracy={result.reversed_accuracy:.3f} n={result.n}")
    typer.echo(f"accuracy={result.accuracy:.3f} n={result.n}")
    raise typer.Exit(EXIT_OK if result.accuracy >= 0.95 and result.reversed_accuracy >= 0.95 else EXIT_SOME_FAILED)


@dev_app.command("make-tiny-model")
def make_tiny_model_command(
    directory: Annotated[Path, typer.Argument(metavar="DIRECTORY", hidden=True, show_default=False)],
    family: Annotated[str, typer.Option(metavar="NAME", help=f"{FAMILY_KEYS} (see 'tarsier models').")] = "tarsier",
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
        fail(error)
    if directory.exists() and any(directory.iterdir()):
        fail(f"{directory} exists and is not empty")
    from . import make_tiny_model

    try:
        typer.echo(make_tiny_model(directory, size, seed, family))
    except ValueError as error:
        fail(error)


def run_command() -> None:
    """The `tarsier` command: the CLI, then out of the process as soon as it has said its last word.

    Python's own exit would go on, after the summary, to tear down every module and collect every
    object torch and the model's code made (2-3 s on a busy machine, which the summary's wall time
    cannot count). What its exit does first still happens here, in its order: the threads that keep
    a process alive are waited for, then the at-exit handlers run (the decoding servers, Ray).
    Only that teardown is skipped: every file is closed by then.
    """
    try:
        app(prog_name="tarsier")
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):   # a message to print: Python's exit says it
            raise
        code = stop.code or 0
    else:
        code = 0
    threading._shutdown()   # type: ignore[attr-defined]  # the exit's first step (private, CPython's own)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):   # a closed pipe has nothing more to take
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    app()
