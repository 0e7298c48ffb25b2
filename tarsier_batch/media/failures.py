"""A decoder's failure, said on one line."""

from __future__ import annotations

import re


class DecoderFailure(Exception):
    """A decoder could not open or decode the file; the message is one line."""


def short_error(error: BaseException) -> str:
    """An error on one line, without decord's "[12:00:00] /src/video/video_reader.cc:83: " prefix."""
    text = _NATIVE_LOG_PREFIX.sub("", " ".join(str(error).split()))
    return text[:200] or type(error).__name__


_NATIVE_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")
