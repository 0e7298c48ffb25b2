"""Run statistics and how they are shown: a rich display on a terminal, log lines elsewhere."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from .api import CaptionResult

LOG_INTERVAL_S = 10.0


@dataclass
class RunStats:
    """Counts and rates of a run, updated as results arrive."""

    total: int
    skipped: int = 0
    done: int = 0
    failed: int = 0
    generated_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def captioned(self) -> int:
        return self.done - self.failed

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def items_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.items_per_s
        return (self.total - self.done) / rate if rate > 0 else None

    def record(self, result: CaptionResult) -> None:
        self.done += 1
        self.failed += not result.ok

    def as_dict(self) -> dict[str, float | int]:
        return {"total": self.total, "captioned": self.captioned, "failed": self.failed,
                "skipped": self.skipped, "generated_tokens": self.generated_tokens,
                "wall_time_s": round(self.elapsed_s, 3), "items_per_s": round(self.items_per_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 2)}


class Reporter(Protocol):
    """Receives events of a run and shows them."""

    def __enter__(self) -> Reporter: ...
    def __exit__(self, *exc: object) -> None: ...
    def on_tokens(self, count: int) -> None: ...
    def on_result(self, result: CaptionResult) -> None: ...


def make_reporter(stats: RunStats, console: Console, quiet: bool) -> Reporter:
    """Rich live display on a terminal, periodic log lines otherwise, nothing when quiet."""
    if quiet:
        return QuietReporter(stats)
    if console.is_terminal:
        return RichReporter(stats, console)
    return LogReporter(stats, console)


class QuietReporter:
    def __init__(self, stats: RunStats):
        self.stats = stats

    def __enter__(self) -> QuietReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def on_tokens(self, count: int) -> None:
        self.stats.generated_tokens += count

    def on_result(self, result: CaptionResult) -> None:
        self.stats.record(result)


class LogReporter(QuietReporter):
    """One line per failure and a progress line at most every LOG_INTERVAL_S seconds (cron logs)."""

    def __init__(self, stats: RunStats, console: Console):
        super().__init__(stats)
        self.console = console
        self._last_line = time.perf_counter()

    def __enter__(self) -> LogReporter:
        self.console.print(f"tarsier: captioning {self.stats.total} items", highlight=False)
        return self

    def on_result(self, result: CaptionResult) -> None:
        super().on_result(result)
        if not result.ok:
            self.console.print(f"tarsier: failed {result.path}: {result.error}", highlight=False, markup=False)
        now = time.perf_counter()
        if now - self._last_line >= LOG_INTERVAL_S or self.stats.done == self.stats.total:
            self._last_line = now
            self.console.print(f"tarsier: {progress_line(self.stats)}", highlight=False)


class RichReporter(QuietReporter):
    """A live bar with items done/total, items/s, tokens/s, failures, elapsed time and ETA."""

    def __init__(self, stats: RunStats, console: Console):
        super().__init__(stats)
        self.progress = Progress(
            TextColumn("[bold]captioning"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rates]}"), TextColumn("{task.fields[failed]}"),
            TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
            console=console, transient=False)
        self.task = self.progress.add_task("caption", total=stats.total, **self._fields())

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.update(self.task, **self._fields())
        self.progress.stop()

    def on_tokens(self, count: int) -> None:
        super().on_tokens(count)
        self.progress.update(self.task, **self._fields())

    def on_result(self, result: CaptionResult) -> None:
        super().on_result(result)
        if not result.ok:
            self.progress.console.print(f"[red]failed[/] {escape(result.path)}: {escape(result.error or '')}",
                                        highlight=False)
        self.progress.update(self.task, completed=self.stats.done, **self._fields())

    def _fields(self) -> dict[str, str]:
        stats = self.stats
        failed = f"[red]{stats.failed} failed[/]" if stats.failed else "0 failed"
        return {"rates": f"{stats.items_per_s:.2f} items/s  {stats.tokens_per_s:.1f} tok/s",
                "failed": failed, "eta": _duration(stats.eta_s)}


def progress_line(stats: RunStats) -> str:
    """One log line: done/total, failures, rates, elapsed time and ETA."""
    return (f"{stats.done}/{stats.total} items, {stats.failed} failed, {stats.items_per_s:.2f} items/s, "
            f"{stats.tokens_per_s:.1f} tokens/s, elapsed {_duration(stats.elapsed_s)}, "
            f"ETA {_duration(stats.eta_s)}")


def print_summary(console: Console, stats: RunStats, written: str, skipped_detail: str) -> None:
    """The closing summary: a table on a terminal, one line in logs."""
    rows = [("captioned", str(stats.captioned)), ("failed", str(stats.failed)),
            ("skipped", f"{stats.skipped}{f' ({skipped_detail})' if skipped_detail else ''}"),
            ("wall time", _duration(stats.elapsed_s)),
            ("throughput", f"{stats.items_per_s:.3f} items/s, {stats.tokens_per_s:.1f} tokens/s"),
            ("output", written)]
    if console.is_terminal:
        table = Table(title="tarsier caption", show_header=False)
        for name, value in rows:
            table.add_row(name, escape(value))
        console.print(table)
    else:
        console.print("tarsier: done: " + "; ".join(f"{name} {value}" for name, value in rows),
                      highlight=False, markup=False)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    return str(timedelta(seconds=round(seconds)))
