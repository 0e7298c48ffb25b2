"""tarsier-batch: offline batch captioning of videos and images with Tarsier models.

These are the library's public names: what `from tarsier_batch import ...` keeps stable, and all that the
command line (`cli.py`) uses. They are imported on first use, so that `tarsier --help` or a bad flag
answers without first loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

# Each public name and the module it lives in.
_EXPORTS = {
    # a run over an output: what `tarsier caption` does
    "CaptionRun": "run", "RunOutcome": "run", "Status": "run", "RunReporter": "run", "LoggingReporter": "run",
    "Backend": "run", "Terminated": "run", "LoadingCrashed": "run",
    "CaptionSettings": "settings", "RunSettings": "settings", "SamplingParams": "settings",
    "RaySettings": "settings", "SettingsError": "settings", "DTYPES": "settings", "PRUNE_METHODS": "settings",
    "FLUSH_ROWS": "settings", "FLUSH_SECONDS": "settings",
    "Captioner": "api",
    "CaptionResult": "outputs.results", "Answer": "outputs.results",
    # inputs
    "MediaItem": "inputs.sources", "Discovery": "inputs.sources", "discover": "inputs.sources",
    "is_shard": "inputs.sources", "InputNotFoundError": "inputs.sources",
    "Manifest": "inputs.manifest", "ManifestError": "inputs.manifest", "read_manifest": "inputs.manifest",
    "check_manifest_path": "inputs.manifest", "sibling_columns": "inputs.manifest",
    "Question": "inputs.prompt_sets", "PromptSetError": "inputs.prompt_sets",
    "read_prompt_set": "inputs.prompt_sets", "parse_asks": "inputs.prompt_sets",
    "Shard": "inputs.sharding", "ShardError": "inputs.sharding",
    "Segmenting": "inputs.segments", "SegmentsError": "inputs.segments",
    "StorageError": "storage",
    "MAX_IMAGE_PIXELS": "media",
    "install_extra_command": "version",
    # models
    "DEFAULT_MODEL": "families.catalog", "FamilyInfo": "families.catalog", "model_families": "families.catalog",
    "family_named": "families.catalog",
    "ModelNotFoundError": "model.checkpoints", "model_reference_problem": "model.checkpoints",
    "DEMO_ALIAS": "model.checkpoints", "DEMO_ACCURACY": "model.checkpoints",
    "NotEnoughMemory": "model.preflight",
    "make_tiny_model": "families.tiny",
    "evaluate_demo": "demo.evaluate",
    # outputs
    "OutputTarget": "outputs.formats", "OutputError": "outputs.formats",
    "RemoteOutput": "outputs.remote", "output_at": "outputs.remote",
    "OutputLockedError": "outputs.lock",
    "OutputWriteError": "outputs.store",
    "SettingsMismatchError": "outputs.resume",
    "RESERVED_NAMES": "outputs.schema",
    "merge_outputs": "outputs.merge", "MergeReport": "outputs.merge", "MergeError": "outputs.merge",
    # looking at inputs and results
    "inspect_file": "review.inspection", "family_for": "review.inspection",
    "write_report": "review", "check_results_path": "review",
    # progress displays (what the command line shows)
    "RunStats": "progress", "Reporter": "progress", "make_reporters": "progress", "print_summary": "progress",
    "LineLog": "progress", "plural": "progress",
    # scaling out
    "RayBackend": "runners.ray",
}

if TYPE_CHECKING:
    from .api import Captioner
    from .demo.evaluate import evaluate_demo
    from .families.catalog import DEFAULT_MODEL, FamilyInfo, family_named, model_families
    from .families.tiny import make_tiny_model
    from .inputs.manifest import Manifest, ManifestError, check_manifest_path, read_manifest, sibling_columns
    from .inputs.prompt_sets import PromptSetError, Question, parse_asks, read_prompt_set
    from .inputs.segments import Segmenting, SegmentsError
    from .inputs.sharding import Shard, ShardError
    from .inputs.sources import Discovery, InputNotFoundError, MediaItem, discover, is_shard
    from .media import MAX_IMAGE_PIXELS
    from .model.checkpoints import DEMO_ACCURACY, DEMO_ALIAS, ModelNotFoundError, model_reference_problem
    from .model.preflight import NotEnoughMemory
    from .outputs.formats import OutputError, OutputTarget
    from .outputs.lock import OutputLockedError
    from .outputs.merge import MergeError, MergeReport, merge_outputs
    from .outputs.remote import RemoteOutput, output_at
    from .outputs.results import Answer, CaptionResult
    from .outputs.resume import SettingsMismatchError
    from .outputs.schema import RESERVED_NAMES
    from .outputs.store import OutputWriteError
    from .progress import LineLog, Reporter, RunStats, make_reporters, plural, print_summary
    from .review import check_results_path, write_report
    from .review.inspection import family_for, inspect_file
    from .run import Backend, CaptionRun, LoadingCrashed, LoggingReporter, RunOutcome, RunReporter, Status, Terminated
    from .runners.ray import RayBackend
    from .settings import (
        DTYPES,
        FLUSH_ROWS,
        FLUSH_SECONDS,
        PRUNE_METHODS,
        CaptionSettings,
        RaySettings,
        RunSettings,
        SamplingParams,
        SettingsError,
    )
    from .storage import StorageError
    from .version import install_extra_command


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every name of _EXPORTS (tests/test_layout.py checks the three lists agree).
__all__ = ["__version__", "Answer", "Backend", "Captioner", "CaptionResult", "CaptionRun", "CaptionSettings",
           "check_manifest_path", "check_results_path", "DEFAULT_MODEL", "DEMO_ACCURACY", "DEMO_ALIAS", "discover",
           "Discovery", "DTYPES", "evaluate_demo", "family_for", "family_named", "FamilyInfo", "FLUSH_ROWS",
           "FLUSH_SECONDS", "InputNotFoundError", "inspect_file", "install_extra_command", "is_shard", "LineLog",
           "LoadingCrashed", "LoggingReporter", "make_reporters", "make_tiny_model", "Manifest", "ManifestError",
           "MAX_IMAGE_PIXELS", "MediaItem", "merge_outputs", "MergeError", "MergeReport", "model_families",
           "model_reference_problem", "ModelNotFoundError", "NotEnoughMemory", "output_at", "OutputError",
           "OutputLockedError", "OutputTarget", "OutputWriteError", "parse_asks", "plural", "print_summary",
           "PromptSetError", "PRUNE_METHODS", "Question", "RayBackend", "RaySettings", "read_manifest",
           "read_prompt_set", "RemoteOutput", "Reporter", "RESERVED_NAMES", "RunOutcome", "RunReporter", "RunSettings",
           "RunStats", "SamplingParams", "Segmenting", "SegmentsError", "SettingsError", "SettingsMismatchError",
           "Shard", "ShardError", "sibling_columns", "Status", "StorageError", "Terminated", "write_report"]
