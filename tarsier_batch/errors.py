"""Why an item failed: the fixed vocabulary of the `error_kind` column, the error that carries a kind, and
text that is safe to show and store (file names of any encoding, errors on one line); text that names
settings (`Worded`), which each caller words its own way.

A failure is classified where it happens (the file check, the decoders, the worker pool, the engine),
never afterwards from its message, so the kind stays the same when a message is reworded. Callers
filter and count by kind; the `error` message says the details in plain words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NOT_FOUND = "not_found"
UNREADABLE = "unreadable"
UNDECODABLE = "undecodable"
TOO_LARGE = "too_large"
TIMEOUT = "timeout"
OUT_OF_MEMORY = "out_of_memory"
CRASHED = "crashed"
MODEL_ERROR = "model_error"
INTERNAL = "internal"
UNKNOWN = "unknown"

# Every value `error_kind` takes (docs/pipelines.md, "Output", lists the same).
KINDS: dict[str, str] = {
    NOT_FOUND: "the file vanished after it was listed, never existed (a broken link), or is not in its store or shard",
    UNREADABLE: "the file is there but cannot be read: permission, not a regular file (a folder, FIFO, device), "
                "empty, a symlink loop, an I/O or network error",
    UNDECODABLE: "the bytes give no frames: not media (text, random bytes), a video cut short or corrupt, "
                 "no video stream (audio only), an image Pillow cannot read",
    TOO_LARGE: "an image above max_image_pixels, a shape the model refuses (Tarsier2: an aspect ratio above 200), "
               "or more positions than the KV cache holds",
    TIMEOUT: "decoding took longer than decode_timeout_s; the worker was stopped",
    OUT_OF_MEMORY: "the decoding worker hit its memory limit (decode_memory_gb), or the model step ran out of "
                   "memory with the item alone",
    CRASHED: "the decoder crashed on the file (a native fault such as SIGSEGV) or its worker died",
    MODEL_ERROR: "the model step failed for this item (the others went on)",
    INTERNAL: "tarsier-batch itself failed for this item (a worker that could not start, a result that could not "
              "be received): a bug to report",
    UNKNOWN: "an error row written by a version before error_kind existed",
}


class ItemError(ValueError):
    """One item's failure, with its kind (one of `KINDS`) and a one-line message in plain words.

    A ValueError, so that callers that catch "this input is bad" as ValueError keep doing so.
    """

    def __init__(self, kind: str, message: str):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # As an exception pickles by default (its args alone), it would come back from a worker process without
        # its kind, and fail to unpickle at all.
        return type(self), (self.kind, str(self))


def plain_message(error: BaseException, limit: int = 500) -> str:
    """`error`'s own words on one line, at most `limit` characters, without its class name (which says nothing
    to whoever reads the row); its class name only where it has no words."""
    text = " ".join(str(error).split()) or f"{type(error).__name__} with no message"
    return printable(text[:limit])


def printable(text: str) -> str:
    """`text` with undecodable bytes (from non-UTF-8 file names) shown as escapes, never raising."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def one_line(error: BaseException, limit: int = 500) -> str:
    """`Type: message` on one line, at most `limit` characters, for error rows and log lines."""
    text = " ".join(str(error).split()) or type(error).__name__
    return printable(f"{type(error).__name__}: {text}"[:limit])


class Worded(str):
    """Text that names settings: as their field names (`top_p`), or in a caller's own words (`--top-p`).

    The library says which setting it means; the caller that knows how a person gave it words it: the
    command line by its flags, while a Python caller reads the field names. `template` holds each setting
    as `{field}` and each other value as `{name}` of `values`, formatted there (so braces in a path are
    safe). An error carries it as its message (`raise OutputError(Worded(...))`); `worded` finds it there.
    """

    template: str
    values: dict[str, Any]

    def __new__(cls, template: str, **values: Any) -> Worded:
        if isinstance(template, Worded) and not values:   # unpickled as an error's message
            return template
        text = super().__new__(cls, _filled(template, {}, values))
        text.template, text.values = template, values
        return text

    def __getnewargs_ex__(self) -> tuple[tuple[str], dict[str, Any]]:
        return (self.template,), self.values

    def worded(self, words: Mapping[str, str]) -> str:
        """The text with each setting named as `words` says (a field it lacks keeps its name)."""
        return _filled(self.template, words, self.values)


def worded(said: object, words: Mapping[str, str]) -> str:
    """A note or an error (its message) in the words of `words` where it names settings, else as it is."""
    message = said.args[0] if isinstance(said, BaseException) and len(said.args) == 1 else said
    return message.worded(words) if isinstance(message, Worded) else str(said)


class _Names(dict):  # type: ignore[type-arg]
    """A template's values, and for any other placeholder (a setting) its words, else its own name."""

    def __init__(self, words: Mapping[str, str], values: Mapping[str, Any]):
        super().__init__(values)
        self.words = words

    def __missing__(self, name: str) -> str:
        return self.words.get(name, name)


def _filled(template: str, words: Mapping[str, str], values: Mapping[str, Any]) -> str:
    # A value that names settings itself (a line of several notes) is worded alike.
    values = {name: value.worded(words) if isinstance(value, Worded) else value for name, value in values.items()}
    return template.format_map(_Names(words, values))


def plural(number: int, noun: str) -> str:
    """'1 item', '2 items', '10,000 items'."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
