"""`--shard I/N`: a deterministic 1/N of a run's items, for Slurm arrays and one process per GPU.

An item's shard is a hash of its resolved path, the part of its stable key that never changes
(the rest of a `--key path` key is the size and modification time): a folder that grows keeps
every earlier item in its shard, and an edited file stays where its earlier row is, so each
shard's output resumes like a single run's. The hash is SHA-256, not Python's `hash()`, which is
salted per process: every machine of an array must agree.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import Worded, printable
from ..storage import is_url, redact
from .sources import MediaItem, row_id_of
from .tars import split_member_path

_SHARD_TEXT = re.compile(r"(\d+)/(\d+)")


class ShardError(ValueError):
    """A --shard value that names no shard."""


@dataclass(frozen=True)
class Shard:
    """Shard `index` (from 0, as Slurm's `--array=0-<N-1>` numbers tasks) of `count`."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        match = _SHARD_TEXT.fullmatch(text.strip())
        if not match:
            raise ShardError(Worded("{shard} {text!r}: give I/N, shard I (from 0) of N, e.g. {shard} 0/8", text=text))
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1 or index >= count:
            raise ShardError(Worded("{shard} {text}: I must be 0 to N-1 (shards are numbered from 0, as Slurm numbers "
                                    "the tasks of an array 0-{last})", text=text, last=max(count, 1) - 1))
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, item: MediaItem) -> bool:
        # A WebDataset shard's members stay together, so that each process streams whole tars.
        split = split_member_path(item.path) if item.member is not None else None
        return shard_of(split[0] if split is not None else item.path, self.count) == self.index

    def provenance(self, items: Sequence[MediaItem], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """What `tarsier merge` needs of this shard's output: which shard, and where each row goes.

        `items` are the whole run's items before sharding; `rows` the shard's output rows. A
        row's position is its item's place among `items` (None for a row kept from an earlier
        run whose file is no longer an input), so merged rows come out in input order.
        """
        position = {item.row_id: number for number, item in enumerate(items)}
        return {"index": self.index, "count": self.count, "inputs": len(items),
                # A window cut from a listed file (--segments) takes its file's place: its rows stay in order.
                "positions": [position.get(row_id_of(row), position.get(row["path"])) for row in rows]}


def shard_of(path: str, count: int) -> int:
    """The shard (0 to `count` - 1) of the file or object at `path`."""
    named = redact(path) if is_url(path) else os.path.realpath(path)
    resolved = printable(named).encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.sha256(resolved).digest()[:8], "big") % count
