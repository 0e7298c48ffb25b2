"""The `tarsier` command: a thin layer over the library API."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import nullcontext
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import __version__
from .catalog import DEFAULT_MODEL, FAMILIES, family_named
from .checkpoints import ModelNotFoundError
from .progress import RunStats, make_reporter, print_summary
from .sinks import OutputExistsError, ParquetSink
from .sources import InputNotFoundError, MediaItem, discover
from .text import one_line

if TYPE_CHECKING:
    from .api import Captioner

# torch and transformers are imported inside the commands, after the arguments are checked,
# so that a bad flag or a missing input is answered at once.

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_CRASHED, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143

app = typer.Typer(
    help="Batch-caption videos and images with Tarsier video-language models.",
    rich_markup_mode=None, pretty_exceptions_enable=False, no_args_is_help=True, add_completion=False)
dev_app = typer.Typer(help="Developer tools.", rich_markup_mode=None, no_args_is_help=True)
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
  find /data -name '*.mp4' -mtime -1 | tarsier caption - -o today.parquet

\b
Exit codes:
  0    every input was captioned
  1    some inputs failed (their rows carry an error)
  2    bad usage: flag value, missing input, existing output, unusable model
  3    crashed mid-run (a bug or a failed device); finished rows are kept in OUT.partial
  130  interrupted (Ctrl-C); finished rows are kept in OUT.partial
  143  terminated (SIGTERM); finished rows are kept in OUT.partial
"""


