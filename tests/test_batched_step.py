"""A step is shaped by the batch, not by its rows: decode attention for every row in one batched
computation over the cache's pages, equal to each row attending alone; the same kernels launched
at any row count; mixed steps (prefill chunks with decoding rows, pruned with unpruned rows,
offloaded with device rows) equal to each row alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tarsier_batch.engine import Engine, EngineConfig, PruneConfig, SamplingParams
from tarsier_batch.engine.attention import attend_decoding, decode_tables
from tarsier_batch.engine.kv_cache import BlockTable, KVCache
from tarsier_batch.engine.profiling import kernel_ops
from tarsier_batch.engine.scheduler import Scheduler
from tarsier_batch.families.base import KVGeometry, ProcessedPrompt
from tarsier_batch.media import media_type_of
from test_engine import MAX_NEW, NAMES, alone, ids, process, run
from test_pruning import run as run_pruned


@pytest.fixture(scope="module")
def prompts(tiny_model, shared_media) -> list[ProcessedPrompt]:
    return [process(tiny_model, shared_media / name) for name in NAMES]


def text_prompt(prompt: ProcessedPrompt, length: int) -> ProcessedPrompt:
    """A prompt of the first `length` text ids of `prompt` (no vision: never pruned)."""
    text = prompt.token_ids[prompt.token_ids != prompt.token_ids[prompt.vision_blocks[0].start]][:length]
    return ProcessedPrompt("", text, torch.arange(length).unsqueeze(0), length, [], torch.empty(0))


def assert_each_row_as_alone(batched: torch.Tensor, cache: KVCache, layer: int, queries: torch.Tensor,
                             rows: list[BlockTable], contexts: list[int]) -> None:
    """Each row's batched result equals SDPA of its query over its own context read back from its pages."""
    for index, (context, table) in enumerate(zip(contexts, rows)):
        keys, values = cache.read(table, layer, context)
        alone_out = F.scaled_dot_product_attention(queries[index].unsqueeze(0).unsqueeze(2), keys, values,
                                                   scale=0.3, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(batched[index], alone_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_decode_attention_over_pages_equals_each_row_attending_alone(bucketed: bool) -> None:
    """Rows of several lengths (one slot, exactly a page, a page and one, many pages) at scattered pages with
    free pages between and before them; never-written memory (NaN here) outside the rows' ranges must not
    leak in. Bucketed (a static decode step's tables), the rows are padded to a power of two, the window and the
    pages per row to `fine_bucket`'s sizes, and each real row's result is the same."""
    geometry = KVGeometry(num_layers=2, kv_heads=2, head_dim=8)
    cache = KVCache(geometry, 40 * 4, torch.float32, torch.device("cpu"), page_slots=4)
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    contexts = [1, 4, 5, 13, 30]
    # Page 0 stays free (NaN): rows with fewer pages than the longest must not borrow it as padding. A row's
    # pages are in any order, with other rows' pages between them.
    rows = [BlockTable(4, np.array(pages)) for pages in ([3], [1, 2], [9, 5], [10, 11, 4, 12], [20, 28, 21, 22, 13,
                                                                                                 14, 23, 24])]
    queries = torch.randn(8 if bucketed else len(contexts), 4, 8)   # 4 query heads over 2 kv heads
    for context, table in zip(contexts, rows):
        cache.values[:, torch.from_numpy(table.pages)] = 0   # as the cache does when it hands pages out
        cache.write(table, 1, 0, torch.randn(context, 2, 8), torch.randn(context, 2, 8))
    tables = decode_tables(rows, np.array(contexts), 4, torch.device("cpu"),
                           bucketed_within=cache.scratch_page if bucketed else None)
    batched = attend_decoding(cache, 1, queries, tables, scale=0.3)
    assert_each_row_as_alone(batched, cache, 1, queries, rows, contexts)
    # The view ends at the last page a decoding row uses (28: 29 pages), or at its bucket (30) within the 40 pages.
    assert tables.owner.shape[0] == (30 if bucketed else 29)
    assert tables.row_pages.shape == ((8, 8) if bucketed else (5, 8))
    assert batched.shape[0] == queries.shape[0] and batched.isfinite().all(), "padding rows come out finite too"


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_rows_sharing_pages_attend_each_over_its_own_context(bucketed: bool) -> None:
    """Three questions about one clip hold its prefix's pages together (pages 3 and 7, then each its own); a
    fourth row shares nothing. Each row's result is its own context's attention, as if alone."""
    geometry = KVGeometry(num_layers=1, kv_heads=2, head_dim=8)
    cache = KVCache(geometry, 16 * 4, torch.float32, torch.device("cpu"), page_slots=4)
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    rows = [BlockTable(4, np.array(pages)) for pages in ([3, 7, 1], [3, 7, 9, 2], [3, 7, 0], [5, 6])]
    contexts = [10, 14, 9, 6]
    cache.values[:, torch.tensor([0, 1, 2, 3, 5, 6, 7, 9])] = 0
    shared_keys, shared_values = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    for context, table in zip(contexts, rows):
        first = 8 if table.pages[0] == 3 else 0
        if first:
            cache.write(table, 0, 0, shared_keys, shared_values)   # the same keys and values: one copy
        cache.write(table, 0, first, torch.randn(context - first, 2, 8), torch.randn(context - first, 2, 8))
    queries = torch.randn(8 if bucketed else len(rows), 4, 8)
    tables = decode_tables(rows, np.array(contexts), 4, torch.device("cpu"),
                           bucketed_within=cache.scratch_page if bucketed else None)
    assert tables.owner.shape[1] == (4 if bucketed else 3), "pages 3 and 7 each meet three rows' queries"
    batched = attend_decoding(cache, 0, queries, tables, scale=0.3)
    assert_each_row_as_alone(batched, cache, 0, queries, rows, contexts)
    assert batched.isfinite().all()


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_rows_far_apart_attend_over_their_pages_copied_out(bucketed: bool) -> None:
    """One row low, one near the top of a 64-page cache: the window is their 3 pages copied out, not the 62 the
    view would read, and each row's result is its own context's attention."""
    geometry = KVGeometry(num_layers=2, kv_heads=2, head_dim=8)
    cache = KVCache(geometry, 64 * 4, torch.float32, torch.device("cpu"), page_slots=4)
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    rows, contexts = [BlockTable(4, np.array([61, 0])), BlockTable(4, np.array([60]))], [7, 3]
    for context, table in zip(contexts, rows):
        cache.values[:, torch.from_numpy(table.pages)] = 0
        cache.write(table, 1, 0, torch.randn(context, 2, 8), torch.randn(context, 2, 8))
    queries = torch.randn(2, 4, 8)
    tables = decode_tables(rows, np.array(contexts), 4, torch.device("cpu"),
                           bucketed_within=cache.scratch_page if bucketed else None)
    assert tables.pages is not None and tables.pages.tolist()[:3] == [0, 60, 61]
    assert tables.owner.shape[0] == (4 if bucketed else 3)
    batched = attend_decoding(cache, 1, queries, tables, scale=0.3)
    assert_each_row_as_alone(batched, cache, 1, queries, rows, contexts)
    # Rows close together are read in place.
    assert decode_tables([BlockTable(4, np.array([0, 2]))], np.array([6]), 4, torch.device("cpu")).pages is None


def test_decode_attention_with_scores_spread_far_apart_matches_float64() -> None:
    """Scores hundreds apart (as random weights and long real contexts give): on the CPU weights below
    exp(-64) of their page's largest are dropped (subnormal arithmetic is slow there), which must leave every
    row's attention equal to an exact float64 softmax, rows of one dominant slot and of near ties alike."""
    geometry = KVGeometry(num_layers=1, kv_heads=2, head_dim=8)
    cache = KVCache(geometry, 16 * 4, torch.float32, torch.device("cpu"), page_slots=4)
    rows, contexts = [BlockTable(4, np.array([0, 1, 2])), BlockTable(4, np.array([3, 4, 5, 6]))], [11, 16]
    generator = torch.Generator().manual_seed(0)
    for context, table in zip(contexts, rows):
        cache.values[:, torch.from_numpy(table.pages)] = 0   # as `grow` does: never-written memory may hold NaN
        cache.write(table, 0, 0, torch.randn(context, 2, 8, generator=generator),
                    torch.randn(context, 2, 8, generator=generator))
    queries = torch.randn(2, 4, 8, generator=generator) * 80
    queries[1, 0] /= 800   # one head of near-equal scores beside the spread ones
    batched = attend_decoding(cache, 0, queries, decode_tables(rows, np.array(contexts), 4, torch.device("cpu")),
                              scale=0.3)
    for index, (context, table) in enumerate(zip(contexts, rows)):
        keys, values = (tensor.double().repeat_interleave(2, dim=1)[0] for tensor in cache.read(table, 0, context))
        scores = torch.einsum("hd,hsd->hs", queries[index].double() * 0.3, keys)
        assert (scores.amax(-1) - scores.amin(-1)).max() > 200, "spread far past exp's floor"
        exact = torch.einsum("hs,hsd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(batched[index].double(), exact, rtol=1e-5, atol=1e-6)


def decode_step_kernels(model, prompts: list[ProcessedPrompt], sampling: SamplingParams) -> list[str]:
    """The kernels of one pure decode step of an engine running `prompts`."""
    engine = Engine(model, EngineConfig(max_rows=len(prompts), max_batch_tokens=4096, prefill_chunk=0,
                                        kv_cache_tokens=8192), sampling)
    for index, prompt in enumerate(prompts):
        engine.add(prompt, seed=sampling.row_seed(str(index)))
    while any(seq.in_prefill for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()   # every row has sampled once: the penalty sees generated ids too
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step()
    return kernel_ops(profile.events())


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.0),
                                      SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.8,
                                                     repetition_penalty=1.2)], ids=["greedy", "sampled"])
