"""How a long video becomes rows: `--segments` says whether a file is one row (the default) or a row per fixed
window of time, and this module turns the spec and a video's length into the spans (`media.Span`) whose rows
the run makes.

    whole                          one row per file
    fixed:10s                      windows of 10 s from the start
    fixed:10s,overlap=2s,min=3s    each window starts 8 s after the one before; a last window shorter than
                                   3 s (default 2 s) joins the one before it

A file shorter than one window, and an image, gives one row.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Literal

from ..media import MediaType, Span
from .sources import MediaItem

Mode = Literal["whole", "fixed"]
DEFAULT_MIN_S = 2.0
_DURATION = re.compile(r"^(?:(?P<h>\d+(?:\.\d*)?)h)?(?:(?P<m>\d+(?:\.\d*)?)m)?(?:(?P<s>\d+(?:\.\d*)?)s?)?$")


class SegmentsError(ValueError):
    """A `--segments` value that does not parse; the message says what is wrong and what is allowed."""


def parse_duration(text: str) -> float:
    """Seconds from `10`, `10s`, `2.5s`, `1m30s`, `1h`; raises SegmentsError."""
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None or not any(match.groupdict().values()):
        raise SegmentsError(f"{text!r} is not a duration: give seconds such as 10s, 2.5s, 1m30s or 1h")
    return sum(float(value or 0) * scale for value, scale in ((match["h"], 3600), (match["m"], 60), (match["s"], 1)))


@dataclass(frozen=True)
class Segmenting:
    """How files are cut into rows; `str()` gives the canonical spec (what a resumed run must match)."""

    mode: Mode = "whole"
    window_s: float = 0.0        # fixed: each window's length
    overlap_s: float = 0.0       # fixed: how much of a window the next one repeats
    min_s: float = DEFAULT_MIN_S  # fixed: a last window shorter than this joins the one before it

    def __post_init__(self) -> None:
        if self.mode == "fixed":
            if self.window_s <= 0:
                raise SegmentsError("a fixed window must be longer than 0 s")
            if not 0 <= self.overlap_s < self.window_s:
                raise SegmentsError(f"overlap={self.overlap_s:g}s must be shorter than the window "
                                    f"({self.window_s:g}s)")
            if self.min_s < 0:
                raise SegmentsError("min= cannot be negative")

    @classmethod
    def parse(cls, text: str) -> Segmenting:
        """`whole` or `fixed:LENGTH[,overlap=LENGTH][,min=LENGTH]`; raises SegmentsError."""
        mode, _, rest = text.strip().partition(":")
        if mode == "whole":
            if rest:
                raise SegmentsError(f"--segments whole takes no value after ':' (got {text!r})")
            return cls()
        if mode != "fixed":
            raise SegmentsError(f"--segments {text!r}: give whole, or fixed:10s (windows of 10 s; optional "
                                f",overlap=2s and ,min=2s)")
        length, *options = rest.split(",")
        values = {"overlap": 0.0, "min": DEFAULT_MIN_S}
        for option in options:
            name, equals, value = option.partition("=")
            if not equals or name.strip() not in values:
                raise SegmentsError(f"--segments {text!r}: {option!r} is not overlap=LENGTH or min=LENGTH")
            values[name.strip()] = parse_duration(value)
        if not length:
            raise SegmentsError(f"--segments {text!r}: give the window's length, as in fixed:10s")
        return cls("fixed", parse_duration(length), values["overlap"], values["min"])

    def __str__(self) -> str:
        if self.mode != "fixed":
            return self.mode
        return f"fixed:{self.window_s:g}s,overlap={self.overlap_s:g}s,min={self.min_s:g}s"

    def fixed_spans(self, duration_s: float) -> list[Span]:
        """The windows of a video `duration_s` long: from 0, one every `window - overlap` seconds, the last one
        ending at the end (joined to the one before when shorter than `min_s`); one span for a video shorter
        than a window."""
        assert self.mode == "fixed"
        if duration_s <= 0:
            raise ValueError(f"a video of {duration_s:g} s has no span")
        spans = []
        step = self.window_s - self.overlap_s
        for number in itertools.count():   # starts as multiples of the step: no drift from adding it up
            start = number * step
            end = min(start + self.window_s, duration_s)
            spans.append(Span(start, end))
            if end >= duration_s:
                break
        if len(spans) > 1 and spans[-1].end_s - spans[-1].start_s < self.min_s:
            spans[-2:] = [Span(spans[-2].start_s, duration_s)]
        return spans

    def split(self, items: list[MediaItem], durations: dict[str, float | None]) -> list[MediaItem]:
        """`items` with each video cut into its fixed windows, in place (`durations`: seconds by row id; a video
        whose length is unknown, an image or an item with a span of its own stays as it is)."""
        assert self.mode == "fixed"
        cut: list[MediaItem] = []
        for item in items:
            duration = durations.get(item.row_id)
            if item.media_type is not MediaType.VIDEO or item.span is not None or not duration:
                cut.append(item)
                continue
            cut += [replace(item, span=span, segment=number)
                    for number, span in enumerate(self.fixed_spans(duration))]
        return cut
