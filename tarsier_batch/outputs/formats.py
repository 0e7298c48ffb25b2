"""Result files on disk: Parquet, JSON Lines, CSV, a folder of Parquet shards, or WebDataset shards beside
the inputs' shards, written and read back.

Each kind of output is one `OutputFormat`: how a whole output is written and how it is read
back, so that any of them can be continued by a later run. A new format is one subclass, named
by its suffixes in `FORMATS`. Parquet carries the provenance in its Arrow schema metadata, so
`pyarrow.parquet.read_table`, pandas, DuckDB and `datasets` all see it. JSON Lines and CSV have
no place for it: a small `<out>.meta.json` beside the file holds it instead.
"""

from __future__ import annotations

import csv
import errno
import fnmatch
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import Worded
from ..inputs.tars import split_member_path, wds_key
from ..settings import SettingsError
from .schema import PROVENANCE_KEY, SUMMARY_KEY

if TYPE_CHECKING:
    from ..settings import RunSettings

ROWS_PER_GROUP = 4096          # a few MB per row group: big enough to scan fast, small enough for viewers
PARQUET_COMPRESSION = "zstd"
SHARD_PATTERN = "part-*.parquet"
META_SUFFIX = ".meta.json"
WDS_META = "tarsier.meta.json"   # a WebDataset output folder's provenance (tars have no place for it)


class OutputError(Exception):
    """`--out` cannot be used: a directory, an unknown suffix, or a file this tool did not write."""


# What to do when the output's folder refuses a write, by errno: the reason alone names no fix.
_NO_SPACE = "free space on its disk and run the same command again"
_NOT_ALLOWED = "make its folder writable, or write the output elsewhere"
_FIXES = {errno.ENOSPC: _NO_SPACE, errno.EDQUOT: _NO_SPACE, errno.EFBIG: _NO_SPACE,
          errno.EACCES: _NOT_ALLOWED, errno.EPERM: _NOT_ALLOWED, errno.EROFS: _NOT_ALLOWED,
          errno.ENOENT: "its folder cannot be made: write the output in a folder that exists",
          errno.ENOTDIR: "a part of its folder is a file: write the output in a folder"}


def what_to_do(error: OSError) -> str:
    """The fix for a write beside the output that failed with `error`."""
    return _FIXES.get(error.errno or 0, "check its folder and run the same command again")


