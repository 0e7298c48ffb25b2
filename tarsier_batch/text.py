"""Text that is safe to show and store: file names of any encoding, errors on one line."""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with undecodable bytes (from non-UTF-8 file names) shown as escapes, never raising."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def one_line(error: BaseException, limit: int = 500) -> str:
    """`Type: message` on one line, at most `limit` characters, for error rows and log lines."""
    text = " ".join(str(error).split()) or type(error).__name__
    return printable(f"{type(error).__name__}: {text}"[:limit])
