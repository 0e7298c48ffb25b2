"""Find the media to caption from files, directories, glob patterns, stdin, object-store URLs and WebDataset
shards, each with a stable key."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import storage
from ..errors import Worded, one_line, printable
from ..media import MediaType, Span, media_type_of
from . import tars
from .prompt_sets import Question
from .tars import TarMember

PROMPT_SET_KEY = "|prompts-sha256:"   # in an item's key, before the digest of its own prompt set
# A segment's row is identified by its file's path (or key) with its span as a media fragment (W3C Media
# Fragments: `clip.mp4#t=10,20` names seconds 10 to 20 of clip.mp4).
_SPAN_FRAGMENT = re.compile(r"#t=[0-9.]+,[0-9.]+$")

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
    # A member of a WebDataset shard: `path` is "shard#member" and this says where its bytes are.
    member: TarMember | None = field(default=None, compare=False)
    shard: str | None = None           # the member's shard (its path or URL)
    shard_version: str | None = None   # of the member's shard when it was listed (a changed shard fails its reads)
    # Where the member's bytes can be opened: an unnamed in-memory file of the decoding pool's process, which its
    # shard reader filled ahead (`workers.member_lane`); a worker opens it by this path, nothing is pickled.
    local_copy: str | None = field(default=None, repr=False, compare=False)
    # A segment: the stretch of the video its row captions, its number among the file's segments, and how many
    # segments `--segments` cut the file into (None for a manifest's spans: it lists what it wants).
    span: Span | None = None
    segment: int | None = None
    num_segments: int | None = None

    @property
    def stable_key(self) -> str:
        """Its content's identity across runs: `key` (or the path), and a segment's span."""
        return with_span(self.key or self.path, self.span)

    @property
    def sampling_key(self) -> str:
        """What its sampling stream derives from: its key without its own prompt set's part, so that a question of
        the set draws what the question asked alone (`--prompt`) draws."""
        return with_span((self.key or self.path).split(PROMPT_SET_KEY)[0], self.span)

    @property
    def row_path(self) -> str:
        """The path as stored in its output row (undecodable bytes escaped, a URL without its credentials)."""
        return printable(storage.redact(self.path))

    @property
    def row_id(self) -> str:
        """Its row's identity in an output: the row path, and a segment's span (`row_id_of` for a stored row)."""
        return with_span(self.row_path, self.span)


def with_span(name: str, span: Span | None) -> str:
    """`name` (a path or key), for a segment with its span as a media fragment: `clip.mp4#t=10,20`."""
    return name if span is None else f"{name}#t={_seconds(span.start_s)},{_seconds(span.end_s)}"


def _seconds(value: float) -> str:
    """Seconds to the microsecond, without trailing zeros: spans closer than that are the same row."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def row_id_of(row: dict[str, Any]) -> str:
    """A stored row's identity (`MediaItem.row_id`): its path, and a segment's span from its columns."""
    start, end = row.get("start_s"), row.get("end_s")
    return with_span(row["path"], None if start is None or end is None else Span(start, end))


@dataclass
class Discovery:
    """What the inputs expand to: media in order, unsupported files counted, folders that could not be read."""

    items: list[MediaItem] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # unsupported files by extension
    skipped_paths: list[str] = field(default_factory=list)  # the same files, for --dry-run
    unreadable: list[str] = field(default_factory=list)     # "folder: reason"
    # Inputs named on the command line (not read from stdin) that hold no media: most likely a wrong path or a
    # folder whose disk is not mounted, a failed input as an unreadable folder is.
    without_media: list[str] = field(default_factory=list)

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

    def add_object(self, url: str, facts: storage.ObjectFacts | None, key_mode: KeyMode | None,
                   prompt: str | None = None, columns: dict[str, Any] | None = None,
                   prompt_set: tuple[Question, ...] | None = None) -> None:
        """List the object at `url` (its `facts` from the listing; None: not found) as an item, or count it as
        skipped if it is not named like media."""
        media_type = media_type_of(storage.url_name(url))
        if media_type is None:
            self.skipped[skipped_kind(storage.url_name(url))] += 1
            self.skipped_paths.append(storage.redact(url))
            return
        if not key_mode:
            self.items.append(MediaItem(url, media_type, prompt, columns=columns or {}, prompt_set=prompt_set))
            return
        shown = printable(storage.redact(url))
        key = f"{shown}|unavailable" if facts is None else f"{shown}|{facts.size_bytes}|{facts.version}"
        file = FileFacts() if facts is None else FileFacts(facts.size_bytes, facts.mtime_ns)
        self.items.append(MediaItem(url, media_type, prompt, _with_prompt_keys(key, prompt, prompt_set), file,
                                    columns or {}, prompt_set=prompt_set))


