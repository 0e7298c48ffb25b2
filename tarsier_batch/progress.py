"""Run statistics and how they are shown: a rich display on a terminal, timestamped lines elsewhere."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
from rich.table import Table
from rich.text import Text

from .errors import UNKNOWN, Worded, plural
from .settings.command import QUIET_FAILURES_NAMED

if TYPE_CHECKING:
    from .outputs.results import CaptionResult

LOG_INTERVAL_S = 30.0  # a progress line at most this often in logs (cron mail stays short)
MIN_ETA_S = 1.0  # the least ETA shown while items remain: a rounded 0:00:00 would say the run is over


@dataclass
class RunStats:
    """Counts and rates of a run, updated as results arrive.

    `total` counts the items this run captions; rows earlier runs finished are `already_done`.
    `generated_tokens` counts the tokens of finished rows only (what the output holds);
    `streamed_tokens` also counts tokens of items still generating, for the live rate.
    """

    total: int
    skipped: int = 0
    already_done: int = 0
    failed_earlier: int = 0   # of `already_done`, rows that hold an error (not retried without --retry-errors)
    failed_inputs: int = 0    # inputs that gave no rows: unreadable folders, named inputs without media
    missing_kept: int = 0
    missing_pruned: int = 0
    left_for_later: int = 0   # beyond --limit
    done: int = 0
    failed: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)   # how many failed items have each `error_kind`
    first_failures: list[tuple[str, str]] = field(default_factory=list)   # (path, error), QUIET_FAILURES_NAMED at most
    warned: int = 0   # rows captioned from a damaged file (their `warnings`)
    warning_kinds: dict[str, int] = field(default_factory=dict)   # how many rows carry each kind
    generated_tokens: int = 0
    streamed_tokens: int = 0
    # Prompt positions of the rows admitted (0: not known), how many came computed from the prefix cache (when
    # it is on), and how many a prompt set's question shared with another question of its clip.
    prompt_positions: int = 0
    reused_positions: int = 0
    shared_positions: int = 0
    prefix_cache: bool = False
    # When the run began (`time.perf_counter()`; the command's: when its process started). The live display's
    # elapsed time counts from it as the summary's wall time does.
    started: float = field(default_factory=time.perf_counter)
    # When loading the model began and when captioning began: the summary tells the parts apart.
    loading_started: float | None = None
    captioning_started: float | None = None

    @property
    def captioned(self) -> int:
        return self.done - self.failed

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def start_captioning(self) -> None:
        self.captioning_started = time.perf_counter()

    @property
    def captioning_s(self) -> float | None:
        """Seconds since captioning began (None before): the wall time less loading the model."""
        return time.perf_counter() - self.captioning_started if self.captioning_started is not None else None

    @property
    def items_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.streamed_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left; None (unknown) until an item has finished, and never 0 while items remain.

        Rows finish a batch at a time, so counting finished items alone makes the first ETAs
        jump. Tokens stream steadily: the tokens of items still generating count as the part of
        an item they are (by the mean tokens per captioned item), which smooths the estimate.
        That mean misleads when the first items to finish were short: the long ones still
        generating would count as done and the ETA would read 0 while they run. An item still
        generating is not done, and how long it will run is not known, so what is in flight counts
        for at most half of the items left (each taken as halfway through, at most).

        The items left go at the rate of captioned items once some are captioned or generating:
        a file that fails to decode fails in milliseconds, so 9,000 quick failures first would
        otherwise make the rate of all items promise seconds where minutes of captioning remain.
        Failures still to come count as long as captions: the estimate errs long, not short.
        Until anything is captioned or generating, the failures' rate is all that is known.
        """
        left = self.total - self.done
        if self.done == 0 or self.elapsed_s <= 0:
            return None
        if left <= 0:
            return 0.0
        mean_tokens = self.generated_tokens / self.captioned if self.captioned else 0.0
        in_flight = (self.streamed_tokens - self.generated_tokens) / mean_tokens if mean_tokens else 0.0
        in_flight = min(max(in_flight, 0.0), left / 2)
        captioning = self.captioned + in_flight
        finished = captioning if captioning > 0 else self.done
        return max((left - in_flight) * self.elapsed_s / finished, MIN_ETA_S)

    def record(self, result: CaptionResult) -> None:
        self.done += 1
        if not result.ok:
            self.failed += 1
            kind = result.error_kind or UNKNOWN
            self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + 1
            if len(self.first_failures) < QUIET_FAILURES_NAMED:
                self.first_failures.append((result.path, result.error or ""))
        self.warned += bool(result.warnings)
        for kind in result.warnings or ():
            self.warning_kinds[kind] = self.warning_kinds.get(kind, 0) + 1
        self.generated_tokens += result.generated_tokens or 0

    def as_dict(self) -> dict[str, float | int]:
        return {"total": self.total, "captioned": self.captioned, "failed": self.failed,
                "already_done": self.already_done,
                "failed_earlier": self.failed_earlier, "failed_inputs": self.failed_inputs,
                "missing_kept": self.missing_kept,
                "missing_pruned": self.missing_pruned, "skipped": self.skipped, "left_for_later": self.left_for_later,
                "generated_tokens": self.generated_tokens, "prompt_positions": self.prompt_positions,
                "reused_prompt_positions": self.reused_positions, "shared_prompt_positions": self.shared_positions,
                "wall_time_s": round(self.elapsed_s, 3),
                "items_per_s": round(self.items_per_s, 4), "tokens_per_s": round(self.tokens_per_s, 2)}