@dataclass(frozen=True)
class OutputTarget:
    """Where the results go: one file (its format by suffix) or, with `shard_rows`, a folder of shards.

    `url` is the object store URL (redacted) whose local staging copy `path` is (`remote.RemoteOutput`):
    messages name the output by it, never by a cache folder the user did not give.
    """

    path: Path
    shard_rows: int | None = None
    url: str | None = None
    webdataset: bool = False   # a folder of WebDataset shards, one per input shard (`WebDatasetShards`)

    @classmethod
    def existing(cls, path: Path) -> OutputTarget:
        """The results at `path`: a folder of shards (Parquet or WebDataset) or one file."""
        if not path.is_dir():
            return cls(path)
        return cls(path, webdataset=True) if (path / WDS_META).exists() else cls(path, shard_rows=1)

    @property
    def is_folder(self) -> bool:
        """A folder (or prefix) of shards rather than one file."""
        return bool(self.shard_rows) or self.webdataset

    @property
    def kind(self) -> OutputFormat:
        """How this output is written and read back."""
        if self.webdataset:
            return WEBDATASET_SHARDS
        return PARQUET_SHARDS if self.shard_rows else FORMATS[self.path.suffix.lower()]

    @property
    def format(self) -> str:
        return self.kind.name

    @property
    def shown(self) -> str:
        """How messages name the output: its URL (redacted) when it goes to an object store, else its path."""
        return self.url or str(self.path)

    def shown_beside(self, name: str) -> str:
        """How messages name the file `name` beside the output (in its folder, or under its URL's prefix)."""
        if self.url is None:
            return str(self.path.parent / name)
        return f"{self.url.rstrip('/').rpartition('/')[0]}/{name}"

    def check(self) -> None:
        """Answer a wrong --out or --out-dir before any work."""
        if self.is_folder:
            if self.path.exists() and not self.path.is_dir():
                raise OutputError(Worded("{out_dir} {path} is a file; give a folder for the shards", path=self.path))
            strangers = [entry.name for entry in self.path.iterdir()
                         if not entry.name.startswith(".") and not self.kind.owns(entry.name)] \
                if self.path.is_dir() else []
            if strangers:
                raise OutputError(Worded("{out_dir} {path} holds other files ({names}); give an empty or new folder, "
                                         "or the folder of an earlier sharded run", path=self.path,
                                         names=", ".join(sorted(strangers)[:3])))
            return
        if self.path.is_dir():
            raise OutputError(Worded("{out} {path} is a directory; give a file name such as {example}, or use "
                                     "{out_dir} with {shard_rows}", path=self.path,
                                     example=self.path / "results.parquet"))
        if self.path.suffix.lower() not in FORMATS:
            raise OutputError(Worded("{out} {shown}: unknown format {suffix!r}; name it .parquet, .jsonl or .csv, or "
                                     "use '{out} -' for JSON Lines on stdout", shown=self.shown,
                                     suffix=self.path.suffix or "(no suffix)"))

    def unwritable(self, error: OSError) -> OutputError:
        """The error of an output whose folder refuses a write: the output as given, the reason and the fix (never
        the name of a file of ours beside it)."""
        return OutputError(Worded("cannot write {setting} {shown}: {reason}; {fix}",
                                  setting=Worded("{out_dir}" if self.is_folder else "{out}"), shown=self.shown,
                                  reason=error.strerror or str(error), fix=what_to_do(error)))

    def check_settings(self, settings: RunSettings) -> None:
        """Refuse, before any work, settings this output cannot honour."""
        shard = settings.shard
        if shard is not None and (self.shard_rows or self.format not in ("parquet", "webdataset")):
            raise SettingsError(f"{{shard}} writes one Parquet file (or WebDataset folder) per shard for 'tarsier "
                                f"merge': give {{out}} shard-{shard.index}.parquet (or {{out_dir}} shard-{shard.index} "
                                f"{{out_format}} webdataset)")
        if self.webdataset and (settings.long or settings.segments.mode != "whole"):
            raise SettingsError("{out_format} webdataset writes one sample per member: not with "
                                + ("{long}" if settings.long else "{segments}"))

    def exists(self) -> bool:
        return bool(self.shards()) if self.is_folder else self.path.exists()

    def shards(self) -> list[Path]:
        """A folder output's files, in the order they are written (a WebDataset folder's provenance first)."""
        if not self.path.is_dir():
            return []
        return sorted((entry for entry in self.path.iterdir() if self.kind.owns(entry.name)),
                      key=lambda entry: (entry.name != WDS_META, entry.name))

    @property
    def meta_path(self) -> Path:
        """Where JSON Lines and CSV results keep their provenance."""
        return self.path.with_name(self.path.name + META_SUFFIX)


def with_metadata(schema: pa.Schema, provenance: dict[str, Any], summary: dict[str, Any]) -> pa.Schema:
    return schema.with_metadata({PROVENANCE_KEY: json.dumps(provenance), SUMMARY_KEY: json.dumps(summary)})


def write_parquet(path: Path, table: pa.Table) -> None:
    """One Parquet file, zstd-compressed, its schema metadata (provenance) kept."""
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP, compression=PARQUET_COMPRESSION)


def json_line(row: dict[str, Any]) -> str:
    """One row as a line of JSON (times as ISO 8601, text as UTF-8)."""
    return json.dumps(row, ensure_ascii=False, default=_json_value) + "\n"


def write_csv(handle: TextIO, table: pa.Table) -> None:
    """A header and one line per row; lists are JSON text, missing values empty."""
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(table.column_names)
    for row in table.to_pylist():
        writer.writerow([_csv_cell(value) for value in row.values()])


