"""How a long video becomes rows: `--segments` says whether a file is one row (the default), a row per fixed
window of time, or a row per shot, and this module turns the spec and what a video holds (its length, its
cuts) into the spans (`media.Span`) whose rows the run makes.

    whole                                   one row per file
    fixed:10s                               windows of 10 s from the start
    fixed:10s,overlap=2s,min=3s             each window starts 8 s after the one before; a last window shorter
                                            than 3 s (default 2 s) joins the one before it
    scenes                                  a row per shot, cut where the picture changes (PySceneDetect's
                                            content detector, the `scenes` extra)
    scenes,threshold=27,min=0.5s,max=30s    its threshold (default 27: higher finds fewer cuts), the shortest
                                            shot (default 0.5 s), and shots longer than `max` (default 30 s)
                                            split evenly
    scenes,max=none                         shots kept whole however long (a video without a cut: one row)

A file shorter than one window, and an image, gives one row.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
from dataclasses import dataclass, replace
from typing import Literal

from ..errors import Worded
from ..media import MediaType, Span
from ..version import install_extra_command
from .sources import MediaItem

Mode = Literal["whole", "fixed", "scenes"]
DEFAULT_MIN_S = {"fixed": 2.0, "scenes": 0.5}
DEFAULT_THRESHOLD = 27.0   # PySceneDetect's own default for its content detector
# The longest scene row: a lecture, a dashcam or a screen recording has no hard cut, and 8 frames over 10 minutes
# caption nothing of it. 30 s keeps a frame every 4 s at the default 8 frames (Tarsier's training clips run seconds
# to tens of seconds), while a shot of a cut film (a few seconds) is not split.
DEFAULT_MAX_S = 30.0
NO_MAX = "none"
_DURATION = re.compile(r"^(?:(?P<h>\d+(?:\.\d*)?)h)?(?:(?P<m>\d+(?:\.\d*)?)m)?(?:(?P<s>\d+(?:\.\d*)?)s?)?$")
_SPECS = "give whole, fixed:10s (windows of 10 s; options overlap=2s, min=2s) or scenes (options threshold=27, " \
         f"min=0.5s, max=30s or max={NO_MAX})"


class SegmentsError(ValueError):
    """A `--segments` value that does not parse; the message says what is wrong and what is allowed."""


def parse_duration(text: str) -> float:
    """Seconds from `10`, `10s`, `2.5s`, `1m30s`, `1h`; raises SegmentsError."""
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None or not any(match.groupdict().values()):
        raise SegmentsError(f"{text!r} is not a duration: give seconds such as 10s, 2.5s, 1m30s or 1h")
    return sum(float(value or 0) * scale for value, scale in ((match["h"], 3600), (match["m"], 60), (match["s"], 1)))


@dataclass(frozen=True)
class VideoFacts:
    """What cutting a video needs of it: its length and, for scenes, where its shots change (seconds from its
    first frame, ascending)."""

    duration_s: float
    cuts_s: tuple[float, ...] = ()
    by_frames: bool = False       # its timestamps were missing or jumped: its seconds are frames over the rate


@dataclass(frozen=True)
class Segmenting:
    """How files are cut into rows; `str()` gives the canonical spec (what a resumed run must match)."""

    mode: Mode = "whole"
    window_s: float = 0.0         # fixed: each window's length
    overlap_s: float = 0.0        # fixed: how much of a window the next one repeats
    min_s: float = 0.0            # fixed: a shorter last window joins the one before; scenes: the shortest shot
    threshold: float = DEFAULT_THRESHOLD   # scenes: how much the picture must change for a cut
    max_s: float | None = DEFAULT_MAX_S   # scenes: a longer shot splits evenly into parts of at most this (None: kept)

    def __post_init__(self) -> None:
        if self.min_s < 0:
            raise SegmentsError("min= cannot be negative")
        if self.mode == "fixed":
            if self.window_s <= 0:
                raise SegmentsError("a fixed window must be longer than 0 s")
            if not 0 <= self.overlap_s < self.window_s:
                raise SegmentsError(f"overlap={self.overlap_s:g}s must be shorter than the window "
                                    f"({self.window_s:g}s)")
        if self.mode == "scenes":
            if self.threshold <= 0:
                raise SegmentsError("threshold= must be above 0")
            if self.max_s is not None and self.max_s <= 0:
                raise SegmentsError(f"max= must be longer than 0 s (max={NO_MAX} keeps shots whole)")

    @classmethod
    def parse(cls, text: str) -> Segmenting:
        """`whole`, `fixed:LENGTH[,overlap=LENGTH][,min=LENGTH]` or `scenes[,threshold=N][,min=LENGTH]
        [,max=LENGTH|none]`; raises SegmentsError naming the setting and the value given."""
        try:
            return cls._parse(text)
        except SegmentsError as error:
            raise SegmentsError(Worded("{segments} {text!r}: {reason}", text=text, reason=str(error))) from None

    @classmethod
    def _parse(cls, text: str) -> Segmenting:
        head, *options = text.strip().split(",")
        mode, _, length = head.partition(":")
        if mode not in ("whole", "fixed", "scenes"):
            raise SegmentsError(_SPECS)
        if mode == "whole":
            if length or options:
                raise SegmentsError("whole takes nothing more")
            return cls()
        if (mode == "fixed") != bool(length):
            raise SegmentsError("give the window's length, as in fixed:10s" if mode == "fixed"
                                else "scenes takes no ':LENGTH'")
        allowed = ("overlap", "min") if mode == "fixed" else ("threshold", "min", "max")
        values: dict[str, float] = {}
        longest: float | None = DEFAULT_MAX_S
        for option in options:
            name, equals, value = (part.strip() for part in option.partition("="))
            if not equals or name not in allowed:
                raise SegmentsError(f"{option!r} is not one of {', '.join(name + '=' for name in allowed)}")
            if name == "max":
                longest = None if value == NO_MAX else parse_duration(value)
                continue
            try:
                values[name] = float(value) if name == "threshold" else parse_duration(value)
            except ValueError:
                raise SegmentsError(f"threshold={value!r} is not a number") from None
        if mode == "fixed":
            return cls("fixed", parse_duration(length), values.get("overlap", 0.0),
                       values.get("min", DEFAULT_MIN_S["fixed"]))
        return cls("scenes", min_s=values.get("min", DEFAULT_MIN_S["scenes"]),
                   threshold=values.get("threshold", DEFAULT_THRESHOLD), max_s=longest)

    def __str__(self) -> str:
        if self.mode == "fixed":
            return f"fixed:{self.window_s:g}s,overlap={self.overlap_s:g}s,min={self.min_s:g}s"
        if self.mode == "scenes":
            return f"scenes,threshold={self.threshold:g},min={self.min_s:g}s,max=" + \
                (f"{self.max_s:g}s" if self.max_s is not None else NO_MAX)
        return "whole"

    def check_available(self) -> None:
        """Scenes need PySceneDetect (the `scenes` extra): refuse now, not in every worker."""
        if self.mode == "scenes" and importlib.util.find_spec("scenedetect") is None:
            raise SegmentsError(Worded("{segments} scenes needs PySceneDetect: {install}",
                                       install=install_extra_command("scenes")))

    def spans(self, facts: VideoFacts) -> list[Span]:
        """The spans of a video with these facts."""
        if self.mode == "fixed":
            return self.fixed_spans(facts.duration_s)
        assert self.mode == "scenes"
        bounds = [0.0, *(cut for cut in facts.cuts_s if 0 < cut < facts.duration_s), facts.duration_s]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < self.min_s:
            # The detector keeps `min` between cuts, not from the last cut to the end: a last shot shorter than
            # `min` joins the one before, as a fixed window does.
            del bounds[-2]
        shots = [Span(start, end) for start, end in zip(bounds, bounds[1:])]
        if self.max_s is None:
            return shots
        return [part for shot in shots for part in _even_parts(shot, self.max_s)]

    def found_no_cut(self, facts: VideoFacts) -> bool:
        """Scenes: the detector found no cut in a video longer than a row may be (of any length when shots are kept
        whole). Such a file (a lecture, a dashcam) gives even parts or one long row rather than shots: the run's
        summary counts them."""
        assert self.mode == "scenes"
        if any(0 < cut < facts.duration_s for cut in facts.cuts_s):
            return False
        return self.max_s is None or facts.duration_s > self.max_s

    def without_cuts(self) -> str:
        """What became of a video without a cut, for the summary."""
        assert self.mode == "scenes"
        return "one row each" if self.max_s is None else f"split evenly into parts of at most {self.max_s:g} s"

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

    def cut_nowhere(self, spans: list[Span]) -> bool:
        """Scenes: whether a video's `spans` are those of a video without a cut (`found_no_cut`), as its stored
        rows tell it without opening the file."""
        assert self.mode == "scenes"
        uncut = VideoFacts(spans[-1].end_s)
        return self.found_no_cut(uncut) and self.spans(uncut) == spans

    def split(self, items: list[MediaItem], spans: dict[str, list[Span]]) -> list[MediaItem]:
        """`items` with each video cut into its `spans` (by row id), in place; a video without spans (its facts
        unknown), an image or an item with a span of its own stays as it is."""
        assert self.mode != "whole"
        cut: list[MediaItem] = []
        for item in items:
            known = spans.get(item.row_id)
            if item.media_type is not MediaType.VIDEO or item.span is not None or not known:
                cut.append(item)
                continue
            cut += [replace(item, span=span, segment=number, num_segments=len(known))
                    for number, span in enumerate(known)]
        return cut


def _even_parts(span: Span, longest_s: float) -> list[Span]:
    """`span` in equal parts of at most `longest_s` seconds."""
    count = math.ceil((span.end_s - span.start_s) / longest_s - 1e-9)
    step = (span.end_s - span.start_s) / count
    ends = [span.start_s + number * step for number in range(1, count)] + [span.end_s]
    return [Span(start, end) for start, end in zip([span.start_s, *ends[:-1]], ends)]


def as_stored_now(spec: str) -> str:
    """A canonical spec stored with an output, as this version writes the same segmenting: a scenes spec without
    `max=` was written when long shots were kept whole, so it reads as `max=none` (and a run continuing such an
    output with the default longest is refused rather than mixing whole shots with split ones)."""
    if spec.startswith("scenes") and ",max=" not in spec:
        return f"{spec},max={NO_MAX}"
    return spec
