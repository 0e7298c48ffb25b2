"""`-o -`: rows as JSON Lines on stdout, in input order, each as soon as every earlier row is out."""

from __future__ import annotations

from typing import Any, TextIO

from ..inputs.sources import row_id_of
from .formats import json_line
from .schema import OutputColumns


class JsonLinesStream:
    """Writes rows to `handle` in the order of `paths`, holding back rows that finish early.

    Each line is flushed at once, so `| jq` or `| head` see rows as they finish. Nothing is
    kept for a later run: a stream cannot be resumed.
    """

    def __init__(self, paths: list[str], handle: TextIO, columns: OutputColumns):
        self.handle = handle
        self.columns = columns   # in the long layout, an item's lines are one per question
        self._order = paths
        self._next = 0
        self._waiting: dict[str, dict[str, Any]] = {}
        self.saved_rows = 0

    def add(self, row: dict[str, Any]) -> None:
        self._waiting[row_id_of(row)] = row
        while self._next < len(self._order) and self._order[self._next] in self._waiting:
            for line in self.columns.file_rows([self._waiting.pop(self._order[self._next])]):
                self.handle.write(json_line(line))
                self.saved_rows += 1
            self.handle.flush()
            self._next += 1

    def flush_if_due(self) -> None:
        """Rows are written as soon as their turn comes; nothing waits for a timer."""

    def flush(self) -> None:
        self.handle.flush()
