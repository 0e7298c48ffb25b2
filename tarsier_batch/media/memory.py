"""Handing the memory freed by a decoded frame back to the system, so the heap does not grow frame by frame."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


def return_freed_memory() -> None:
    """Hand the freed temporaries of the last frame back to the system (glibc only).

    Each kept result (a 1.35 MB pixel tensor at 336 px) is allocated among its frame's
    temporaries (the full frame, its stretched square and their arrays, 5-15 MB each). Once
    those are freed the results split the free space into pieces too small for the next
    frame's temporaries, so the heap grows: measured ~2 MB per frame on top of the results.
    `malloc_trim` releases the free pages (well under a millisecond).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc (musl, macOS) or no C library handle
        return None