def test_a_decode_step_launches_the_same_kernels_at_any_row_count(tiny_model, prompts, sampling) -> None:
    """Before the batched step, every row added its own KV write, attention, positions, penalty and draw."""
    one, three, seven = (decode_step_kernels(tiny_model, prompts[:rows], sampling) for rows in (1, 3, 7))
    assert one == three == seven, (len(one), len(three), len(seven))
    assert one.count("aten::bmm") == 2 * 2, "two batched matrix multiplies per layer for all rows' attention"
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in one


def test_steps_mixing_prefill_chunks_and_decoding_rows_equal_rows_alone(tiny_model, prompts, monkeypatch) -> None:
    reference = alone(tiny_model, prompts)
    engine_rows, mixed = run_recording(tiny_model, prompts, monkeypatch, max_rows=4, prefill_chunk=40,
                                       max_batch_tokens=48)
    assert ids(engine_rows) == reference
    assert mixed > 5, "steps should hold prefill chunks beside decoding rows"


def test_offloaded_prefill_beside_decoding_rows_equals_rows_alone(tiny_model, prompts, monkeypatch) -> None:
    reference = alone(tiny_model, prompts)
    engine_rows, mixed = run_recording(tiny_model, prompts, monkeypatch, max_rows=4, prefill_chunk=40,
                                       max_batch_tokens=48, offload_kv=True, host_rows=True)
    assert ids(engine_rows) == reference
    assert mixed > 5, "steps should hold offloaded prefill chunks beside decoding rows"


