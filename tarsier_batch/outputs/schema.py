"""The output columns and how a result becomes a row."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from ..results import CaptionResult
from ..sources import MediaItem

# Key-value metadata of the final Parquet file.
PROVENANCE_KEY = "tarsier_batch"          # how the captions were made (includes the resume settings)
SUMMARY_KEY = "tarsier_batch_summary"     # counts and rates of the run that wrote the file

_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("path", pa.string()),
    ("key", pa.string()),
    ("media_type", pa.string()),
    ("caption", pa.string()),
    ("model", pa.string()),
    ("prompt", pa.string()),
    ("num_frames", pa.int32()),
    ("frame_indices", pa.list_(pa.int32())),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("duration_s", pa.float64()),
    ("decoder", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("generated_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("elapsed_s", pa.float64()),
    ("size_bytes", pa.int64()),
    ("mtime", pa.timestamp("us", tz="UTC")),
]
_SHA256_COLUMN = ("sha256", pa.string())
_TOKEN_IDS_COLUMN = ("generated_ids", pa.list_(pa.int32()))
_FROM_ITEM = frozenset({"size_bytes", "mtime"})
RESERVED_NAMES = frozenset(name for name, _ in _COLUMNS + [_SHA256_COLUMN, _TOKEN_IDS_COLUMN])


@dataclass(frozen=True)
class OutputColumns:
    """Which columns a run writes: the fixed ones, `sha256` when hashing, `generated_ids` when asked,
    then a manifest's kept columns."""

    with_token_ids: bool = False
    hashed: bool = False
    kept: tuple[pa.Field, ...] = field(default=())

    @classmethod
    def of_schema(cls, schema: pa.Schema) -> OutputColumns:
        """The columns of results written with `schema` (what `tarsier merge` writes back)."""
        fixed = {name for name, _ in _COLUMNS} | {_SHA256_COLUMN[0], _TOKEN_IDS_COLUMN[0]}
        return cls(_TOKEN_IDS_COLUMN[0] in schema.names, _SHA256_COLUMN[0] in schema.names,
                   tuple(field for field in schema if field.name not in fixed))

    def schema(self) -> pa.Schema:
        return pa.schema(_COLUMNS + ([_SHA256_COLUMN] if self.hashed else [])
                         + ([_TOKEN_IDS_COLUMN] if self.with_token_ids else []) + list(self.kept))

    def row(self, result: CaptionResult, item: MediaItem, model: str) -> dict[str, Any]:
        """The row of `result` for `item`, with the columns of `schema()`."""
        row = {name: getattr(result, name) for name, _ in _COLUMNS if name != "model" and name not in _FROM_ITEM}
        row["model"] = model
        row.update(self.item_values(item))
        if self.with_token_ids:
            row["generated_ids"] = result.generated_ids
        return row

    def item_values(self, item: MediaItem) -> dict[str, Any]:
        """The columns that come from the item, not the model: file facts and kept manifest columns.

        A row done by an earlier run gets them afresh, so a manifest's edited columns show.
        """
        facts = item.facts
        mtime = None if facts.mtime_ns is None else \
            datetime.fromtimestamp(facts.mtime_ns / 1e9, tz=timezone.utc)
        values: dict[str, Any] = {"size_bytes": facts.size_bytes, "mtime": mtime}
        if self.hashed:
            values["sha256"] = facts.sha256
        values.update({kept.name: item.columns.get(kept.name) for kept in self.kept})
        return values
