"""Vision-token pruning (`engine.pruning`): the engine's pruned rows against a plain reference that
prunes one unchunked row alone; chunked, batched and preempted rows against rows alone; the score
against eager attention weights."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.engine import Engine, EngineConfig, PruneConfig, SamplingParams
from tarsier_batch.engine.pruning import attention_of_last_query, choose_survivors, row_pruning
from tarsier_batch.families.base import ProcessedPrompt, embed_whole_prompt
from tarsier_batch.outputs.resume import SettingsMismatchError, check_settings
from test_engine import NAMES, process

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts(tiny_model, shared_media) -> list[ProcessedPrompt]:
    return [process(tiny_model, shared_media / name) for name in NAMES]


class _DenseAttention:
    """Plain causal attention over per-layer key/value lists, with every layer's attention weights kept."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}

    def __call__(self, layer, q, k, v, scale):
        keys = torch.cat([self.keys[layer], k]) if layer in self.keys else k
        values = torch.cat([self.values[layer], v]) if layer in self.values else v
        self.keys[layer], self.values[layer] = keys, values
        groups = q.shape[1] // k.shape[1]
        expanded_k = keys.repeat_interleave(groups, dim=1).transpose(0, 1)
        expanded_v = values.repeat_interleave(groups, dim=1).transpose(0, 1)   # (heads, context, dim)
        logits = torch.einsum("qhd,hcd->hqc", q, expanded_k) * scale
        new, context = q.shape[0], keys.shape[0]
        mask = torch.ones(new, context, dtype=torch.bool).tril(context - new)
        self.weights[layer] = logits.masked_fill(~mask, float("-inf")).softmax(-1)
        # The output through SDPA, as the official code computes it (the weights above only rank tokens).
        return F.scaled_dot_product_attention(q.transpose(0, 1), expanded_k, expanded_v, attn_mask=mask,
                                              scale=scale).transpose(0, 1)


def reference(model, prompt: ProcessedPrompt, config: PruneConfig, max_new: int = MAX_NEW,
              attention: _DenseAttention | None = None) -> tuple[list[int], torch.Tensor]:
    """FastV on one row, written out plainly: layers [0, K) over the whole prompt, the last token's
    head-averaged attention weights at layer K-1 rank the vision tokens, layers [K, end) over the
    survivors at their own positions, then greedy decoding through every layer. `attention` keeps
    each layer's keys and values."""
    layers = model.kv_geometry.num_layers
    attention = attention if attention is not None else _DenseAttention()
    with torch.inference_mode():
        hidden = model.run_layers(embed_whole_prompt(model, prompt), prompt.positions, attention, 0, config.layer)
        scores = attention.weights[config.layer - 1][:, -1].mean(0)
        pruning = row_pruning(prompt, config)
        vision = pruning.vision_mask.nonzero().squeeze(1)
        best = vision[scores[vision].topk(pruning.kept_vision).indices]
        survivors = torch.cat([(~pruning.vision_mask).nonzero().squeeze(1), best]).sort().values
        out = model.run_layers(hidden[survivors], prompt.positions[:, survivors], attention, config.layer, layers)
        tokens = greedy_decode(model, prompt, model.final_norm(out[-1:]), attention, max_new)
    return tokens, survivors


def greedy_decode(model, prompt: ProcessedPrompt, normed: torch.Tensor, attention: _DenseAttention,
                  max_new: int) -> list[int]:
    """Greedy tokens from the prompt's last final hidden state `normed`, each fed back at the positions after the
    prompt's (`next_position`)."""
    tokens: list[int] = []
    for step in range(max_new):
        token = int(model.logits(normed).argmax(-1))
        tokens.append(token)
        if token in model.eos_token_ids:
            break
        position = torch.full((prompt.positions.shape[0], 1), prompt.next_position + step)
        normed = model.forward(model.embed_tokens(torch.tensor([token])), position, attention)
    return tokens


def run(model, prompts: list[ProcessedPrompt], config: PruneConfig, max_new: int = MAX_NEW, **engine_config) -> list:
    # Plain greedy, as the reference decodes (Tarsier2 checkpoints carry a repetition penalty).
    engine = Engine(model, EngineConfig(prune=config, **engine_config),
                    SamplingParams(max_new_tokens=max_new, repetition_penalty=1.0))
    rows = [engine.add(prompt) for prompt in prompts]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return rows


