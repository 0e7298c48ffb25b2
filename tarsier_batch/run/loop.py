"""The loop inside a run: the plan's items to the backend, each finished row to the sink."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ..inputs.sources import MediaItem, row_id_of
from ..outputs.results import CaptionResult
from ..outputs.resume import Plan
from ..outputs.schema import OutputColumns
from ..outputs.writer import RowWriter
from ..progress import Reporter, RunStats
from .backend import Backend


class ItemLoop:
    """The loop inside a run: feeds the plan's items to the backend and hands every finished row to the sink.

    An item whose content another item of the run shares (same key: links to one file,
    copies with `--key sha256`) is captioned once; each path still gets its own row.
    """

    def __init__(self, items: list[MediaItem], plan: Plan, store: RowWriter, stats: RunStats, model_name: str,
                 columns: OutputColumns):
        self.items, self.plan, self.store, self.stats = items, plan, store, stats
        self.model_name, self.columns = model_name, columns
        self.new_rows: dict[str, dict[str, Any]] = {}
        self._by_id = {item.row_id: item for item in items}

    def run(self, backend: Backend, reporters: list[Reporter]) -> Iterator[CaptionResult]:
        """Caption the plan's items, yielding each row's result as it is saved (same-content copies too), in the
        order they finish."""
        def on_tokens(count: int) -> None:
            self.stats.streamed_tokens += count
            self.store.flush_if_due()  # rows waiting for a flush are saved even while nothing finishes
            for reporter in reporters:
                reporter.on_tokens()

        # As each finishes, not in input order: a finished row is saved even while an earlier item still
        # generates (the output is put in order at the end; a stream keeps its own order).
        for result in backend.caption(self.plan.todo, on_tokens, in_order=False):
            for copy in [result, *self._copies(result)]:
                self._finish(copy, reporters)
                yield copy

    def final_rows(self) -> list[dict[str, Any]]:
        """Every row of the output; rows of earlier runs get this run's file facts and manifest columns."""
        rows = self.plan.ordered_rows(self.items, self.new_rows)
        return [{**row, **self.columns.item_values(self._by_id[row_id_of(row)])} if row_id_of(row) in self._by_id
                else row for row in rows]

    def _copies(self, result: CaptionResult) -> list[CaptionResult]:
        return [replace(result, path=item.row_path) for item in self.plan.sharing.get(result.key or "", [])]

    def _finish(self, result: CaptionResult, reporters: list[Reporter]) -> None:
        row = self.columns.row(result, self._by_id[result.row_id], self.model_name,
                               self.plan.earlier.get(result.row_id))
        self.new_rows[result.row_id] = row
        self.store.add(row)
        self.stats.record(result)
        for reporter in reporters:
            reporter.on_result(result)
