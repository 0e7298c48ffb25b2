"""`tarsier merge`: join the outputs of `--shard I/N` runs into the output one run would have written.

`merge_outputs(folder, out)` does all of it (what the command calls); `merge_shards(folder)` only reads and
merges. Each shard's output (a Parquet file, or a folder of WebDataset shards) records which shard it is, how
many inputs the whole run listed, and each row's place among them (`Shard.provenance`). Merging checks that the
outputs are one complete set made the same way (every shard once, the same inputs, the same settings and columns),
then interleaves the rows back into input order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import Worded, one_line
from ..inputs.sources import row_id_of
from .formats import WDS_META, WEBDATASET_SHARDS, OutputTarget, parquet_metadata
from .lock import OutputLock
from .remote import RemoteOutput, output_at
from .schema import OutputColumns
from .store import ResultStore

# Per-item counts of a run's summary: a merged run's are the shards' sums.
_SUMMED = ("total", "captioned", "failed", "already_done", "missing_kept", "missing_pruned", "left_for_later",
           "generated_tokens")


class MergeError(Exception):
    """The folder does not hold one complete, consistent set of shard outputs."""


@dataclass
class ShardOutput:
    path: Path
    table: pa.Table
    provenance: dict[str, Any]
    summary: dict[str, Any]

    @property
    def shard(self) -> dict[str, Any]:
        return self.provenance["shard"]

    @cached_property
    def columns(self) -> OutputColumns:
        return OutputColumns.of_schema(self.table.schema, self.provenance)

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """One per item, whichever layout the file has."""
        return self.columns.item_rows(self.table, self.columns.long)


@dataclass
class Merged:
    """The rows in input order, and the provenance and summary of the run the shards make up."""

    rows: list[dict[str, Any]]
    columns: OutputColumns
    provenance: dict[str, Any]
    summary: dict[str, Any]
    shards: int


@dataclass(frozen=True)
class MergeReport:
    """What `merge_outputs` wrote."""

    shards: int
    rows: int        # one per file (with --long, a file's questions are one)
    failed: int      # rows with an error
    written: str     # the output, as shown to the user (a URL without its signature)


def merge_outputs(folder: Path, out: str | Path | OutputTarget | RemoteOutput) -> MergeReport:
    """Merge the shard outputs in `folder` into `out` (a .parquet, .jsonl or .csv path or object store URL, or a
    folder of Parquet or WebDataset shards), under `out`'s lock, replacing it atomically: the output one run over
    all the inputs would have written, which a later run without a shard continues.

    Raises `MergeError` (not one complete, consistent set), `OutputError` (an output it cannot write),
    `OutputLockedError` (another run writes `out`), `OutputWriteError` or `OSError`; nothing is written then.
    """
    output = output_at(out) if isinstance(out, (str, Path)) else out
    remote = output if isinstance(output, RemoteOutput) else None
    target = remote.target if remote is not None else output
    assert isinstance(target, OutputTarget)
    target.check()
    if remote is None and target.path.resolve().parent == folder.resolve() and \
            (target.webdataset or target.path.suffix.lower() == ".parquet"):
        raise MergeError(f"{target.shown} is inside {folder}: a later merge would read it as a shard; "
                         f"write it elsewhere")
    merged = merge_shards(folder)
    if remote is None:
        target.path.parent.mkdir(parents=True, exist_ok=True)
    with remote.held() if remote is not None else OutputLock(target.path):
        ResultStore(target, merged.columns).commit(merged.rows, merged.provenance, merged.summary)
        if remote is not None:
            remote.publish()
    return MergeReport(merged.shards, len(merged.columns.file_rows(merged.rows)),
                       sum(row["error"] is not None for row in merged.rows), target.shown)


def merge_shards(folder: Path) -> Merged:
    """Read every shard output of `folder` (its `*.parquet` files, or its folders of WebDataset shards) and merge
    them; raises MergeError."""
    if not folder.is_dir():
        raise MergeError(f"{folder} is not a folder; give the folder holding the shards' outputs")
    found = sorted(path for path in folder.iterdir() if not path.name.startswith(".") and (
        path.suffix.lower() == ".parquet" and path.is_file() or (path / WDS_META).is_file()))
    if not found:
        raise MergeError(Worded("{folder} holds no shard outputs; write each shard with {shard} I/N {out} "
                                "{folder}/shard-I.parquet (or {out_dir} {folder}/shard-I {out_format} webdataset)",
                                folder=folder))
    if len({path.is_dir() for path in found}) > 1:
        raise MergeError(f"{folder} holds .parquet files and WebDataset folders: keep one run's shard outputs")
    outputs = [_read_shard(path) for path in found]
    _check_one_set(outputs)
    first = outputs[0]
    placed: list[tuple[bool, int, int, int, dict[str, Any]]] = []
    seen: dict[str, Path] = {}
    for output in outputs:
        for number, (row, position) in enumerate(zip(output.rows, output.shard["positions"])):
            if row_id_of(row) in seen:
                raise MergeError(f"{row_id_of(row)} has a row in both {seen[row_id_of(row)].name} and "
                                 f"{output.path.name}")
            seen[row_id_of(row)] = output.path
            # Rows kept from earlier runs (no position) go last, as a single run puts them.
            placed.append((position is None, position or 0, output.shard["index"], number, row))
    placed.sort(key=lambda entry: entry[:4])
    provenance = {name: value for name, value in first.provenance.items() if name != "shard"}
    provenance["settings"] = {**provenance.get("settings", {}), "shard": None}
    provenance["merged_shards"] = len(outputs)
    summaries = [output.summary for output in outputs]
    summary: dict[str, Any] = {name: sum(s.get(name, 0) for s in summaries) for name in _SUMMED}
    summary["skipped"] = max(s.get("skipped", 0) for s in summaries)   # every shard saw the whole input
    summary["complete"] = all(s.get("complete", False) for s in summaries)
    summary["wall_time_s"] = max(s.get("wall_time_s", 0.0) for s in summaries)
    return Merged([entry[4] for entry in placed], first.columns, provenance,
                  summary, len(outputs))


def _read_shard(path: Path) -> ShardOutput:
    try:
        if path.is_dir():
            table, provenance, summary = _read_webdataset(path)
        else:
            table = pq.read_table(path)
            provenance, summary = parquet_metadata(table.schema)
    except (OSError, ValueError, KeyError, pa.ArrowException) as error:
        raise MergeError(f"cannot read {path}: {one_line(error)}") from error
    shard = provenance.get("shard")
    if not shard:
        raise MergeError(Worded("{name} is not the output of a tarsier caption {shard} run; keep only the shards' "
                                "outputs in the folder", name=path.name))
    output = ShardOutput(path, table, provenance, summary)
    items = len(output.rows)
    if len(shard["positions"]) != items:
        raise MergeError(f"{path.name} was changed after tarsier wrote it ({items} items, "
                         f"{len(shard['positions'])} recorded)")
    return output


def _read_webdataset(folder: Path) -> tuple[pa.Table, dict[str, Any], dict[str, Any]]:
    """A WebDataset output's rows, typed by the columns its settings name (its JSON rows carry no types), and any
    other columns they hold (a manifest's kept columns) as they read."""
    target = OutputTarget(folder, webdataset=True)
    settings = WEBDATASET_SHARDS.meta(target)[0].get("settings") or {}
    columns = OutputColumns(with_token_ids=bool(settings.get("with_token_ids")), hashed=settings.get("key") == "sha256",
                            questions=tuple(settings.get("prompt_set") or ()))
    return WEBDATASET_SHARDS.read(target, columns.schema(), other_columns=True)


def _check_one_set(outputs: list[ShardOutput]) -> None:
    """Every shard of one N exactly once, over the same inputs, with the same settings and columns."""
    first = outputs[0]
    count = first.shard["count"]
    by_index: dict[int, Path] = {}
    for output in outputs:
        shard = output.shard
        if shard["count"] != count:
            raise MergeError(f"{first.path.name} is a shard of {count} but {output.path.name} of {shard['count']}")
        if shard["index"] in by_index:
            raise MergeError(f"shard {shard['index']}/{count} twice: {by_index[shard['index']].name} and "
                             f"{output.path.name}")
        by_index[shard["index"]] = output.path
        if shard["inputs"] != first.shard["inputs"]:
            raise MergeError(f"the shards saw different inputs ({first.path.name}: {first.shard['inputs']} items, "
                             f"{output.path.name}: {shard['inputs']}): the folder changed between their runs; "
                             f"run the older shards again (they resume) so that all see the same inputs")
        differences = _setting_differences(first.provenance.get("settings", {}),
                                           output.provenance.get("settings", {}))
        if differences:
            raise MergeError(f"{output.path.name} was made with other settings than {first.path.name} "
                             f"({'; '.join(differences)})")
        # Compared as the columns a run writes: a shard written by a version without a column that is always
        # written now (such as `warnings`) merges, its rows reading as null there.
        if output.columns != first.columns:
            raise MergeError(f"{output.path.name} has other columns than {first.path.name}")
    missing = [str(index) for index in range(count) if index not in by_index]
    if missing:
        raise MergeError(f"shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} of {count} "
                         f"{'are' if len(missing) > 1 else 'is'} missing from the folder")


def _setting_differences(one: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Settings both outputs record that differ (a shard with no items records only what its flags said)."""
    return [f"{name} {one[name]!r} there, {other[name]!r} here" for name in sorted(one.keys() & other.keys())
            if name != "shard" and one[name] != other[name]]
