"""`tarsier peek`: how far a run's output has got, finished or not, and its last rows, without changing anything."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..inputs.sources import row_id_of
from ..outputs.formats import json_line
from .results import Results, Unfinished, warning_kinds
from .selection import status_of

CAPTION_WIDTH = 80


def counts_line(results: Results, name: str) -> str:
    """One line: the rows, captioned and failed (by kind), those with warnings (by kind), and whether the run has
    finished; of a run that has saved no row, whether it is running."""
    run = no_row_saved(results)
    if run is not None:
        return f"{name}: {run.note}"
    statuses = Counter(status_of(row) for row in results.rows)
    captioned = statuses.pop("captioned", 0)
    failed = ", ".join(f"{kind} {count:,}" for kind, count in sorted(statuses.items(),
                                                                     key=lambda pair: (-pair[1], pair[0])))
    warned = sum(bool(row.get("warnings")) for row in results.rows)
    kinds = ", ".join(f"{kind} {count:,}" for kind, count in warning_kinds(results.rows))
    state = (f"{results.unfinished.note} in {results.unfinished.parts} part files" if results.unfinished
             else "finished output")
    return (f"{name}: {len(results.rows):,} rows, {captioned:,} captioned, {sum(statuses.values()):,} failed"
            f"{f' ({failed})' if failed else ''}{f', with warnings {warned:,} ({kinds})' if warned else ''}; {state}")


def no_row_saved(results: Results) -> Unfinished | None:
    """The run of `results` if it has saved no row yet (loading its model, or stopped before its first row)."""
    return results.unfinished if results.unfinished is not None and not results.unfinished.parts else None


def no_row_json(run: Unfinished, name: str) -> str:
    """What `--json` prints for a run that has saved no row, in place of rows: one object saying so."""
    return json_line({"results": name, "rows": 0, "unfinished": True, "running": run.holder is not None,
                      "holder": run.holder, "note": run.note})


def last_rows_table(results: Results, last: int) -> str:
    """The last `last` rows (in the order saved) as aligned text: status (with the row's warnings), row, caption or
    error, cut to a line."""
    rows = results.rows[-last:] if last else []
    lines = [(_status(row), row_id_of(row), _one_line(row.get("error") or _text(results, row))) for row in rows]
    width = max((len(status) for status, _, _ in lines), default=0)
    return "\n".join(f"{status:<{width}}  {row}  {text}" for status, row, text in lines)


def last_rows_json(results: Results, last: int) -> str:
    """The last `last` rows as JSON Lines, every column."""
    return "".join(json_line(row) for row in (results.rows[-last:] if last else []))


def _text(results: Results, row: dict[str, Any]) -> str:
    if results.questions:
        return " | ".join(f"{question}: {row.get(question)}" for question in results.questions)
    return row.get("caption") or ""


def _status(row: dict[str, Any]) -> str:
    warnings = row.get("warnings")
    return f"{status_of(row)} (warnings: {', '.join(warnings)})" if warnings else status_of(row)


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= CAPTION_WIDTH else flat[:CAPTION_WIDTH - 1] + "…"