def test_pruned_and_unpruned_rows_in_one_step_equal_rows_alone(tiny_model, prompts) -> None:
    config = PruneConfig(0.5, 1)
    mixed_prompts = [prompts[3], text_prompt(prompts[0], 30), prompts[0], text_prompt(prompts[2], 9), prompts[5]]
    expected = [run_pruned(tiny_model, [prompt], config, max_rows=1, prefill_chunk=0)[0].output_ids
                for prompt in mixed_prompts]
    rows = run_pruned(tiny_model, mixed_prompts, config, max_rows=5, prefill_chunk=24, max_batch_tokens=40)
    assert [row.output_ids for row in rows] == expected
    assert [row.pruning is not None for row in rows] == [True, False, True, False, True]


def run_recording(model, prompts: list[ProcessedPrompt], monkeypatch, host_rows: bool = False,
                  **config) -> tuple[list, int]:
    """The engine's rows, and how many steps computed a chunk of several positions (of an offloaded row, with
    `host_rows`) and a decoding row together."""
    schedule = Scheduler.schedule
    mixed = 0

    def recording(scheduler: Scheduler) -> list:
        nonlocal mixed
        step = schedule(scheduler)
        chunks = [row for row in step if row.num_tokens > 1 and (row.kv.host is not None or not host_rows)]
        mixed += bool(chunks) and any(not row.seq.in_prefill for row in step)
        return step

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return run(model, prompts, **config), mixed


@pytest.mark.compile
@pytest.mark.parametrize("family", ["tarsier", "tarsier2", "qwen2_5_vl", "qwen3_vl"])
def test_compiled_steps_give_the_eager_tokens(family, tmp_path_factory, shared_media, monkeypatch) -> None:
    """--compile: the layers and the decode attention through torch.compile (inductor's C++ kernels here, Triton
    on a GPU) give the same tokens as the eager step, with rows joining and leaving and chunked prefill. Decode
    steps run at power-of-two sizes; a few compilations serve every step shape of the run, not one per shape."""
    import torch._dynamo

    from tarsier_batch.engine.decode_step import DecodeStep
    from tarsier_batch.families.loading import load_caption_model
    from tarsier_batch.families.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp(f"compile-{family}"), "tiny", seed=0, family=family)
    eager_model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    compiled_model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))   # compiled in place
    names = ["tarsier_logo.jpg", "clip_5f.gif", "short_5f.mp4", "portrait_200x333.png"]
    prompts = [compiled_model.processor.process(
        compiled_model.processor.load_media(str(shared_media / name), media_type_of(shared_media / name), 4), None)
        for name in names]
    sampling = SamplingParams(max_new_tokens=10)
    max_new = [10, 3, 7, 10]   # rows leave at different steps (or at EOS): decode steps of several row counts
    expected = [row.output_ids for row in run(eager_model, prompts, sampling=sampling, max_new=max_new, max_rows=1,
                                              prefill_chunk=0)]
    decode_steps = []
    decode = DecodeStep.run
    monkeypatch.setattr(DecodeStep, "run", lambda self, step: decode_steps.append(len(step)) or decode(self, step))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=4, fail_on_recompile_limit_hit=True):
        rows = run(compiled_model, prompts, sampling=sampling, max_new=max_new, max_rows=3, prefill_chunk=32,
                   max_batch_tokens=40, compile=True)
    assert [row.output_ids for row in rows] == expected
    assert 3 in decode_steps and len(set(decode_steps)) >= 2, "3 rows padded to 4, and other sizes"
