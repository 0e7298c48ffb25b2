"""Where a report's frame strips go: inside the page as data: URIs, or as JPEG files in a folder beside it.

Inline, the page is one file to copy or mail; but a strip is about 12 KB, so 2,000 of them make
a page of 24 MB that a browser reads whole. Beside it (`report_files/` for `report.html`, as a
browser saves a page), the page stays small and the images load as their items are shown; the
page and its folder still work offline, wherever they are copied together.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

from ..outputs.formats import OutputError
from .thumbnails import Strip

THUMBNAIL_MODES = ("auto", "inline", "folder")
INLINE_STRIPS_AT_MOST = 1_000   # "auto": more strips than this go to a folder (about 12 MB of them inline)
_STRIP_NAME = re.compile(r"\d{6}\.jpg")


def strips_folder(page: Path) -> Path:
    """The folder beside `page` that holds its strips."""
    return page.with_name(f"{page.stem}_files")


def place_strips(strips: list[Strip | None], page: Path, mode: str = "auto"
                 ) -> tuple[list[dict[str, str | None]], Path | None]:
    """Per item, {"uri": ...} (a data: URI, or the strip's path relative to the page) or {"problem": ...} or {}
    (no strip); and the folder the strips were written to (None: inline)."""
    made = sum(strip is not None and strip.jpeg is not None for strip in strips)
    if mode == "inline" or (mode == "auto" and made <= INLINE_STRIPS_AT_MOST):
        return [_inline(strip) for strip in strips], None
    folder = strips_folder(page)
    names: dict[int, str] = {}   # an item's strip shared with another's (the same frames) is one file
    temporary = page.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    placed = []
    try:
        for strip in strips:
            if strip is None or strip.jpeg is None:
                placed.append({"problem": strip.problem} if strip is not None else {})
                continue
            if id(strip) not in names:
                names[id(strip)] = f"{len(names):06d}.jpg"
                (temporary / names[id(strip)]).write_bytes(strip.jpeg)
            placed.append({"uri": f"{quote(folder.name)}/{names[id(strip)]}"})
        _replace_folder(temporary, folder)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return placed, folder


def _inline(strip: Strip | None) -> dict[str, str | None]:
    if strip is None:
        return {}
    return {"uri": strip.uri} if strip.jpeg is not None else {"problem": strip.problem}


def _replace_folder(new: Path, folder: Path) -> None:
    """Put `new` in the place of `folder`: an earlier report's strips folder is replaced, anything else refused."""
    if folder.exists():
        if not folder.is_dir() or any(not _STRIP_NAME.fullmatch(entry.name) for entry in folder.iterdir()):
            raise OutputError(f"{folder} exists and is not the strips folder of an earlier report; move it away")
        old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
        os.replace(folder, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(new, folder)
