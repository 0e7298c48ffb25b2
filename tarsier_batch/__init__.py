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
            "Captioner": "api", "CaptionResult": "outputs.results", "Answer": "outputs.results",
            "MediaItem": "inputs.sources", "discover": "inputs.sources", "Question": "inputs.prompt_sets",
            "read_prompt_set": "inputs.prompt_sets", "read_manifest": "inputs.manifest",
            "OutputTarget": "outputs.formats",
            # what a run raises for the caller to fix
            "OutputError": "outputs.formats", "SettingsMismatchError": "outputs.resume",
            "OutputLockedError": "outputs.lock", "ModelNotFoundError": "model.checkpoints",
            "InputNotFoundError": "inputs.sources", "NotEnoughMemory": "model.preflight"}

if TYPE_CHECKING:
    from .api import Captioner
    from .inputs.manifest import read_manifest
    from .inputs.prompt_sets import Question, read_prompt_set
    from .inputs.sources import InputNotFoundError, MediaItem, discover
    from .model.checkpoints import ModelNotFoundError
    from .model.preflight import NotEnoughMemory
    from .outputs.formats import OutputError, OutputTarget
    from .outputs.lock import OutputLockedError
    from .outputs.results import Answer, CaptionResult
    from .outputs.resume import SettingsMismatchError
    from .run import CaptionRun, LoggingReporter, RunOutcome, RunReporter, Status, Terminated
    from .settings import CaptionSettings, RunSettings, SamplingParams, SettingsError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Answer", "CaptionResult", "CaptionRun", "CaptionSettings", "Captioner", "InputNotFoundError",
           "LoggingReporter", "MediaItem", "ModelNotFoundError", "NotEnoughMemory", "OutputError", "OutputLockedError",
           "OutputTarget", "Question", "RunOutcome", "RunReporter", "RunSettings", "SamplingParams", "SettingsError",
           "SettingsMismatchError", "Status", "Terminated", "__version__", "discover", "read_manifest",
           "read_prompt_set"]
