"""The decoding pool's reader of WebDataset shards: each shard streamed once, members handed on in tar order.

Only one reader can follow a shard's stream, and items reach the pool in input order (the
members of a shard together, in tar order), so one thread serves them all: it keeps the current
shard's stream open and reads each member as its turn comes, so a run over a shard costs one
GET of it on an object store, not one request per member. The bytes read ahead but not yet
decoded are bounded, so a fast store cannot fill memory while the workers are busy.

A member is read straight into an unnamed in-memory file (`storage.Spooled`: memfd, or an unnamed file
on disk past `storage.SPILL_TO_DISK_BYTES`) that a worker opens by path (`/proc/PID/fd/N`): its bytes
are never a Python object here, nor pickled to the worker and copied again there. The file is closed
once the item is decoded (`release`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import storage
from ..errors import plain_message
from ..inputs import tars
from ..inputs.copies import member_copy
from ..inputs.sources import MediaItem

READ_AHEAD_BYTES = 256 * 2**20   # member bytes read but not yet decoded (one bigger member still passes alone)
_JOIN_TIMEOUT_S = 30


class MemberLane:
    """Reads members for the pool on one thread: `hand_on(item_with_its_copy, ticket)` or `fail(item, ticket,
    message)` per item, `ticket` being what `read` was given with it (unique per item).

    `release(ticket)` closes an item's copy and gives back its share of the read-ahead bound once it is decoded.
    """

    def __init__(self, hand_on: Callable[[MediaItem, Any], None], fail: Callable[[MediaItem, Any, str], None],
                 read_ahead_bytes: int = READ_AHEAD_BYTES):
        self._hand_on, self._fail = hand_on, fail
        self._read_ahead_bytes = read_ahead_bytes
        self._queue: queue.SimpleQueue[tuple[MediaItem, Any] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._room = threading.Condition()
        self._in_flight = 0
        self._copies: dict[Any, tuple[int, storage.Spooled]] = {}   # ticket -> (bytes, copy), until released
        self._thread = threading.Thread(target=self._run, name="tarsier-shard-reader", daemon=True)
        self._thread.start()

    def read(self, item: MediaItem, ticket: Any) -> None:
        """Queue a shard member (`item.member` set) to be read and handed on with `ticket`."""
        self._queue.put((item, ticket))

    def release(self, ticket: Any) -> None:
        """Close the copy handed on with `ticket` (a worker that opened it keeps its own descriptor) and give back
        its bytes to the read-ahead bound; nothing if none was handed on."""
        with self._room:
            size, copy = self._copies.pop(ticket, (0, None))
            self._in_flight -= size
            self._room.notify_all()
        if copy is not None:
            copy.close()

    def close(self) -> None:
        """Stop reading (a read under way stops within a chunk); items still queued are left to the caller, and
        copies not yet released are closed."""
        self._stop.set()
        with self._room:
            self._room.notify_all()
        self._queue.put(None)
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        with self._room:
            copies, self._copies = self._copies, {}
        for _, copy in copies.values():
            copy.close()

    def _run(self) -> None:
        reader: tars.ShardReader | None = None
        reading = ""
        try:
            while (entry := self._queue.get()) is not None and not self._stop.is_set():
                item, ticket = entry
                shard = item.shard or ""
                if reader is None or reading != shard:
                    if reader is not None:
                        reader.close()
                    reader, reading = tars.ShardReader(shard, item.shard_version, stop=self._stop), shard
                if not self._wait_for_room(item):
                    return
                try:
                    copy = member_copy(item, reader)
                except tars.ReadStopped:
                    return
                except Exception as error:  # this member's problem (or its shard's): its row says why
                    self._give_back_room(item)
                    reader.close()
                    reader = None   # reopened for the next member
                    self._fail(item, ticket,
                               f"cannot read it from its shard: {storage.redact_text(plain_message(error))}")
                    continue
                with self._room:
                    self._copies[ticket] = (item.member.size, copy)
                self._hand_on(replace(item, local_copy=copy.path), ticket)   # never raises (the pool's callback)
        finally:
            if reader is not None:
                reader.close()

    def _give_back_room(self, item: MediaItem) -> None:
        with self._room:
            self._in_flight -= item.member.size
            self._room.notify_all()

    def _wait_for_room(self, item: MediaItem) -> bool:
        """Take `item`'s bytes from the read-ahead bound, waiting while it is full; False once stopped."""
        size = item.member.size
        with self._room:
            while self._in_flight and self._in_flight + size > self._read_ahead_bytes and not self._stop.is_set():
                self._room.wait()
            self._in_flight += size
        return not self._stop.is_set()
