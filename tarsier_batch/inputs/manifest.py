"""Read a manifest: a table of files to caption, with optional per-row prompts and columns to carry through."""

from __future__ import annotations

import os
import posixpath
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa

from .. import storage
from ..errors import Worded
from ..media import MediaType, Span, media_type_of
from .prompt_sets import PromptSetError, row_prompt_set
from .sources import Discovery, KeyMode

MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson", ".parquet")
PATH_COLUMNS = ("path", "file_name", "video", "image")   # tried in this order when --path-column is not given
PROMPT_COLUMN = "prompt"
PROMPTS_COLUMN = "prompts"   # a row's own prompt set: a JSON object of question name -> text
SPAN_COLUMNS = ("start_s", "end_s")   # a row's span of its video, in seconds: the row captions only that stretch
RENAMED_PREFIX = "input_"   # a kept column named like an output column is renamed with this prefix


class ManifestError(Exception):
    """The manifest cannot be used as asked (unreadable, no path column, unknown column, ...)."""


@dataclass
class Manifest:
    """The manifest's items (in `discovery`) and the types of the columns carried into the output."""

    discovery: Discovery
    kept_fields: list[pa.Field]
    renamed: dict[str, str]   # manifest column -> output column, for kept columns that collided


def read_manifest(path: Path | str, key_mode: KeyMode, reserved: frozenset[str], path_column: str | None = None,
                  keep_columns: str | None = None) -> Manifest:
    """The items listed in `path` (CSV, TSV, JSONL or Parquet, by suffix), in row order.

    Relative paths resolve against the manifest's folder, so a manifest travels with its
    media. A `prompt` column (empty cells: the run's prompt) gives rows their own prompt; a
    `prompts` column (empty cells: the run's set) their own prompt set.
    `keep_columns` is "all" or comma-separated names carried into each output row; a kept
    column that is also an output column (`reserved`) is renamed `input_<name>`. `start_s` and
    `end_s` columns give a row a span of its video (empty cells: the whole file): one file may be
    listed once per span, each its own row and segment (numbered in the manifest's order). A file
    listed twice with the same span (or twice whole) is refused: output rows are identified by path
    and span.
    """
    if storage.is_url(str(path)):   # read from a local copy; its relative rows are objects beside it
        shown = storage.redact(str(path))
        check_manifest_path(shown)
        try:
            with storage.fetch(str(path)) as copy:
                table = _read_table(Path(copy.path), shown)
        except (OSError, storage.StorageError) as error:
            raise ManifestError(Worded("cannot read {manifest} {shown}: {error}", shown=shown,
                                        error=storage.redact_text(str(error)))) from None
        return _manifest_of(table, shown, key_mode, reserved, path_column, keep_columns,
                            lambda value: _beside_url(str(path), value))
    check_manifest_path(path)
    table = _read_table(Path(path), str(path))
    base = Path(path).parent.resolve()
    return _manifest_of(table, str(path), key_mode, reserved, path_column, keep_columns,
                        lambda value: os.path.abspath(os.path.join(base, os.path.expanduser(value))))


def _beside_url(manifest_url: str, value: str) -> str:
    """A manifest row's path relative to the manifest's URL: the object it names beside the manifest."""
    parts = urlsplit(manifest_url)
    joined = value if value.startswith("/") else posixpath.join(posixpath.dirname(parts.path), value)
    return urlunsplit((parts.scheme, parts.netloc, posixpath.normpath(joined), "", ""))