def discover(inputs: list[str], recursive: bool = True, piped: list[str] | None = None,
             key_mode: KeyMode | None = None, tar_index_cache: Path | None = None) -> Discovery:
    """Expand inputs in the order given; each directory, prefix or pattern contributes its files sorted.

    Paths are made absolute (symlinks are kept, not resolved: each distinct path is its own
    item, so 60 links to one clip give 60 rows). Hidden files and folders (names starting with
    '.') inside directories are ignored. A path reached twice is listed once. Unsupported files
    are counted by extension, not listed.

    A URL (s3://, gs://, az://, hf://, http(s)://) names one object, or a prefix listed like a
    folder, or a glob pattern. A `.tar` file or object (also as a brace pattern such as
    `shards/{00000..00099}.tar`) is a WebDataset shard: each media member is an item, its path
    `shard.tar#member`, and the text of its sibling members (same key, e.g. `.json`) is kept in
    the item's columns under their extension (see `manifest.sibling_columns`).

    `piped` replaces each `-` in `inputs` (paths read from stdin). A piped path that does not exist
    (any more) is kept: it becomes an error row rather than stopping the run (a file deleted between
    `find` and the run). A missing path given in `inputs` itself, or a glob that matches nothing,
    raises InputNotFoundError: most likely a typo, answered before any model is loaded.

    With `key_mode`, every item gets its stable key (`item_key`; for an object, its ETag).
    """
    found = Discovery()
    seen: set[str] = set()
    for entry, from_stdin in _entries(inputs, piped or []):
        items, unreadable, repeated = len(found.items), len(found.unreadable), False
        for path, facts in _expand_entry(entry, recursive, found.unreadable, from_stdin, key_mode):
            if not storage.is_url(path):
                path = os.path.abspath(path)
            # A URL signed twice (other signatures, the same object) is one input: its row path is the redacted URL.
            if storage.redact(path) in seen:
                repeated = repeated or _names_media(path)
                continue
            seen.add(storage.redact(path))
            if is_shard(path):
                _add_shard(found, path, key_mode, tar_index_cache)
            elif facts is not None or storage.is_url(path):
                found.add_object(path, facts, key_mode)
            else:
                found.add(path, key_mode)
        if not from_stdin and not repeated and len(found.items) == items and len(found.unreadable) == unreadable:
            found.without_media.append(storage.redact(entry))
    return found


def _names_media(path: str) -> bool:
    """Whether `path` (a path, URL or shard) is named like something that gives items."""
    return is_shard(path) or media_type_of(storage.url_name(path) if storage.is_url(path) else path) is not None


def is_shard(path: str) -> bool:
    """Whether `path` (a path or URL) names a WebDataset shard: a `.tar` (not one of its members, `shard.tar#x`)."""
    if tars.split_member_path(path) is not None:
        return False
    name = storage.url_name(path) if storage.is_url(path) else path
    return name.lower().endswith(".tar")


def _expand_entry(entry: str, recursive: bool, unreadable: list[str], from_stdin: bool,
                  key_mode: KeyMode | None) -> list[tuple[str, storage.ObjectFacts | None]]:
    """What one input names: (path or URL, the object's facts when a listing gave them)."""
    if storage.is_url(entry):
        if key_mode == "sha256":
            raise InputNotFoundError(Worded("{key} sha256 reads every file to hash it; for {entry} the store's "
                                            "ETag identifies the content: use {key} path",
                                            entry=storage.redact(entry)))
        return [found for url in _braced(entry) for found in _expand_url(url, recursive, from_stdin)]
    return [(path, None) for pattern in _braced(entry) for path in _expand(pattern, recursive, unreadable, from_stdin)]


def _braced(entry: str) -> list[str]:
    """`entry`'s brace pattern expanded (`{00000..00099}`, `{a,b}`), unless it has no braces or is a local file
    named so (a file may have braces in its name)."""
    if "{" not in entry or (not storage.is_url(entry) and os.path.lexists(entry)):
        return [entry]
    try:
        return tars.expand_braces(entry)
    except ValueError as error:
        raise InputNotFoundError(f"{storage.redact(entry)}: {error}") from None


def _expand_url(url: str, recursive: bool, from_stdin: bool) -> list[tuple[str, storage.ObjectFacts | None]]:
    """One object, or the objects under a prefix or matching a pattern, sorted; a URL named like media or a shard
    that names nothing is kept (its row says so)."""
    import fsspec.core

    shown = storage.redact(url)
    try:
        if not fsspec.core.has_magic(url.partition("://")[2]):
            facts = storage.stat_url(url)
            if facts is not None:
                return [(url, facts)]
        listed = storage.list_objects(url, recursive)
    except storage.StorageError as error:
        raise InputNotFoundError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - refused, unreachable, any backend's own error: the store's reason
        raise InputNotFoundError(f"cannot list {shown}: {storage.redact_text(one_line(error))}") from None
    if listed:
        return list(listed)
    if from_stdin or media_type_of(storage.url_name(url)) is not None or is_shard(url):
        return [(url, None)]
    raise InputNotFoundError(f"nothing found at {shown}")


