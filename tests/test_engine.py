"""The engine computes every row exactly as if it were alone: chunked, continuous, preempted, offloaded."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import all_pages_free
from tarsier_batch.engine import Engine, EngineConfig, SamplingParams, Sequence
from tarsier_batch.families.base import ProcessedPrompt, embed_whole_prompt
from tarsier_batch.families.tarsier.family import TarsierCaptionModel
from tarsier_batch.media import load_media, media_type_of

MAX_NEW = 24
# Different lengths: an image (47 positions), a 5-frame GIF (131), 8-frame videos and GIFs (194).
NAMES = ["tarsier_logo.jpg", "clip_5f.gif", "short_5f.mp4", "demo_test_8frames.gif", "portrait_200x333.png",
         "portrait_25fps.mp4", "clip_12f.gif"]


def process(model: TarsierCaptionModel, path: Path, frames: int = 8, instruction: str | None = None) -> ProcessedPrompt:
    media = load_media(str(path), media_type_of(path), frames, frame_transform=model.processor.frame_pixels)
    return model.processor.process(media, instruction)


@pytest.fixture(scope="module")
def prompts(tiny_model: TarsierCaptionModel, shared_media: Path) -> list[ProcessedPrompt]:
    return [process(tiny_model, shared_media / name) for name in NAMES]


@pytest.fixture(scope="module")
def reference(tiny_model: TarsierCaptionModel, prompts: list[ProcessedPrompt]) -> list[list[int]]:
    """Greedy tokens of each prompt generated alone."""
    return alone(tiny_model, prompts)


def run(model: TarsierCaptionModel, prompts: list[ProcessedPrompt], sampling: SamplingParams | None = None,
        max_new: list[int] | None = None, seeds: list[int] | None = None, **config) -> list[Sequence]:
    """Generate for `prompts` with one engine; returns the sequences in input order."""
    sampling = sampling or SamplingParams(max_new_tokens=MAX_NEW)
    engine = Engine(model, EngineConfig(**config), sampling)
    rows = []
    for index, prompt in enumerate(prompts):
        rows.append(engine.add(prompt, payload=index, max_new_tokens=max_new[index] if max_new else None,
                               seed=seeds[index] if seeds is not None else None))
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    assert all_pages_free(engine)
    return rows


def alone(model: TarsierCaptionModel, prompts: list[ProcessedPrompt], **kwargs) -> list[list[int]]:
    """Each prompt in an engine of its own, unchunked: the reference."""
    max_new = kwargs.pop("max_new", None)
    seeds = kwargs.pop("seeds", None)
    return [run(model, [prompt], max_new=[max_new[i]] if max_new else None,
                seeds=[seeds[i]] if seeds else None, max_rows=1, prefill_chunk=0, **kwargs)[0].output_ids
            for i, prompt in enumerate(prompts)]


def ids(rows: list[Sequence]) -> list[list[int]]:
    return [row.output_ids for row in rows]


@pytest.mark.smoke
@pytest.mark.parametrize("chunk", [1, 5, 21, 64, 0])
def test_chunked_prefill_equals_unchunked(tiny_model: TarsierCaptionModel, prompts: list[ProcessedPrompt],
                                          reference: list[list[int]], chunk: int) -> None:
    """Chunk 5 splits a frame's 21 vectors across steps; chunk 1 computes one position per step."""
    chunked = run(tiny_model, prompts[:3], max_rows=3, prefill_chunk=chunk, max_batch_tokens=max(chunk, 3) + 3)
    assert ids(chunked) == reference[:3]
    assert all(len(row) == MAX_NEW for row in reference)
    assert len({tuple(row) for row in reference}) == len(prompts), "inputs should give distinct outputs"