def _manifest_of(table: pa.Table, path: str, key_mode: KeyMode, reserved: frozenset[str], path_column: str | None,
                 keep_columns: str | None, resolve: Callable[[str], str]) -> Manifest:
    """The manifest's items from its `table` (`path` names it in messages; `resolve` makes a row's relative path
    whole)."""
    column = _path_column(table, path_column, path)
    kept = _kept_columns(table, keep_columns, path)
    renamed = {name: RENAMED_PREFIX + name for name in kept if name in reserved}
    row_prompts = table.column(PROMPT_COLUMN).to_pylist() if PROMPT_COLUMN in table.column_names else None
    if row_prompts is not None and not pa.types.is_string(table.schema.field(PROMPT_COLUMN).type) \
            and not pa.types.is_large_string(table.schema.field(PROMPT_COLUMN).type):
        raise ManifestError(f"{path}: the '{PROMPT_COLUMN}' column holds {table.schema.field(PROMPT_COLUMN).type}, "
                            f"not text")
    if row_prompts is not None and PROMPTS_COLUMN in table.column_names:
        raise ManifestError(f"{path}: the '{PROMPT_COLUMN}' and '{PROMPTS_COLUMN}' columns do not go together; "
                            f"make each row's prompt one of its questions")
    row_prompt_sets = table.column(PROMPTS_COLUMN).to_pylist() if PROMPTS_COLUMN in table.column_names else None
    kept_values = {name: table.column(name).to_pylist() for name in kept}
    spans = _row_spans(table, path)
    discovery = Discovery()
    first_row: dict[tuple[str, Span | None], int] = {}
    segments: Counter[str] = Counter()   # spans listed so far per file: the next one's segment number
    for index, value in enumerate(table.column(column).to_pylist()):
        row_number = index + 1
        if not isinstance(value, str) or not value.strip():
            raise ManifestError(f"{path}: row {row_number} has no path in column '{column}'")
        media_path = value.strip() if storage.is_url(value.strip()) else resolve(value)
        url = storage.is_url(media_path)
        span = spans[index]
        if (media_path, span) in first_row:
            raise ManifestError(f"{path}: row {row_number} repeats the path{' and span' if span else ''} of row "
                                f"{first_row[media_path, span]} ({value}); give each file (or span) one row")
        first_row[media_path, span] = row_number
        if span is not None and media_type_of(storage.url_name(media_path) if url else media_path) \
                is not MediaType.VIDEO:
            raise ManifestError(f"{path}: row {row_number} gives {value} a span, which applies to videos only")
        prompt = row_prompts[index] if row_prompts is not None else None
        columns = {renamed.get(name, name): values[index] for name, values in kept_values.items()}
        try:
            prompt_set = row_prompt_set(row_prompt_sets[index]) if row_prompt_sets is not None else None
        except PromptSetError as error:
            raise ManifestError(f"{path}: row {row_number}, column '{PROMPTS_COLUMN}': {error}") from None
        own_prompt = prompt if prompt and prompt.strip() else None
        listed = len(discovery.items)
        if url:   # its facts (for the key) from the store: one request per row
            facts = _object_facts(path, row_number, media_path) if key_mode else None
            discovery.add_object(media_path, facts, key_mode, own_prompt, columns, prompt_set)
        else:
            discovery.add(media_path, key_mode, own_prompt, columns, prompt_set)
        if span is not None and len(discovery.items) > listed:
            discovery.items[-1] = replace(discovery.items[-1], span=span, segment=segments[media_path])
            segments[media_path] += 1
    fields = [pa.field(renamed.get(name, name), table.schema.field(name).type) for name in kept]
    return Manifest(discovery, fields, renamed)


def _row_spans(table: pa.Table, path: str) -> list[Span | None]:
    """Each row's span from the `start_s` and `end_s` columns (None: the whole file, also without the columns)."""
    present = [name for name in SPAN_COLUMNS if name in table.column_names]
    if not present:
        return [None] * table.num_rows
    if len(present) == 1:
        raise ManifestError(f"{path}: a '{present[0]}' column needs its partner: give both start_s and end_s")
    spans: list[Span | None] = []
    for number, (start, end) in enumerate(zip(*(table.column(name).to_pylist() for name in SPAN_COLUMNS)), 1):
        cells = [None if cell is None or str(cell).strip() == "" else cell for cell in (start, end)]
        if cells == [None, None]:
            spans.append(None)
            continue
        try:
            spans.append(Span(float(cells[0]), float(cells[1])))   # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ManifestError(f"{path}: row {number}: start_s {start!r} and end_s {end!r} must be seconds, the "
                                f"start at or after 0 and before the end") from None
    return spans


def _object_facts(path: Path, row_number: int, url: str) -> storage.ObjectFacts | None:
    """The facts of a row's object (None: there is none, its row will say so)."""
    try:
        return storage.stat_url(url)
    except storage.StorageError as error:
        raise ManifestError(f"{path}: row {row_number}: {error}") from None
    except (OSError, ValueError) as error:
        raise ManifestError(f"{path}: row {row_number}: cannot read {storage.redact(url)}: "
                            f"{storage.redact_text(str(error))}") from None