@pytest.mark.parametrize("ratio, layer", [(0.5, 1), (0.75, 1), (0.25, 1)])   # the tiny model has 2 layers
def test_a_pruned_row_alone_equals_the_plain_reference(tiny_model, prompts, ratio: float, layer: int) -> None:
    config = PruneConfig(ratio, layer)
    for prompt in prompts[:3]:
        expected_tokens, expected_survivors = reference(tiny_model, prompt, config)
        [row] = run(tiny_model, [prompt], config, max_rows=1, prefill_chunk=0)
        assert row.output_ids == expected_tokens
        assert torch.equal(row.pruning.survivors, expected_survivors)
        text = (~row.pruning.vision_mask).nonzero().squeeze(1)
        assert torch.isin(text, row.pruning.survivors).all()   # text positions are never dropped


@pytest.mark.parametrize("chunk", [0, 7, 64])
def test_pruned_rows_chunked_and_batched_equal_rows_alone(tiny_model, prompts, chunk: int) -> None:
    config = PruneConfig(0.5, 1)
    alone = [run(tiny_model, [prompt], config, max_rows=1, prefill_chunk=0)[0] for prompt in prompts]
    together = run(tiny_model, prompts, config, max_rows=3, prefill_chunk=chunk, max_batch_tokens=96)
    assert [row.output_ids for row in together] == [row.output_ids for row in alone]
    assert all(torch.equal(a.pruning.survivors, b.pruning.survivors) for a, b in zip(alone, together))


