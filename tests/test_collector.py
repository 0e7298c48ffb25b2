"""The cyclic garbage collector is paused while a model loads (model/collector.py): what the pause promises, and
that a load of every built-in family keeps it without holding memory back."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tarsier_batch import api
from tarsier_batch.api import Captioner
from tarsier_batch.families.catalog import model_families
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.inputs.sources import MediaItem
from tarsier_batch.media import MediaType
from tarsier_batch.model.collector import collection_paused
from tarsier_batch.settings.caption import CaptionSettings, SamplingParams

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


class Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def held_by(captioner: Captioner) -> dict[str, weakref.ref]:
    """Weak references to what holds a Captioner's memory: its model, its engine, its KV cache."""
    return {"model": weakref.ref(captioner.model), "engine": weakref.ref(captioner.engine),
            "kv cache": weakref.ref(captioner.engine.pools[0].keys)}


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic collector off: what is freed inside is freed by reference counting alone."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of each collection that starts while the test runs."""
    started: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        yield started
    finally:
        gc.callbacks.remove(record)


def test_nothing_is_collected_inside_and_the_collector_runs_again_after(collections: list[int]) -> None:
    with collection_paused():
        assert not gc.isenabled()
        made = [Cycle() for _ in range(20_000)]   # enough allocations for many young collections
        assert collections == []
    assert gc.isenabled()
    del made
    gc.collect()
    assert collections == [2]


def test_what_the_block_made_is_in_the_oldest_generation_after_it() -> None:
    """Left young, the collector would walk all of it again in its young collections (0.5 s after a model load)."""
    with collection_paused():
        kept = Cycle()
    assert gc.get_count() == (0, 0, 0)
    assert any(found is kept for found in gc.get_objects(generation=2))


def test_garbage_the_block_left_is_freed_by_the_next_full_collection() -> None:
    with collection_paused():
        left = weakref.ref(Cycle())
    assert left() is not None   # a cycle: refcounting alone cannot free it
    gc.collect()
    assert left() is None


def test_a_pause_inside_another_leaves_resuming_to_the_outer_one() -> None:
    with collection_paused():
        with collection_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_resumes_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("the load failed")
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off() -> None:
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("family", [family.key for family in model_families()])
def test_each_family_loads_with_the_collector_paused_and_leaves_no_tensor_in_garbage(
        tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's code is imported (its processor and network) and its weights read with the collector paused;
    what the load made is in the oldest generation after it; a download would run with the collector on. A tensor
    that the load left in a reference cycle would stay in memory until the collector's next full collection: for
    a 7B model, gigabytes. Every family's load leaves none."""
    model_dir = make_tiny_model(tmp_path / family, "tiny", seed=0, family=family)
    collecting: dict[str, bool] = {}

    def watched(name: str, function):
        def call(*args):
            collecting[name] = gc.isenabled()
            return function(*args)
        monkeypatch.setattr(api, name, call)

    for name in ("resolve_model", "load_processor", "load_caption_model"):
        watched(name, getattr(api, name))
    captioner = Captioner(CaptionSettings(model=str(model_dir), device="cpu", isolate_decoding=False))
    assert collecting == {"resolve_model": True, "load_processor": False, "load_caption_model": False}
    assert gc.isenabled()
    assert any(found is captioner.model for found in gc.get_objects(generation=2))
    gc.set_debug(gc.DEBUG_SAVEALL)   # what a collection frees, kept in gc.garbage to be looked at
    try:
        gc.collect()
        held = [type(found).__name__ for found in gc.garbage if isinstance(found, (torch.Tensor, torch.nn.Module))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert held == []


@pytest.mark.parametrize("family", [family.key for family in model_families()])
def test_a_captioner_dropped_after_captioning_frees_its_model_and_kv_cache_without_the_collector(
        tmp_path: Path, family: str) -> None:
    """What the load made sits in the oldest generation, which the collector walks rarely: a model or KV cache
    kept alive by a reference cycle would stay in memory long after its Captioner was dropped (a step function
    that held its own method did: the model's weights outlived the engine). Refcounting alone frees them."""
    model_dir = make_tiny_model(tmp_path / family, "tiny", seed=0, family=family)
    captioner = Captioner(CaptionSettings(model=str(model_dir), device="cpu", isolate_decoding=False,
                                          sampling=SamplingParams(max_new_tokens=4)))
    results = list(captioner.caption([MediaItem(str(SAMPLE / "still.png"), MediaType.IMAGE),
                                         MediaItem(str(SAMPLE / "ball_h264.mp4"), MediaType.VIDEO)]))
    assert [result.error for result in results] == [None, None]
    kept = held_by(captioner)
    with collector_off():
        del captioner, results
        assert [name for name, ref in kept.items() if ref() is not None] == []


def test_a_captioner_dropped_after_serving_frees_its_model_without_the_collector(tiny_model_dir: Path) -> None:
    """A closed service keeps its failure (the close) for later callers: its traceback holds the service's frames,
    which must not hold the service, or the Captioner stays alive in a reference cycle."""
    captioner = Captioner(CaptionSettings(model=str(tiny_model_dir), device="cpu", isolate_decoding=False))
    server = captioner.serve()
    server.close()
    with pytest.raises(RuntimeError, match="stopped earlier"):
        server.submit([])
    kept = held_by(captioner)
    with collector_off():
        del captioner, server
        assert [name for name, ref in kept.items() if ref() is not None] == []


def test_objects_the_process_froze_itself_stay_frozen() -> None:
    """A process that freezes what it holds before forking workers keeps them out of every collection: the pause
    must not unfreeze them."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collection_paused():
            Cycle()
        assert gc.get_freeze_count() == frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()
