"""The prefix cache: a row whose prompt starts like one computed earlier takes its computed pages instead of
computing them, and its tokens are those it gets computing everything (both families, greedy and sampled,
chunked, preempted); other pixels under the same ids share nothing from the first frame on."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import all_pages_free
from tarsier_batch import CaptionRun, CaptionSettings, RunSettings, SamplingParams
from tarsier_batch.engine import Engine, EngineConfig, Sequence
from tarsier_batch.families.base import ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import media_type_of

MAX_NEW = 10
PAGE = 8   # small pages: a prompt of the tiny models spans dozens, and the text before the frames whole ones
GREEDY = SamplingParams(max_new_tokens=MAX_NEW)
SAMPLED = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module", params=["tarsier", "tarsier2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    directory = make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)
    return load_caption_model(directory, torch.float32, torch.device("cpu"))


def decoded(model, path: Path) -> ProcessedPrompt:
    """The clip decoded and processed afresh: new tensors, equal content (the same file under a second path)."""
    media = model.processor.load_media(str(path), media_type_of(path), 8)
    return model.processor.process(media, None)


def run(engine: Engine, prompts: list[ProcessedPrompt], seed: int | None = None) -> list[Sequence]:
    rows = [engine.add(prompt, seed=seed) for prompt in prompts]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return rows


def alone(model, prompt: ProcessedPrompt, sampling: SamplingParams, seed: int | None) -> list[int]:
    """The prompt in an engine of its own, unchunked: nothing to take, everything computed."""
    engine = Engine(model, EngineConfig(max_rows=1, prefill_chunk=0, kv_page_slots=PAGE), sampling)
    return run(engine, [prompt], seed)[0].output_ids


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_clip_asked_again_takes_its_computed_pages_and_answers_the_same(model, shared_media, sampling) -> None:
    seed = 3 if sampling.temperature else None
    clip, other = decoded(model, shared_media / "demo_test_8frames.gif"), decoded(model, shared_media / "short_5f.mp4")
    again = decoded(model, shared_media / "demo_test_8frames.gif")
    assert again.pixel_values is not clip.pixel_values
    engine = Engine(model, EngineConfig(max_rows=1, prefill_chunk=24, max_batch_tokens=32, kv_page_slots=PAGE),
                    sampling)
    first, between, last = (run(engine, [prompt], seed)[0] for prompt in (clip, other, again))
    whole_pages = (clip.length - 1) // PAGE * PAGE   # all but the page holding the last position, computed to sample
    assert (first.cached, last.cached) == (0, whole_pages), "the second asking takes every whole page of the prompt"
    assert between.cached <= other.vision_blocks[0].start, "another clip: at most the text before its frames"
    assert first.output_ids == last.output_ids == alone(model, clip, sampling, seed)
    assert between.output_ids == alone(model, other, sampling, seed)
    counts = engine.prefix_counts
    assert (counts.rows, counts.prompt_positions) == (3, clip.length + other.length + again.length)
    assert counts.reused_positions == between.cached + whole_pages
    assert all_pages_free(engine) and engine.pools[0].pool.kept > 0, "the pages no row holds stay kept"


def test_the_same_ids_with_other_pixels_share_only_the_text_before_the_frames(model, shared_media) -> None:
    """A digest of the ids alone would make the second clip take the first's frames: its vectors are other."""
    clip = decoded(model, shared_media / "demo_test_8frames.gif")
    flipped = replace(clip, pixel_values=clip.pixel_values.flip(0))   # carries the first's digests, of other pixels
    assert torch.equal(flipped.token_ids, clip.token_ids) and torch.equal(flipped.positions, clip.positions)
    page = 2   # the text before the frames is 6 to 8 positions: whole pages of it
    engine = Engine(model, EngineConfig(max_rows=1, prefill_chunk=0, kv_page_slots=page), GREEDY)
    first, second = (run(engine, [prompt])[0] for prompt in (clip, flipped))
    before_frames = clip.vision_blocks[0].start // page
    assert second.cached == before_frames * page
    assert second.output_ids == alone(model, flipped, GREEDY, None)
    assert second.output_ids != first.output_ids, "other frames, another caption (else the test shows nothing)"
    assert clip.page_digests(page)[:before_frames] == flipped.page_digests(page)[:before_frames]
    assert clip.page_digests(page)[before_frames] != flipped.page_digests(page)[before_frames]


