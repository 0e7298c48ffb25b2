"""Find the media to caption from files, directories and glob patterns."""

from __future__ import annotations

import glob
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .media import MediaType, media_type_of


class InputNotFoundError(Exception):
    """An input path does not exist or a glob pattern matches nothing."""


@dataclass(frozen=True)
class MediaItem:
    """One file to caption; `prompt` overrides the run's instruction for this item only."""

    path: str
    media_type: MediaType
    prompt: str | None = None


@dataclass
class Discovery:
    """What the inputs expand to: media in order, unsupported files counted, folders that could not be read."""

    items: list[MediaItem] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # unsupported files by extension
    unreadable: list[str] = field(default_factory=list)     # "folder: reason"

    @property
    def skipped_count(self) -> int:
        return sum(self.skipped.values())


def discover(inputs: list[str], recursive: bool = True) -> Discovery:
    """Expand inputs in the order given; each directory or pattern contributes its files sorted.

    Hidden files and folders (names starting with '.') inside directories are ignored. A file
    reached twice is listed once. Unsupported files are counted by extension, not listed.
    """
    found = Discovery()
    seen: set[str] = set()
    for entry in inputs:
        for path in _expand(entry, recursive, found.unreadable):
            key = os.path.realpath(path)
            if key in seen:
                continue
            seen.add(key)
            media_type = media_type_of(path)
            if media_type is None:
                found.skipped[Path(path).suffix.lower() or "(no extension)"] += 1
            else:
                found.items.append(MediaItem(path, media_type))
    return found


def _expand(entry: str, recursive: bool, unreadable: list[str]) -> list[str]:
    if os.path.isdir(entry):
        return _walk(entry, recursive, unreadable)
    if os.path.exists(entry):
        return [entry]
    if glob.has_magic(entry):
        matches = sorted(glob.glob(entry, recursive=True))
        if not matches:
            raise InputNotFoundError(f"no file matches {entry!r}")
        return [path for match in matches for path in _expand(match, recursive, unreadable)]
    raise InputNotFoundError(f"input not found: {entry}")


def _walk(directory: str, recursive: bool, unreadable: list[str]) -> list[str]:
    def note(error: OSError) -> None:
        unreadable.append(f"{error.filename}: {error.strerror}")

    if not recursive:
        try:
            return sorted(entry.path for entry in os.scandir(directory)
                          if entry.is_file() and not entry.name.startswith("."))
        except OSError as error:
            note(error)
            return []
    files = []
    for root, dirs, names in os.walk(directory, onerror=note):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        files += [os.path.join(root, name) for name in names if not name.startswith(".")]
    return sorted(files)
