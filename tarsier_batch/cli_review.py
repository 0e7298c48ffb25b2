"""The commands that read results: `tarsier report` (a page to review) and `tarsier peek` (counts and last rows).

Both read a finished output, or the rows an unfinished run has saved so far, and change nothing.
`cli` registers them on its app.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import OutputError, write_report
from .cli_run import fail
from .progress import plural
from .review import WrittenReport, check_results_path
from .review.peek import counts_line, last_rows_json, last_rows_table, no_row_json, no_row_saved
from .review.results import load_results
from .review.selection import DEFAULT_SAMPLE, DEFAULT_SEED, status_of
from .review.strip_files import INLINE_STRIPS_AT_MOST, THUMBNAIL_MODES


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
    sample: Annotated[Optional[int], typer.Option(
        min=0, metavar="N",
        help=f"Show N items one by one, a seeded sample that keeps each status's share and at least a few of each "
             f"kind of failure (0: every item) [default: {DEFAULT_SAMPLE:,} when there are more]. Figures and "
             f"error groups always count every row.", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", help="Show the first N items one by one instead of a sample.", show_default=False)] = None,
    seed: Annotated[int, typer.Option(min=0, metavar="S", help="Which sample --sample draws.")] = DEFAULT_SEED,
    thumbnails: Annotated[Literal[THUMBNAIL_MODES], typer.Option(  # type: ignore[valid-type]
        case_sensitive=False,
        help=f"Where the frame strips go: inside the page (inline), or as JPEG files in a folder beside it named "
             f"after it, report_files/ for report.html (folder); auto: the folder above {INLINE_STRIPS_AT_MOST:,} "
             f"strips.")] = "auto",
) -> None:
    """Write an HTML page to review RESULTS (a .parquet, .jsonl or .csv file or a folder of shards).

    Per item: the frames the caption was made from (re-extracted from the file at the recorded
    indices), the caption, prompt, model, tokens and timing; failed items grouped by kind, with
    examples; summary figures and a caption-length histogram. Filter by media type, status and
    text; the page works offline. A run that has not finished (stopped, or still running) is
    reported from the rows it has saved so far, without waiting for it or changing anything.
    """
    if out.is_dir():
        fail(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
    if sample is not None and limit is not None:
        fail("give --sample or --limit, not both")
    try:
        check_results_path(results)
    except OutputError as error:
        fail(error)
    console = Console(stderr=True, soft_wrap=True)
    start = time.perf_counter()
    progress = Progress(TextColumn("extracting frames"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=not console.is_terminal)
    task = progress.add_task("frames", total=None)
    try:
        with progress:
            written = write_report(results, out, frames_per_item, thumb_height,
                                   workers if workers is not None else max(1, (os.cpu_count() or 2) - 1), title,
                                   on_strips=lambda done: progress.advance(task, done),
                                   on_total=lambda total: progress.update(task, total=total),
                                   sample=sample, limit=limit, seed=seed, thumbnails=thumbnails)
    except (OutputError, OSError) as error:
        fail(error)
    console.print(_wrote(written, out, time.perf_counter() - start), highlight=False, markup=False)


def _wrote(written: WrittenReport, out: Path, seconds: float) -> str:
    shown = f", {written.shown:,} shown" if written.shown < written.items else ""
    beside = f", frames in {written.strips_folder}" if written.strips_folder else ""
    unfinished = f"; {written.unfinished}" if written.unfinished is not None else ""
    return (f"tarsier: wrote {out} ({plural(written.items, 'item')}{shown}, {_size(out.stat().st_size)}"
            f"{beside}) in {seconds:.1f} s{unfinished}")


def _size(size: int) -> str:
    """A page's size as one reads it: in KB below a MB (a small page is not '0.0 MB')."""
    return f"{size / 2**20:,.1f} MB" if size >= 2**20 else f"{max(1, round(size / 2**10))} KB"


def peek_command(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", hidden=True, show_default=False)],
    last: Annotated[int, typer.Option(min=0, metavar="N", help="Rows to print, the last saved.")] = 10,
    failed: Annotated[bool, typer.Option("--failed", help="Print failed rows only (the last N of them).")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="The rows as JSON Lines, every column (a run with no row saved yet: one object saying so)."
    )] = False,
) -> None:
    """How far RESULTS has got, and its last rows: also a run that has not finished (stopped, or still running),
    from the rows it has saved so far, read without waiting for it or changing anything.

    The counts (rows, captioned, failed by kind, with warnings by kind, finished or not) go to
    stderr; the last N rows to stdout, one a line: status (and warnings), item and caption (or
    error), or with --json every column. A run that has saved no row yet is said to be running
    (its lock held: loading its model, say) or stopped (run the same command again to resume).
    """
    try:
        check_results_path(results)
        found = load_results(results)
    except (OutputError, OSError) as error:
        fail(error)
    typer.echo(counts_line(found, str(results)), err=True)
    run = no_row_saved(found)
    if as_json and run is not None:
        typer.echo(no_row_json(run, str(results)), nl=False)
        return
    if failed:
        found = replace(found, rows=[row for row in found.rows if status_of(row) != "captioned"])
    shown = last_rows_json(found, last) if as_json else last_rows_table(found, last)
    if shown:
        typer.echo(shown, nl=not as_json)
