"""The output columns and how a result becomes a row."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ..results import CaptionResult

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
]
_TOKEN_IDS_COLUMN = ("generated_ids", pa.list_(pa.int32()))


def output_schema(with_token_ids: bool) -> pa.Schema:
    """The output columns, in order; `generated_ids` only when asked for."""
    return pa.schema(_COLUMNS + ([_TOKEN_IDS_COLUMN] if with_token_ids else []))


def result_row(result: CaptionResult, model: str, with_token_ids: bool) -> dict[str, Any]:
    """The row of `result`, with the columns of `output_schema(with_token_ids)`."""
    row = {name: getattr(result, name) for name, _ in _COLUMNS if name != "model"}
    row["model"] = model
    if with_token_ids:
        row["generated_ids"] = result.generated_ids
    return row
