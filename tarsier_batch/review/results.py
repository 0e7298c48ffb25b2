"""Results to review: the rows of any output `tarsier caption` writes, and the figures that sum them up."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import UNKNOWN, one_line
from ..inputs.sources import row_id_of
from ..outputs.formats import FORMATS, OutputError, OutputTarget, read_results
from ..outputs.schema import OutputColumns, is_long
from ..outputs.unfinished import SavedParts, has_saved_parts, read_saved_parts, run_without_rows

HISTOGRAM_BINS = 12
EXAMPLES_PER_ERROR_KIND = 3


@dataclass
class Results:
    rows: list[dict[str, Any]]
    provenance: dict[str, Any]
    summary: dict[str, Any]
    extra_columns: list[str] = field(default_factory=list)   # a manifest's kept columns
    questions: list[str] = field(default_factory=list)       # a prompt set's names (each answer in its columns)
    unfinished: Unfinished | None = None                      # a run that has not written its output (yet)


@dataclass(frozen=True)
class Unfinished:
    """The rows of a run that was stopped, or is still running, as far as its part files go (none: no row yet)."""

    parts: int        # part files read
    saved_rows: int   # every row saved so far: the parts', and the output's where an earlier run wrote one
    unreadable: list[str] = field(default_factory=list)
    holder: str | None = None   # the live run writing the output: looked for only while it has saved no row

    @property
    def note(self) -> str:
        if self.parts:
            return f"unfinished run: {self.saved_rows:,} rows saved so far"
        if self.holder is not None:
            return f"a run is writing it ({self.holder}); no row saved yet"
        return "an unfinished run saved no row yet; run the same command again to resume"


@dataclass
class Figures:
    """What the page's header shows."""

    total: int
    captioned: int
    failed: int
    by_type: dict[str, int]
    items_per_s: float | None
    tokens_per_s: float | None
    words_mean: float | None
    words_median: float | None
    histogram: list[tuple[int, int, int]]   # (from words, to words, count)
    errors: list[ErrorGroup]                # by error_kind, most frequent first
    warned: int = 0                         # items captioned from a damaged file (`warnings`)
    warning_kinds: list[tuple[str, int]] = field(default_factory=list)   # kind -> items, most first, then by name


@dataclass(frozen=True)
class ErrorGroup:
    """The failed items of one `error_kind`: how many, and a few of them (path, message)."""

    kind: str
    count: int
    examples: list[tuple[str, str]]


def check_results_path(path: Path) -> None:
    """Answer a wrong RESULTS argument before anything is read."""
    if not path.exists() and not has_saved_parts(path) and run_without_rows(path) is None:
        raise OutputError(f"{path}: no such file or folder (nor the saved rows of a run writing it)")
    if path.is_file() and path.suffix.lower() not in FORMATS:
        raise OutputError(f"{path}: not results of tarsier caption (.parquet, .jsonl, .csv or a folder of shards)")


def load_results(path: Path) -> Results:
    """The rows of `path` (Parquet, JSON Lines, CSV or a folder of shards) with their provenance; with the rows
    saved so far by a run writing `path` that has not finished (stopped, or still running), read without its
    lock: those rows come after the output's, an item's newest row winning; a run replacing the output
    (`--overwrite`) has its own rows alone. A run that has saved no row (loading its model, or stopped before its
    first row) gives no rows, its `unfinished` saying whether it is running."""
    check_results_path(path)
    started = run_without_rows(path)
    if started is not None:   # a run loading its model, or one stopped before its first row
        return Results([], {}, {}, unfinished=Unfinished(0, 0, holder=started.holder))
    base = OutputColumns(with_token_ids=True, hashed=True, spans=True).schema()
    # The parts before the output: a run that finishes meanwhile writes its output before it removes its parts,
    # so whichever of the two this meets, every row saved is read (the other order could meet neither).
    saved = _read_saved_parts(path) if has_saved_parts(path) else None
    unfinished = saved if saved is not None and saved.parts else None   # none left: the run finished meanwhile
    written = path.exists() and (OutputTarget.existing(path).exists() or saved is None) \
        and not (unfinished is not None and unfinished.replaces_output)
    results = _read_output(path, base) if written else Results([], {}, {})   # an --out-dir with no shard yet: {}
    if unfinished is not None:
        if unfinished.replaces(results.provenance.get("settings")):
            results = Results([], {}, {})
        _add_saved_parts(results, unfinished, base)
    return results


def _read_output(path: Path, base: pa.Schema) -> Results:
    try:
        table, provenance, summary = read_results(OutputTarget.existing(path), base)
        questions = _questions(provenance)
        columns = OutputColumns(with_token_ids=True, hashed=True, questions=tuple(questions), spans=True)
        with_answers = columns.read_schema()
        if questions:   # read again for the answers' columns (text formats keep only the columns asked for)
            table = read_results(OutputTarget.existing(path), with_answers)[0]
        rows = columns.item_rows(table, is_long(provenance))   # a long layout's rows joined per item
    except (OSError, pa.ArrowException, ValueError, KeyError, IndexError) as error:
        raise OutputError(f"cannot read {path} as results of tarsier caption ({one_line(error)})") from error
    if "path" not in table.column_names:
        raise OutputError(f"{path} has no 'path' column: not results of tarsier caption")
    extra = [name for name in table.column_names if name not in base.names and name not in with_answers.names]
    return Results(rows, provenance, summary, extra, questions)


