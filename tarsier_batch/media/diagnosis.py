"""Why a file cannot be decoded, in words: not a regular file, or what its bytes show where no decoder opens it
(a container cut short, text, bytes of no known format)."""

from __future__ import annotations

import os
import stat

from ..errors import NOT_FOUND, UNREADABLE, ItemError


def check_regular_file(path: str) -> None:
    """Fail with a clear reason, before opening, on anything but a readable, non-empty regular file.

    Opening a FIFO named like media would block for ever, and a device would never end.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ItemError(NOT_FOUND, "the file no longer exists" if os.path.lexists(path) is False
                        else "broken symbolic link") from None
    except OSError as error:  # ELOOP (a symlink loop), EACCES on a folder on the way, ...
        raise ItemError(UNREADABLE, f"cannot open: {error.strerror}") from None
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]
    for test, kind in kinds:
        if test(info.st_mode):
            raise ItemError(UNREADABLE, f"not a regular file: {kind}")
    if info.st_size == 0:
        raise ItemError(UNREADABLE, "empty file (0 bytes)")
    if not os.access(path, os.R_OK):
        raise ItemError(UNREADABLE, "cannot open: permission denied")


def why_no_decoder_opens(source: str) -> str | None:
    """What the file's bytes say about why no decoder opened it, where they say more than the decoders: FFmpeg
    gives "Invalid data found when processing input" alike for text, random bytes and an MP4 cut short."""
    try:
        with open(source, "rb") as file:
            head = file.read(_HEAD_BYTES)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return None
    if head[4:8] == b"ftyp":   # ISO base media (MP4, MOV, 3GP): its boxes say whether the file is whole
        return _mp4_problem(source, size)
    for signature, name in _CONTAINER_SIGNATURES:
        if head.startswith(signature):
            return f"the {name} file is damaged or cut short: no decoder can open it"
    if _looks_like_text(head):
        return "not a video: no media stream found (the file starts like text)"
    return "not a video: no media stream found (no decoder knows the format of its bytes)"


_HEAD_BYTES = 4096
_CONTAINER_SIGNATURES = ((b"\x1a\x45\xdf\xa3", "Matroska/WebM"), (b"RIFF", "AVI"), (b"FLV", "FLV"),
                         (b"OggS", "Ogg"), (b"\x00\x00\x01\xba", "MPEG-PS"), (b"\x30\x26\xb2\x75", "ASF/WMV"))


def _mp4_problem(source: str, size: int) -> str:
    """Why an MP4 no decoder opens is unreadable, from its top-level boxes (size, then type; a size of 1: a
    64-bit size follows; 0: up to the end of the file)."""
    offset, types = 0, set()
    with open(source, "rb") as file:
        while offset + 8 <= size:
            file.seek(offset)
            header = file.read(16)
            length, kind = int.from_bytes(header[:4], "big"), header[4:8]
            if length == 1 and len(header) == 16:
                length = int.from_bytes(header[8:16], "big")
            elif length == 0:
                length = size - offset
            if length < 8:
                return f"the MP4 is damaged: a box at byte {offset:,} has an impossible size ({length})"
            types.add(kind)
            if offset + length > size:
                return (f"the video is cut short: the file ends at byte {size:,}, inside its "
                        f"{kind.decode('latin-1')!r} box, which runs to byte {offset + length:,}")
            offset += length
    if b"moov" not in types:
        return "the video is cut short or was never finished: the MP4 has no index (moov box)"
    return "the MP4 is damaged: its boxes are whole, but no decoder finds a playable stream in them"


def _looks_like_text(head: bytes) -> bool:
    """Do the first bytes read as text (UTF-8, no control characters but whitespace)?"""
    if not head or b"\x00" in head:
        return False
    for cut in range(4):   # the head may end inside a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(character.isprintable() or character.isspace() for character in text)
    return False
