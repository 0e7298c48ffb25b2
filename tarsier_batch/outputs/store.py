"""Crash-safe output: finished rows go to part files as they come; `--out` is written once, atomically.

Beside `--out` (say `r.parquet`; or a folder of shards) a run keeps a hidden work directory
`.r.parquet.tarsier/`:

    settings.json                 what decides the captions (model, prompt, frames, generation), and
                                  whether the run replaces `--out` (`--overwrite`)
    part-<time>-<pid>.parquet     finished rows, every N rows or T seconds

Each part is written under a temporary name, fsynced, renamed and its directory fsynced, so a
part either exists whole or not at all: a `kill -9` or a power cut loses at most the rows not
yet flushed. When the run ends, the rows of `--out` (if any), of the parts and of this run
are merged into a temporary file that replaces `--out` atomically (in `--out`'s format, see
`formats`; with shards, each shard is replaced atomically); then the work directory is removed.
A reader never sees a half-written file, and a later run reads both `--out` and any parts left
behind to resume. The parts of a run that replaces `--out` replace it for the runs that continue it
too: those never read `--out`'s rows, which the finished run would not have kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import Worded, one_line, plural
from ..inputs.sources import row_id_of
from ..settings import FLUSH_ROWS, FLUSH_SECONDS
from .formats import OutputError, OutputTarget, read_results, what_to_do, with_metadata
from .schema import OutputColumns, is_long, with_layout

SETTINGS_FILE = "settings.json"
# In the settings file of a run that replaces the output (`--overwrite`): its parts are all the rows there are.
REPLACES_OUTPUT = "replaces_output"
COMPACT_EVERY = 256   # parts written, after which the work directory's parts are merged into one


class OutputWriteError(Exception):
    """Finished rows could not be written (full disk, permissions, I/O error)."""


@dataclass
class StoredRows:
    """What earlier runs left for this output: rows by path (the newest wins) and their settings."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)   # where -> resume settings
    provenance: dict[str, Any] | None = None                            # of the newest run that left rows
    long: bool = False         # `--out` holds the long layout (`OutputColumns.long`)
    parts: int = 0
    replaces_output: bool = False   # the parts are of a run replacing `--out`: its rows were not read
    unreadable_parts: list[str] = field(default_factory=list)           # "name: reason"


def work_name(output_name: str) -> str:
    """The name of the hidden work directory beside the output named `output_name`."""
    return f".{output_name}.tarsier"


