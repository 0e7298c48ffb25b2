"""The rows an unfinished run has saved so far, read without its lock and without changing anything.

A run keeps its finished rows in part files in its work directory until it ends (`store`); after
a Ctrl-C, a `kill` or a crash they stay there for the next run to resume. A reader may look at
them at any time, even while a run still writes them: a part appears whole, by a rename, or not
at all (its temporary name is no part's name), and compacting writes the merged part before it
removes the parts it merged, so a part that was listed and is gone when read has its rows in a
newer part: the listing is simply read again. The parts of a run that replaces its output
(`--overwrite`) are all its rows: that output's are not among them. A run that has saved no row
yet is told by its lock, held while it loads its model, or by its settings in the work directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import one_line
from ..inputs.sources import row_id_of
from .formats import OutputError
from .lock import OutputLock
from .resume import settings_match
from .schema import OutputColumns
from .store import REPLACES_OUTPUT, SETTINGS_FILE, work_name

LISTINGS = 20   # times the parts are listed again while a running compaction removes them under the reader


@dataclass
class SavedParts:
    """What an unfinished run's work directory holds: its rows (one per item, in the order saved) and provenance."""

    rows: list[dict[str, Any]]
    provenance: dict[str, Any]
    parts: int
    unreadable: list[str] = field(default_factory=list)   # "name: reason"
    replaces_output: bool = False   # the run replaces its output: the output's rows are not the run's

    def replaces(self, output_settings: dict[str, Any] | None) -> bool:
        """Whether these rows replace those of the output made with `output_settings`: the run says so, or made
        them with settings no run continuing that output would take (an overwriting run of an earlier version)."""
        settings = self.provenance.get("settings")
        return self.replaces_output or (bool(self.parts) and output_settings is not None and settings is not None
                                        and not settings_match({"output": output_settings}, settings))


def work_dir_of(results: Path) -> Path:
    """The work directory a run writing `results` (a file, or a folder of shards) keeps beside it."""
    return results.parent / work_name(results.name)


def has_saved_parts(results: Path) -> bool:
    """Whether a run writing `results` left (or is writing) rows in part files."""
    work_dir = work_dir_of(results)
    return work_dir.is_dir() and any(work_dir.glob("part-*.parquet"))


@dataclass(frozen=True)
class RunWithoutRows:
    """A run writing an output that has saved no row of it yet: one starting (its model loading, say) or one stopped
    before its first row."""

    holder: str | None   # the live run holding the output's lock, as it names itself; None: stopped


def run_without_rows(results: Path) -> RunWithoutRows | None:
    """The run of `results` that has saved no row, where `results` does not exist and no part was saved: one whose
    lock a live process holds, or one that left its work directory with its settings and no part. None otherwise
    (a wrong name, or a run that died loading its model, before it recorded anything)."""
    if results.exists() or has_saved_parts(results):
        return None
    holder = OutputLock(results).holder()
    if holder is None and not (work_dir_of(results) / SETTINGS_FILE).is_file():
        return None
    return RunWithoutRows(holder)


def read_saved_parts(results: Path, columns: OutputColumns) -> SavedParts:
    """The rows saved so far in the parts of a run writing `results`, the newest row of an item kept; read only.

    Raises OutputError if the parts keep vanishing while they are read (a run compacting faster than
    this reads), or the settings file cannot be read."""
    work_dir = work_dir_of(results)
    for _ in range(LISTINGS):
        parts = sorted(work_dir.glob("part-*.parquet"))
        try:
            rows, unreadable = _read_parts(parts, columns)
        except FileNotFoundError:
            continue   # compacted under us: its rows are in a newer part
        provenance = _provenance(work_dir)
        replaces_output = bool(provenance.pop(REPLACES_OUTPUT, False))
        return SavedParts(rows, provenance, len(parts), unreadable, replaces_output)
    raise OutputError(f"the parts in {work_dir} kept changing while they were read; try again")


def _read_parts(parts: list[Path], columns: OutputColumns) -> tuple[list[dict[str, Any]], list[str]]:
    by_id: dict[str, dict[str, Any]] = {}
    unreadable = []
    for part in parts:
        try:
            table = pq.read_table(part)
        except FileNotFoundError:
            raise   # compacted away since it was listed: `read_saved_parts` lists again
        except (OSError, pa.ArrowException) as error:   # only if the disk itself lost data: the others still count
            unreadable.append(f"{part.name}: {one_line(error)}")
            continue
        for row in columns.item_rows(table, long=False):
            by_id.pop(row_id_of(row), None)   # re-inserted last: the newest row of an item comes last
            by_id[row_id_of(row)] = row
    return list(by_id.values()), unreadable


def _provenance(work_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((work_dir / SETTINGS_FILE).read_text())
    except FileNotFoundError:
        return {}   # a run removed its work directory as it finished: its output holds the provenance
    except (OSError, ValueError) as error:
        raise OutputError(f"cannot read {work_dir / SETTINGS_FILE}: {one_line(error)}") from error


__all__ = ["RunWithoutRows", "SavedParts", "has_saved_parts", "read_saved_parts", "run_without_rows", "work_dir_of"]
