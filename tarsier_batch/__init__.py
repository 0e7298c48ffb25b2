"""tarsier-batch: offline batch captioning of videos and images with Tarsier models.

The public names are imported on first use, so that `tarsier --help` or a bad flag answers
without first loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# The public names, and the module of each: what `from tarsier_batch import ...` keeps stable.
_EXPORTS = {"CaptionRun": "run", "RunOutcome": "run", "RunReporter": "run", "LoggingReporter": "run",
            "Status": "run", "Terminated": "run",
            "CaptionSettings": "settings", "RunSettings": "settings", "SamplingParams": "settings",
            "SettingsError": "settings",
            "Captioner": "api", "CaptionResult": "results", "Answer": "results", "MediaItem": "sources",
            "discover": "sources", "Question": "prompt_sets", "read_prompt_set": "prompt_sets",
            "read_manifest": "manifest", "OutputTarget": "outputs.formats",
            # what a run raises for the caller to fix
            "OutputError": "outputs.formats", "SettingsMismatchError": "outputs.resume",
            "OutputLockedError": "outputs.lock", "ModelNotFoundError": "checkpoints", "InputNotFoundError": "sources",
            "NotEnoughMemory": "preflight"}

if TYPE_CHECKING:
    from .api import Captioner
    from .checkpoints import ModelNotFoundError
    from .manifest import read_manifest
    from .outputs.formats import OutputError, OutputTarget
    from .outputs.lock import OutputLockedError
    from .outputs.resume import SettingsMismatchError
    from .preflight import NotEnoughMemory
    from .prompt_sets import Question, read_prompt_set
    from .results import Answer, CaptionResult
    from .run import CaptionRun, LoggingReporter, RunOutcome, RunReporter, Status, Terminated
    from .settings import CaptionSettings, RunSettings, SamplingParams, SettingsError
    from .sources import InputNotFoundError, MediaItem, discover


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Answer", "CaptionResult", "CaptionRun", "CaptionSettings", "Captioner", "InputNotFoundError",
           "LoggingReporter", "MediaItem", "ModelNotFoundError", "NotEnoughMemory", "OutputError", "OutputLockedError",
           "OutputTarget", "Question", "RunOutcome", "RunReporter", "RunSettings", "SamplingParams", "SettingsError",
           "SettingsMismatchError", "Status", "Terminated", "__version__", "discover", "read_manifest",
           "read_prompt_set"]
