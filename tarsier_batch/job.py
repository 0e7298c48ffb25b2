"""One captioning job over an output: caption what the plan says, save rows as they finish."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .outputs.resume import Plan
from .outputs.schema import result_row
from .outputs.store import ResultStore
from .progress import Reporter, RunStats
from .results import CaptionResult
from .sources import MediaItem

if TYPE_CHECKING:
    from .api import Captioner


class CaptionJob:
    """Feeds the plan's items to a captioner and hands every finished row to the store.

    An item whose content another item of the run shares (same key: links to one file,
    copies with `--key sha256`) is captioned once; each path still gets its own row.
    """

    def __init__(self, items: list[MediaItem], plan: Plan, store: ResultStore, stats: RunStats, model_name: str,
                 with_token_ids: bool):
        self.items, self.plan, self.store, self.stats = items, plan, store, stats
        self.model_name, self.with_token_ids = model_name, with_token_ids
        self.new_rows: dict[str, dict[str, Any]] = {}

    def run(self, captioner: Captioner, reporters: list[Reporter]) -> None:
        def on_tokens(count: int) -> None:
            self.stats.streamed_tokens += count
            self.store.flush_if_due()  # rows waiting for a flush are saved even while nothing finishes
            for reporter in reporters:
                reporter.on_tokens()

        for result in captioner.caption(self.plan.todo, on_tokens):
            for copy in [result, *self._copies(result)]:
                self._finish(copy, reporters)

    def final_rows(self) -> list[dict[str, Any]]:
        return self.plan.ordered_rows(self.items, self.new_rows)

    def _copies(self, result: CaptionResult) -> list[CaptionResult]:
        return [replace(result, path=item.row_path) for item in self.plan.sharing.get(result.key or "", [])]

    def _finish(self, result: CaptionResult, reporters: list[Reporter]) -> None:
        row = result_row(result, self.model_name, self.with_token_ids)
        self.new_rows[result.path] = row
        self.store.add(row)
        self.stats.record(result)
        for reporter in reporters:
            reporter.on_result(result)
