"""The settings of a run: what it does with its output, where it runs, and the fingerprint stored with the output.

`resume_settings` says which settings decide a caption: they are stored with the output, and a
later run must match them to continue it. Which settings those are is declared on their fields
(`fingerprint=True`), so a new setting that decides a caption is recorded without a line here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ..inputs.segments import DEFAULT_MAX_S, NO_MAX, Segmenting
from ..inputs.sharding import Shard
from .caption import CaptionSettings
from .declaring import SettingsError, fingerprint, setting, shown

KEY_MODES = ("path", "sha256")
# Finished rows reach a part file within about a second (at once when they come slower than that), and
# fast rows share one: a part per second at most, so a `kill -9` loses about a second of work.
FLUSH_SECONDS = 1.0
FLUSH_ROWS = 4096        # and at most this many rows per part (one Parquet row group)


@dataclass(frozen=True)
class RunSettings:
    """A run's settings: the captioning ones, and what the run does with its output."""

    caption: CaptionSettings = field(default_factory=CaptionSettings)
    with_token_ids: bool = setting(False, group="resume", fingerprint=True, help="Add a generated_ids column.")
    long: bool = setting(   # with a prompt set, the output holds a row per (item, question)
        False, group="rows",
        help="With --ask/--prompts: one row per file and question (a 'question' column and the single prompt's "
             "columns) instead of one row per file with each question's columns.")
    key: str = setting(
        "path", group="resume", choices=KEY_MODES, fingerprint=True,
        help="What identifies a finished item on later runs: 'path' (resolved path, size and mtime) or 'sha256' "
             "(content; reads each file; adds a sha256 column).")
    shard: Shard | None = setting(
        None, group="run", metavar="I/N", parse=Shard.parse, show_default=False, fingerprint=True,
        record=lambda settings: str(settings.shard) if settings.shard else None,
        help="Caption only shard I (from 0) of N: a fixed 1/N of the items, by path (Slurm arrays, one process per "
             "GPU); join the outputs with 'tarsier merge'.")
    overwrite: bool = setting(
        False, group="resume",
        help="Start from scratch: caption everything again and replace --out (stopped part way, the same command "
             "continues it, without --out's earlier rows).")
    retry_errors: bool = setting(False, group="resume", help="Caption again the items whose stored rows are errors.")
    prune_missing: bool = setting(False, group="resume",
                                  help="Drop stored rows of files that no longer exist (kept by default).")
    limit: int | None = setting(
        None, group="run", metavar="N", at_least=1, show_default=False,
        help="Caption at most N items this run (the first that need it); a later run does the rest.")
    fail_on_empty: bool = setting(False, group="resume",
                                  help="Exit 1 when paths from stdin or a manifest hold no media (default: exit 0 "
                                       "with a message); an input named on the command line without media always "
                                       "does.")
    flush_rows: int = setting(FLUSH_ROWS, group="resume", metavar="N", at_least=1,
                              help="Save finished rows to disk every this many rows...")
    flush_seconds: float = setting(
        FLUSH_SECONDS, group="resume", metavar="SECONDS", at_least=0.0,
        help="...or once this many seconds passed since the last save (the run's first row, and a row finishing later "
             "than that, are saved at once).")
    segments: Segmenting = setting(   # a row per file, or per window or scene of a video
        default_factory=Segmenting, group="rows", metavar="SPEC", parse=Segmenting.parse, flag_default="whole",
        fingerprint=True, record=lambda settings: None if settings.segments.mode == "whole" else str(settings.segments),
        help="Rows per video, each sampled like a file of its own: 'whole' (one per file); 'fixed:10s', a row per "
             "10 s window (',overlap=2s': windows repeat 2 s; ',min=2s': a shorter last window joins the one "
             "before); 'scenes', a row per shot (the scenes extra; ',threshold=27': higher finds fewer cuts, "
             "',min=0.5s': the shortest shot, ',max=30s': longer shots, a video without a cut included, split "
             f"evenly, {DEFAULT_MAX_S:g} s by default; ',max={NO_MAX}' keeps them whole).")

    def __post_init__(self) -> None:
        if self.key not in KEY_MODES:
            raise SettingsError(f"{{key}} {shown(repr(self.key))}: use {' or '.join(KEY_MODES)}")
        for name in ("limit", "flush_rows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{{{name}}} {shown(value)}: give at least 1")
        if self.flush_seconds < 0:
            raise SettingsError(f"{{flush_seconds}} {shown(self.flush_seconds)}: give 0 or more")

    def check_streamable(self) -> None:
        """Refuse the settings that continue an output file, for a run that streams its rows instead."""
        given = [f"{{{name}}}" for name in ("overwrite", "retry_errors", "prune_missing") if getattr(self, name)]
        if given:
            raise SettingsError(f"{', '.join(given)} continue an output file; '-o -' streams to stdout and "
                                f"keeps nothing to continue")


