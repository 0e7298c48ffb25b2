"""One output row: what captioning an item produced, or why it failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..inputs.sources import with_span
from ..media import Span


@dataclass
class Answer:
    """What one question of a prompt set got (`prompt_sets`): as a result's caption fields, per question."""

    prompt: str
    caption: str | None
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str             # "eos", "length" or "error"
    error: str | None = None
    error_kind: str | None = None   # with `error`: one of `errors.KINDS`
    generated_ids: list[int] | None = None


@dataclass
class CaptionResult:
    """One output row. `prompt_tokens` counts the merged prefill (text plus vision vectors).

    `path` is the item's path as the caller gave it (the CLI gives absolute paths); `key` is
    its stable identity for resuming (see `sources.item_key`); `span` the stretch of the video a
    segment's row captions (None: the whole file); `decoder` names what produced
    the frames ("decord", "pyav" or "pillow"). With a prompt set, `answers` holds each question
    asked (by name), `generated_tokens` their sum, and the other caption fields are None; `error`
    then also says which questions failed. `error_kind` classifies `error` (one of `errors.KINDS`; None on
    success). `warnings` names damage decoding read past (of `media.WARNING_KINDS`; None where it met none): the
    row is captioned, from what could be decoded.
    """

    path: str
    media_type: str
    key: str | None = None
    caption: str | None = None
    prompt: str | None = None
    num_frames: int | None = None
    frame_indices: list[int] | None = None
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    decoder: str | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    finish_reason: str = "error"
    error: str | None = None
    error_kind: str | None = None
    warnings: list[str] | None = None
    elapsed_s: float = 0.0
    generated_ids: list[int] | None = None
    answers: dict[str, Answer] = field(default_factory=dict)
    span: Span | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def row_id(self) -> str:
        """Its row's identity in the output (`MediaItem.row_id`)."""
        return with_span(self.path, self.span)
