"""tarsier-batch: offline batch captioning of videos and images with Tarsier models.

These are the library's public names: what a Python caller needs, and what `from tarsier_batch import ...`
keeps stable (a run, its settings, the captioner, results, inputs, outputs, errors). The command line
imports the rest from the modules themselves. They are imported on first use, so that
`import tarsier_batch` loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# Each public name and the module it lives in.
_EXPORTS = {
    # a run over an output: what `tarsier caption` does
    "CaptionRun": "run", "RunOutcome": "run", "Status": "run", "RunReporter": "run", "LoggingReporter": "run",
    "Backend": "run", "LoadingCrashed": "run",
    "CaptionSettings": "settings", "RunSettings": "settings", "SamplingParams": "settings",
    "RaySettings": "settings", "SettingsError": "settings",
    "Captioner": "api",
    "CaptionResult": "outputs.results", "Answer": "outputs.results",
    # inputs
    "MediaItem": "inputs.sources", "Discovery": "inputs.sources", "discover": "inputs.sources",
    "InputNotFoundError": "inputs.sources",
    "Manifest": "inputs.manifest", "ManifestError": "inputs.manifest", "read_manifest": "inputs.manifest",
    "Question": "inputs.prompt_sets", "PromptSetError": "inputs.prompt_sets",
    "read_prompt_set": "inputs.prompt_sets", "parse_asks": "inputs.prompt_sets",
    "Shard": "inputs.sharding", "ShardError": "inputs.sharding",
    "Segmenting": "inputs.segments", "SegmentsError": "inputs.segments",
    "StorageError": "storage",
    # models
    "DEFAULT_MODEL": "families.catalog", "FamilyInfo": "families.catalog", "model_families": "families.catalog",
    "ModelNotFoundError": "model.checkpoints", "NotEnoughMemory": "model.preflight",
    "make_tiny_model": "families.tiny",
    # outputs
    "OutputTarget": "outputs.formats", "OutputError": "outputs.formats", "output_at": "outputs.remote",
    "OutputLockedError": "outputs.lock", "OutputWriteError": "outputs.store",
    "SettingsMismatchError": "outputs.resume",
    "merge_outputs": "outputs.merge", "MergeReport": "outputs.merge", "MergeError": "outputs.merge",
    # looking at inputs and results
    "inspect_file": "review.inspection", "write_report": "review",
    # scaling out
    "RayBackend": "runners.ray",
}

if TYPE_CHECKING:
    from .api import Captioner
    from .families.catalog import DEFAULT_MODEL, FamilyInfo, model_families
    from .families.tiny import make_tiny_model
    from .inputs.manifest import Manifest, ManifestError, read_manifest
    from .inputs.prompt_sets import PromptSetError, Question, parse_asks, read_prompt_set
    from .inputs.segments import Segmenting, SegmentsError
    from .inputs.sharding import Shard, ShardError
    from .inputs.sources import Discovery, InputNotFoundError, MediaItem, discover
    from .model.checkpoints import ModelNotFoundError
    from .model.preflight import NotEnoughMemory
    from .outputs.formats import OutputError, OutputTarget
    from .outputs.lock import OutputLockedError
    from .outputs.merge import MergeError, MergeReport, merge_outputs
    from .outputs.remote import output_at
    from .outputs.results import Answer, CaptionResult
    from .outputs.resume import SettingsMismatchError
    from .outputs.store import OutputWriteError
    from .review import write_report
    from .review.inspection import inspect_file
    from .run import Backend, CaptionRun, LoadingCrashed, LoggingReporter, RunOutcome, RunReporter, Status
    from .runners.ray import RayBackend
    from .settings import CaptionSettings, RaySettings, RunSettings, SamplingParams, SettingsError
    from .storage import StorageError


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every name of _EXPORTS (tests/test_layout.py checks the three lists agree).
__all__ = ["__version__", "Answer", "Backend", "Captioner", "CaptionResult", "CaptionRun", "CaptionSettings",
           "DEFAULT_MODEL", "discover", "Discovery", "FamilyInfo", "InputNotFoundError", "inspect_file",
           "LoadingCrashed", "LoggingReporter", "make_tiny_model", "Manifest", "ManifestError", "MediaItem",
           "merge_outputs", "MergeError", "MergeReport", "model_families", "ModelNotFoundError", "NotEnoughMemory",
           "output_at", "OutputError", "OutputLockedError", "OutputTarget", "OutputWriteError", "parse_asks",
           "PromptSetError", "Question", "RayBackend", "RaySettings", "read_manifest", "read_prompt_set",
           "RunOutcome", "RunReporter", "RunSettings", "SamplingParams", "Segmenting", "SegmentsError",
           "SettingsError", "SettingsMismatchError", "Shard", "ShardError", "Status", "StorageError", "write_report"]
