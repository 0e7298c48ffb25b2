"""The one interface finished rows are written through, by a single run and by a run on Ray.

Two writers implement it: `store.ResultStore` (an output file or a folder of shards: rows saved
in crash-safe part files as they finish, the output written once, atomically, in its
`formats.OutputFormat`) and `stream.JsonLinesStream` (`-o -`: rows on stdout in input order,
nothing kept). A new file format is a new `OutputFormat`, not a new writer.
"""

from __future__ import annotations

from typing import Any, Protocol


class RowWriter(Protocol):
    """Where a run's finished rows go as they finish."""

    saved_rows: int   # rows of this run that are safely written

    def add(self, row: dict[str, Any]) -> None:
        """Take a finished row (written at once, or with the next flush)."""

    def flush_if_due(self) -> None:
        """Write the rows taken so far if enough wait, or the oldest has waited long enough."""

    def flush(self) -> None:
        """Write every row taken so far."""