def test_the_late_layers_cache_only_the_survivors_and_the_generated_tokens(tiny_model, prompts) -> None:
    """Per-layer KV: the early layers' cache holds the whole prompt, the late layers' the survivors (their keys
    as the reference computes them at their own positions), both then the generated tokens; a row reserves
    less memory than without pruning, in caches that together take the memory of the unpruned one."""
    config = PruneConfig(0.5, 1)
    prompt = prompts[3]
    attention = _DenseAttention()
    reference(tiny_model, prompt, config, attention=attention)
    engine = Engine(tiny_model, EngineConfig(max_rows=1, prefill_chunk=0, kv_cache_tokens=4096, prune=config),
                    SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.0))
    row = engine.add(prompt)
    while len(row.output_ids) < 3:
        engine.step()
    early, late = engine.pools
    assert (early.layers, late.layers) == (range(0, 1), range(1, 2))
    survivors, generated = row.pruning.num_survivors, len(row.output_ids) - 1   # the last one is not computed yet
    assert survivors < prompt.length
    assert (row.slots_used(), row.slots_used(late=True)) == (prompt.length + generated, survivors + generated)
    tables = engine.kv.block_tables(row)
    for pool, table, layer, length in ((early, tables[0], 0, prompt.length + generated),
                                       (late, tables[1], 1, survivors + generated)):
        keys, values = pool.read(table, layer, length)
        torch.testing.assert_close(keys[0].transpose(0, 1), attention.keys[layer][:length], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(values[0].transpose(0, 1), attention.values[layer][:length], rtol=1e-4, atol=1e-5)
    unpruned = Engine(tiny_model, EngineConfig(max_rows=1, prefill_chunk=0, kv_cache_tokens=4096),
                      SamplingParams(max_new_tokens=MAX_NEW))
    whole = unpruned.add(prompt)
    unpruned.step()
    assert engine.kv_bytes <= unpruned.kv_bytes and late.capacity_tokens < early.capacity_tokens
    reserved = sum(table.capacity * pool.bytes_per_slot for table, pool in zip(tables, engine.pools))
    assert reserved < unpruned.kv.block_tables(whole)[0].capacity * unpruned.pools[0].bytes_per_slot * 0.8


def test_pruned_rows_fit_more_rows_in_the_same_memory(tiny_model, shared_media) -> None:
    """In a cache that holds two unpruned rows, pruning three quarters of the vision tokens runs more at once,
    with the same tokens as each row alone. (32 frames: a video-shaped prompt, almost all vision, as the
    late layers' cache is sized for. The six rows are one clip: without the prefix cache, which would let the
    unpruned rows share their prompt's pages, each holds its own.)"""
    videos = [process(tiny_model, shared_media / "demo_test.mp4", frames=32)] * 6
    memory = 2 * (videos[0].length + 20) + 40

    def most_rows_at_once(prune: PruneConfig | None) -> tuple[int, list[list[int]]]:
        engine = Engine(tiny_model, EngineConfig(max_rows=6, prefill_chunk=0, kv_cache_tokens=memory, prune=prune,
                                                     kv_page_slots=2, prefix_cache=False),
                        SamplingParams(max_new_tokens=20, repetition_penalty=1.0))
        rows = [engine.add(prompt) for prompt in videos]
        most = 0
        while engine.has_work:
            engine.step()
            most = max(most, len(engine.scheduler.running))
        assert all(row.error is None for row in rows)
        return most, [row.output_ids for row in rows]

    config = PruneConfig(0.75, 1)
    unpruned_rows, _ = most_rows_at_once(None)
    pruned_rows, outputs = most_rows_at_once(config)
    assert unpruned_rows == 2 and pruned_rows >= 3
    assert outputs == [run(tiny_model, videos[:1], config, 20, max_rows=1, prefill_chunk=0)[0].output_ids] * 6


def test_preempted_pruned_rows_are_recomputed_to_the_same_tokens(tiny_model, prompts, no_room_to_grow) -> None:
    """A KV cache for about two rows forces preemptions mid-decode: the rows keep their survivors and tokens."""
    config = PruneConfig(0.5, 1)
    alone = [run(tiny_model, [prompt], config, 40, max_rows=1, prefill_chunk=0)[0] for prompt in prompts]
    crowded = run(tiny_model, prompts, config, 40, max_rows=7, prefill_chunk=64, kv_cache_tokens=2 * (194 + 40) + 20)
    assert [row.output_ids for row in crowded] == [row.output_ids for row in alone]
    assert sum(row.preemptions for row in crowded) > 0


def test_tarsier2_pruned_rows_keep_their_mrope_positions_and_equal_the_reference(shared_media, tmp_path_factory):
    """M-RoPE: survivors keep their (t, h, w) positions, decoding continues after the rope delta; mixed frame
    counts batched and chunked equal each row alone, which equals the plain reference."""
    from tarsier_batch.families.loading import load_caption_model
    from tarsier_batch.families.tiny import make_tiny_model
    from test_tarsier2 import process as process2

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-tarsier2"), "tiny", seed=0, family="tarsier2")
    model = load_caption_model(model_dir, torch.float32, torch.device("cpu"))
    prompts2 = [process2(model, shared_media / "demo_test.mp4", frames=frames) for frames in (4, 8)] + \
        [process2(model, shared_media / "tarsier_logo.jpg")]
    config = PruneConfig(0.5, 1)
    alone = [run(model, [prompt], config, max_rows=1, prefill_chunk=0)[0] for prompt in prompts2]
    for prompt, row in zip(prompts2, alone):
        tokens, survivors = reference(model, prompt, config)
        assert row.output_ids == tokens and torch.equal(row.pruning.survivors, survivors)
        assert prompt.positions.shape[0] == 3 and len(survivors) == row.pruning.num_survivors < prompt.length
    together = run(model, prompts2, config, max_rows=3, prefill_chunk=16, max_batch_tokens=64)
    assert [row.output_ids for row in together] == [row.output_ids for row in alone]


def test_survivors_are_every_text_position_and_the_best_vision_positions_in_order() -> None:
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.3, 0.05, 0.8])
    vision = torch.tensor([False, True, True, True, True, True, False])
    survivors = choose_survivors(scores, vision, kept_vision=3)
    assert survivors.tolist() == [0, 2, 3, 4, 6]   # text 0 and 6 (whatever their score); 0.5, then 0.3 twice
    assert choose_survivors(scores, vision, kept_vision=2).tolist() == [0, 2, 3, 6]   # a tie: the earlier one


def test_the_score_equals_eager_attention_weights(tiny_model, prompts) -> None:
    """The last prompt token's head-averaged attention at layer K-1, from its rotated query and the engine's
    cached keys, equals transformers' eager attention weights for that token."""
    language_model = tiny_model.model.language_model.model
    prompt = prompts[1]
    layer = 0   # K - 1: the tiny model has 2 layers
    with torch.inference_mode():
        embeds = embed_whole_prompt(tiny_model, prompt)
        language_model.config._attn_implementation = "eager"
        try:
            eager = language_model(inputs_embeds=embeds.unsqueeze(0), position_ids=prompt.positions,
                                   output_attentions=True).attentions[layer][0, :, -1].mean(0)
        finally:
            language_model.config._attn_implementation = "sdpa"
    engine = Engine(tiny_model, EngineConfig(max_rows=1, prefill_chunk=0, prune=PruneConfig(0.5, layer + 1)),
                    SamplingParams(max_new_tokens=1))
    row = engine.add(prompt)
    captured = {}
    real_choose = engine.runner._choose_survivors

    def choose(seq, query, scale):
        keys, _ = engine.pools[0].read(engine.kv.block_tables(seq)[0], layer, seq.prompt.length)
        captured["score"] = attention_of_last_query(query, keys[0], scale)
        real_choose(seq, query, scale)

    engine.runner._choose_survivors = choose
    engine.step()
    assert torch.allclose(captured["score"], eager, atol=1e-6), (captured["score"] - eager).abs().max()
    assert len(row.pruning.survivors) == row.pruning.num_survivors