def test_masked_chunks_attend_in_query_blocks_with_the_same_result(tiny_model: TarsierCaptionModel,
                                                                   prompts: list[ProcessedPrompt],
                                                                   reference: list[list[int]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tarsier_batch.engine import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 7)  # 64-position chunks: 9 query blocks, the last short
    chunked = run(tiny_model, prompts[:3], max_rows=3, prefill_chunk=64, max_batch_tokens=70)
    assert ids(chunked) == reference[:3]


@pytest.mark.parametrize("chunk", [5, 64])
def test_chunks_through_the_cuda_attention_path_equal_unchunked(tiny_model: TarsierCaptionModel,
                                                               prompts: list[ProcessedPrompt],
                                                               reference: list[list[int]], chunk: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA's path (keys widened to the query heads, a later chunk's triangle as a lower-right causal bias)
    # run on the CPU: a wrong alignment of the triangle or a wrong head widening changes the ids.
    from tarsier_batch.engine import attention

    monkeypatch.setattr(attention, "fuses_chunks", lambda device: True)
    chunked = run(tiny_model, prompts[:3], max_rows=3, prefill_chunk=chunk, max_batch_tokens=chunk + 6)
    assert ids(chunked) == reference[:3]


@pytest.mark.smoke
def test_rows_joining_and_leaving_equal_one_at_a_time(tiny_model: TarsierCaptionModel,
                                                      prompts: list[ProcessedPrompt]) -> None:
    """Three rows at a time over seven prompts of different lengths and token limits."""
    max_new = [3, 30, 7, 19, 1, 25, 12]
    reference = alone(tiny_model, prompts, max_new=max_new)
    continuous = run(tiny_model, prompts, max_new=max_new, max_rows=3, prefill_chunk=32, max_batch_tokens=40)
    assert ids(continuous) == reference
    assert [len(row) for row in reference] == max_new


def test_sampled_rows_joining_leaving_and_preempted_equal_one_at_a_time(tiny_model: TarsierCaptionModel,
                                                              prompts: list[ProcessedPrompt],
                                                              no_room_to_grow: None) -> None:
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)
    max_new = [5, 24, 9, 17, 2, 24, 11]
    seeds = [11, 12, 13, 14, 15, 16, 17]
    reference = alone(tiny_model, prompts, sampling=sampling, max_new=max_new, seeds=seeds)
    continuous = run(tiny_model, prompts, sampling=sampling, max_new=max_new, seeds=seeds, max_rows=3,
                     prefill_chunk=16, max_batch_tokens=24)
    assert ids(continuous) == reference
    # A cache of the first three prompts' pages and no more: the first row to need a page preempts another.
    filled = 8 * sum(-(-prompt.length // 8) for prompt in prompts[:3])
    preempted = run(tiny_model, prompts, sampling=sampling, max_new=max_new, seeds=seeds, max_rows=7,
                    prefill_chunk=64, kv_cache_tokens=filled, kv_page_slots=8)
    assert ids(preempted) == reference
    assert sum(row.preemptions for row in preempted) > 0
    greedy = alone(tiny_model, prompts, max_new=max_new)
    assert reference != greedy, "sampling should differ from greedy decoding"


def test_preempted_rows_are_recomputed_to_the_same_tokens(tiny_model: TarsierCaptionModel,
                                                          prompts: list[ProcessedPrompt],
                                                          reference: list[list[int]], no_room_to_grow: None) -> None:
    """A KV cache for about two rows forces preemptions mid-decode; outputs do not change."""
    engine_rows = run(tiny_model, prompts, max_rows=7, prefill_chunk=64, kv_cache_tokens=2 * (194 + MAX_NEW) + 20)
    assert ids(engine_rows) == reference
    assert sum(row.preemptions for row in engine_rows) > 0


def test_offloaded_prefill_gives_the_same_tokens(tiny_model: TarsierCaptionModel, prompts: list[ProcessedPrompt],
                                                 reference: list[list[int]]) -> None:
    offloaded = run(tiny_model, prompts, max_rows=4, prefill_chunk=50, offload_kv=True,
                    kv_cache_tokens=2 * (194 + MAX_NEW) + 20)
    assert ids(offloaded) == reference


def test_kv_cache_after_prefill_equals_transformers_cache(tiny_model: TarsierCaptionModel,
                                                          prompts: list[ProcessedPrompt]) -> None:
    """Our cache, filled in chunks beside another row, holds what transformers' forward caches."""
    video, image = prompts[2], prompts[0]
    engine = Engine(tiny_model, EngineConfig(max_rows=2, prefill_chunk=13, max_batch_tokens=20),
                    SamplingParams(max_new_tokens=2))
    rows = [engine.add(image), engine.add(video)]
    while any(row.num_computed_tokens < row.prompt.length for row in rows):
        engine.step()
    row = rows[1]
    assert engine.kv.block_tables(row) and row.num_computed_tokens == video.length
    embeds = embed_whole_prompt(tiny_model, video)
    language_model = tiny_model.model.language_model
    with torch.inference_mode():
        output = language_model(inputs_embeds=embeds[None], use_cache=True)
    for layer, cached in enumerate(output.past_key_values.layers):
        keys, values = engine.pools[0].read(engine.kv.block_tables(row)[0], layer, video.length)
        torch.testing.assert_close(keys, cached.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, cached.values, rtol=1e-5, atol=1e-5)


@pytest.mark.smoke
def test_greedy_tokens_match_transformers_generate(tiny_model: TarsierCaptionModel,
                                                   prompts: list[ProcessedPrompt]) -> None:
    language_model = tiny_model.model.language_model
    ours = ids(run(tiny_model, prompts[:4], max_rows=4, prefill_chunk=50))
    for prompt, tokens in zip(prompts[:4], ours):
        embeds = embed_whole_prompt(tiny_model, prompt)
        reference = language_model.generate(
            inputs_embeds=embeds[None], attention_mask=torch.ones(1, prompt.length, dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=sorted(tiny_model.eos_token_ids), pad_token_id=0)
        assert tokens == reference[0].tolist()


def test_rows_stop_at_their_own_eos(tiny_model: TarsierCaptionModel, prompts: list[ProcessedPrompt],
                                    reference: list[list[int]]) -> None:
    free_running = reference[:4]
    stopping = copy.copy(tiny_model)
    stopping.eos_token_ids = frozenset({free_running[1][5]})  # the GIF's sixth token stops it
    together = run(stopping, prompts[:4], max_rows=4)
    assert ids(together) == alone(stopping, prompts[:4])
    gif = together[1]
    assert gif.finish_reason == "eos" and gif.output_ids == free_running[1][:len(gif.output_ids)]
    assert len(gif.output_ids) <= 6
    for row, reference in zip(together, free_running):
        if free_running[1][5] not in reference:
            assert row.finish_reason == "length" and row.output_ids == reference


def test_step_budget_puts_decodes_first_and_caps_rows(tiny_model: TarsierCaptionModel,
                                                      prompts: list[ProcessedPrompt]) -> None:
    engine = Engine(tiny_model, EngineConfig(max_rows=2, prefill_chunk=100, max_batch_tokens=120),
                    SamplingParams(max_new_tokens=4))
    for prompt in prompts[:3]:
        engine.add(prompt)
    image, gif, video = engine.scheduler.waiting
    first = engine.scheduler.schedule()
    # The image whole (47) and the rest of the budget for the GIF (73 of 131); the video waits.
    assert [(row.seq, row.num_tokens) for row in first] == [(image, 47), (gif, 73)]
    engine.runner.run(first)
    for row in first:
        row.seq.num_computed_tokens += row.num_tokens
    image.output_ids.append(1)
    second = engine.scheduler.schedule()
    assert [(row.seq, row.num_tokens) for row in second] == [(image, 1), (gif, 58)]
    assert video in engine.scheduler.waiting and len(engine.scheduler.running) == 2


def test_out_of_memory_lowers_the_budget_and_completes(tiny_model: TarsierCaptionModel,
                                                       prompts: list[ProcessedPrompt], reference: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_model, EngineConfig(max_rows=4, prefill_chunk=64, max_batch_tokens=128),
                    SamplingParams(max_new_tokens=MAX_NEW))
    real_run = engine.runner.run
    calls = {"steps": 0}

    def run_out_of_memory_twice(step):
        calls["steps"] += 1
        if calls["steps"] in (3, 9):  # once in prefill, once when rows decode together
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_run(step)

    monkeypatch.setattr(engine.runner, "run", run_out_of_memory_twice)
    rows = [engine.add(prompt) for prompt in prompts]
    counted: list[int] = []
    while engine.has_work:
        engine.step(counted.append)
    assert ids(rows) == reference
    assert engine.scheduler.max_batch_tokens == 32 and engine.scheduler.max_rows < 4
    assert sum(counted) == sum(len(row.output_ids) for row in rows), "tokens are counted once"


def test_row_out_of_memory_even_alone_becomes_an_error(tiny_model: TarsierCaptionModel,
                                                       prompts: list[ProcessedPrompt], reference: list[list[int]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(tiny_model, EngineConfig(max_rows=2, prefill_chunk=64), SamplingParams(max_new_tokens=4))
    real_run = engine.runner.run
    huge = prompts[2]

    def run_out_of_memory_on_the_video(step):
        if any(row.seq.prompt is huge for row in step):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_run(step)

    monkeypatch.setattr(engine.runner, "run", run_out_of_memory_on_the_video)
    rows = [engine.add(prompt) for prompt in prompts[:4]]
    while engine.has_work:
        engine.step()
    assert [row.finish_reason for row in rows] == ["length", "length", "error", "length"]
    assert rows[2].error == "the model step ran out of memory even with this item alone"
    assert rows[2].error_kind == "out_of_memory"
    assert ids(rows)[:2] + ids(rows)[3:] == [reference[0][:4], reference[1][:4], reference[3][:4]]


def test_a_failing_row_is_found_and_the_others_finish(tiny_model: TarsierCaptionModel,
                                                      prompts: list[ProcessedPrompt], reference: list[list[int]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error in a shared step: every row of it reruns alone; only the culprit fails."""
    engine = Engine(tiny_model, EngineConfig(max_rows=4, prefill_chunk=64), SamplingParams(max_new_tokens=MAX_NEW))
    broken = prompts[1]
    real_encode = tiny_model.encode_vision

    def encode_failing_for_the_gif(pixels, blocks):
        if any(frame.data_ptr() == broken.pixel_values[0].data_ptr() for frame in pixels):
            raise RuntimeError("corrupt pixels (injected)")
        return real_encode(pixels, blocks)

    monkeypatch.setattr(tiny_model, "encode_vision", encode_failing_for_the_gif)
    rows = [engine.add(prompt) for prompt in prompts[:4]]
    while engine.has_work:
        engine.step()
    monkeypatch.undo()
    assert [row.finish_reason for row in rows] == ["length", "error", "length", "length"]
    assert (rows[1].error, rows[1].error_kind) == ("the model step failed: corrupt pixels (injected)", "model_error")
    assert [rows[0].output_ids, rows[2].output_ids, rows[3].output_ids] == [reference[0], reference[2], reference[3]]


def test_row_larger_than_the_kv_cache_is_refused_at_once(tiny_model: TarsierCaptionModel,
                                                         prompts: list[ProcessedPrompt]) -> None:
    engine = Engine(tiny_model, EngineConfig(kv_cache_tokens=100), SamplingParams(max_new_tokens=MAX_NEW))
    video = engine.add(prompts[2])
    image = engine.add(prompts[0])
    # The cache holds whole pages: 3 of 32 slots.
    assert video.finish_reason == "error" and "more than the cache holds (96 tokens)" in (video.error or "")
    assert video.error_kind == "too_large"
    assert image.error is None and list(engine.scheduler.waiting) == [image]
