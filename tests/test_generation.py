"""Captioning many items together equals captioning them one at a time, token for token (float32)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tarsier_batch import Captioner, CaptionSettings, MediaItem, SamplingParams
from tarsier_batch.families.tarsier.family import TarsierCaptionModel
from tarsier_batch.media import MediaType, media_type_of

MAX_NEW = 24


def mixed_items(shared_media: Path, sample_data: Path) -> list[MediaItem]:
    """An image, GIFs with 5 and 8 frames, videos with 8 frames, two custom prompts."""
    def item(path: Path, prompt: str | None = None) -> MediaItem:
        media_type = media_type_of(path)
        assert media_type is not None
        return MediaItem(str(path), media_type, prompt)

    return [
        item(shared_media / "tarsier_logo.jpg"),
        item(shared_media / "clip_5f.gif"),
        item(shared_media / "short_5f.mp4", "What moves in this clip?"),
        item(shared_media / "portrait_25fps.mp4"),
        item(sample_data / "still.png", "Name the colours."),
        item(shared_media / "demo_test_8frames.gif"),
        item(sample_data / "ball_vp9.webm"),
    ]


@pytest.fixture(scope="module")
def settings(tiny_model_dir: Path) -> CaptionSettings:
    return CaptionSettings(model=str(tiny_model_dir), sampling=SamplingParams(max_new_tokens=MAX_NEW),
                           dtype="float32", device="cpu")


def caption_ids(settings: CaptionSettings, items: list[MediaItem]) -> list[list[int]]:
    results = list(Captioner(settings).caption(items))
    assert all(result.ok for result in results), [result.error for result in results]
    return [result.generated_ids for result in results]


def test_mixed_batch_equals_one_at_a_time(settings: CaptionSettings, shared_media: Path) -> None:
    from conftest import SAMPLE_DATA

    items = mixed_items(shared_media, SAMPLE_DATA)
    alone = caption_ids(replace(settings, batch_size=1), items)
    together = caption_ids(replace(settings, batch_size=len(items)), items)
    in_threes = caption_ids(replace(settings, batch_size=3), items)
    assert together == alone
    assert in_threes == alone
    assert all(len(ids) == MAX_NEW for ids in alone)
    assert len({tuple(ids) for ids in alone}) == len(items), "inputs should give distinct outputs"


def test_sampling_is_reproducible_and_independent_of_batching(settings: CaptionSettings, shared_media: Path) -> None:
    from conftest import SAMPLE_DATA

    items = mixed_items(shared_media, SAMPLE_DATA)[:4]
    sampled = replace(settings, sampling=SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7))
    first = caption_ids(replace(sampled, batch_size=4), items)
    again = caption_ids(replace(sampled, batch_size=1), items)
    greedy = caption_ids(replace(settings, batch_size=4), items)
    other_seed = caption_ids(replace(sampled, sampling=replace(sampled.sampling, seed=8), batch_size=4), items)
    assert first == again
    assert first != [ids[:12] for ids in greedy]
    assert first != other_seed


def test_half_precision_runs_end_to_end(settings: CaptionSettings, shared_media: Path) -> None:
    """bfloat16 weights with float32 pixels and masks: no dtype mismatch anywhere."""
    items = [MediaItem(str(shared_media / "clip_5f.gif"), MediaType.GIF),
             MediaItem(str(shared_media / "tarsier_logo.jpg"), MediaType.IMAGE)]
    captioner = Captioner(replace(settings, dtype="bfloat16", batch_size=2))
    network = captioner.model.model
    assert network.language_model.lm_head.weight.dtype == torch.bfloat16
    assert network.vision_tower.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    assert network.language_model.model.rotary_emb.inv_freq.dtype == torch.float32
    results = list(captioner.caption(items))
    assert [result.error for result in results] == [None, None]
    assert all(result.generated_tokens == MAX_NEW for result in results)


def test_decoding_drops_ids_the_tokenizer_does_not_know(tiny_model: TarsierCaptionModel) -> None:
    tokenizer = tiny_model.processor.tokenizer
    known = tokenizer("a man walks", add_special_tokens=False)["input_ids"]
    beyond = [tiny_model.config.image_newline_idx, tiny_model.config.image_new_idx,
              tiny_model.config.text.vocab_size - 1]
    mixed = known[:1] + beyond[:2] + known[1:] + beyond[2:] + [tokenizer.eos_token_id]
    assert tiny_model.decode(mixed) == tiny_model.decode(known) == "a man walks"


@pytest.mark.parametrize("in_order", [True, False])
def test_results_come_in_input_order_though_rows_finish_out_of_order(settings: CaptionSettings, shared_media: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     in_order: bool) -> None:
    """In input order, or (what a run saves rows by) as each finishes: then a row is not held back by an earlier
    item still generating, and a kill loses less."""
    import threading

    from conftest import SAMPLE_DATA
    from tarsier_batch.workers import pool as workers

    items = mixed_items(shared_media, SAMPLE_DATA)
    # Every item is decoded before the first can join the batch, so which rows finish first
    # depends only on the engine (short prompts first), never on decoding speed.
    captioner = Captioner(replace(settings, batch_size=3, prefill_chunk=64, isolate_decoding=False,
                                  workers=len(items)))
    others_done = threading.Semaphore(0)
    real_decode = workers.decode_item

    def decode_first_last(job, index, item):
        if index == 0:
            for _ in items[1:]:
                others_done.acquire()
            return real_decode(job, index, item)
        decoded = real_decode(job, index, item)
        others_done.release()
        return decoded

    monkeypatch.setattr(workers, "decode_item", decode_first_last)
    finished: list[str] = []
    real_step = captioner.engine.step

    def recording_step(on_tokens=None):
        rows = real_step(on_tokens)
        finished.extend(row.payload[0].decoded.item.path for row in rows)   # (the item queued, its question)
        return rows

    monkeypatch.setattr(captioner.engine, "step", recording_step)
    results = list(captioner.caption(items, in_order=in_order))
    assert [result.path for result in results] == ([item.path for item in items] if in_order else finished)
    assert finished != [item.path for item in items], "short prompts should finish first"
    assert sorted(finished) == sorted(item.path for item in items)


def test_item_too_large_for_the_kv_cache_is_an_error_row(settings: CaptionSettings, shared_media: Path) -> None:
    from conftest import SAMPLE_DATA

    items = mixed_items(shared_media, SAMPLE_DATA)[:3]  # an image, a 5-frame GIF, a video
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # layers x (keys, values) x kv heads x head dim x float32
    # 170 slots' worth: the cache holds whole pages of 32 slots, 5 pages (160 slots), fewer than 168 positions.
    tight = replace(settings, batch_size=2, kv_cache_gb=170 * bytes_per_token / 2**30)
    with pytest.raises(ValueError, match="^frames 8 needs at least 168 positions per item, more than the KV cache"):
        Captioner(tight)  # 8 frames of 21 vectors can never fit: refused before any item is decoded
    captioner = Captioner(replace(tight, frames=7))  # 147 vision positions fit, but not with the text around them
    results = list(captioner.caption(items))
    assert [result.ok for result in results] == [True, True, False], [result.error for result in results]
    assert "more than the cache holds (160 tokens)" in (results[2].error or "")
    assert [result.error_kind for result in results] == [None, None, "too_large"]
    assert results[0].generated_ids == caption_ids(replace(settings, batch_size=1, frames=7), items[:1])[0]


def test_the_caller_hears_ticks_while_the_model_waits_for_a_decode(settings: CaptionSettings, shared_media: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A run saves waiting rows on each `on_tokens` call: while the model waits on a slow decode (up to
    --decode-timeout), calls with 0 tokens keep coming. Here the second decode waits for such a call."""
    import threading

    from conftest import SAMPLE_DATA
    from tarsier_batch.workers import pool as workers

    items = mixed_items(shared_media, SAMPLE_DATA)[:2]
    captioner = Captioner(replace(settings, batch_size=1, workers=1, isolate_decoding=False))
    first_done, ticked = threading.Event(), threading.Event()
    real_decode = workers.decode_item

    def second_waits_for_a_tick(job, index, item):
        if index == 1:
            ticked.wait(60)   # without ticks: held 60 s, and the assertion below fails
        return real_decode(job, index, item)

    def on_tokens(count: int) -> None:
        if count == 0 and first_done.is_set():   # the engine has nothing to do: only the wait calls now
            ticked.set()

    monkeypatch.setattr(workers, "decode_item", second_waits_for_a_tick)
    results = []
    for result in captioner.caption(items, on_tokens):
        results.append(result)
        first_done.set()
    assert ticked.is_set() and [result.ok for result in results] == [True, True]