class LineLog:
    """Plain timestamped lines, to the console (when it is not a terminal) and/or a --log-file."""

    def __init__(self, console: Console | None = None, file: TextIO | None = None,
                 now: Callable[[], datetime] = datetime.now):
        self.console, self.file, self._now = console, file, now

    def __call__(self, text: str) -> None:
        line = f"{self._now().isoformat(timespec='seconds')} tarsier: {text}"
        if self.console is not None:
            self.console.print(line, highlight=False, markup=False)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


class Reporter(Protocol):
    """Shows a run as it goes; `stats` is updated by the caller before each call."""

    def __enter__(self) -> Reporter: ...
    def __exit__(self, *exc: object) -> None: ...
    def on_tokens(self) -> None: ...
    def on_result(self, result: CaptionResult) -> None: ...


def make_reporters(stats: RunStats, console: Console, quiet: bool, log_file: TextIO | None) -> list[Reporter]:
    """A rich display on a terminal (log lines otherwise, nothing when quiet), plus the --log-file."""
    reporters: list[Reporter] = []
    if not quiet:
        reporters.append(RichReporter(stats, console) if console.is_terminal else LogReporter(stats, LineLog(console)))
    if log_file is not None:
        reporters.append(LogReporter(stats, LineLog(file=log_file)))
    return reporters


class LogReporter:
    """A start line, one line per failure and a progress line at most every `interval` seconds."""

    def __init__(self, stats: RunStats, log: Callable[[str], None], interval: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.perf_counter):
        self.stats, self.log, self.interval, self._clock = stats, log, interval, clock
        self._last_line = clock()

    def __enter__(self) -> LogReporter:
        resumed = (f" ({plural(self.stats.already_done, 'item')} done by earlier runs)" if self.stats.already_done
                   else "")
        self.log(f"captioning {plural(self.stats.total, 'item')}{resumed}")
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def on_tokens(self) -> None:
        self._maybe_progress()

    def on_result(self, result: CaptionResult) -> None:
        if not result.ok:
            self.log(failed_line(result.path, result.error))
        elif result.warnings:
            self.log(f"warning {result.path}: {_warned(result)}")
        self._maybe_progress(force=self.stats.done == self.stats.total)

    def _maybe_progress(self, force: bool = False) -> None:
        now = self._clock()
        if force or now - self._last_line >= self.interval:
            self._last_line = now
            self.log(progress_line(self.stats))


