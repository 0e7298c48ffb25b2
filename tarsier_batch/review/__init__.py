"""`tarsier report`: one HTML page to review captions, with the frames they were made from; also of a run that has
not finished, from the rows it saved so far."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .page import render
from .results import check_results_path, figures, load_results
from .selection import DEFAULT_SEED, select_items
from .strip_files import THUMBNAIL_MODES, place_strips
from .thumbnails import StripJob, make_strips, shown_indices


@dataclass(frozen=True)
class WrittenReport:
    """What `write_report` wrote."""

    items: int                  # rows the figures count
    shown: int                  # items on the page one by one (a sample or the first ones, when fewer)
    unfinished: str | None      # how far an unfinished run has got (None: a finished output)
    strips_folder: Path | None  # the frame strips beside the page, when not inside it


def write_report(results_path: Path, out: Path, frames_per_item: int = 8, thumb_height: int = 72, workers: int = 1,
                 title: str | None = None, on_strips: Callable[[int], None] = lambda count: None,
                 on_total: Callable[[int], None] = lambda count: None, sample: int | None = None,
                 limit: int | None = None, seed: int = DEFAULT_SEED, thumbnails: str = "auto") -> WrittenReport:
    """Write the report of `results_path` to `out` (atomically).

    The figures and error groups count every row; the items shown one by one are the first
    `limit`, or a stratified sample of `sample` (0: all; neither: a sample when there are many,
    see `selection`). Frames are re-extracted only for captioned items shown (failed ones have
    none recorded); `frames_per_item` of the recorded frames are shown (0: all). `thumbnails`
    (one of THUMBNAIL_MODES) puts the strips inside the page or in a folder beside it.
    An unfinished run's rows saved so far are read without its lock (`load_results`).
    """
    results = load_results(results_path)
    selection = select_items(results.rows, sample, limit, seed)
    shown = [results.rows[index] for index in selection.indices]
    jobs = {place: StripJob(row["path"], row["media_type"], tuple(shown_indices(row["frame_indices"], frames_per_item)),
                            thumb_height)
            for place, row in enumerate(shown) if not row.get("error") and row.get("frame_indices")}
    on_total(len(jobs))
    made = dict(zip(jobs, make_strips(list(jobs.values()), workers, on_strips)))
    strips, folder = place_strips([made.get(place) for place in range(len(shown))], out, thumbnails)
    page = render(results, figures(results), strips, title or f"tarsier-batch report: {results_path.name}",
                  selection)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(page, encoding="utf-8")
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return WrittenReport(len(results.rows), len(shown),
                         results.unfinished.note if results.unfinished else None, folder)


__all__ = ["THUMBNAIL_MODES", "WrittenReport", "check_results_path", "write_report"]