@app.command(epilog=EXAMPLES)
def caption(
    inputs: Annotated[list[str], typer.Argument(help="Media files, directories or glob patterns; '-' reads paths from stdin, one per line.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet file to write.", show_default=False)],
    model: Annotated[str, typer.Option(help="Checkpoint directory, Hugging Face id, or a built-in random model ('tiny-random-tarsier2', 'tiny-random'); see 'tarsier models'.")]
    = DEFAULT_MODEL,
    prompt: Annotated[Optional[str], typer.Option(help="Instruction replacing the model's default ('Describe the video in detail.').")] = None,
    frames: Annotated[Optional[int], typer.Option(min=1, help="Frames sampled uniformly from each video or GIF [default: 16 for Tarsier2, 8 for Tarsier v1].", show_default=False)] = None,
    batch_size: Annotated[Optional[int], typer.Option(min=1, help="Most items generating at once; a finished item's place is taken at the next step [default: 16 on CPU, 32 on CUDA].", show_default=False)] = None,
    max_batch_tokens: Annotated[int, typer.Option(min=1, help="Positions computed per model step: one per decoding item, the rest for prefill chunks.")] = 4096,
    prefill_chunk: Annotated[int, typer.Option(min=0, help="Prefill long prompts in chunks of at most this many positions (0: whole).")] = 2048,
    kv_cache_gb: Annotated[Optional[float], typer.Option(min=0.001, help="KV cache size in GiB [default: what CUDA can spare after loading; on CPU min(4, RAM/4)].", show_default=False)] = None,
    offload_kv: Annotated[bool, typer.Option("--offload-kv", help="Keep a prefilling item's KV cache in host memory until it decodes (long videos on small GPUs; no effect on CPU).")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens generated per caption.")] = 512,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy decoding; above 0 samples.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass in (0, 1] (with --temperature > 0).")] = 1.0,
    repetition_penalty: Annotated[Optional[float], typer.Option(min=0.01, help="Penalty on tokens already in the prompt or caption (1: none) [default: the checkpoint's generation_config.json].", show_default=False)] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed for sampling; each file gets its own stream.")] = 0,
    dtype: Annotated[DType, typer.Option(help="Weights and compute dtype [auto: float32 on CPU, bfloat16 on CUDA].")] = DType.auto,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    workers: Annotated[int, typer.Option(min=1, help="Threads decoding media ahead of the model.")] = 2,
    recursive: Annotated[bool, typer.Option("--recursive/--no-recursive", help="Descend into subdirectories.")] = True,
    with_token_ids: Annotated[bool, typer.Option("--with-token-ids", help="Add a generated_ids column.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it exists.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display or summary.")] = False,
) -> None:
    """Caption every video, GIF and image in INPUTS and write one Parquet row per file."""
    console = Console(stderr=True, soft_wrap=True)
    if batch_size is not None and max_batch_tokens < batch_size:
        _fail(f"--max-batch-tokens {max_batch_tokens} is below --batch-size {batch_size}: "
              f"every generating item needs one position per step")
    try:
        discovery = discover(_with_stdin_paths(inputs), recursive)
        for problem in discovery.unreadable:
            console.print(f"tarsier: warning: cannot read folder {problem}", highlight=False, markup=False)
        if not discovery.items:
            _fail(f"no supported media in {' '.join(inputs)} ({discovery.skipped_count} other files skipped)")
        sink = ParquetSink(out, model, with_token_ids, overwrite)
    except (InputNotFoundError, OutputExistsError, OSError) as error:
        _fail(str(error))
    with sink:  # whatever happens below, finished rows survive in <out>.partial and <out> stays intact
        try:
            captioner = _load_captioner(console, quiet, model=model, prompt=prompt, frames=frames,
                                        batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                                        prefill_chunk=prefill_chunk, kv_cache_gb=kv_cache_gb, offload_kv=offload_kv,
                                        dtype=dtype.value, device=device, workers=workers,
                                        sampling=(max_new_tokens, temperature, top_p, seed, repetition_penalty))
        except KeyboardInterrupt:
            sink.abort({"complete": False, "stopped_by": "interrupted while loading"})
            console.print("tarsier: interrupted while loading the model; nothing was written", markup=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as error:  # anything that stops the model loading means nothing was run
            sink.abort({"complete": False, "stopped_by": "setup"})
            _fail(str(error) if isinstance(error, (ModelNotFoundError, ValueError)) else one_line(error))
        sink.provenance = captioner.provenance()
        stats = RunStats(total=len(discovery.items), skipped=discovery.skipped_count)
        code = _run(captioner, discovery.items, sink, stats, console, quiet)
    if code in (EXIT_OK, EXIT_SOME_FAILED) and not quiet:
        skipped = ", ".join(f"{count} {suffix}" for suffix, count in sorted(discovery.skipped.items()))
        print_summary(console, stats, str(out), skipped)
    raise typer.Exit(code)


class Terminated(BaseException):
    """SIGTERM arrived (timeout, a scheduler, `docker stop`): stop like Ctrl-C."""


def _load_captioner(console: Console, quiet: bool, sampling: tuple[int, float, float, int, float | None],
                    **settings: Any) -> Captioner:
    from .api import Captioner, CaptionSettings
    from .engine import SamplingParams

    _quiet_library_logs()
    loading = console.status(f"loading {escape(settings['model'])}", spinner="dots")
    with loading if console.is_terminal and not quiet else nullcontext():
        captioner = Captioner(CaptionSettings(sampling=SamplingParams(*sampling), **settings))
    if not quiet:
        config = captioner.engine.config
        kv_gib = captioner.engine.kv.nbytes / 2**30
        offload = ", KV offloaded during prefill" if config.offload_kv \
            else "; --offload-kv has no effect on the CPU" if settings["offload_kv"] else ""
        console.print(f"tarsier: {settings['model']} ({captioner.model.family.name}, {captioner.frames} frames) on "
                      f"{captioner.device} ({str(captioner.dtype).removeprefix('torch.')}), batch size {captioner.batch_size}, "
                      f"KV cache {config.kv_cache_tokens} tokens ({kv_gib:.2f} GiB){offload}",
                      highlight=False, markup=False)
    return captioner


def _run(captioner: Captioner, items: list[MediaItem], sink: ParquetSink, stats: RunStats, console: Console,
         quiet: bool) -> int:
    """Caption into `sink`; the exit code says how it ended."""
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        with make_reporter(stats, console, quiet) as reporter:
            for result in captioner.caption(items, reporter.on_tokens):
                sink.write(result)
                reporter.on_result(result)
        sink.commit({"complete": True, **stats.as_dict()})
        return EXIT_SOME_FAILED if stats.failed else EXIT_OK
    except (KeyboardInterrupt, Terminated) as stop:
        reason, code = ("interrupted", EXIT_INTERRUPTED) if isinstance(stop, KeyboardInterrupt) \
            else ("terminated", EXIT_TERMINATED)
    except Exception as error:  # a bug or a dead device: keep what finished, say what happened
        if not quiet:
            console.print_exception()
        reason, code = f"crashed ({one_line(error)})", EXIT_CRASHED
    finally:
        signal.signal(signal.SIGTERM, previous)
    partial = sink.abort({"complete": False, "stopped_by": reason, **stats.as_dict()})
    kept = f"{stats.done} finished rows kept in {partial}" if partial else "no rows had finished"
    console.print(f"tarsier: {reason}; {kept}; {sink.out} was not written", highlight=False, markup=False)
    return code


@app.command()
def models() -> None:
    """List the model families, their known checkpoints and their defaults."""
    for family in FAMILIES:
        default = " (the default --model)" if DEFAULT_MODEL in family.checkpoints else ""
        typer.echo(f"{family.name}{default}\n"
                   f"  config.json:  model_type 'llava', text_config.model_type '{family.text_model_type}'\n"
                   f"  vision:       {family.vision}\n"
                   f"  checkpoints:  {', '.join(family.checkpoints)}\n"
                   f"  frames:       {family.default_frames}\n"
                   f"  instruction:  {family.default_instruction}\n"
                   f"  offline demo: --model {family.tiny_alias} (random weights, captions are noise)\n")


@dev_app.command("make-tiny-model")
def make_tiny_model_command(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.", show_default=False)],
    family: Annotated[str, typer.Option(help="tarsier (v1) or tarsier2.")] = "tarsier",
    size: Annotated[str, typer.Option(help="tiny (unit tests), small (real frame geometry), bench (a ~100M-parameter LM, small frames) or wide (that LM, real frames).")] = "tiny",
    seed: Annotated[int, typer.Option(min=0, help="Seed of the random weights.")] = 0,
) -> None:
    """Write a deterministic random-weight checkpoint in the family's real format (captions are noise)."""
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


def _with_stdin_paths(inputs: list[str]) -> list[str]:
    """Replace `-` by the paths on standard input (one per line, blank lines ignored)."""
    if "-" not in inputs:
        return inputs
    piped = [line.strip() for line in sys.stdin if line.strip()]
    return [path for entry in inputs for path in (piped if entry == "-" else [entry])]


def _fail(message: str) -> NoReturn:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _quiet_library_logs() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if __name__ == "__main__":
    app()