# -- the CLI -----------------------------------------------------------------------------------------

def test_cli_prune_flags_reach_the_engine_are_recorded_and_must_match_to_resume(tiny_model, tiny_model_dir, prompts,
                                                                                 shared_media, tmp_path) -> None:
    names = NAMES[:3]
    common = ["caption", *[str(shared_media / name) for name in names], "--model", str(tiny_model_dir),
              "--max-new-tokens", str(MAX_NEW), "--with-token-ids"]

    def caption(out: Path, *flags: str):
        return CliRunner().invoke(app, [*common, "-o", str(out), *flags])

    def ids(out: Path) -> dict[str, list[int]]:
        return {Path(row["path"]).name: row["generated_ids"] for row in pq.read_table(out).to_pylist()}

    assert caption(tmp_path / "off.parquet").exit_code == 0
    assert caption(tmp_path / "zero.parquet", "--prune-vision", "0").exit_code == 0
    assert ids(tmp_path / "zero.parquet") == ids(tmp_path / "off.parquet")   # R = 0: pruning is off
    pruned_out = tmp_path / "pruned.parquet"
    done = caption(pruned_out, "--prune-vision", "0.5", "--prune-layer", "1")
    assert done.exit_code == 0, done.output
    assert "0.5 of the vision tokens dropped after layer 1 (not the official output)" in done.output
    engine = Engine(tiny_model, EngineConfig(prune=PruneConfig(0.5, 1)), SamplingParams(max_new_tokens=MAX_NEW))
    rows = [engine.add(prompt) for prompt in prompts[:3]]
    while engine.has_work:
        engine.step()
    assert ids(pruned_out) == {name: row.output_ids for name, row in zip(names, rows)}
    assert ids(pruned_out) != ids(tmp_path / "off.parquet")
    provenance = json.loads(pq.read_schema(pruned_out).metadata[b"tarsier_batch"])
    assert provenance["prune"] == provenance["settings"]["prune"] == {"vision": 0.5, "layer": 1}
    assert json.loads(pq.read_schema(tmp_path / "off.parquet").metadata[b"tarsier_batch"])["prune"] is None
    unpruned_again = caption(pruned_out)
    assert unpruned_again.exit_code == 2 and "prune {'vision': 0.5, 'layer': 1} there, (default) now" in \
        unpruned_again.output and "loading" not in unpruned_again.output
    too_deep = caption(tmp_path / "deep.parquet", "--prune-vision", "0.5", "--prune-layer", "2")
    assert too_deep.exit_code == 2 and "--prune-layer 2: the model has 2 layers; give 1 <= K < 2" in too_deep.output


def test_outputs_from_before_pruning_resume_unpruned_only() -> None:
    """Stored settings without a 'prune' entry were not pruned: they continue without pruning, not with it."""
    before = {"old.parquet": {"model": "m", "frames": 8}}
    check_settings(before, {"model": "m", "frames": 8, "prune": None})
    with pytest.raises(SettingsMismatchError, match="prune"):
        check_settings(before, {"model": "m", "frames": 8, "prune": {"vision": 0.5, "layer": 2}})


def test_a_pruned_row_drops_its_layer_inputs_whenever_it_samples(tiny_model, prompts) -> None:
    """Preempted after its first token, a pruned row is recomputed: its prompt, its survivors (no sample: the
    token exists), then that token alone, a pure decode step, which samples. Its layer-K inputs (prompt x
    hidden, ~40 MB a row at 7B, outside the KV budget) must go then too, not stay until the row finishes."""
    engine = Engine(tiny_model, EngineConfig(max_rows=1, prefill_chunk=0, prune=PruneConfig(0.5, 1)),
                    SamplingParams(max_new_tokens=8))
    seq = engine.add(prompts[1])
    while not seq.output_ids:
        engine.step()
    assert seq.pruning is not None and engine.runner.layer_inputs(seq) is None
    engine.scheduler.preempt(seq)
    while len(seq.output_ids) < 2:
        engine.step()
    assert engine.runner.layer_inputs(seq) is None