def read_results(target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
    """The rows, provenance and run summary of earlier results; `schema` types text formats' columns.

    Raises ValueError (or an Arrow/OS error) when the file is not results of this tool.
    """
    return target.kind.read(target, schema)


def meta_text(provenance: dict[str, Any], summary: dict[str, Any]) -> str:
    return json.dumps({PROVENANCE_KEY: provenance, SUMMARY_KEY: summary}, indent=2, ensure_ascii=False) + "\n"


def parquet_metadata(schema: pa.Schema) -> tuple[dict[str, Any], dict[str, Any]]:
    """Provenance and summary from a Parquet file's schema metadata ({} where absent)."""
    metadata = schema.metadata or {}
    return (json.loads(metadata.get(PROVENANCE_KEY.encode(), b"{}")),
            json.loads(metadata.get(SUMMARY_KEY.encode(), b"{}")))


# Writes one file: through a temporary name, then renamed over it (`store.write_atomically`).
Replace = Callable[[Path, Callable[[Path], None]], None]


class OutputFormat:
    """One kind of output: how a whole output is written, and read back to be continued."""

    name: ClassVar[str]

    def owns(self, name: str) -> bool:
        """Whether a file of this name in a folder output is part of the output (else it is a stranger)."""
        return False

    def check_rows(self, paths: list[str]) -> None:
        """Refuse, before any work, inputs whose rows this format cannot place (any, but for `WebDatasetShards`)."""

    def write(self, target: OutputTarget, table: pa.Table, provenance: dict[str, Any], summary: dict[str, Any],
              replace: Replace) -> None:
        """Write `table` (its schema carries `provenance` and `summary`) as the whole output, each file whole."""
        raise NotImplementedError

    def read(self, target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
        """The rows, provenance and summary; `schema` types formats that do not carry types."""
        raise NotImplementedError


class ParquetFile(OutputFormat):
    name = "parquet"

    def write(self, target: OutputTarget, table: pa.Table, provenance: dict[str, Any], summary: dict[str, Any],
              replace: Replace) -> None:
        replace(target.path, lambda path: write_parquet(path, table))

    def read(self, target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
        table = pq.read_table(target.path)
        return (table, *parquet_metadata(table.schema))


class ParquetShards(OutputFormat):
    """A folder of `shard_rows`-row Parquet files, `part-00000.parquet` on, each carrying the provenance."""

    name = "parquet"

    def owns(self, name: str) -> bool:
        return fnmatch.fnmatch(name, SHARD_PATTERN)

    def write(self, target: OutputTarget, table: pa.Table, provenance: dict[str, Any], summary: dict[str, Any],
              replace: Replace) -> None:
        target.path.mkdir(parents=True, exist_ok=True)
        size = target.shard_rows or 1
        names = [f"part-{index:05d}.parquet" for index in range(max(1, -(-table.num_rows // size)))]
        for index, name in enumerate(names):
            shard = table.slice(index * size, size)
            replace(target.path / name, lambda path: write_parquet(path, shard))
        for stale in target.shards():   # beyond the new count
            if stale.name not in names:
                stale.unlink(missing_ok=True)

    def read(self, target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
        tables = [pq.read_table(shard) for shard in target.shards()]
        return (pa.concat_tables(tables, promote_options="permissive"), *parquet_metadata(tables[-1].schema))


class TextWithMeta(OutputFormat):
    """A text format with no place for the provenance: it goes into `<out>.meta.json` beside the file."""

    def write(self, target: OutputTarget, table: pa.Table, provenance: dict[str, Any], summary: dict[str, Any],
              replace: Replace) -> None:
        # The provenance first: a crash between the two leaves the old rows with the new settings,
        # which the next run refuses to mix (never the other way round).
        replace(target.meta_path, lambda path: path.write_text(meta_text(provenance, summary), encoding="utf-8"))

        def write_rows(path: Path) -> None:
            with open(path, "w", encoding="utf-8", newline="") as handle:
                self.write_rows(handle, table)
        replace(target.path, write_rows)

    def read(self, target: OutputTarget, schema: pa.Schema) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
        if not target.meta_path.exists():
            raise ValueError(f"{target.meta_path.name} is missing beside it")
        meta = json.loads(target.meta_path.read_text(encoding="utf-8"))
        return self.read_rows(target.path, schema), meta[PROVENANCE_KEY], meta.get(SUMMARY_KEY, {})

    def write_rows(self, handle: TextIO, table: pa.Table) -> None:
        raise NotImplementedError

    def read_rows(self, path: Path, schema: pa.Schema) -> pa.Table:
        raise NotImplementedError


class JsonLinesFile(TextWithMeta):
    name = "jsonl"

    def write_rows(self, handle: TextIO, table: pa.Table) -> None:
        for row in table.to_pylist():
            handle.write(json_line(row))

    def read_rows(self, path: Path, schema: pa.Schema) -> pa.Table:
        return _read_jsonl(path, schema)


class CsvFile(TextWithMeta):
    name = "csv"

    def write_rows(self, handle: TextIO, table: pa.Table) -> None:
        write_csv(handle, table)

    def read_rows(self, path: Path, schema: pa.Schema) -> pa.Table:
        return _read_csv(path, schema)


class WebDatasetShards(OutputFormat):
    """A folder of tar shards, one per input shard and named like it, in which each member's row is `KEY.json`
    and its caption `KEY.txt` (KEY: the member's WebDataset key), in input order: read beside the media shards,
    key by key, they give each sample its caption. The provenance is `tarsier.meta.json` in the folder.

    Every row must come from a tar member, one row per member (`check_rows`). Each shard is replaced whole
    (`replace`), so a reader never sees half of one; shards of another run's inputs are left alone, and a
    shard whose input shard no longer has rows is removed.
    """

    name = "webdataset"

    def owns(self, name: str) -> bool:
        return name == WDS_META or name.endswith(".tar")

    def write(self, target: OutputTarget, table: pa.Table, provenance: dict[str, Any], summary: dict[str, Any],
              replace: Replace) -> None:
        rows = table.to_pylist()
        by_shard: dict[str, list[int]] = {}
        for number, row in enumerate(rows):   # a row from no shard is refused before anything is written
            by_shard.setdefault(_shard_of(row["path"]), []).append(number)
        target.path.mkdir(parents=True, exist_ok=True)
        names = shard_names(list(by_shard))
        # In the order `read` reads them back (by name), so that a `--shard` run's row positions, recorded in
        # the rows' order, follow the rows as `tarsier merge` reads them.
        order = sorted(by_shard, key=names.__getitem__)
        if provenance.get("shard"):
            positions = provenance["shard"]["positions"]
            provenance = {**provenance, "shard": {**provenance["shard"], "positions": [
                positions[number] for shard in order for number in by_shard[shard]]}}
        # The provenance first: a crash between leaves the old shards with the new settings, which the next run
        # refuses to mix (never the other way round).
        replace(target.path / WDS_META, lambda path: path.write_text(meta_text(provenance, summary), encoding="utf-8"))
        for shard in order:
            replace(target.path / names[shard],
                    lambda path, shard=shard: _write_tar(path, [rows[number] for number in by_shard[shard]]))
        for stale in target.shards():
            if stale.name != WDS_META and stale.name not in names.values():
                stale.unlink(missing_ok=True)

    def read(self, target: OutputTarget, schema: pa.Schema,
             other_columns: bool = False) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
        """`other_columns`: keep the rows' values that `schema` does not name too, typed as they read (a
        manifest's kept columns, for `tarsier merge`, which knows the run's settings but not its manifest)."""
        provenance, summary = self.meta(target)
        lines = io.BytesIO()
        for shard in target.shards():
            if shard.name == WDS_META:
                continue
            with tarfile.open(shard, "r:") as tar:
                for member in tar:
                    if member.isfile() and member.name.endswith(".json"):
                        extracted = tar.extractfile(member)
                        assert extracted is not None   # a regular file
                        lines.write(extracted.read().rstrip(b"\n") + b"\n")
        table = _parse_jsonl(io.BytesIO(lines.getvalue()), schema, other_columns) if lines.tell() \
            else schema.empty_table()
        return table, provenance, summary

    def meta(self, target: OutputTarget) -> tuple[dict[str, Any], dict[str, Any]]:
        """The provenance and run summary of the output in `target`."""
        meta_path = target.path / WDS_META
        if not meta_path.exists():
            raise ValueError(f"{WDS_META} is missing in it")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        return meta[PROVENANCE_KEY], meta.get(SUMMARY_KEY, {})

    def check_rows(self, paths: list[str]) -> None:
        """Refuse, before any work, inputs whose rows this format cannot place: a row not from a tar member, or
        two members of one shard with the same WebDataset key (their captions would share a sample)."""
        seen: dict[tuple[str, str], str] = {}
        for path in paths:
            split = split_member_path(path)
            if split is None:
                raise OutputError(Worded("{out_format} webdataset writes captions beside WebDataset shards: {path} is "
                                         "not a member of a .tar shard", path=path))
            shard, member = split
            key = (shard, _sample_key(member))
            if key in seen and seen[key] != member:
                raise OutputError(Worded("{out_format} webdataset: {tar} holds {seen} and {member}, one WebDataset "
                                         "sample ({sample}); their captions cannot both be {sample}.json",
                                         tar=shard, seen=seen[key], member=member, sample=key[1]))
            seen[key] = member


def shard_names(shards: list[str]) -> dict[str, str]:
    """Each input shard's output shard name: its own file name, or, where two shards share one (a/x.tar and
    b/x.tar), that name with a digest of the whole path, so that each stays the same from run to run."""
    base = {shard: shard.rstrip("/").rpartition("/")[2] for shard in shards}
    taken = list(base.values())
    return {shard: name if taken.count(name) == 1 else
            f"{name[:-4]}-{hashlib.sha256(shard.encode()).hexdigest()[:8]}.tar" for shard, name in base.items()}


def _shard_of(path: str) -> str:
    split = split_member_path(path)
    if split is None:   # the run checked its inputs (`check_rows`): an earlier output of other inputs
        raise OutputError(Worded("{out_format} webdataset: the row of {path} comes from no .tar shard", path=path))
    return split[0]


def _sample_key(member: str) -> str:
    named = wds_key(member)
    return named[0] if named is not None else member


def _write_tar(path: Path, rows: list[dict[str, Any]]) -> None:
    """One output shard: `KEY.json` (the row) and `KEY.txt` (its caption, where there is one) per member."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for row in rows:
            key = _sample_key(split_member_path(row["path"])[1])   # type: ignore[index]
            _add(tar, f"{key}.json", json_line(row).encode())
            if row.get("caption") is not None:
                _add(tar, f"{key}.txt", row["caption"].encode())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


PARQUET_SHARDS = ParquetShards()
WEBDATASET_SHARDS = WebDatasetShards()
FORMATS: dict[str, OutputFormat] = {".parquet": ParquetFile(), ".jsonl": JsonLinesFile(), ".ndjson": JsonLinesFile(),
                                    ".csv": CsvFile()}


def _read_jsonl(path: Path, schema: pa.Schema) -> pa.Table:
    """A JSON Lines file, read by Arrow from the file (not all in memory first)."""
    return _parse_jsonl(path, schema) if path.stat().st_size else schema.empty_table()


def _parse_jsonl(source: Path | BinaryIO, schema: pa.Schema, other_columns: bool = False) -> pa.Table:
    """Rows of JSON, one a line (at least one), typed by `schema` (and fields it lacks inferred, or dropped)."""
    from pyarrow import json as arrow_json

    options = arrow_json.ParseOptions(explicit_schema=schema,
                                      unexpected_field_behavior="infer" if other_columns else "ignore")
    return arrow_json.read_json(source, parse_options=options)


def _read_csv(path: Path, schema: pa.Schema) -> pa.Table:
    from pyarrow import csv as arrow_csv

    text_types = {field.name: pa.string() if _is_list(field.type) else field.type for field in schema}
    parse = arrow_csv.ParseOptions(newlines_in_values=True)   # captions may span lines
    header = arrow_csv.open_csv(path, parse_options=parse).schema.names
    options = arrow_csv.ConvertOptions(column_types={name: kind for name, kind in text_types.items() if name in header},
                                       strings_can_be_null=True,
                                       include_columns=[n for n in schema.names if n in header])
    table = arrow_csv.read_csv(path, parse_options=parse, convert_options=options)
    for field in schema:
        if _is_list(field.type) and field.name in table.column_names:
            values = [None if text is None else json.loads(text) for text in table.column(field.name).to_pylist()]
            table = table.set_column(table.column_names.index(field.name), field.name, pa.array(values, field.type))
    return table


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_struct(kind)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False, default=_json_value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value