class RichReporter:
    """A live bar with items done/total, items/s, tokens/s, failures, elapsed time and ETA."""

    def __init__(self, stats: RunStats, console: Console):
        self.stats = stats
        self.progress = Progress(
            TextColumn("[bold]captioning"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"), TextColumn("{task.fields[failed]}"),
            _RunElapsed(stats), TextColumn("ETA {task.fields[eta]}"),
            console=console, transient=False)
        self.task = self.progress.add_task("caption", total=stats.total, **self._fields())

    def __enter__(self) -> RichReporter:
        if self.stats.already_done:
            done = self.stats.already_done
            self.progress.console.print(f"resuming: {plural(done, 'item')} {'was' if done == 1 else 'were'} done by "
                                        f"earlier runs",
                                        highlight=False, markup=False)
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.update(self.task, **self._fields())
        self.progress.stop()

    def on_tokens(self) -> None:
        self.progress.update(self.task, **self._fields())

    def on_result(self, result: CaptionResult) -> None:
        if not result.ok:
            self.progress.console.print(f"[red]failed[/] {escape(result.path)}: {escape(result.error or '')}",
                                        highlight=False)
        elif result.warnings:
            self.progress.console.print(f"[yellow]warning[/] {escape(result.path)}: {escape(_warned(result))}",
                                        highlight=False)
        self.progress.update(self.task, completed=self.stats.done, **self._fields())

    def _fields(self) -> dict[str, str]:
        stats = self.stats
        failed = f"[red]{stats.failed} failed[/]" if stats.failed else "0 failed"
        return {"rates": f"{stats.items_per_s:.2f} items/s  {stats.tokens_per_s:,.1f} tok/s",
                "failed": failed, "eta": _duration(stats.eta_s)}


class _RunElapsed(ProgressColumn):
    """The run's elapsed time, loading the model included, as the summary's wall time counts it (rich's own
    column would count from when the bar appeared, after loading); redrawn on every refresh."""

    def __init__(self, stats: RunStats):
        super().__init__()
        self.stats = stats

    def render(self, task: Task) -> Text:
        return Text(_duration(self.stats.elapsed_s), style="progress.elapsed")


def progress_line(stats: RunStats) -> str:
    """One log line: done/total, failures, rates, elapsed time and ETA."""
    return (f"{stats.done}/{plural(stats.total, 'item')}, {stats.failed} failed, {stats.items_per_s:.2f} items/s, "
            f"{stats.tokens_per_s:,.1f} tokens/s, elapsed {_duration(stats.elapsed_s)}, "
            f"ETA {_duration(stats.eta_s)}")


def summary_rows(stats: RunStats, written: str, skipped_detail: str,
                 notes: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """The closing summary's (name, value) rows; `notes` are what the run found of its inputs (videos without a
    scene cut), shown after the skipped files."""
    failed = f"{stats.failed} ({by_kind(stats.failure_kinds)})" if stats.failed else "0"
    rows = [("captioned", str(stats.captioned)), ("failed", failed)]
    if stats.warned:
        rows.append(("with warnings", f"{stats.warned} ({by_kind(stats.warning_kinds)}: captioned from damaged files)"))
    if stats.failed_inputs:
        rows.append(("failed inputs", f"{stats.failed_inputs} (unreadable or without media, named above)"))
    if stats.failed_earlier:
        rows.append(("done earlier", Worded("{done}, {failed} of them failed; {retry_errors} tries them again",
                                            done=stats.already_done, failed=stats.failed_earlier)))
    elif stats.already_done:
        rows.append(("done earlier", str(stats.already_done)))
    if stats.missing_kept:
        rows.append(("files gone", Worded("{count} rows kept ({prune_missing} drops them)", count=stats.missing_kept)))
    if stats.missing_pruned:
        rows.append(("files gone", Worded("{count} rows dropped ({prune_missing})", count=stats.missing_pruned)))
    if stats.left_for_later:
        rows.append(("left for later",
                     Worded("{count} ({limit}); run again to caption them", count=stats.left_for_later)))
    rows += [("skipped", f"{stats.skipped}{f' ({skipped_detail})' if skipped_detail else ''}"),
             *(notes or []),
             ("wall time", _wall_time(stats)),
             ("throughput", _throughput(stats))]
    if stats.prompt_positions and stats.shared_positions:
        rows.append(("shared prefixes", f"{stats.shared_positions:,} of {stats.prompt_positions:,} prompt positions "
                                        f"shared between a clip's questions "
                                        f"({stats.shared_positions / stats.prompt_positions:.1%})"))
    if stats.prompt_positions and stats.prefix_cache:
        rows.append(("prefix cache", f"{stats.reused_positions:,} of {stats.prompt_positions:,} prompt positions "
                                     f"reused ({stats.reused_positions / stats.prompt_positions:.1%})"))
    return rows + [("output", written)]


def by_kind(counts: dict[str, int]) -> str:
    """`undecodable 290, timeout 10`: counts by kind, the most frequent first (ties by name)."""
    return ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items(), key=lambda pair: (-pair[1], pair[0])))