def _add_shard(found: Discovery, shard: str, key_mode: KeyMode | None, cache_dir: Path | None) -> None:
    """The media members of a WebDataset shard as items, in tar order; other members counted as skipped unless they
    are a media member's siblings."""
    if key_mode == "sha256":
        raise InputNotFoundError(Worded("{key} sha256 does not apply to the members of {shard}: use {key} path "
                                        "(a member's key is the shard's version, its name and its size)",
                                        shard=storage.redact(shard)))
    try:
        index = tars.list_shard(shard, cache_dir if cache_dir is not None else tars.default_cache_dir())
    except FileNotFoundError:
        raise InputNotFoundError(f"shard not found: {storage.redact(shard)}") from None
    except Exception as error:  # noqa: BLE001 - not a tar, refused, any backend's own error: the run goes on
        found.unreadable.append(f"{storage.redact(shard)}: {storage.redact_text(str(error) or one_line(error))}")
        return
    if index.problem is not None:   # its members before the problem are listed; a member cut short fails when read
        found.unreadable.append(f"{storage.redact(shard)}: {index.problem}; the members after it are not listed")
    sibling_keys = set(index.siblings)
    last_copy = {member.name: member for member in index.members}   # a name held twice: the later copy counts, as
    for member in index.members:                                     # when the tar is extracted
        if last_copy[member.name] is not member:
            continue
        media_type = media_type_of(member.name)
        if media_type is None:
            split = tars.wds_key(member.name)
            if split is None or split[0] not in sibling_keys:
                found.skipped[skipped_kind(member.name)] += 1
                found.skipped_paths.append(tars.member_path(shard, member.name))
            continue
        path = tars.member_path(shard, member.name)
        split = tars.wds_key(member.name)
        columns = dict(index.siblings.get(split[0], {})) if split is not None else {}
        facts = FileFacts(member.size, member.mtime * 10**9)
        key = f"{printable(storage.redact(shard))}|{index.version}#{printable(member.name)}|{member.size}" \
            if key_mode else None
        found.items.append(MediaItem(path, media_type, key=key, facts=facts, columns=columns, member=member,
                                     shard=shard, shard_version=index.version))


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
    key = _with_prompt_keys(item_key(path, key_mode, facts), prompt, prompt_set)
    return MediaItem(path, media_type, prompt, key, facts, columns or {}, prompt_set=prompt_set)


def _with_prompt_keys(key: str, prompt: str | None, prompt_set: tuple[Question, ...] | None) -> str:
    """`key` with the digest of the item's own prompt or prompt set, if it has one."""
    if prompt is not None:
        key += "|prompt-sha256:" + _digest(prompt)
    if prompt_set is not None:   # in name order: a JSON object's order is not the row's (a struct's fields are shared)
        key += PROMPT_SET_KEY + _digest("\0".join(f"{question.name}\0{question.text}"
                                                   for question in sorted(prompt_set, key=lambda q: q.name)))
    return key


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
    if from_stdin or (media_type_of(entry) is not None and tars.split_member_path(entry) is not None):
        return [entry]  # vanished since it was listed (or a shard's member, found in its shard): its row will say so
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


def row_source_exists(row_id: str) -> bool:
    """Whether what an output row was made from is still there: its file, its object, or its member's shard (a
    store that cannot be asked keeps the row); `row_id` as `MediaItem.row_id`, a segment's span included."""
    row_path = _SPAN_FRAGMENT.sub("", row_id)
    split = tars.split_member_path(row_path)
    source = split[0] if split is not None else row_path
    if not storage.is_url(source):
        return os.path.lexists(source)
    try:
        return storage.stat_url(source) is not None
    except Exception:  # noqa: BLE001 - unreachable or refused: not proof that it is gone
        return True


def item_of_path(path: str) -> MediaItem | None:
    """The item that a path, URL or output row's path (`shard.tar#member`) names, for commands that read one item
    (inspect, report); None if it is not named like media. A member is found in its shard's (cached) index; a
    missing shard, member or object raises FileNotFoundError."""
    split = tars.split_member_path(path)
    if split is not None:
        shard, name = split
        index = tars.list_shard(shard, tars.default_cache_dir())
        member = next((member for member in reversed(index.members) if member.name == name), None)
        if member is None:
            raise FileNotFoundError(f"{storage.redact(shard)} has no member {name!r}")
        media_type = media_type_of(name)
        return None if media_type is None else MediaItem(
            path, media_type, facts=FileFacts(member.size, member.mtime * 10**9), member=member,
            shard=shard, shard_version=index.version)
    if storage.is_url(path):
        media_type = media_type_of(storage.url_name(path))
        if media_type is None:
            return None
        facts = storage.stat_url(path)
        if facts is None:
            raise FileNotFoundError(f"no such object: {storage.redact(path)}")
        return MediaItem(path, media_type, facts=FileFacts(facts.size_bytes, facts.mtime_ns))
    return new_item(path, None)
