"""Python's cyclic garbage collector paused while a process imports and loads a model.

Importing torch and transformers' model code makes some 350,000 objects that live as long as the process. The
collector runs by allocation counts, so it walks them again and again while they are being made: about 15 % of the
time a model process spends before its first row (0.6 s of 5 s for the demo model on 2 cores). What the imports
and the load leave behind for it is small (about 10,000 objects, import-time closures and tuples; no tensor, for
every built-in family: tests/test_collector.py), so it can wait for the collector's next full collection.

The same holds later for what the block made: a reference cycle among those objects is freed only by a full
collection, which comes rarely. So the model and its engine keep none of their memory in a cycle: a dropped
Captioner frees its weights and KV cache by reference counting alone (tested for every family).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic collection inside the block; after it, the collector as it was (a pause inside another one leaves
    the resuming to the outer one)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            # What the block made moves to the oldest generation at once (frozen, then back: unfrozen objects go
            # there), without a walk: the collector walks it next in a full collection, and frees there what the
            # block left behind. Resumed with it in the youngest generation instead, it would walk all of it twice
            # first (0.5 s for the demo model). Not where the process froze objects itself (a server that forks
            # workers does): unfreezing would release those too.
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
