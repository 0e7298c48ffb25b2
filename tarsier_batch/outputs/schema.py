"""The output columns and how a result becomes a row."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from ..errors import UNKNOWN
from ..inputs.prompt_sets import ANSWER_SUFFIXES, ROW_COLUMNS, TOKEN_IDS_SUFFIX
from ..inputs.sources import MediaItem, row_id_of
from .results import Answer, CaptionResult

# Key-value metadata of the final Parquet file.
PROVENANCE_KEY = "tarsier_batch"          # how the captions were made (includes the resume settings)
LAYOUT_KEY = "layout"                     # in the provenance: "long" for a row per (item, question) (`--long`)
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
    ("error_kind", pa.string()),   # one of errors.KINDS, null on success
    ("warnings", pa.list_(pa.string())),   # of media.WARNING_KINDS, null when decoding met no damage
    ("elapsed_s", pa.float64()),
    ("size_bytes", pa.int64()),
    ("mtime", pa.timestamp("us", tz="UTC")),
]
_SHA256_COLUMN = ("sha256", pa.string())
# A segment's (a stretch of a video, its own row): its number among the file's segments, its span, and how many
# segments its file was cut into (so that a run continuing the output knows a file's rows whole without opening it).
_SPAN_COLUMNS = [("segment", pa.int32()), ("start_s", pa.float64()), ("end_s", pa.float64()),
                 ("num_segments", pa.int32())]
# The long layout's (`--long`): which question of the set a row answers.
_QUESTION_COLUMN = ("question", pa.string())
_TOKEN_IDS_COLUMN = ("generated_ids", pa.list_(pa.int32()))
_FROM_ITEM = frozenset({"size_bytes", "mtime"})
_MEDIA_FACTS = ("num_frames", "frame_indices", "width", "height", "duration_s", "decoder", "warnings")
RESERVED_NAMES = frozenset(name for name, _ in _COLUMNS + _SPAN_COLUMNS + [_SHA256_COLUMN, _TOKEN_IDS_COLUMN,
                                                                           _QUESTION_COLUMN])
# With a prompt set, each question's columns take the place of these (its answer, in `caption`'s place).
_ANSWER_COLUMNS = ("caption", "prompt", "prompt_tokens", "generated_tokens", "finish_reason")
_ANSWER_TYPES = dict(zip(("",) + ANSWER_SUFFIXES, (pa.string(), pa.string(), pa.int32(), pa.int32(), pa.string())))
assert ROW_COLUMNS == RESERVED_NAMES - set(_ANSWER_COLUMNS) - {_TOKEN_IDS_COLUMN[0]}, "prompt_sets.ROW_COLUMNS"


@dataclass(frozen=True)
class OutputColumns:
    """Which columns a run writes: the fixed ones (with a prompt set, each question's in place of the caption's),
    `sha256` when hashing, `generated_ids` when asked, then a manifest's kept columns."""

    with_token_ids: bool = False
    hashed: bool = False
    kept: tuple[pa.Field, ...] = field(default=())
    questions: tuple[str, ...] = ()   # a prompt set's names, in its order
    # The output file holds a row per (item, question), with the single prompt's columns and `question`
    # (`--long`). Rows in memory and in part files stay one per item: only the file's layout differs.
    long: bool = False
    spans: bool = False   # rows of segments: `segment`, `start_s` and `end_s` after `key`

    @classmethod
    def of_schema(cls, schema: pa.Schema, provenance: dict[str, Any]) -> OutputColumns:
        """The columns of results written with `schema` and `provenance` (what `tarsier merge` writes back); the
        long layout's questions are not in its schema but in the provenance's settings."""
        if is_long(provenance):
            single = cls.of_schema(schema.remove(schema.get_field_index(_QUESTION_COLUMN[0])), {})
            questions = tuple((provenance.get("settings") or {}).get("prompt_set") or ())
            return replace(single, questions=questions, long=True)
        names = set(schema.names)
        questions = () if "finish_reason" in names else \
            tuple(name for name in schema.names if name + "_finish_reason" in names)
        fixed = {name for name, _ in _COLUMNS + _SPAN_COLUMNS} | {_SHA256_COLUMN[0], _TOKEN_IDS_COLUMN[0]} | \
            {column for question in questions for column in _question_columns(question, True)}
        return cls(_TOKEN_IDS_COLUMN[0] in names or any(q + TOKEN_IDS_SUFFIX in names for q in questions),
                   _SHA256_COLUMN[0] in names, tuple(field for field in schema if field.name not in fixed), questions,
                   spans=_SPAN_COLUMNS[1][0] in names)

    def schema(self) -> pa.Schema:
        columns: list[tuple[str, pa.DataType]] = []
        for name, kind in _COLUMNS:
            if not self.questions or name not in _ANSWER_COLUMNS:
                columns.append((name, kind))
            if name == "key" and self.spans:
                columns += _SPAN_COLUMNS
            elif name == "caption":
                columns += [pair for question in self.questions
                            for pair in _question_columns(question, self.with_token_ids).items()]
        token_ids = [_TOKEN_IDS_COLUMN] if self.with_token_ids and not self.questions else []
        return pa.schema(columns + ([_SHA256_COLUMN] if self.hashed else []) + token_ids + list(self.kept))

    def file_schema(self) -> pa.Schema:
        """The output file's columns: `schema()`, or in the long layout the single prompt's plus `question`."""
        if not self.long:
            return self.schema()
        single = replace(self, questions=(), long=False).schema()
        return single.insert(single.get_field_index("media_type") + 1, pa.field(*_QUESTION_COLUMN))

    def read_schema(self) -> pa.Schema:
        """What to read an earlier output with, whichever layout it has (text formats keep only these columns)."""
        wide = self.schema()
        return pa.schema(list(wide) + [column for column in replace(self, long=True).file_schema()
                                       if column.name not in wide.names])

    def file_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`rows` (one per item) as the output file holds them."""
        return [answer for row in rows for answer in self._long_rows(row)] if self.long else rows

    def item_rows(self, table: pa.Table, long: bool) -> list[dict[str, Any]]:
        """The rows of an output file read with `read_schema()`, one per item: as they are (without the other
        layout's columns, which text formats read as empty), or joined from the `long` layout's rows per
        question (its error is the one its failed rows carry). An error row of a version without `error_kind`
        gets the kind `unknown`: what failed is not derived again from its message."""
        wide = self.schema().names
        if not long:
            rows = table.drop_columns([name for name in self.read_schema().names
                                       if name not in wide and name in table.column_names]).to_pylist()
            return [_with_error_kind(row) for row in rows]
        single = _single_answer_columns(self.with_token_ids)
        items: dict[str, dict[str, Any]] = {}
        for row in table.to_pylist():
            question = row.pop(_QUESTION_COLUMN[0])
            answer = [row.pop(name, None) for name in single]
            item = items.get(row_id_of(row))
            if item is None:
                item = items[row_id_of(row)] = {**row, **{column: None for name in self.questions
                                                       for column in _question_columns(name, self.with_token_ids)}}
            if item["error"] is None and row["error"] is not None:
                item["error"], item["error_kind"] = row["error"], row.get("error_kind")
            if question in self.questions and answer[single.index("finish_reason")] is not None:
                item.update(zip(_question_columns(question, self.with_token_ids), answer))
        return [_with_error_kind(item) for item in items.values()]

    def _long_rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """An item's row as one row per question it was asked (answered, or failed: finish reason "error"). A
        failed question's row carries the item's error, which says why."""
        answer_columns = {column for question in self.questions
                          for column in _question_columns(question, self.with_token_ids)}
        common = {name: value for name, value in row.items() if name not in answer_columns}
        rows = []
        for question in self.questions:
            values = dict(zip(_single_answer_columns(self.with_token_ids),
                              (row.get(column) for column in _question_columns(question, self.with_token_ids))))
            if values["finish_reason"] is not None:
                failed = values["finish_reason"] == "error"
                rows.append({**common, _QUESTION_COLUMN[0]: question, **values,
                             "error": common.get("error") if failed else None,
                             "error_kind": common.get("error_kind") if failed else None})
        return rows

    def row(self, result: CaptionResult, item: MediaItem, model: str,
            earlier: dict[str, Any] | None = None) -> dict[str, Any]:
        """The row of `result` for `item`, with the columns of `schema()`. With a prompt set, the questions
        `result` did not ask keep the answers of `earlier` (the item's stored row)."""
        row = {name: getattr(result, name) for name, _ in _COLUMNS
               if name != "model" and name not in _FROM_ITEM and not (self.questions and name in _ANSWER_COLUMNS)}
        row["model"] = model
        row.update(self.item_values(item))
        if self.with_token_ids and not self.questions:
            row["generated_ids"] = result.generated_ids
        if self.questions and earlier is not None and result.num_frames is None:   # decoding failed this time
            row.update({name: earlier.get(name) for name in _MEDIA_FACTS})   # what the earlier answers were made of
        asked = item.questions if item.questions is not None else self.questions if item.prompt_set is None \
            else tuple(question.name for question in item.prompt_set)
        for question in self.questions:
            answer = result.answers.get(question)
            columns = _question_columns(question, self.with_token_ids)
            if answer is not None:
                row.update(zip(columns, _answer_values(answer)))
            elif (earlier or {}).get(question + "_finish_reason") is not None or question not in asked:
                row.update({column: (earlier or {}).get(column) for column in columns})
            else:   # asked, but the item failed before any answer (its media did not decode)
                row.update({column: "error" if column == question + "_finish_reason" else None for column in columns})
        return row

    def item_values(self, item: MediaItem) -> dict[str, Any]:
        """The columns that come from the item, not the model: file facts and kept manifest columns.

        A row done by an earlier run gets them afresh, so a manifest's edited columns show.
        """
        facts = item.facts
        mtime = None if facts.mtime_ns is None else \
            datetime.fromtimestamp(facts.mtime_ns / 1e9, tz=timezone.utc)
        values: dict[str, Any] = {"size_bytes": facts.size_bytes, "mtime": mtime}
        if self.spans:
            span = item.span
            values.update(segment=item.segment, start_s=None if span is None else span.start_s,
                          end_s=None if span is None else span.end_s, num_segments=item.num_segments)
        if self.hashed:
            values["sha256"] = facts.sha256
        values.update({kept.name: item.columns.get(kept.name) for kept in self.kept})
        return values


def is_long(provenance: dict[str, Any]) -> bool:
    """Was the output of `provenance` written in the long layout? (Told by the provenance, not by a column: a kept
    manifest column may be named like the layout's.)"""
    return provenance.get(LAYOUT_KEY) == "long"


def with_layout(provenance: dict[str, Any], long: bool) -> dict[str, Any]:
    """`provenance` recording the layout the output is written in."""
    return {**{name: value for name, value in provenance.items() if name != LAYOUT_KEY},
            **({LAYOUT_KEY: "long"} if long else {})}


def _with_error_kind(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its `error_kind`, `unknown` for an error row written before the column existed."""
    kind = row.get("error_kind")
    return {**row, "error_kind": kind if kind is not None or row["error"] is None else UNKNOWN}


def _question_columns(question: str, with_token_ids: bool) -> dict[str, pa.DataType]:
    """A prompt set question's columns: its answer, its prompt, token counts, finish reason (and token ids)."""
    columns = {question + suffix: kind for suffix, kind in _ANSWER_TYPES.items()}
    if with_token_ids:
        columns[question + TOKEN_IDS_SUFFIX] = pa.list_(pa.int32())
    return columns


def _single_answer_columns(with_token_ids: bool) -> list[str]:
    """The single prompt's answer columns, in the order of a question's (`_question_columns`)."""
    return list(_ANSWER_COLUMNS) + ([_TOKEN_IDS_COLUMN[0]] if with_token_ids else [])


def _answer_values(answer: Answer) -> list[Any]:
    """In `_question_columns`' order."""
    return [answer.caption, answer.prompt, answer.prompt_tokens, answer.generated_tokens, answer.finish_reason,
            answer.generated_ids]
