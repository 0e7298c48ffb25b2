"""The fused decode attention (a Triton kernel, for CUDA) run by Triton's interpreter on the CPU: every row's
result equals its own context's attention alone, whatever its pages, their order and sharing, the padding of a
static step or the other rows; and an engine decoding through it gives every row the tokens of the split
attention of torch ops."""
# The decode-step tests' fixtures are imported and requested by name as test arguments (pytest's injection).
# ruff: noqa: F811

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tarsier_batch.engine import model_runner
from tarsier_batch.engine.kv_cache import BlockTable, KVCache
from tarsier_batch.families.base import KVGeometry
from test_decode_step import family_case, prompts  # noqa: F401
from test_engine import NAMES, ids, run

pytestmark = pytest.mark.triton   # needs the triton extra (see pyproject.toml)

PAGE = 4


@pytest.fixture(scope="module")
def fused() -> ModuleType:
    """The module, its kernels run by Triton's interpreter (conftest sets TRITON_INTERPRET before Triton loads)."""
    module = importlib.import_module("tarsier_batch.engine.fused_decode")
    assert type(module._attend_split).__name__ == "InterpretedFunction", "TRITON_INTERPRET was not set in time"
    return module


@pytest.fixture
def small_splits(fused: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits of 32 positions read 16 at a time: short contexts span several splits and blocks."""
    monkeypatch.setattr(fused, "SPLIT_POSITIONS", 32)
    monkeypatch.setattr(fused, "BLOCK_POSITIONS", 16)


def filled_cache(geometry: KVGeometry, pages: int, dtype: torch.dtype, rows: list[BlockTable],
                 contexts: list[int], shared: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> KVCache:
    """A cache whose never-written memory is NaN (it must never be read) holding each row's keys and values;
    `shared`: (positions, keys, values) that every row starting at the same page holds in common."""
    cache = KVCache(geometry, pages * PAGE, dtype, torch.device("cpu"), page_slots=PAGE)
    cache.keys.fill_(float("nan"))
    cache.values.fill_(float("nan"))
    shape = (geometry.kv_heads, geometry.head_dim)
    for context, table in zip(contexts, rows):
        first = 0
        if shared is not None and table.pages[0] == rows[0].pages[0]:
            first = shared[0]
            cache.write(table, 0, 0, shared[1].to(dtype), shared[2].to(dtype))
        cache.write(table, 0, first, torch.randn(context - first, *shape).to(dtype),
                    torch.randn(context - first, *shape).to(dtype))
    return cache


def alone(cache: KVCache, queries: torch.Tensor, rows: list[BlockTable], contexts: list[int],
          scale: float) -> torch.Tensor:
    """Each row's attention over its own context, read out of its pages, in float32."""
    out = []
    for query, table, context in zip(queries, rows, contexts):
        keys, values = cache.read(table, 0, context)
        out.append(F.scaled_dot_product_attention(query.float()[None, :, None], keys.float(), values.float(),
                                                  scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


GEOMETRY = KVGeometry(num_layers=1, kv_heads=2, head_dim=24)   # a head_dim the kernel pads (to 32)
HEADS = 6                                                      # 3 query heads a kv head, padded to 16 for the product
SCATTERED = [[3], [1, 2], [9, 5], [10, 11, 4, 12], [20, 28, 21, 22, 13, 14, 23, 24],
             [30 + page for page in reversed(range(20))]]
CONTEXTS = [1, 4, 5, 13, 30, 77]   # one slot, a page, a page and one, several splits of 32, a part-filled page


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_row_attends_over_its_own_pages_as_alone(fused, small_splits, dtype) -> None:
    """Rows of one slot up to several splits, at scattered pages in any order (one row's pages descending), with
    free pages (NaN) between them."""
    rows = [BlockTable(PAGE, np.array(pages)) for pages in SCATTERED]
    cache = filled_cache(GEOMETRY, 64, dtype, rows, CONTEXTS)
    queries = torch.randn(len(rows), HEADS, GEOMETRY.head_dim).to(dtype)
    attention = fused.FusedDecodeAttention()
    out = attention(cache, 0, queries, attention.tables(rows, np.array(CONTEXTS), PAGE, torch.device("cpu")), 0.3)
    assert out.dtype == dtype and out.shape == queries.shape
    # float16: the kernel multiplies float16 weights by values, as the model's dtype would on the GPU.
    torch.testing.assert_close(out.float(), alone(cache, queries, rows, CONTEXTS, 0.3),
                               rtol=1e-5 if dtype == torch.float32 else 2e-3,
                               atol=1e-5 if dtype == torch.float32 else 2e-3)


def test_a_row_gets_the_same_result_whatever_else_the_step_holds_and_however_it_is_padded(fused, small_splits):
    """Splits lie at fixed positions of a row, so its result is the same bits alone, among other rows, and in a
    step padded to a static size (padding rows repeat row 0 and come out finite)."""
    rows = [BlockTable(PAGE, np.array(pages)) for pages in SCATTERED]
    cache = filled_cache(GEOMETRY, 64, torch.float32, rows, CONTEXTS)
    queries = torch.randn(len(rows), HEADS, GEOMETRY.head_dim)
    attention = fused.FusedDecodeAttention()
    cpu = torch.device("cpu")
    together = attention(cache, 0, queries, attention.tables(rows, np.array(CONTEXTS), PAGE, cpu), 0.3)
    padded_queries = torch.cat([queries, queries[:2]])   # 8 rows: a power of two
    padded_tables = attention.tables(rows, np.array(CONTEXTS), PAGE, cpu, bucketed_within=cache.scratch_page)
    assert padded_tables.pages.shape == (8, 20) and padded_tables.contexts.tolist()[-2:] == [1, 1]
    padded = attention(cache, 0, padded_queries, padded_tables, 0.3)
    assert torch.equal(padded[:len(rows)], together)
    assert padded.isfinite().all()
    for index in (0, 3, 5):
        one = attention(cache, 0, queries[index:index + 1],
                        attention.tables(rows[index:index + 1], np.array(CONTEXTS[index:index + 1]), PAGE, cpu), 0.3)
        assert torch.equal(one[0], together[index])


def test_rows_sharing_a_prefix_s_pages_attend_each_over_its_own_context(fused, small_splits) -> None:
    """Three questions about one clip hold its first 8 positions' pages (3 and 7) together, then each its own;
    a fourth row shares nothing."""
    rows = [BlockTable(PAGE, np.array(pages)) for pages in ([3, 7, 1], [3, 7, 9, 2], [3, 7, 0], [5, 6])]
    contexts = [10, 14, 9, 6]
    shape = (8, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    cache = filled_cache(GEOMETRY, 16, torch.float32, rows, contexts, shared=(8, torch.randn(shape),
                                                                              torch.randn(shape)))
    queries = torch.randn(len(rows), HEADS, GEOMETRY.head_dim)
    attention = fused.FusedDecodeAttention()
    out = attention(cache, 0, queries, attention.tables(rows, np.array(contexts), PAGE, torch.device("cpu")), 0.3)
    torch.testing.assert_close(out, alone(cache, queries, rows, contexts, 0.3), rtol=1e-5, atol=1e-5)


def test_a_row_of_more_splits_than_the_combination_holds_at_once(fused, small_splits) -> None:
    """600 positions in splits of 32: 19 splits, combined 16 at a time (the rest past the row's context)."""
    rows, contexts = [BlockTable(PAGE, np.arange(150)[::-1].copy()), BlockTable(PAGE, np.array([150]))], [600, 3]
    cache = filled_cache(GEOMETRY, 160, torch.float32, rows, contexts)
    queries = torch.randn(2, HEADS, GEOMETRY.head_dim)
    attention = fused.FusedDecodeAttention()
    out = attention(cache, 0, queries, attention.tables(rows, np.array(contexts), PAGE, torch.device("cpu")), 0.3)
    torch.testing.assert_close(out, alone(cache, queries, rows, contexts, 0.3), rtol=1e-5, atol=1e-5)


def test_the_real_split_size_over_a_long_context(fused) -> None:
    """The module's own sizes (splits of 512 positions read 64 at a time) at 7B's page of 32 slots and head_dim
    of 128: 1,100 positions, three splits, the last part-filled."""
    geometry = KVGeometry(num_layers=1, kv_heads=1, head_dim=128)
    page = 32
    rows, contexts = [BlockTable(page, np.arange(40)[::-1].copy())], [1100]
    cache = KVCache(geometry, 40 * page, torch.float32, torch.device("cpu"), page_slots=page)
    cache.write(rows[0], 0, 0, torch.randn(1100, 1, 128), torch.randn(1100, 1, 128))
    queries = torch.randn(1, 7, 128)   # 7 query heads, as Tarsier2-7B's group
    attention = fused.FusedDecodeAttention()
    out = attention(cache, 0, queries, attention.tables(rows, np.array(contexts), page, torch.device("cpu")), 0.1)
    torch.testing.assert_close(out, alone(cache, queries, rows, contexts, 0.1), rtol=1e-5, atol=1e-5)


def test_an_engine_decoding_through_the_fused_attention_gives_the_split_attention_s_tokens(
        fused, family_case, monkeypatch) -> None:
    """Rows joining and leaving, chunked prefill, float32: the engine with the fused kernel (chosen as on CUDA)
    generates exactly the tokens of the split attention of torch ops, for every family's tiny model."""
    model = family_case.model
    clips = [family_case.prompts[NAMES.index(name)] for name in ("clip_5f.gif", "tarsier_logo.jpg", "short_5f.mp4")]
    max_new = [12, 3, 6]   # the second row leaves early, the third takes its place
    expected = ids(run(model, clips, max_new=max_new, max_rows=2, prefill_chunk=64, max_batch_tokens=80))
    monkeypatch.setattr(model_runner, "fused_attention_available", lambda device: True)
    chosen = model_runner._decode_attention(torch.device("cpu"), compiled=False, fused=True)
    assert isinstance(chosen, fused.FusedDecodeAttention)
    assert ids(run(model, clips, max_new=max_new, max_rows=2, prefill_chunk=64,
                   max_batch_tokens=80)) == expected
