"""What the command line does around a run: its reports on the terminal and in the log file, how the run's end
is shown and becomes the exit code, and what Ctrl-C and SIGTERM do meanwhile."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import NoReturn, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.traceback import Traceback

from .cli_options import FLAGS, in_flags
from .outputs.formats import OutputError
from .outputs.resume import SettingsMismatchError
from .outputs.store import OutputWriteError
from .progress import LineLog, Reporter, RunStats, make_reporters, print_summary, quiet_report
from .run import CaptionRun, RunOutcome, Status, Terminated

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_CRASHED = 0, 1, 2, 3
EXIT_LOCKED = 75  # EX_TEMPFAIL: try again later
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader went away

class CommandReporter:
    """A run's reports on stderr (a spinner and a live display on a terminal) and in the --log-file."""

    def __init__(self, console: Console, quiet: bool, log: LineLog):
        self.console, self.quiet, self.log = console, quiet, log

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"tarsier: {in_flags(message)}", highlight=False, markup=False)
        self.log(in_flags(message))

    def warning(self, message: str) -> None:
        self.console.print(f"tarsier: {in_flags(message)}", highlight=False, markup=False)
        self.log(in_flags(message))

    def loading(self, model: str) -> AbstractContextManager[object]:
        quiet_library_logs()
        if self.console.is_terminal and not self.quiet:
            return self.console.status(f"loading {escape(model)}", spinner="dots")
        return nullcontext()

    def progress(self, stats: RunStats) -> list[Reporter]:
        return make_reporters(stats, self.console, self.quiet, self.log.file)


EXIT_CODES = {Status.DONE: EXIT_OK, Status.NO_MEDIA: EXIT_OK, Status.SOME_FAILED: EXIT_SOME_FAILED,
              Status.INTERRUPTED: EXIT_INTERRUPTED, Status.TERMINATED: EXIT_TERMINATED,
              Status.STDOUT_CLOSED: EXIT_BROKEN_PIPE, Status.CRASHED: EXIT_CRASHED}


def present(outcome: RunOutcome, console: Console, quiet: bool, log: LineLog) -> int:
    """Show how the run ended; returns the exit code."""
    if outcome.status is Status.STDOUT_CLOSED:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits
    finished = outcome.status in (Status.DONE, Status.SOME_FAILED) and outcome.stats is not None
    if outcome.error is not None and not quiet and not isinstance(outcome.error, OutputWriteError):
        console.print(Traceback.from_exception(type(outcome.error), outcome.error, outcome.error.__traceback__))
    if not finished or not quiet:
        if finished and outcome.summary and console.is_terminal:
            print_summary(console, [(name, in_flags(value)) for name, value in outcome.summary])
        else:
            console.print(f"tarsier: {in_flags(outcome.message)}", highlight=False, markup=False)
    else:   # quiet: what failed or was captioned from damaged files, in a few lines
        assert outcome.stats is not None
        lines = quiet_report(outcome.stats, outcome.summary)
        if lines and outcome.output is not None and (outcome.stats.failed or outcome.stats.failed_earlier):
            lines.append(where_failures_are(outcome.output))
        for line in lines:
            console.print(f"tarsier: {in_flags(line)}", highlight=False, markup=False)
    log(in_flags(outcome.message))
    return EXIT_CODES[outcome.status]


def where_failures_are(output: str) -> str:
    """The commands that list the failed rows of `output` and group them, for `--quiet`'s last line."""
    quoted = shlex.quote(output)
    return (f"the failed rows' errors are in {output} (tarsier peek {quoted} --failed --last 100 lists them; "
            f"tarsier report {quoted} -o report.html groups them by kind, with examples)")


@contextmanager
def stop_signals() -> Iterator[None]:
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


def quiet_library_logs() -> None:
    """transformers' warnings off. Until transformers is imported, through the variable it reads when it is: importing
    it here (~0.6 s of CPU) would delay the decoding workers' fork server, which starts once this returns."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    else:
        transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def let_waiting_cpu_threads_sleep() -> None:
    """torch's CPU threads (OpenMP's) sleep when they wait at a barrier instead of spinning, unless the user chose.

    The model's threads share the cores with the decoding workers: a spinning thread holds a core a worker needs and
    then waits for the thread the worker delays (on 2 cores the quick start's captioning took 3.4 s of CPU for 0.1 s
    of work). OpenMP reads the policy once, when torch loads it, so this runs before torch is imported; the number of
    threads, and with it every result, stays as it was.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def fail(said: object, flags: dict[str, str] = FLAGS) -> NoReturn:
    """Stop the command with a message (a library's error or note names settings by field: worded by `flags`)."""
    typer.echo(f"Error: {in_flags(said, flags)}", err=True)
    raise typer.Exit(EXIT_USAGE)


def open_log(path: Path | None) -> TextIO | None:
    """The --log-file, opened to append; its folder is made, as --out's is (shards/shard-0.log beside
    shards/shard-0.parquet)."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as error:
        fail(f"--log-file {path}: {error.strerror or error}")


def dry_run(run: CaptionRun) -> int:
    """Print one line per input (what would happen and why) on stdout, the counts on stderr."""
    try:
        lines, counts = run.describe()
    except (OutputError, SettingsMismatchError) as error:
        fail(error)
    sys.stdout.writelines(f"{action}\t{path}\t{in_flags(reason)}\n" for action, path, reason in lines)
    by_action: dict[str, Counter[str]] = {}
    for (action, kind), count in counts.items():
        by_action.setdefault(action, Counter())[kind] += count
    summary = "; ".join(f"{action} {sum(kinds.values())} "
                        f"({', '.join(f'{n} {in_flags(kind)}' for kind, n in kinds.items())})"
                        for action, kinds in by_action.items())
    typer.echo(f"tarsier: dry run, nothing loaded or written: {summary or 'nothing to do'}", err=True)
    return EXIT_OK


def stdin_paths(inputs: list[str], null_separated: bool = False) -> list[str]:
    """The paths on standard input if an input is `-`: one per line (blank lines ignored) or NUL-separated.

    Read as bytes: a file name that is not valid UTF-8 still names its file.
    """
    if "-" not in inputs:
        return []
    data = sys.stdin.buffer.read()
    if null_separated:
        return [os.fsdecode(path) for path in data.split(b"\0") if path]
    return [os.fsdecode(line.rstrip(b"\r")) for line in data.split(b"\n") if line.strip()]
