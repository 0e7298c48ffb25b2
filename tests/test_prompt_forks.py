"""Several questions about one clip: the engine prefills their shared prefix once and forks it, and each
question's tokens equal that question asked alone (both families, chunked, sampled, joining, preempted)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import all_pages_free
from tarsier_batch.engine import Engine, EngineConfig, SamplingParams, Sequence
from tarsier_batch.engine.kv_cache import KVCache
from tarsier_batch.engine.pruning import PruneConfig
from tarsier_batch.engine.scheduler import Scheduler, SchedulerConfig
from tarsier_batch.families.base import KVGeometry, ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.temporal import drop_static_vision
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import media_type_of

MAX_NEW = 12
QUESTIONS = ["Describe the video in detail.", "List the objects that appear.", "How does the camera move?"]
CLIPS = ["demo_test_8frames.gif", "short_5f.mp4"]


@pytest.fixture(scope="module", params=["tarsier", "tarsier2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    directory = make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)
    return load_caption_model(directory, torch.float32, torch.device("cpu"))


def ask(model, path: Path, questions: list[str], frames: int = 8) -> list[ProcessedPrompt]:
    """One prompt per question about one clip, decoded once."""
    processor = model.processor
    media = processor.load_media(str(path), media_type_of(path), frames)
    return [processor.process(media, question) for question in questions]


@pytest.fixture(scope="module")
def prompt_sets(model, shared_media: Path) -> list[list[ProcessedPrompt]]:
    return [ask(model, shared_media / clip, QUESTIONS) for clip in CLIPS]


def run_sets(model, prompt_sets: list[list[ProcessedPrompt]], sampling: SamplingParams | None = None,
             max_new: list[int] | None = None, seeds: list[int] | None = None, fork: bool = True,
             **config) -> list[Sequence]:
    """Every prompt of every set in one engine, each set's later prompts forked from its first; the rows in
    input order."""
    engine = Engine(model, EngineConfig(**config), sampling or SamplingParams(max_new_tokens=MAX_NEW))
    rows = []
    for prompts in prompt_sets:
        first = None
        for prompt in prompts:
            index = len(rows)
            rows.append(engine.add(prompt, payload=index, max_new_tokens=max_new[index] if max_new else None,
                                   seed=seeds[index] if seeds else None, prefix_source=first if fork else None))
            first = first or rows[-1]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    assert all_pages_free(engine)
    return rows


def alone(model, prompt_sets: list[list[ProcessedPrompt]], **kwargs) -> list[list[int]]:
    """Each prompt in an engine of its own, unchunked and unforked: the reference."""
    max_new, seeds = kwargs.pop("max_new", None), kwargs.pop("seeds", None)
    prompts = [prompt for prompts in prompt_sets for prompt in prompts]
    return [run_sets(model, [[prompt]], max_new=[max_new[i]] if max_new else None, seeds=[seeds[i]] if seeds else None,
                     max_rows=1, prefill_chunk=0, **kwargs)[0].output_ids
            for i, prompt in enumerate(prompts)]


def shared_lengths(prompt_sets: list[list[ProcessedPrompt]]) -> list[int]:
    return [prompts[0].shared_prefix(prompt) for prompts in prompt_sets for prompt in prompts[1:]]


def test_the_shared_prefix_is_the_vision_and_the_text_before_the_question(model, prompt_sets) -> None:
    for prompts in prompt_sets:
        first, second = prompts[0], prompts[1]
        shared = first.shared_prefix(second)
        vision_end = first.vision_blocks[-1].end
        assert vision_end <= shared < min(first.length, second.length)
        assert torch.equal(first.token_ids[:shared], second.token_ids[:shared])
        assert first.token_ids[shared] != second.token_ids[shared]
        assert shared - vision_end < 8, "only the template's text between the frames and the question is shared"
    # The same prompt shares all but its last position, which must be computed to sample.
    first = prompt_sets[0][0]
    assert first.shared_prefix(first) == first.length - 1
    # Other pixels: nothing from the first frame on is shared, though the ids are the same.
    other = replace(first, pixel_values=first.pixel_values.flip(0))
    assert first.shared_prefix(other) == first.vision_blocks[0].start


def test_each_question_equals_it_asked_alone(model, prompt_sets, monkeypatch) -> None:
    # Every answer runs its full length: a random model's early end of a set's first answer would free the prefix
    # before its forks are admitted (they then compute it themselves, rightly), which is not what is tested here.
    monkeypatch.setattr(model, "eos_token_ids", frozenset())
    reference = alone(model, prompt_sets)
    assert len({tuple(tokens) for tokens in reference}) == len(reference), "questions should get distinct answers"
    shared = shared_lengths(prompt_sets)
    # Chunks that end inside the vision, exactly at the end of the shared prefix, past it, and whole prompts.
    for chunk in (7, shared[0], shared[0] + 3, 0):
        rows = run_sets(model, prompt_sets, max_rows=6, prefill_chunk=chunk, max_batch_tokens=max(chunk, 6) + 6)
        assert [row.output_ids for row in rows] == reference, f"chunk {chunk}"
        forked = [row.forked for row in rows]
        # Each set's first prompt computes everything; the others copy the shared prefix and compute the rest.
        assert forked == [0, shared[0], shared[1], 0, shared[2], shared[3]], f"chunk {chunk}"


def test_a_prefix_shared_by_three_questions_outlives_one_finishing_and_one_preempted(model, prompt_sets) -> None:
    """A set's three questions hold one copy of its prefix's whole pages, three holders each. The first question
    finishes early, the second is preempted (it lets go of them, and later shares them again or computes its
    prefix itself): every question's tokens are those asked alone, and every page comes free."""
    prompts = prompt_sets[0]
    max_new = [2, MAX_NEW, MAX_NEW]
    reference = alone(model, [prompts], max_new=max_new)
    engine = Engine(model, EngineConfig(max_rows=3, prefill_chunk=0), SamplingParams(max_new_tokens=MAX_NEW))
    first = engine.add(prompts[0], max_new_tokens=max_new[0])
    rows = [first] + [engine.add(prompt, prefix_source=first) for prompt in prompts[1:]]
    while engine.scheduler.waiting or any(row.in_prefill for row in rows):
        engine.step()
    pool = engine.pools[0]
    whole = min(row.prefix_length for row in rows[1:]) // pool.page_slots
    shared = engine.kv.block_tables(first)[0].pages[:whole]
    assert whole > 0 and all((engine.kv.block_tables(row)[0].pages[:whole] == shared).all() for row in rows[1:])
    assert (pool.pool.holders[shared] == 3).all()
    held = pool.capacity_tokens - pool.free_slots
    # Each question's pages, as if it held its own copy.
    apart = sum(engine.kv.block_tables(row)[0].capacity for row in rows)
    assert held == apart - 2 * whole * pool.page_slots, "the prefix's whole pages are held once, not three times"
    engine.scheduler.preempt(rows[1])
    assert (pool.pool.holders[shared] == 2).all()
    while engine.has_work:
        engine.step()
    assert [row.output_ids for row in rows] == reference
    assert first.finish_reason == "length" and rows[1].preemptions == 1
    assert all_pages_free(engine)


