"""What a worker reads of the video whose spans it decodes, kept for its next span: a worker takes a long video's
windows one after another, and reading the index (decord) or the packets (PyAV) of an hour of video takes
longer than decoding a window's frames."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

spans_video = threading.local()     # decord's reader of the video (`decord_video.OpenVideo`)
spans_packets = threading.local()   # its packets' times, as PyAV reads them (`pyav_video.PacketTimes`)
spans_reading = threading.local()   # which decoder decodes its spans (`video._SpansReading`)
T = TypeVar("T")


def kept_for_spans(slot: threading.local, source: str, read: Callable[[], T]) -> T:
    """What `read` reads of `source`, kept in this thread's `slot`: the one read last if of the same unchanged file."""
    stat = os.stat(source)
    identity = (source, stat.st_size, stat.st_mtime_ns)
    kept: tuple[tuple[str, int, int], T] | None = getattr(slot, "kept", None)
    if kept is None or kept[0] != identity:
        slot.kept = None   # the other video's goes before this one is read
        slot.kept = (identity, read())
    return slot.kept[1]