def quiet_report(stats: RunStats, rows: list[tuple[str, str]]) -> list[str]:
    """What `--quiet` prints of a finished run: nothing when every row is clean; else the summary's counts of
    failures and warnings (this run's and the failures earlier runs left) and the first QUIET_FAILURES_NAMED failed
    items with their errors, so that a cron job's mail says what went wrong (the command adds where to look)."""
    if not (stats.failed or stats.warned or stats.failed_inputs or stats.failed_earlier):
        return []
    kept = {"captioned", "failed", "with warnings", "failed inputs", "output"} | \
        ({"done earlier"} if stats.failed_earlier else set())
    lines = [summary_line([(name, value) for name, value in rows if name in kept])]
    lines += [failed_line(path, error) for path, error in stats.first_failures]
    unnamed = stats.failed - len(stats.first_failures)
    if unnamed:
        lines.append(f"... and {unnamed} more failed")
    return lines


def failed_line(path: str, error: str | None) -> str:
    """A failed item's line: its path and its error."""
    return f"failed {path}: {error}"


def _throughput(stats: RunStats) -> str:
    """Rows (captions and errors) a second, over the captioning alone where loading the model came first: a short
    run's rate over the whole wall time says more about the load than about captioning."""
    whole = f"{stats.items_per_s:.3f} items/s"
    captioning = stats.captioning_s
    if captioning is not None and captioning > 0 and stats.done:
        whole = f"{stats.done / captioning:.3f} items/s while captioning ({whole} with loading)"
    return f"{whole}, {stats.generated_tokens:,} tokens"


def _wall_time(stats: RunStats) -> str:
    """The whole run's time, split into starting (reading the inputs and the stored rows, planning), loading the
    model and captioning when it captioned (without the start of loading known, the first two as one)."""
    elapsed, captioning = stats.elapsed_s, stats.captioning_s
    if captioning is None:
        return _duration(elapsed)
    if stats.loading_started is None:
        loading = round(elapsed) - round(captioning)   # the parts add up to the whole as shown
        return f"{_duration(elapsed)} ({_duration(loading)} loading the model, {_duration(captioning)} captioning)"
    assert stats.captioning_started is not None
    # Each boundary rounded once: the parts add up to the whole as shown, and none is below zero.
    bounds = [0, *(round(moment - stats.started) for moment in (stats.loading_started, stats.captioning_started)),
              round(elapsed)]
    starting, loading, captioned = (after - before for before, after in zip(bounds, bounds[1:]))
    return f"{_duration(elapsed)} ({_duration(starting)} starting, {_duration(loading)} loading the model, " \
           f"{_duration(captioned)} captioning)"


def process_started() -> float:
    """When this process started, as a `time.perf_counter()` reading: a command's wall time counts from there,
    the interpreter's start and the imports included. Read from the kernel's clocks (to a clock tick, as `ps`
    tells a process's age) where /proc has them; elsewhere, now."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            started_ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])   # field 22, counted after the name
        with open("/proc/uptime", "rb") as handle:
            uptime_s = float(handle.read().split()[0])
        age_s = uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        age_s = 0.0
    return time.perf_counter() - max(age_s, 0.0)


def print_summary(console: Console, rows: list[tuple[str, str]]) -> None:
    """The closing summary as a table on a terminal (log lines carry it otherwise)."""
    table = Table(title="tarsier caption", show_header=False)
    for name, value in rows:
        table.add_row(name, escape(value))
    console.print(table)


def summary_line(rows: list[tuple[str, str]]) -> str:
    """`done: name value; ...`, naming settings as its values do (`Worded`)."""
    template = "done: " + "; ".join(f"{{name{index}}} {{value{index}}}" for index in range(len(rows)))
    values = {f"{part}{index}": text for index, row in enumerate(rows) for part, text in zip(("name", "value"), row)}
    return Worded(template, **values)


def _warned(result: CaptionResult) -> str:
    """A row's warnings, said on its progress line: the kinds, and that it was captioned all the same."""
    return f"{', '.join(result.warnings or ())} (captioned from what decodes)"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    return str(timedelta(seconds=round(seconds)))
