"""Resolve what the user passed as --model to a local checkpoint directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .catalog import FAMILIES

# Files a checkpoint needs; weights in other formats (.bin, .pt) are not downloaded.
_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


class ModelNotFoundError(Exception):
    """--model names neither a usable local directory nor a downloadable Hugging Face repository."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a checkpoint lives and how it was found, for the run's provenance."""

    reference: str            # what the user passed
    path: Path
    revision: str | None      # the hub commit, when downloaded


def cache_dir() -> Path:
    """Where built-in models are cached: $TARSIER_BATCH_CACHE, else $XDG_CACHE_HOME/tarsier-batch."""
    explicit = os.environ.get("TARSIER_BATCH_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tarsier-batch"


def resolve_model(reference: str) -> ResolvedModel:
    """A local directory, a built-in `tiny-random*` alias, or a Hugging Face id (downloaded)."""
    for family in FAMILIES:
        if reference == family.tiny_alias:
            from .tiny import ensure_tiny_model

            return ResolvedModel(reference, ensure_tiny_model(cache_dir(), family.key), None)
    local = Path(reference).expanduser()
    if local.is_dir():
        return ResolvedModel(reference, local.resolve(), None)
    if local.exists() or reference.count("/") != 1 or reference.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"--model {reference!r} is not a checkpoint directory or a Hugging Face id")
    return _download(reference)


def _download(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_CHECKPOINT_PATTERNS))
    except Exception as error:  # offline, unknown repository, gated, interrupted: all end here
        raise ModelNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(error).__name__}). "
            f"If this machine is offline, download it elsewhere (huggingface-cli download {repo_id} "
            f"--local-dir DIR), copy DIR here and pass --model DIR") from error
    return ResolvedModel(repo_id, path, path.name)