def _questions(provenance: dict[str, Any]) -> list[str]:
    # A merged output whose first shard was empty keeps only the stored settings: the names are there too.
    return [question["name"] for question in provenance.get("prompt_set") or []] or \
        list((provenance.get("settings") or {}).get("prompt_set") or [])


def _read_saved_parts(path: Path) -> SavedParts:
    try:
        return read_saved_parts(path, OutputColumns(with_token_ids=True, hashed=True, spans=True))
    except (OSError, pa.ArrowException, ValueError, KeyError) as error:
        raise OutputError(f"cannot read the rows saved so far for {path} ({one_line(error)})") from error


def _add_saved_parts(results: Results, saved: SavedParts, base: pa.Schema) -> None:
    """Add the rows of an unfinished run's parts to `results` (the newest row of an item wins) and mark it."""
    by_id = {row_id_of(row): row for row in results.rows}
    for row in saved.rows:
        by_id.pop(row_id_of(row), None)
        by_id[row_id_of(row)] = row
    results.rows = list(by_id.values())
    if saved.provenance:   # the newest run's
        results.provenance = saved.provenance
        results.questions = _questions(saved.provenance)
    if not results.extra_columns and saved.rows:   # a manifest's kept columns, as the parts hold them
        known = OutputColumns(with_token_ids=True, hashed=True, questions=tuple(results.questions),
                              spans=True).read_schema().names
        results.extra_columns = [name for name in saved.rows[0] if name not in base.names and name not in known]
    results.unfinished = Unfinished(saved.parts, len(results.rows), saved.unreadable)


def answers(results: Results, row: dict[str, Any]) -> list[str | None]:
    """A row's captions: its one caption, or its answer to each question of the prompt set."""
    return [row.get(question) for question in results.questions] if results.questions else [row.get("caption")]


def figures(results: Results) -> Figures:
    rows = results.rows
    failed = [row for row in rows if row.get("error")]
    # A question a row was not asked (a manifest row's own set) has no answer: not an answer of no words.
    words = [len(answer.split()) for row in rows if not row.get("error") for answer in answers(results, row)
             if answer is not None]
    summary = results.summary
    elapsed = sum(row.get("elapsed_s") or 0.0 for row in rows)
    token_columns = [question + "_generated_tokens" for question in results.questions] or ["generated_tokens"]
    tokens = sum(row.get(column) or 0 for row in rows for column in token_columns)
    return Figures(
        total=len(rows), captioned=len(rows) - len(failed), failed=len(failed),
        by_type=dict(Counter(row.get("media_type") or "unknown" for row in rows).most_common()),
        # The run's own rates when the file has them (items overlap in a batch, so the per-item
        # times do not add up to the wall time); otherwise a lower bound from the rows.
        items_per_s=summary.get("items_per_s") or (len(rows) / elapsed if elapsed else None),
        tokens_per_s=summary.get("tokens_per_s") or (tokens / elapsed if elapsed else None),
        words_mean=statistics.fmean(words) if words else None,
        words_median=statistics.median(words) if words else None,
        histogram=_histogram(words),
        errors=error_groups(failed),
        warned=sum(bool(row.get("warnings")) for row in rows), warning_kinds=warning_kinds(rows))


def warning_kinds(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The kinds of `warnings` the rows carry (an output older than the column: none), each with how many rows carry
    it, the most frequent first, then by name."""
    counts = Counter(kind for row in rows for kind in row.get("warnings") or ())
    return sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))


def error_groups(failed: list[dict[str, Any]]) -> list[ErrorGroup]:
    """The failed rows by `error_kind` (a message names sizes, offsets and files: a thousand files cut short are
    a thousand messages but one kind), the largest group first, each with its first few rows as examples."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in failed:
        by_kind.setdefault(row.get("error_kind") or UNKNOWN, []).append(row)
    groups = [ErrorGroup(kind, len(rows), [(row_id_of(row), row["error"]) for row in rows[:EXAMPLES_PER_ERROR_KIND]])
              for kind, rows in by_kind.items()]
    return sorted(groups, key=lambda group: (-group.count, group.kind))


def _histogram(values: list[int]) -> list[tuple[int, int, int]]:
    if not values:
        return []
    low, high = min(values), max(values)
    width = max(1, -(-(high - low + 1) // HISTOGRAM_BINS))
    counts = Counter((value - low) // width for value in values)
    return [(low + bin_ * width, low + (bin_ + 1) * width - 1, counts.get(bin_, 0))
            for bin_ in range((high - low) // width + 1)]
