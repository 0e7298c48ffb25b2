"""A local path the decoders can open for an item: its own file, or a copy of an object or a shard's member."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .. import storage
from ..errors import NOT_FOUND, ItemError
from . import tars
from .sources import MediaItem

# The object whose windows this thread decodes, kept downloaded: a worker takes a long video's windows one after
# another, and each would otherwise download the whole object again.
_kept_object = threading.local()


@contextlib.contextmanager
def readable_copy(item: MediaItem) -> Iterator[str]:
    """A path the decoders can open for `item`: its own path, the local copy the decoding pool made of a shard's
    member (`item.local_copy`), or an unnamed local copy of an object or a shard's member made here (freed on
    leaving, also if the process is killed: see `storage.Spooled`). A window of an object
    (`item.span`) keeps its copy in this thread until a window of another object (or another version) comes."""
    if item.local_copy is not None:
        yield item.local_copy
        return
    if item.member is None and not storage.is_url(item.path):
        yield item.path
        return
    if item.member is None and item.span is not None:
        identity = (item.path, item.facts.size_bytes, item.facts.mtime_ns)
        kept: tuple[tuple, storage.Spooled] | None = getattr(_kept_object, "copy", None)
        if kept is None or kept[0] != identity:
            _kept_object.copy = None
            if kept is not None:
                kept[1].close()
            _kept_object.copy = (identity, _fetched(item))
        yield _kept_object.copy[1].path
        return
    if item.member is not None:   # not read ahead by a pool: read this member alone
        spooled = member_copy(item)
    else:
        spooled = _fetched(item)
    with spooled:
        yield spooled.path


def member_copy(item: MediaItem, reader: tars.ShardReader | None = None) -> storage.Spooled:
    """A shard member's bytes in an unnamed local file (in memory up to `storage.SPILL_TO_DISK_BYTES`), read by
    `reader` (which must be on the member's shard) or by a reader of its own."""
    assert item.member is not None and item.shard is not None, item.path
    spooled = storage.Spooled(item.member.size, item.member.name.rpartition("/")[2][:200] or "member")
    try:
        if reader is not None:
            reader.copy_to(item.member, spooled.write)
        else:
            with tars.ShardReader(item.shard, item.shard_version) as own:
                own.copy_to(item.member, spooled.write)
    except BaseException:
        spooled.close()
        raise
    return spooled


def _fetched(item: MediaItem) -> storage.Spooled:
    try:
        return storage.fetch(item.path, item.facts.size_bytes)
    except FileNotFoundError:
        raise ItemError(NOT_FOUND, "no such object in the store") from None
