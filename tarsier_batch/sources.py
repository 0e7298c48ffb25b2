"""Find the media to caption from files, directories, glob patterns and stdin, each with a stable key."""

from __future__ import annotations

import glob
import hashlib
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .media import MediaType, media_type_of
from .prompt_sets import Question
from .text import printable

PROMPT_SET_KEY = "|prompts-sha256:"   # in an item's key, before the digest of its own prompt set

KeyMode = Literal["path", "sha256"]
KEY_MODES: tuple[KeyMode, ...] = ("path", "sha256")


class InputNotFoundError(Exception):
    """An input given on the command line does not exist or a glob pattern matches nothing."""


@dataclass(frozen=True)
class FileFacts:
    """What the output records of a file for joins and dedupe: size, modification time, content hash."""

    size_bytes: int | None = None
    mtime_ns: int | None = None
    sha256: str | None = None   # only with `--key sha256` (hashing reads every file)


@dataclass(frozen=True)
class MediaItem:
    """One file to caption; `prompt` overrides the run's instruction for this item only.

    `key` identifies the file's content (and its own prompt, if any) across runs (see
    `item_key`); without one, the path stands in for it (sampling seeds derive from it).
    `columns` are a manifest's columns carried through into the item's output row.
    """

    path: str
    media_type: MediaType
    prompt: str | None = None
    key: str | None = None
    facts: FileFacts = FileFacts()
    columns: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    # With a prompt set: the names of the questions still to ask of it (None: every one).
    questions: tuple[str, ...] | None = None
    # Its own prompt set (a manifest's `prompts` column), in place of the run's (None: the run's).
    prompt_set: tuple[Question, ...] | None = None

    @property
    def stable_key(self) -> str:
        return self.key or self.path

    @property
    def sampling_key(self) -> str:
        """What its sampling stream derives from: its key without its own prompt set's part, so that a question of
        the set draws what the question asked alone (`--prompt`) draws."""
        return self.stable_key.split(PROMPT_SET_KEY)[0]

    @property
    def row_path(self) -> str:
        """The path as stored in its output row (undecodable bytes escaped)."""
        return printable(self.path)


@dataclass
class Discovery:
    """What the inputs expand to: media in order, unsupported files counted, folders that could not be read."""

    items: list[MediaItem] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # unsupported files by extension
    skipped_paths: list[str] = field(default_factory=list)  # the same files, for --dry-run
    unreadable: list[str] = field(default_factory=list)     # "folder: reason"

    @property
    def skipped_count(self) -> int:
        return sum(self.skipped.values())

    def add(self, path: str, key_mode: KeyMode | None, prompt: str | None = None,
            columns: dict[str, Any] | None = None, prompt_set: tuple[Question, ...] | None = None) -> None:
        """List `path` as an item, or count it as skipped if it is not named like media."""
        item = new_item(path, key_mode, prompt, columns, prompt_set)
        if item is None:
            self.skipped[skipped_kind(path)] += 1
            self.skipped_paths.append(path)
        else:
            self.items.append(item)


def discover(inputs: list[str], recursive: bool = True, piped: list[str] | None = None,
             key_mode: KeyMode | None = None) -> Discovery:
    """Expand inputs in the order given; each directory or pattern contributes its files sorted.

    Paths are made absolute (symlinks are kept, not resolved: each distinct path is its own
    item, so 60 links to one clip give 60 rows). Hidden files and folders (names starting with
    '.') inside directories are ignored. A path reached twice is listed once. Unsupported files
    are counted by extension, not listed.

    `piped` replaces each `-` in `inputs` (paths read from stdin). A piped path, or a path named
    like media on the command line, that does not exist (any more) is kept: it becomes an error
    row rather than stopping the run. A missing path not named like media, or a glob that
    matches nothing, raises InputNotFoundError: most likely a typo.

    With `key_mode`, every item gets its stable key (`item_key`).
    """
    found = Discovery()
    seen: set[str] = set()
    for entry, from_stdin in _entries(inputs, piped or []):
        for path in _expand(entry, recursive, found.unreadable, from_stdin):
            path = os.path.abspath(path)
            if path in seen:
                continue
            seen.add(path)
            found.add(path, key_mode)
    return found


def skipped_kind(path: str) -> str:
    """How an unsupported file is counted: by its extension."""
    return Path(path).suffix.lower() or "(no extension)"