def _actor_bounds(text: str) -> tuple[int, int]:
    """`N` or `MIN-MAX` -> (MIN, MAX)."""
    bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    low, high = (int(bounds.group(1)), int(bounds.group(2) or bounds.group(1))) if bounds else (0, 0)
    if not 1 <= low <= high:
        raise SettingsError(f"{{actors}} {shown(repr(text))}: give a number of actors N >= 1, or MIN-MAX with "
                            f"1 <= MIN <= MAX")
    return low, high


@dataclass(frozen=True)
class RaySettings:
    """Where and how wide a run captions on a Ray cluster."""

    address: str = setting(   # 'auto', ray://HOST:10001, or 'local' (start a cluster here)
        group="ray", flags=("--ray",), key="ray", metavar="ADDRESS", flag_default=None, show_default=False,
        help="Caption on a Ray cluster: 'auto' (the cluster this machine belongs to), ray://HOST:10001, or 'local' "
             "(start one here). Needs pip install 'tarsier-batch[ray]'.")
    actors: tuple[int, int] = setting(   # the captioning actor pool: (N, N), or bounds Ray scales between
        (1, 1), group="ray", flags=("--ray-workers",), key="ray_workers", metavar="N|MIN-MAX", flag_default="1",
        parse=_actor_bounds,
        help="Captioning actors on the Ray cluster, each loading the model once: N, or MIN-MAX to let Ray scale "
             "between them.")
    gpus_per_actor: float = setting(
        1.0, group="ray", flags=("--ray-gpus-per-worker",), key="ray_gpus_per_worker", metavar="G", at_least=0.0,
        flag_default=None, show_default=False, help="GPUs per captioning actor [default: 1, or 0 with --device cpu].")

    def __post_init__(self) -> None:
        low, high = self.actors
        if not 1 <= low <= high:
            raise SettingsError(f"{{actors}} {low}-{high}: give 1 <= MIN <= MAX actors")
        if self.gpus_per_actor < 0:
            raise SettingsError(f"{{gpus_per_actor}} {shown(self.gpus_per_actor)}: give 0 or more")

    def check_run(self, settings: RunSettings) -> None:
        """Refuse what a run on Ray does not do."""
        if settings.shard is not None:
            raise SettingsError("{address} spreads the items over the cluster itself; leave out {shard}")


@dataclass(frozen=True)
class Resolved:
    """What loading the model settles that the settings may leave open."""

    model_revision: str | None
    frames: int
    repetition_penalty: float | None


def resume_settings(settings: RunSettings, resolved: Resolved | None = None) -> dict[str, Any]:
    """The settings that decide a caption, as stored with the output; a later run must match them to continue.

    Without `resolved` (before the model is loaded), only what the settings say: what loading settles
    (frames, the repetition penalty) only when given, so that a mismatch is answered before loading.
    With it, every value as the loaded model resolved it, and the checkpoint's revision.
    """
    decided = fingerprint(settings)
    settled = [found.name for found in dataclasses.fields(Resolved) if found.name in decided]
    if resolved is None:
        return {name: value for name, value in decided.items() if value is not None or name not in settled}
    decided.update({name: getattr(resolved, name) for name in settled})
    return {"model": decided.pop("model"), "model_revision": resolved.model_revision, **decided}