def test_rows_running_together_share_the_pages_the_first_computed(model, shared_media) -> None:
    """The same clip twice in one batch: the second is admitted once the first's chunks have computed pages it
    starts with, and holds them with it (both rows hold those pages at once)."""
    clip = decoded(model, shared_media / "demo_test_8frames.gif")
    engine = Engine(model, EngineConfig(max_rows=2, prefill_chunk=16, max_batch_tokens=16, kv_page_slots=PAGE),
                    GREEDY)
    first = engine.add(clip)
    engine.step()   # the first chunk: 16 positions, two pages computed
    second = engine.add(decoded(model, shared_media / "demo_test_8frames.gif"))
    shared_seen = 0
    while engine.has_work:
        engine.step()
        first_tables, second_tables = engine.kv.block_tables(first), engine.kv.block_tables(second)
        if first_tables and second_tables:
            shared_seen = max(shared_seen, len(set(first_tables[0].pages) & set(second_tables[0].pages)))
    assert second.cached >= 2 * PAGE and shared_seen >= 2
    assert first.output_ids == second.output_ids == alone(model, clip, GREEDY, None)
    assert all_pages_free(engine)


@pytest.mark.usefixtures("no_room_to_grow")
def test_a_preempted_row_comes_back_to_its_own_computed_pages(model, shared_media) -> None:
    """Two rows in a cache that holds both prompts but not both grown: the later is preempted when the earlier
    grows, and on its return takes its prompt's pages back instead of computing them (its last pages went to
    the earlier row first)."""
    clips = [decoded(model, shared_media / name) for name in ("demo_test_8frames.gif", "short_5f.mp4")]
    pages = sum(-(-prompt.length // PAGE) for prompt in clips) + 1
    engine = Engine(model, EngineConfig(max_rows=2, prefill_chunk=0, max_batch_tokens=1024,
                                        kv_cache_tokens=pages * PAGE, kv_page_slots=PAGE), GREEDY)
    rows = run(engine, clips)
    assert rows[1].preemptions >= 1 and rows[1].cached > 0, (rows[1].preemptions, rows[1].cached)
    assert [row.output_ids for row in rows] == [alone(model, prompt, GREEDY, None) for prompt in clips]
    assert all_pages_free(engine)


def test_the_run_summary_tells_how_much_of_the_prompts_came_from_the_cache(tiny_model_dir, shared_media,
                                                                         tmp_path) -> None:
    """The same clip under two paths, one row at a time: the second row's prompt comes from the cache."""
    for name in ("a.gif", "b.gif"):
        shutil.copy(shared_media / "demo_test_8frames.gif", tmp_path / name)
    settings = RunSettings(CaptionSettings(model=str(tiny_model_dir), batch_size=1, workers=1, device="cpu",
                                           dtype="float32", sampling=SamplingParams(max_new_tokens=4)))
    outcome = CaptionRun([tmp_path / "a.gif", tmp_path / "b.gif"], tmp_path / "out.parquet", settings).execute()
    summary = dict(outcome.summary)
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    prompt = table[0]["prompt_tokens"]
    reused = outcome.stats.reused_positions
    assert outcome.stats.prompt_positions == 2 * prompt and 0 < reused < prompt
    rate = reused / (2 * prompt)
    assert summary["prefix cache"] == f"{reused:,} of {2 * prompt:,} prompt positions reused ({rate:.1%})"
    assert "shared prefixes" not in summary   # one prompt per clip: no question shares another's prefix
    assert table[0]["caption"] == table[1]["caption"]
    # Turned off (--no-prefix-cache): nothing reused, nothing reported, the same captions.
    off = RunSettings(replace(settings.caption, prefix_cache=False))
    outcome = CaptionRun([tmp_path / "a.gif", tmp_path / "b.gif"], tmp_path / "off.parquet", off).execute()
    assert (outcome.stats.prompt_positions, outcome.stats.reused_positions) == (2 * prompt, 0)
    assert "prefix cache" not in dict(outcome.summary)
    assert [row["caption"] for row in pq.read_table(tmp_path / "off.parquet").to_pylist()] == \
        [row["caption"] for row in table]
