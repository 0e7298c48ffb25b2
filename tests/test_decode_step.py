"""Decode steps at static shapes (what --compile and CUDA graphs run): rows, pages per row and the window of
pages padded to powers of two give every row the tokens it gets alone, with rows joining and leaving,
sampled rows, and pruned rows in two caches; the padding rows never write into a row's KV."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch._dynamo

from tarsier_batch.engine import PruneConfig, SamplingParams, model_runner
from tarsier_batch.engine.attention import fine_bucket
from tarsier_batch.engine.decode_step import DecodeStep
from tarsier_batch.families.base import CaptionModel, ProcessedPrompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from test_engine import MAX_NEW, NAMES, alone, ids, process, run
from test_pruning import run as run_pruned
from test_tarsier2 import process as process_lineage

MAX_NEW_BY_ROW = [5, 24, 9, 17, 3, 12, 20]   # rows leave at different steps, so the real row counts vary


@pytest.fixture(scope="module")
def prompts(tiny_model, shared_media) -> list[ProcessedPrompt]:
    return [process(tiny_model, shared_media / name) for name in NAMES]


class FamilyCase(NamedTuple):
    model: CaptionModel
    prompts: list[ProcessedPrompt]
    components: int   # of a position: 1 for RoPE, 3 for M-RoPE


@pytest.fixture(scope="module", params=["tarsier", "qwen2_5_vl", "qwen3_vl"])
def family_case(request, tiny_model, prompts, tmp_path_factory, shared_media) -> FamilyCase:
    """A family's tiny model and its prompts of NAMES: the decode step is the same for every family (the Qwen
    families' positions have three components; Qwen3-VL's layers take wider prefill inputs, never decode ones)."""
    if request.param == "tarsier":
        return FamilyCase(tiny_model, prompts, 1)
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)
    model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    return FamilyCase(model, [process_lineage(model, shared_media / name, frames=4) for name in NAMES], 3)


class StaticDecodeStep(DecodeStep):
    """The engine's decode step padded to power-of-two sizes without compiling, recording each step's sizes."""

    steps: list[dict] = []

    def __init__(self, model, pools, attention=None, graphs: bool = False, static_shapes: bool | None = None):
        super().__init__(model, pools, attention, graphs, static_shapes=True)

    def run(self, step):
        StaticDecodeStep.steps.append({"rows": len(step)})
        return super().run(step)

    def logits(self, token_ids, positions, parts):
        StaticDecodeStep.steps[-1].update(padded_rows=token_ids.shape[0], positions=tuple(positions.shape),
                                          windows=[part.tables.owner.shape[0] for part in parts],
                                          widest=[part.tables.row_pages.shape[1] for part in parts],
                                          writes=[part.write_pages.shape[0] for part in parts])
        return super().logits(token_ids, positions, parts)


@pytest.fixture
def static_steps(monkeypatch) -> list[dict]:
    StaticDecodeStep.steps = []
    monkeypatch.setattr(model_runner, "DecodeStep", StaticDecodeStep)
    return StaticDecodeStep.steps


def power_of_two(size: int) -> bool:
    return size & (size - 1) == 0


def assert_static(steps: list[dict], components: int) -> None:
    assert len(steps) >= 10, "many steps of the run should be pure decode steps"
    assert any(not power_of_two(step["rows"]) for step in steps), "some steps should need padding rows"
    for step in steps:
        assert step["padded_rows"] == max(2, 1 << (step["rows"] - 1).bit_length())
        assert step["positions"] == (components, step["padded_rows"])
        assert step["writes"] == [step["padded_rows"]] * len(step["windows"])
        assert all(fine_bucket(size) == size for size in step["windows"] + step["widest"]), step


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=MAX_NEW),
                                      SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.8,
                                                     repetition_penalty=1.2)], ids=["greedy", "sampled"])
def test_static_decode_steps_give_every_row_its_tokens_alone(family_case, static_steps, sampling) -> None:
    model, prompts = family_case.model, family_case.prompts
    seeds = None if sampling.greedy else [sampling.row_seed(name) for name in NAMES]
    expected = alone(model, prompts, sampling=sampling, max_new=MAX_NEW_BY_ROW, seeds=seeds)
    static_steps.clear()   # the reference ran padded too: count the batched run alone
    rows = run(model, prompts, sampling=sampling, max_new=MAX_NEW_BY_ROW, seeds=seeds, max_rows=5,
               prefill_chunk=64, max_batch_tokens=80)
    assert ids(rows) == expected
    assert [len(row) for row in expected] == MAX_NEW_BY_ROW, "EOS would hide where rows leave"
    assert_static(static_steps, components=family_case.components)


def test_static_decode_steps_of_pruned_rows_equal_rows_alone(tiny_model, prompts, static_steps) -> None:
    """Two caches (the layers before and after pruning), each with its own tables and scratch page."""
    config = PruneConfig(0.5, 1)
    expected = [row.output_ids for prompt in prompts
                for row in run_pruned(tiny_model, [prompt], config, max_rows=1, prefill_chunk=0)]
    static_steps.clear()
    rows = run_pruned(tiny_model, prompts, config, max_rows=3, prefill_chunk=64, max_batch_tokens=80)
    assert [row.output_ids for row in rows] == expected
    assert all(len(step["windows"]) == 2 for step in static_steps)
    assert_static(static_steps, components=1)


def test_padding_rows_write_only_the_scratch_page(tiny_model, prompts) -> None:
    """Three rows padded to four: the fourth writes its keys and values to the scratch page, nowhere else."""
    from tarsier_batch.engine import Engine, EngineConfig

    engine = Engine(tiny_model, EngineConfig(max_rows=3, prefill_chunk=0, kv_cache_tokens=4096),
                    SamplingParams(max_new_tokens=MAX_NEW))
    for prompt in prompts[:3]:
        engine.add(prompt)
    while any(seq.in_prefill for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.runner.decode_step = DecodeStep(tiny_model, engine.pools, static_shapes=True)
    pool = engine.pools[0]
    pool.keys[:, pool.scratch_page] = float("nan")
    before = pool.keys[:, :pool.scratch_page].clone()
    slots = [int(engine.kv.block_tables(seq)[0].pages[seq.num_computed_tokens // pool.page_slots]) * pool.page_slots
             + seq.num_computed_tokens % pool.page_slots for seq in engine.scheduler.running]
    engine.step()
    after = pool.keys[:, :pool.scratch_page]
    written = (after != before) & ~(after.isnan() & before.isnan())   # never-written memory may hold NaN
    changed = written.any(dim=(0, 2, 4)).nonzero().tolist()           # (page, slot) pairs written
    assert sorted(page * pool.page_slots + slot for page, slot in changed) == sorted(slots)
    assert pool.keys[:, pool.scratch_page].isfinite().any(), "the padding row wrote the scratch page"


@pytest.mark.compile
def test_compiled_decode_steps_of_pruned_rows_equal_eager(tiny_model_dir, prompts) -> None:
    """--compile with pruning: each decode step's attention compiled over two caches (the early layers' and the
    late layers'), in a process that has compiled decode steps for other models before (their caches' sizes and
    layer ranges differ: the compiled code must not branch on them)."""
    from tarsier_batch.families.loading import load_caption_model

    compiled_model = load_caption_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    config = PruneConfig(0.5, 1)
    expected = [row.output_ids for row in run_pruned(compiled_model, prompts[:4], config, max_rows=1,
                                                     prefill_chunk=0)]
    with torch._dynamo.config.patch(recompile_limit=4, fail_on_recompile_limit_hit=True):
        for rows in (3, 2):   # two engines: two pairs of caches of other sizes
            compiled = run_pruned(compiled_model, prompts[:4], config, max_rows=rows, prefill_chunk=64,
                                  max_batch_tokens=80, compile=True)
            assert [row.output_ids for row in compiled] == expected


# Qwen3-VL refuses FastV pruning (its DeepStack layers), so its decode steps have one cache only.
@pytest.mark.parametrize("family_case, pruned", [("tarsier", False), ("tarsier", True), ("qwen2_5_vl", True),
                                                 ("qwen3_vl", False)], indirect=["family_case"],
                         ids=["one cache", "two caches", "qwen2_5_vl two caches", "qwen3_vl one cache"])
def test_a_decode_step_traces_whole_as_a_cuda_graph_records_it(family_case, pruned) -> None:
    """What recording a CUDA graph needs, checked on the CPU: a decode step is one function of its tensors that
    torch.compile traces whole (fullgraph: a `.item()`, `.tolist()`, `.nonzero()` or a branch on a value inside
    would break the trace, as it would break a recording), and the traced function gives the step's logits."""
    from tarsier_batch.engine import Engine, EngineConfig

    model = family_case.model
    engine = Engine(model, EngineConfig(max_rows=3, prefill_chunk=0, kv_cache_tokens=4096,
                                        prune=PruneConfig(0.5, 1) if pruned else None),
                    SamplingParams(max_new_tokens=MAX_NEW))
    for prompt in family_case.prompts[:3]:
        engine.add(prompt)
    while any(seq.in_prefill for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    step = engine.runner.decode_step = DecodeStep(model, engine.pools, static_shapes=True)
    eager = step.logits
    traced = torch.compile(eager, fullgraph=True, backend="eager")
    agreed = []

    def both(*inputs):
        expected = eager(*inputs)   # both write the same keys and values to the same slots
        logits = traced(*inputs)
        agreed.append(torch.equal(logits, expected))
        return logits

    step.logits = both   # type: ignore[method-assign]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            engine.step()
    assert agreed == [True, True, True]
