"""Where a run's captions are made (`Backend`) and where it tells how it goes (`RunReporter`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from typing import Any, Protocol

from ..inputs.sources import MediaItem
from ..outputs.results import CaptionResult
from ..progress import LogReporter, Reporter, RunStats
from ..settings import Resolved, RunSettings, resume_settings

LOG = logging.getLogger("tarsier_batch")


class RunReporter(Protocol):
    """What a run tells as it goes."""

    def info(self, message: str) -> None:
        """What the run is doing (the model loaded, what it will caption)."""

    def warning(self, message: str) -> None:
        """Something the caller should know (an unreadable folder or part file)."""

    def loading(self, model: str) -> AbstractContextManager[object]:
        """Held while the model loads."""

    def progress(self, stats: RunStats) -> list[Reporter]:
        """The live displays of the captioning, updated through `stats`."""


class LoggingReporter:
    """Reports to the `tarsier_batch` logger (what a pipeline's logging set-up shows; with none, Python shows
    only warnings): what the run does, failures, and a progress line at most every 30 s."""

    def info(self, message: str) -> None:
        LOG.info(message)

    def warning(self, message: str) -> None:
        LOG.warning(message)

    def loading(self, model: str) -> AbstractContextManager[object]:
        LOG.info("loading %s", model)
        return nullcontext()

    def progress(self, stats: RunStats) -> list[Reporter]:
        return [LogReporter(stats, LOG.info)]


class Backend(Protocol):
    """Where a run's captions are made: a `Captioner` in this process, or a Ray cluster (`runners.ray.RayBackend`)."""

    def caption(self, items: Iterable[MediaItem], on_tokens: Callable[[int], None] | None = None,
                in_order: bool = True) -> Iterator[CaptionResult]:
        """One result per item: in input order, or (`in_order=False`) as each finishes."""

    def provenance(self) -> dict[str, Any]:
        """How the captions are made, stored with the output."""

    def resolved_settings(self) -> Resolved:
        """What loading settled that the settings may leave open."""

    def prompt_reuse(self) -> tuple[int, int, int] | None:
        """(prompt positions of the rows admitted, how many came computed from the prefix cache, how many from
        another question of the clip) since loading, or None where not known."""

    def describe(self) -> str:
        """One line for the user: the model and where it runs."""


def run_provenance(backend: Backend, settings: RunSettings) -> dict[str, Any]:
    """How a run's captions were made, stored with its output; "settings" must match to continue it."""
    # The run's set, which a manifest's rows may have widened beyond a shared captioner's (each row's own texts
    # are in its NAME_prompt columns).
    return {**backend.provenance(), "prompt_set": [asdict(question) for question in settings.caption.prompt_set]
            or None, "settings": resume_settings(settings, backend.resolved_settings())}
