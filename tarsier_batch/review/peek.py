"""`tarsier peek`: how far a run's output has got, finished or not, and its last rows, without changing anything."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..inputs.sources import row_id_of
from ..outputs.formats import json_line
from .results import Results
from .selection import status_of

CAPTION_WIDTH = 80


def counts_line(results: Results, name: str) -> str:
    """One line: the rows, captioned and failed (by kind), and whether the run has finished."""
    statuses = Counter(status_of(row) for row in results.rows)
    captioned = statuses.pop("captioned", 0)
    failed = ", ".join(f"{kind} {count:,}" for kind, count in statuses.most_common())
    state = (f"{results.unfinished.note} in {results.unfinished.parts} part files" if results.unfinished
             else "finished output")
    return (f"{name}: {len(results.rows):,} rows, {captioned:,} captioned, {sum(statuses.values()):,} failed"
            f"{f' ({failed})' if failed else ''}; {state}")


def last_rows_table(results: Results, last: int) -> str:
    """The last `last` rows (in the order saved) as aligned text: status, row, caption or error, cut to a line."""
    rows = results.rows[-last:] if last else []
    lines = [(status_of(row), row_id_of(row), _one_line(row.get("error") or _text(results, row)))
             for row in rows]
    width = max((len(status) for status, _, _ in lines), default=0)
    return "\n".join(f"{status:<{width}}  {row}  {text}" for status, row, text in lines)


def last_rows_json(results: Results, last: int) -> str:
    """The last `last` rows as JSON Lines, every column."""
    return "".join(json_line(row) for row in (results.rows[-last:] if last else []))


def _text(results: Results, row: dict[str, Any]) -> str:
    if results.questions:
        return " | ".join(f"{question}: {row.get(question)}" for question in results.questions)
    return row.get("caption") or ""


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= CAPTION_WIDTH else flat[:CAPTION_WIDTH - 1] + "…"