def sibling_columns(discovery: Discovery, keep_columns: str, reserved: frozenset[str]) -> Manifest:
    """The items of WebDataset shards with their siblings' texts (by extension: `json`, `txt`, ...) kept as columns:
    "all" or comma-separated extensions. A kept extension named like an output column gets the prefix input_."""
    if not any(item.member is not None for item in discovery.items):
        raise ManifestError(Worded("{keep_columns} needs {manifest} (its columns) or WebDataset shards among the "
                                   "inputs (their sibling files)"))
    found = sorted({name for item in discovery.items for name in item.columns})
    wanted = found if keep_columns.strip() == "all" else [name.strip() for name in keep_columns.split(",")
                                                          if name.strip()]
    unknown = [name for name in wanted if name not in found]
    if unknown:
        raise ManifestError(Worded("{keep_columns}: no member of the shards has the sibling {unknown} (found: {found})",
                                   unknown=", ".join(unknown), found=", ".join(found) or "none"))
    renamed = {name: RENAMED_PREFIX + name for name in wanted if name in reserved}
    items = [replace(item, columns={renamed.get(name, name): item.columns.get(name) for name in wanted})
             for item in discovery.items]
    fields = [pa.field(renamed.get(name, name), pa.string()) for name in wanted]
    return Manifest(replace(discovery, items=items), fields, renamed)


def check_manifest_path(path: Path | str) -> None:
    """Answer a wrong --manifest at once, before anything is read or imported (an object's existence is checked
    when it is read)."""
    name = storage.url_name(str(path)) if storage.is_url(str(path)) else str(path)
    if PurePosixPath(name).suffix.lower() not in MANIFEST_SUFFIXES:
        raise ManifestError(Worded("{manifest} {path}: unknown kind; name it .csv, .tsv, .jsonl or .parquet",
                                   path=storage.redact(str(path))))
    if not storage.is_url(str(path)) and not Path(path).is_file():
        raise ManifestError(Worded("{manifest} {path}: no such file", path=path))


def _read_table(path: Path, shown: str) -> pa.Table:
    """The table in the file at `path`, of the kind `shown` (its name in messages) is named like."""
    suffix = PurePosixPath(storage.url_name(shown) if storage.is_url(shown) else shown).suffix.lower()
    try:
        if suffix in (".csv", ".tsv"):
            from pyarrow import csv

            # Every column as text: a path column of digits or a zip code keeps its leading zeros.
            return csv.read_csv(path, parse_options=_csv_options(suffix),
                                convert_options=csv.ConvertOptions(column_types=_all_text(path, suffix),
                                                                   strings_can_be_null=True))
        if suffix in (".jsonl", ".ndjson"):
            from pyarrow import json

            return json.read_json(path)
        import pyarrow.parquet as pq

        return pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise ManifestError(Worded("cannot read {manifest} {shown}: {error}", shown=shown,
                                   error=" ".join(str(error).split()))) from error


def _csv_options(suffix: str) -> Any:
    from pyarrow import csv

    return csv.ParseOptions(delimiter="\t" if suffix == ".tsv" else ",", newlines_in_values=True)


def _all_text(path: Path, suffix: str) -> dict[str, pa.DataType]:
    """Every column of a CSV or TSV manifest read as text."""
    from pyarrow import csv

    with csv.open_csv(path, parse_options=_csv_options(suffix)) as reader:
        return {name: pa.string() for name in reader.schema.names}


def _path_column(table: pa.Table, asked: str | None, path: Path) -> str:
    names = table.column_names
    if asked is not None:
        if asked not in names:
            raise ManifestError(Worded("{path_column} {asked!r} is not a column of {path} (columns: {names})",
                                       asked=asked, path=path, names=", ".join(names)))
        return asked
    for name in PATH_COLUMNS:
        if name in names:
            return name
    raise ManifestError(Worded("{path} has none of the columns {known}; name the column of file paths with "
                               "{path_column} (columns: {names})", path=path, known=", ".join(PATH_COLUMNS),
                               names=", ".join(names)))


def _kept_columns(table: pa.Table, asked: str | None, path: Path) -> list[str]:
    if not asked:
        return []
    names = table.column_names
    if asked.strip() == "all":  # the path column too: its original (relative) value is what users join on
        return [name for name in names if name not in (PROMPT_COLUMN, PROMPTS_COLUMN, *SPAN_COLUMNS)]
    wanted = [name.strip() for name in asked.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise ManifestError(Worded("{keep_columns}: {unknown} not in {path} (columns: {names})",
                                   unknown=", ".join(unknown), path=path, names=", ".join(names)))
    return list(dict.fromkeys(wanted))