def test_sampled_questions_joining_leaving_and_preempted_equal_them_alone(model, prompt_sets,
                                                                          no_room_to_grow: None) -> None:
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9)
    max_new = [3, 40, 7, 33, 1, 25]   # past the slots a row gets at admission: rows grow and preempt others
    seeds = [5, 5, 5, 6, 6, 6]   # a clip's stream, as each question asked alone of that clip would draw
    reference = alone(model, prompt_sets, sampling=sampling, max_new=max_new, seeds=seeds)
    assert reference != alone(model, prompt_sets, max_new=max_new), "sampling should differ from greedy decoding"
    # Two rows at a time: questions wait for a free row, join as others finish, some after their clip's first left.
    joining = run_sets(model, prompt_sets, sampling=sampling, max_new=max_new, seeds=seeds, max_rows=2,
                       prefill_chunk=16, max_batch_tokens=24)
    assert [row.output_ids for row in joining] == reference
    assert any(row.forked for row in joining)
    # A KV cache of the first two questions' pages and no more: rows are preempted and recomputed, forked again
    # or from their own prompt.
    filled = 8 * sum(-(-prompt.length // 8) for prompt in prompt_sets[0][:2])
    preempted = run_sets(model, prompt_sets, sampling=sampling, max_new=max_new, seeds=seeds, max_rows=6,
                         prefill_chunk=32, max_batch_tokens=48, kv_cache_tokens=filled, kv_page_slots=8)
    assert [row.output_ids for row in preempted] == reference
    assert sum(row.preemptions for row in preempted) > 0


def test_temporally_pruned_questions_fork_and_equal_them_alone(model, prompt_sets) -> None:
    pruned = [[drop_static_vision(prompt, model.processor.vision_changes(prompt), 0.5) for prompt in prompts]
              for prompts in prompt_sets]
    assert all(p.length < f.length for p, f in zip(pruned[0], prompt_sets[0]))
    reference = alone(model, pruned)
    rows = run_sets(model, pruned, max_rows=6, prefill_chunk=9, max_batch_tokens=20)
    assert [row.output_ids for row in rows] == reference
    assert [row.forked > 0 for row in rows] == [False, True, True, False, True, True]


def test_fastv_questions_do_not_fork_and_equal_them_alone(model, prompt_sets) -> None:
    """FastV ranks the vision tokens by the last prompt token's attention, which differs per question: each
    question prefills its own prompt."""
    prune = PruneConfig(ratio=0.5, layer=1)
    if model.family.fastv_refusal is not None:   # refused before loading by the API; the engine refuses it too
        with pytest.raises(AssertionError, match="DeepStack features enter decoder layers"):
            alone(model, prompt_sets, prune=prune)
        return
    reference = alone(model, prompt_sets, prune=prune)
    rows = run_sets(model, prompt_sets, max_rows=6, prefill_chunk=9, max_batch_tokens=20, prune=prune)
    assert [row.output_ids for row in rows] == reference
    assert not any(row.forked for row in rows)



def _text_prompt(ids: list[int]) -> ProcessedPrompt:
    return ProcessedPrompt("", torch.tensor(ids), torch.arange(len(ids))[None], len(ids), [], torch.zeros(0))


def _scheduler(max_rows: int) -> Scheduler:
    pool = KVCache(KVGeometry(num_layers=2, kv_heads=1, head_dim=4), 256, torch.float32, torch.device("cpu"))
    return Scheduler(SchedulerConfig(max_rows=max_rows, max_batch_tokens=64, prefill_chunk=16,
                                     offload_prefill=False), [pool])


def test_a_fork_waits_for_its_prefix_only_while_it_is_on_the_way() -> None:
    """Admission passes over a fork while its source computes the prefix (keeping a row for it); a fork
    whose source cannot come first (run alone after a failed step, queued behind it) computes the prefix
    itself instead of stalling the engine."""
    source, fork, other = (Sequence(_text_prompt(ids), 4) for ids in ([1, 2, 3, 4, 5] * 8, [1, 2, 3, 4, 5] * 7 + [9],
                                                                      [7] * 10))
    fork.prefix_source, fork.prefix_length = source, source.prompt.shared_prefix(fork.prompt)
    assert fork.prefix_length == 35
    scheduler = _scheduler(max_rows=3)
    for seq in (source, fork, other):
        scheduler.add(seq)
    first = scheduler.schedule()   # the source's first chunk; the fork waits, the other row passes it
    assert [(row.seq, row.num_tokens) for row in first] == [(source, 16), (other, 10)]
    source.num_computed_tokens, other.num_computed_tokens = 16, 10
    assert not any(row.seq is fork for row in scheduler.schedule())
    source.num_computed_tokens = 35
    admitted = [row for row in scheduler.schedule() if row.seq is fork]
    assert [(row.num_tokens, fork.forked, fork.num_computed_tokens) for row in admitted] == [(1, 35, 35)]

    # A source to be run alone, queued behind its fork, with nothing running.
    scheduler = _scheduler(max_rows=3)
    source, fork = Sequence(_text_prompt([1, 2, 3] * 5), 4), Sequence(_text_prompt([1, 2, 3] * 4 + [8]), 4)
    fork.prefix_source, fork.prefix_length, source.isolate = source, 12, True
    scheduler.waiting.extend([fork, source])
    assert [row.seq for row in scheduler.schedule()] == [fork] and fork.prefix_source is None
