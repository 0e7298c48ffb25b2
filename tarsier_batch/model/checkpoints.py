"""Resolve what the user passed as --model to a local checkpoint directory."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from ..errors import Worded
from ..families.catalog import model_families
from ..storage import cache_home

# Files a checkpoint needs; weights in other formats (.bin, .pt) are not downloaded.
_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
_PROCESSOR_PATTERNS = [pattern for pattern in _CHECKPOINT_PATTERNS if pattern != "*.safetensors"]


class ModelNotFoundError(Exception):
    """--model names neither a usable local directory nor a downloadable Hugging Face repository."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a checkpoint lives and how it was found, for the run's provenance."""

    reference: str            # what the user passed
    path: Path
    revision: str | None      # the hub commit, when downloaded


def cache_dir() -> Path:
    """Where built-in models are cached: the tool's cache (`storage.cache_home`)."""
    return cache_home()


def tiny_model_dir(alias: str) -> Path:
    """Where the built-in random model `alias` ('tiny-random', 'tiny-random-tarsier2') is cached."""
    return cache_dir() / f"{alias}-tiny-seed0"


def needs_building(reference: str) -> bool:
    """Whether `reference` is a built-in random model not built yet (the first use builds it)."""
    return any(reference == family.tiny_alias for family in model_families()) and \
        not (tiny_model_dir(reference) / "model.safetensors").exists()


DEMO_ALIAS = "demo"
DEMO_CHECKPOINT = Path(__file__).resolve().parents[1] / "demo" / "checkpoint"   # the package's demo/ folder
# As measured by `tarsier dev eval-demo` over 1,000 held-out clips, one mistake (README, "The demo model");
# `tarsier models` and the README state it in these same words.
DEMO_ACCURACY = "99.9 % of held-out clips exactly right"


def model_reference_problem(reference: str) -> str | None:
    """Why `reference` names no checkpoint, from the name and the local disk alone (no torch, no download), with
    the closest built-in or known name; None when it may name one (whether a Hugging Face id exists is the hub's
    to say, and a directory's contents are checked when loading)."""
    if reference == DEMO_ALIAS or any(reference == family.tiny_alias for family in model_families()):
        return None
    local = Path(reference).expanduser()
    if local.is_dir():
        return None
    if not local.exists() and reference.count("/") == 1 and not reference.startswith((".", "/", "~")):
        return None
    known = [DEMO_ALIAS, *(family.tiny_alias for family in model_families()),
             *(checkpoint for family in model_families() for checkpoint in family.checkpoints)]
    by_lower = {name.lower(): name for name in known}   # 'Demo' is a near miss of 'demo' too
    close = difflib.get_close_matches(reference.lower(), list(by_lower), n=1)
    hint = f"did you mean {by_lower[close[0]]!r}?" if close else "see 'tarsier models'"
    return Worded("{model} {reference!r} is not a checkpoint directory, a Hugging Face id (org/name) or a built-in "
                  "model; {hint}", reference=reference, hint=hint)


def resolve_model(reference: str, weights: bool = True) -> ResolvedModel:
    """A local directory, `demo`, a built-in `tiny-random*` alias, or a Hugging Face id (downloaded;
    without `weights`, only its configuration and tokenizer: what frames and prompts need)."""
    if reference == DEMO_ALIAS:
        if not (DEMO_CHECKPOINT / "model.safetensors").exists():
            raise ModelNotFoundError(f"the demo model is missing from this installation ({DEMO_CHECKPOINT}); "
                                     f"train it with tools/train_demo_model.py")
        return ResolvedModel(reference, DEMO_CHECKPOINT, None)
    for family in model_families():
        if reference == family.tiny_alias:
            from ..families.tiny import ensure_tiny_model

            return ResolvedModel(reference, ensure_tiny_model(tiny_model_dir(reference), family.key), None)
    problem = model_reference_problem(reference)
    if problem is not None:
        raise ModelNotFoundError(problem)
    local = Path(reference).expanduser()
    if local.is_dir():
        return ResolvedModel(reference, local.resolve(), None)
    return _download(reference, _CHECKPOINT_PATTERNS if weights else _PROCESSOR_PATTERNS)


def local_checkpoint(reference: str) -> Path | None:
    """The folder `reference` names where it is on this disk already (the demo, a built-in random model built
    before, a local directory); None where finding it would download or build it."""
    if reference == DEMO_ALIAS:
        return DEMO_CHECKPOINT
    if any(reference == family.tiny_alias for family in model_families()):
        return None if needs_building(reference) else tiny_model_dir(reference)
    local = Path(reference).expanduser()
    return local.resolve() if local.is_dir() else None


def _download(repo_id: str, patterns: list[str]) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # offline, unknown repository, gated, interrupted: all end here
        raise ModelNotFoundError(download_problem(repo_id, error)) from error
    return ResolvedModel(repo_id, path, path.name)


def download_problem(repo_id: str, error: BaseException) -> str:
    """Whether the name or the network is the problem, and what to do about it."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        return (f"{repo_id!r} is gated on the Hugging Face hub: accept its terms on https://huggingface.co/{repo_id}, "
                f"then log in with 'hf auth login' (or set HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return (f"there is no model {repo_id!r} on the Hugging Face hub (check the name; see 'tarsier models'; "
                f"a private one needs 'hf auth login' or HF_TOKEN)")
    offline = Worded("download it on a machine that is online with 'hf download {repo} --local-dir DIR', copy DIR "
                     "here and pass {model} DIR", repo=repo_id)
    if isinstance(error, (LocalEntryNotFoundError, ConnectionError, TimeoutError)) or "Connect" in type(error).__name__:
        cause = error.__cause__ or error.__context__ or error
        return Worded("cannot reach the Hugging Face hub to download {repo!r} ({cause}); {offline}", repo=repo_id,
                      cause=_first_line(cause), offline=offline)
    return Worded("could not download {repo!r} from the Hugging Face hub ({cause}); {offline}", repo=repo_id,
                  cause=_first_line(error), offline=offline)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
