"""Prompt sets: several named questions asked of every item, each answer in its own columns.

A set comes from repeated `--ask NAME=TEXT` or from a `--prompts` file (TOML or JSON):

    caption = "Describe the video in detail."
    objects = { text = "List the objects that appear.", max_new_tokens = 64 }

The engine prefills what the questions share (the item's frames) once and forks it for each
question (`Engine.add(prefix_source=...)`); each answer equals the one a run asking that question
alone (`--prompt TEXT`) gives. An answer is identified by (item key, name, text): adding a question
to a set asks only it of the items done earlier, changing a question's text asks only it again.

No torch or pyarrow here: the CLI checks a set before importing anything heavy.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

NAME = re.compile(r"[a-z][a-z0-9_]*")
# Per question, the columns after its answer column (`objects`, `objects_prompt`, ...).
ANSWER_SUFFIXES = ("_prompt", "_prompt_tokens", "_generated_tokens", "_finish_reason")
TOKEN_IDS_SUFFIX = "_generated_ids"
# The row's own columns with a set (outputs.schema asserts it): a name must not take one of them.
ROW_COLUMNS = frozenset({"path", "key", "segment", "start_s", "end_s", "num_segments", "media_type", "model",
                         "num_frames", "frame_indices", "width", "height", "duration_s", "decoder", "error",
                         "error_kind", "warnings", "elapsed_s", "size_bytes", "mtime", "sha256", "question"})
# The single prompt's columns, which a set replaces: not names of questions (readers tell the two apart by
# them), except `caption`, the natural name of a set's caption.
SINGLE_PROMPT_COLUMNS = frozenset({"prompt", "prompt_tokens", "generated_tokens", "finish_reason", "generated_ids"})


class PromptSetError(ValueError):
    """A prompt set that cannot be used; the message names the question or the file."""


@dataclass(frozen=True)
class Question:
    """One named instruction of a set; `max_new_tokens` None: the run's."""

    name: str
    text: str
    max_new_tokens: int | None = None

    def columns(self, with_token_ids: bool = False) -> list[str]:
        return [self.name] + [self.name + suffix for suffix in ANSWER_SUFFIXES] + \
            ([self.name + TOKEN_IDS_SUFFIX] if with_token_ids else [])


def check_prompt_set(questions: tuple[Question, ...]) -> None:
    """Refuse names that are not lowercase identifiers, repeat, or take another column; empty texts."""
    taken: dict[str, str] = {}   # column -> the question giving it
    names: set[str] = set()
    for question in questions:
        if question.name in names:
            raise PromptSetError(f"question {question.name!r} is given twice")
        names.add(question.name)
        if not NAME.fullmatch(question.name):
            raise PromptSetError(f"question name {question.name!r}: use lowercase letters, digits and _, starting "
                                 f"with a letter (it names output columns)")
        if not question.text.strip():
            raise PromptSetError(f"question {question.name!r} has no text")
        if question.max_new_tokens is not None and question.max_new_tokens < 1:
            raise PromptSetError(f"question {question.name!r}: max_new_tokens {question.max_new_tokens}: "
                                 f"give at least 1")
        for column in question.columns(with_token_ids=True):
            if column in ROW_COLUMNS or column in SINGLE_PROMPT_COLUMNS:
                raise PromptSetError(f"question name {question.name!r} gives a column {column!r}, which every row "
                                     f"has already; choose another name")
            if column in taken:
                raise PromptSetError(f"questions {taken[column]!r} and {question.name!r} both give a column "
                                     f"{column!r}; choose other names")
            taken[column] = question.name


def parse_asks(asks: list[str]) -> tuple[Question, ...]:
    """`NAME=TEXT` values (the first `=` splits: the text may hold more)."""
    questions = []
    for ask in asks:
        name, equals, text = ask.partition("=")
        if not equals:
            raise PromptSetError(f"{ask!r}: give NAME=TEXT, e.g. objects='List the objects that appear.'")
        questions.append(Question(name.strip(), text))
    return tuple(questions)


def read_prompt_set(path: str | Path) -> tuple[Question, ...]:
    """A set from a TOML or JSON file: `name = "text"` or `name = {text = "...", max_new_tokens = N}`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise PromptSetError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        table = json.loads(raw) if path.suffix.lower() == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as error:
        raise PromptSetError(f"{path} is not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: "
                             f"{error}") from None
    if not isinstance(table, dict) or not table:
        raise PromptSetError(f"{path} holds no questions: write one `name = \"text\"` per question")
    return tuple(_question(path, name, value) for name, value in table.items())


def row_prompt_set(value: Any) -> tuple[Question, ...] | None:
    """A manifest row's own questions (its `prompts` cell): a JSON object of name -> text, as text (CSV) or as an
    object (JSONL, Parquet struct or map); None for an empty cell."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise PromptSetError(f"not a JSON object of question name -> text ({error})") from None
    if isinstance(value, list) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        value = dict(value)   # a Parquet map reads as (key, value) pairs
    if isinstance(value, dict):   # a struct column has every row's names: a name this row lacks is None
        value = {name: text for name, text in value.items() if text is not None}
    if not isinstance(value, dict) or not value or not all(isinstance(text, str) for text in value.values()):
        raise PromptSetError('give a JSON object of question name -> text, e.g. {"tags": "List three tags."}')
    questions = tuple(Question(name, text) for name, text in value.items())
    check_prompt_set(questions)
    return questions


def _question(path: Path, name: str, value: Any) -> Question:
    if isinstance(value, str):
        return Question(name, value)
    if isinstance(value, dict) and isinstance(value.get("text"), str) and set(value) <= {"text", "max_new_tokens"}:
        limit = value.get("max_new_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise PromptSetError(f"{path}: {name}.max_new_tokens must be a whole number")
        return Question(name, value["text"], limit)
    raise PromptSetError(f"{path}: {name} must be a text or a table with `text` (and optionally "
                         f"`max_new_tokens`)")
