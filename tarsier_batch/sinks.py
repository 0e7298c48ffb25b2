"""Write results to Parquet so that a reader never sees a half-written file."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from .api import CaptionResult

PROVENANCE_KEY = "tarsier_batch"
SUMMARY_KEY = "tarsier_batch_summary"
ROWS_PER_GROUP = 256

_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("path", pa.string()),
    ("media_type", pa.string()),
    ("caption", pa.string()),
    ("model", pa.string()),
    ("prompt", pa.string()),
    ("num_frames", pa.int32()),
    ("frame_indices", pa.list_(pa.int32())),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("duration_s", pa.float64()),
    ("prompt_tokens", pa.int32()),
    ("generated_tokens", pa.int32()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("elapsed_s", pa.float64()),
]
_TOKEN_IDS_COLUMN = ("generated_ids", pa.list_(pa.int32()))


class OutputExistsError(Exception):
    """The output file exists and overwriting was not asked for."""


def output_schema(with_token_ids: bool) -> pa.Schema:
    """The output columns, in order; `generated_ids` only when asked for."""
    return pa.schema(_COLUMNS + ([_TOKEN_IDS_COLUMN] if with_token_ids else []))


def check_output_path(out: Path, overwrite: bool) -> None:
    """Fail before any work if `out` exists (without `overwrite`) or is a directory."""
    if out.is_dir():
        raise OutputExistsError(f"--out {out} is a directory; give a file name such as {out / 'results.parquet'}")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass --overwrite to replace it")


class ParquetSink:
    """Rows go to a temporary file beside `out`, which replaces `out` only when the run completes.

    If the run stops early (an exception, Ctrl-C, SIGTERM), the rows finished so far are kept in
    a valid Parquet file `<out>.partial` and `out` is left untouched. The run's provenance and
    totals are stored as key-value metadata when the file is closed.
    """

    def __init__(self, out: Path, model: str, with_token_ids: bool, overwrite: bool = False):
        check_output_path(out, overwrite)
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphaned_temporaries(out)
        self.out = out
        self.partial = out.with_name(out.name + ".partial")
        self.model = model
        self.with_token_ids = with_token_ids
        self.schema = output_schema(with_token_ids)
        self.provenance: dict[str, Any] | None = None
        self._temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(str(self._temporary), self.schema)
        self._buffer: list[dict[str, Any]] = []
        self.rows_written = 0

    def write(self, result: CaptionResult) -> None:
        row = {name: getattr(result, name) for name, _ in _COLUMNS if name != "model"}
        row["model"] = self.model
        if self.with_token_ids:
            row["generated_ids"] = result.generated_ids
        self._buffer.append(row)
        if len(self._buffer) >= ROWS_PER_GROUP:
            self._flush()

    def commit(self, summary: dict[str, Any]) -> Path:
        """Finish the file and move it to `out` atomically."""
        self._close(summary)
        os.replace(self._temporary, self.out)
        return self.out

    def abort(self, summary: dict[str, Any]) -> Path | None:
        """Keep finished rows in `<out>.partial` (returned), or remove the file if there are none."""
        try:
            self._flush()
        except (pa.ArrowException, ValueError, UnicodeError):
            self._buffer = []  # a row that cannot be written must not cost the rows already written
        self._close(summary)
        if self.rows_written == 0:
            self._temporary.unlink(missing_ok=True)
            return None
        os.replace(self._temporary, self.partial)
        return self.partial

    def __enter__(self) -> ParquetSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._writer is not None:  # neither committed nor aborted: the run stopped early
            self.abort({"complete": False, "stopped_by": kind.__name__ if kind else "unknown"})

    def _flush(self) -> None:
        if self._buffer:
            assert self._writer is not None
            self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema))
            self.rows_written += len(self._buffer)
            self._buffer = []

    def _close(self, summary: dict[str, Any]) -> None:
        assert self._writer is not None
        self._flush()
        metadata = {SUMMARY_KEY: json.dumps(summary)}
        if self.provenance is not None:
            metadata[PROVENANCE_KEY] = json.dumps(self.provenance)
        self._writer.add_key_value_metadata(metadata)
        self._writer.close()
        self._writer = None
        with open(self._temporary, "rb") as written:
            os.fsync(written.fileno())


def _remove_orphaned_temporaries(out: Path) -> None:
    """Delete temporary files that runs killed outright (SIGKILL, power loss) left beside `out`."""
    for leftover in out.parent.glob(f".{glob.escape(out.name)}.*.tmp"):
        pid = leftover.name.removeprefix(f".{out.name}.").removesuffix(".tmp")
        if pid.isdigit() and not _process_alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