class ResultStore:
    """The output (a file, or a folder of shards) and its work directory of part files.

    `on_written` and `on_removed` are told of each file of the work directory written (a part, the
    settings) and of parts removed, after the fact, so that a mirror (`remote.RemoteOutput`, an object
    store) can follow; they must return at once: they are called where rows are saved.
    """

    def __init__(self, target: OutputTarget, columns: OutputColumns, flush_rows: int = FLUSH_ROWS,
                 flush_seconds: float = FLUSH_SECONDS, clock: Callable[[], float] = time.monotonic,
                 on_written: Callable[[Path], None] | None = None,
                 on_removed: Callable[[list[Path]], None] | None = None):
        target.check()
        self.target = target
        self.out = target.path
        self.work_dir = self.out.parent / work_name(self.out.name)
        self.out_shown, self.work_shown = target.shown, target.shown_beside(work_name(self.out.name))
        self._on_written, self._on_removed = on_written, on_removed
        self.columns = columns
        self.schema = columns.schema()   # of the rows and the part files: one row per item
        self.flush_rows, self.flush_seconds, self._clock = flush_rows, flush_seconds, clock
        self._pending: list[dict[str, Any]] = []
        # When the last part was written: rows wait at most flush_seconds after it. Before the first part, none wait:
        # the run's first row is on disk as soon as it finishes.
        self._last_save = -math.inf
        self._parts_written = 0
        self.saved_rows = 0    # rows of this run that are safely in part files
        self.output_existed: bool | None = None   # whether `read` found --out (None: not read yet)
        self.replaces_output = False   # this run's parts replace --out (`begin`)

    def read(self, output: bool = True) -> StoredRows:
        """The rows and settings of `--out` (unless not `output`, or the parts left replace it) and of the parts an
        unfinished run left."""
        stored = StoredRows()
        self.output_existed = self.target.exists()
        settings_file = self.work_dir / SETTINGS_FILE
        parts = self._parts()
        work_provenance = json.loads(settings_file.read_text()) if settings_file.exists() and parts else None
        stored.replaces_output = bool(work_provenance and work_provenance.pop(REPLACES_OUTPUT, False))
        if self.output_existed and output and not stored.replaces_output:
            table, stored.provenance = _read_output(self.target, self.columns.read_schema())
            stored.settings[self.out_shown] = stored.provenance["settings"]
            stored.long = is_long(stored.provenance)
            _take_rows(stored, self.columns.item_rows(table, stored.long))
        if work_provenance is not None:
            stored.provenance = work_provenance
            stored.settings[self.work_shown] = work_provenance["settings"]
        stored.parts = len(parts)
        for part in parts:
            try:
                _take_rows(stored, pq.read_table(part).to_pylist())
            except (OSError, pa.ArrowException) as error:  # only possible if the disk itself lost data
                stored.unreadable_parts.append(f"{part.name}: {error}")
        return stored

    def begin(self, provenance: dict[str, Any], fresh: bool, replaces_output: bool = False) -> None:
        """Prepare the work directory; `fresh` drops the parts of earlier runs (`--overwrite`, not continuing one).

        `provenance` (with the resume settings under "settings") is stored for the next run, and whether this
        run's rows replace `--out` (`replaces_output`: the next run continuing them must not read it).
        """
        self.replaces_output = replaces_output
        if fresh:
            self._removed(self._parts())
            shutil.rmtree(self.work_dir, ignore_errors=True)
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.work_dir.glob(".*.tmp"):  # from a run killed mid-write; we hold the lock
                leftover.unlink(missing_ok=True)
            self.record_provenance(provenance)
        except OSError as error:   # a disk that filled up since `check_room`: nothing of this run is saved yet
            if not self._parts():   # the rows of earlier runs stay; a folder of no rows would only puzzle
                shutil.rmtree(self.work_dir, ignore_errors=True)
            raise self.target.unwritable(error) from None
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for leftover in self.out.parent.glob(f".{self.out.name}.*.tmp"):
            leftover.unlink(missing_ok=True)

    def check_room(self, provenance: dict[str, Any]) -> None:
        """Raise `OutputError` if the output's folder cannot take a file as big as `provenance`: a disk too full for
        the work directory's settings then says so before the model loads (a minute, on a large checkpoint). The
        settings themselves are written by `begin`, once the model is loaded: they name what it resolved, and
        `--overwrite` drops the parts of earlier runs only when there is a run to replace them."""
        stand_in = self.out.parent / f".{self.out.name}.{os.getpid()}.tmp"   # removed by `begin` if left
        try:
            with open(stand_in, "w", encoding="utf-8") as file:
                file.write(json.dumps(provenance))
                file.flush()
                os.fsync(file.fileno())   # where a filesystem allocates its blocks only now
        except OSError as error:
            raise self.target.unwritable(error) from None
        finally:
            stand_in.unlink(missing_ok=True)

    def record_provenance(self, provenance: dict[str, Any]) -> None:
        """Keep `provenance` in the work directory: the output's, when a later run resumes it."""
        kept = {**provenance, REPLACES_OUTPUT: True} if self.replaces_output else provenance
        write_atomically(self.work_dir / SETTINGS_FILE, lambda path: path.write_text(json.dumps(kept)))
        self._written(self.work_dir / SETTINGS_FILE)

    def add(self, row: dict[str, Any]) -> None:
        """Queue a finished row: saved with the next part (`flush_if_due`; at once if it fills one).

        Only the count is checked here: rows that finish together (one engine step, one Ray batch)
        are added one by one, then share a part at the caller's next `flush_if_due`."""
        self._pending.append(row)
        if len(self._pending) >= self.flush_rows:
            self.flush()

    def flush_if_due(self) -> None:
        """Save the queued rows if there are `flush_rows` of them or `flush_seconds` passed since the last part (or
        none was written yet).

        So a row waits at most about `flush_seconds` (rows slower than that, and the run's first, are saved
        one by one, at once), and fast rows share a part: at most one part per `flush_seconds`, whatever the rate.
        """
        if self._pending and (len(self._pending) >= self.flush_rows
                              or self._clock() - self._last_save >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Save the queued rows as one part file; on failure they are lost and the error says how many."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        part = self._new_part()
        table = pa.Table.from_pylist(rows, schema=self.schema)
        try:
            write_atomically(part, lambda path: pq.write_table(table, path))
        except OSError as error:
            raise OutputWriteError(f"cannot save {plural(len(rows), 'finished row')} in {self.work_shown}: "
                                   f"{error.strerror or error}; {what_to_do(error)}") from error
        self._written(part)
        self.saved_rows += len(rows)
        self._last_save = self._clock()
        self._parts_written += 1
        if self._parts_written % COMPACT_EVERY == 0:
            self._compact()

    def _compact(self) -> None:
        """Merge the work directory's parts into one: slow rows, each saved at once, would leave a part per row
        (100,000 files on a long run, each read again on resume). The merged part is written before the
        others are removed: a crash in between leaves rows twice, and the newest row of a path wins."""
        parts, merged = self._parts(), self._new_part()
        try:
            table = pa.concat_tables(pq.read_table(part) for part in parts)
            write_atomically(merged, lambda path: pq.write_table(table, path))
        except (OSError, pa.ArrowException):
            return   # compacting is an economy: the parts stay as they are
        self._written(merged)   # told first: a mirror holds the merged part before it drops the others
        for part in parts:
            part.unlink(missing_ok=True)
        self._removed(parts)

    @property
    def pending_rows(self) -> int:
        return len(self._pending)

    def commit(self, rows: list[dict[str, Any]], provenance: dict[str, Any], summary: dict[str, Any]) -> None:
        """Write `rows` (one per item) as `--out` (atomically replacing it, in its format and layout), then remove
        the work directory."""
        provenance = with_layout(provenance, self.columns.long)
        table = pa.Table.from_pylist(self.columns.file_rows(rows),
                                     schema=with_metadata(self.columns.file_schema(), provenance, summary))
        try:
            self.target.kind.write(self.target, table, provenance, summary, self._replace)
        except OSError as error:
            raise OutputWriteError(f"cannot write {self.out_shown}: {error.strerror or error}") from error
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def _replace(self, path: Path, write: Callable[[Path], None]) -> None:
        write_atomically(path, write, temporary=path.parent / f".{path.name}.{os.getpid()}.tmp")

    def holds_parts(self) -> bool:
        """Whether the work directory holds parts: rows for the next run to continue from."""
        return bool(self._parts())

    def _parts(self) -> list[Path]:
        return sorted(self.work_dir.glob("part-*.parquet")) if self.work_dir.is_dir() else []

    def _new_part(self) -> Path:
        return self.work_dir / f"part-{time.time_ns():020d}-{os.getpid()}.parquet"

    def _written(self, path: Path) -> None:
        if self._on_written is not None:
            self._on_written(path)

    def _removed(self, paths: list[Path]) -> None:
        if self._on_removed is not None and paths:
            self._on_removed(paths)


def _read_output(target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any]]:
    try:
        table, provenance, _ = read_results(target, schema)
    except (OSError, pa.ArrowException, ValueError, KeyError) as error:
        raise OutputError(Worded("{shown} exists but is not readable {format} results of tarsier-batch ({error}); "
                                 "pass {overwrite} to replace it", shown=target.shown, format=target.format,
                                 error=one_line(error))) from error
    if not provenance:   # no provenance at all: another tool's file, or a typo naming one
        raise OutputError(Worded("{shown} exists and is not the output of a tarsier run (it has no run provenance), "
                                 "so it cannot be continued; pass {overwrite} to replace it", shown=target.shown))
    if "settings" not in provenance or "key" not in table.column_names:
        raise OutputError(Worded("{shown} exists but was written by an older version of tarsier-batch, so it cannot "
                                 "be continued; pass {overwrite} to replace it", shown=target.shown))
    return table, provenance


def _take_rows(stored: StoredRows, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        stored.rows.pop(row_id_of(row), None)  # re-inserted last: the newest row of a path comes last
        stored.rows[row_id_of(row)] = row


def write_atomically(path: Path, write: Callable[[Path], None], temporary: Path | None = None) -> None:
    """Write through `temporary` (default `.<name>.tmp` beside `path`), fsync, rename, fsync the folder."""
    temporary = temporary or path.with_name(f".{path.name}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; the rename still happened
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


__all__ = ["REPLACES_OUTPUT", "OutputError", "OutputWriteError", "ResultStore", "StoredRows", "work_name",
           "write_atomically"]
