"""`tarsier report`: one self-contained HTML page to review captions, with the frames they were made from."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .page import render
from .results import check_results_path, figures, load_results
from .thumbnails import StripJob, make_strips, shown_indices


def write_report(results_path: Path, out: Path, frames_per_item: int = 8, thumb_height: int = 72, workers: int = 1,
                 title: str | None = None, on_strips: Callable[[int], None] = lambda count: None,
                 on_total: Callable[[int], None] = lambda count: None) -> int:
    """Write the report of `results_path` to `out` (atomically); returns the number of items.

    Frames are re-extracted only for captioned items (failed ones have none recorded);
    `frames_per_item` of the recorded frames are shown (0: all).
    """
    results = load_results(results_path)
    jobs = {index: StripJob(row["path"], row["media_type"], tuple(shown_indices(row["frame_indices"], frames_per_item)),
                            thumb_height)
            for index, row in enumerate(results.rows) if not row.get("error") and row.get("frame_indices")}
    on_total(len(jobs))
    made = dict(zip(jobs, make_strips(list(jobs.values()), workers, on_strips)))
    strips = [asdict(made[index]) if index in made else {} for index in range(len(results.rows))]
    page = render(results, figures(results), strips, title or f"tarsier-batch report: {results_path.name}")
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(page, encoding="utf-8")
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return len(results.rows)


__all__ = ["check_results_path", "write_report"]