def new_item(path: str, key_mode: KeyMode | None, prompt: str | None = None,
             columns: dict[str, Any] | None = None, prompt_set: tuple[Question, ...] | None = None
             ) -> MediaItem | None:
    """The item of `path` (None if it is not named like media), with its key and file facts if asked.

    An item's own prompt, or its own prompt set, is part of its key: changing it makes the item new
    for a later run (and only items asked the same questions share a caption of the same content).
    """
    media_type = media_type_of(path)
    if media_type is None:
        return None
    if not key_mode:
        return MediaItem(path, media_type, prompt, columns=columns or {}, prompt_set=prompt_set)
    facts = file_facts(path, key_mode)
    key = item_key(path, key_mode, facts)
    if prompt is not None:
        key += "|prompt-sha256:" + _digest(prompt)
    if prompt_set is not None:   # in name order: a JSON object's order is not the row's (a struct's fields are shared)
        key += PROMPT_SET_KEY + _digest("\0".join(f"{question.name}\0{question.text}"
                                                   for question in sorted(prompt_set, key=lambda q: q.name)))
    return MediaItem(path, media_type, prompt, key, facts, columns or {}, prompt_set=prompt_set)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def file_facts(path: str, mode: KeyMode = "path") -> FileFacts:
    """Size and mtime of a regular file (and its hash in "sha256" mode); empty for anything else.

    Never reads a FIFO or a device: it could block for ever.
    """
    try:
        info = os.stat(path)
    except OSError:
        return FileFacts()
    if not stat.S_ISREG(info.st_mode):
        return FileFacts()
    digest = None
    if mode == "sha256":
        try:
            with open(path, "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
        except OSError:
            pass  # the key says so; the item fails when decoding tries to read it
    return FileFacts(info.st_size, info.st_mtime_ns, digest)


def item_key(path: str, mode: KeyMode = "path", facts: FileFacts | None = None) -> str:
    """What identifies a file's content across runs: a changed file gets a new key.

    "path": the resolved absolute path, size and modification time (cheap; touching a file
    counts as a change). "sha256": a hash of the bytes (reads every file once; a file that
    was copied or touched without change keeps its key). Files that cannot be read as regular
    files (missing, FIFOs, devices) get a key from their resolved path alone; they become
    error rows.
    """
    resolved = printable(os.path.realpath(path))
    facts = facts or file_facts(path, mode)
    if facts.size_bytes is None:
        return f"{resolved}|{'not-a-file' if os.path.exists(path) else 'unavailable'}"
    if mode == "sha256":
        return f"sha256:{facts.sha256}" if facts.sha256 else f"{resolved}|unreadable"
    return f"{resolved}|{facts.size_bytes}|{facts.mtime_ns}"


def _entries(inputs: list[str], piped: list[str]) -> list[tuple[str, bool]]:
    return [(path, True) if entry == "-" else (entry, False)
            for entry in inputs for path in (piped if entry == "-" else [entry])]


def _expand(entry: str, recursive: bool, unreadable: list[str], from_stdin: bool) -> list[str]:
    if os.path.isdir(entry):
        return _walk(entry, recursive, unreadable)
    if os.path.lexists(entry):  # files, but also FIFOs, devices and broken links: they become error rows
        return [entry]
    if not from_stdin and glob.has_magic(entry):
        matches = sorted(glob.glob(entry, recursive=True))
        if not matches:
            raise InputNotFoundError(f"no file matches {entry!r}")
        return [path for match in matches for path in _expand(match, recursive, unreadable, False)]
    if from_stdin or media_type_of(entry) is not None:
        return [entry]  # vanished (or never existed): its row will say so
    raise InputNotFoundError(f"input not found: {entry}")


def _walk(directory: str, recursive: bool, unreadable: list[str]) -> list[str]:
    """Files under `directory`, sorted; FIFOs, devices and links are listed too (they become error rows).

    A directory named like media ("x.mp4/") is listed as an item that will fail with a clear
    reason rather than walked. Links to directories are not followed (no loops).
    """
    def note(error: OSError) -> None:
        unreadable.append(f"{error.filename}: {error.strerror}")

    def listed(name: str, is_dir: bool) -> bool:
        return not name.startswith(".") and (not is_dir or media_type_of(name) is not None)

    if not recursive:
        try:
            return sorted(entry.path for entry in os.scandir(directory) if listed(entry.name, entry.is_dir()))
        except OSError as error:
            note(error)
            return []
    files = []
    for root, dirs, names in os.walk(directory, onerror=note):
        files += [os.path.join(root, name) for name in names if listed(name, False)]
        files += [os.path.join(root, name) for name in dirs if listed(name, True)]
        dirs[:] = [name for name in dirs if not name.startswith(".") and media_type_of(name) is None]
    return sorted(files)
