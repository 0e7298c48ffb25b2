"""Batched generation equals one-at-a-time generation, token for token (float32, greedy)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tarsier_batch import Captioner, CaptionSettings, MediaItem, SamplingParams
from tarsier_batch.engine import generate
from tarsier_batch.engine.prefill import prefill
from tarsier_batch.families.tarsier import TarsierCaptioner
from tarsier_batch.media import MediaType, load_media, media_type_of

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


def prompts_for(model: TarsierCaptioner, shared_media: Path) -> list:
    names = ["tarsier_logo.jpg", "clip_5f.gif", "short_5f.mp4", "demo_test_8frames.gif"]
    prepared = [model.prepare(load_media(str(shared_media / name), media_type_of(name), 8), None) for name in names]
    return model.embed_prompts(prepared)


def test_rows_stop_at_their_own_eos(tiny_model: TarsierCaptioner, shared_media: Path) -> None:
    prompts = prompts_for(tiny_model, shared_media)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    free_running = [generate(tiny_model, [prompt], params, frozenset())[0].token_ids for prompt in prompts]
    stop = free_running[1][5]  # make the GIF's sixth token a stop token
    eos = frozenset({stop})
    alone = [generate(tiny_model, [prompt], params, eos)[0] for prompt in prompts]
    together = generate(tiny_model, prompts, params, eos)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.finish_reason for g in together] == [g.finish_reason for g in alone]
    gif = together[1]
    assert gif.finish_reason == "eos" and gif.token_ids == free_running[1][:gif.token_ids.index(stop) + 1]
    assert len(gif.token_ids) <= 6
    for generation, reference in zip(together, free_running):
        if stop not in reference:
            assert generation.finish_reason == "length" and generation.token_ids == reference


def test_tokens_match_transformers_generate(tiny_model: TarsierCaptioner, shared_media: Path) -> None:
    """Our prefill/decode loop gives what transformers' own greedy `generate` gives."""
    params = SamplingParams(max_new_tokens=MAX_NEW)
    language_model = tiny_model.model.language_model
    for prompt in prompts_for(tiny_model, shared_media):
        ours = generate(tiny_model, [prompt], params, tiny_model.eos_token_ids)[0].token_ids
        reference = language_model.generate(
            inputs_embeds=prompt.embeds[None], attention_mask=torch.ones(1, prompt.length, dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=sorted(tiny_model.eos_token_ids),
            pad_token_id=0)
        assert ours == reference[0].tolist()


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


def test_prefill_stacks_rows_left_padded_as_if_alone(tiny_model: TarsierCaptioner, shared_media: Path) -> None:
    image, gif, video = prompts_for(tiny_model, shared_media)[:3]
    assert image.length < gif.length < video.length
    batch = prefill(tiny_model, [image, video, gif])
    longest = video.length
    expected_mask = [[0] * (longest - prompt.length) + [1] * prompt.length for prompt in (image, video, gif)]
    assert batch.attention_mask.tolist() == expected_mask
    alone = prefill(tiny_model, [image])
    torch.testing.assert_close(batch.logits[0], alone.logits[0], rtol=0, atol=0)
    for (keys, values), (own_keys, own_values) in zip(
            [(layer.keys, layer.values) for layer in batch.cache.layers],
            [(layer.keys, layer.values) for layer in alone.cache.layers]):
        assert keys.shape[0] == 3 and keys.shape[2] == longest
        pad = longest - image.length
        assert keys[0, :, :pad].abs().sum() == 0 and values[0, :, :pad].abs().sum() == 0
        torch.testing.assert_close(keys[0, :, pad:], own_keys[0], rtol=0, atol=0)
        torch.testing.assert_close(values[0, :, pad:], own_values[0], rtol=0, atol=0)
    assert [image.next_position, video.next_position, gif.next_position] == [image.length, video.length, gif.length]


def test_decode_steps_continue_each_rows_own_positions(tiny_model: TarsierCaptioner, shared_media: Path) -> None:
    """Under left padding, row r's n-th generated token sits at position len(r) + n, padding masked."""
    image, gif, video = prompts_for(tiny_model, shared_media)[:3]
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Recorder:
        def embed_tokens(self, token_ids):
            return tiny_model.embed_tokens(token_ids)

        def new_cache(self):
            return tiny_model.new_cache()

        def forward_step(self, embeds, attention_mask, position_ids, cache):
            calls.append((attention_mask.clone(), position_ids.clone()))
            return tiny_model.forward_step(embeds, attention_mask, position_ids, cache)

    generate(Recorder(), [image, gif, video], SamplingParams(max_new_tokens=4), frozenset())
    prefills, decodes = calls[:3], calls[3:]
    for (mask, positions), prompt in zip(prefills, (image, gif, video)):
        assert mask.tolist() == [[1] * prompt.length]
        assert positions.tolist() == [list(range(prompt.length))]
    longest = video.length
    assert len(decodes) == 3  # the 4th token needs no forward step
    for step, (mask, positions) in enumerate(decodes):
        assert positions.tolist() == [[image.length + step], [gif.length + step], [video.length + step]]
        assert mask.shape == (3, longest + step + 1)
        for row, prompt in enumerate((image, gif, video)):
            assert mask[row].tolist() == [0] * (longest - prompt.length) + [1] * (prompt.length + step + 1)


def test_longest_row_leaving_first_does_not_disturb_the_others(tiny_model: TarsierCaptioner,
                                                               shared_media: Path) -> None:
    image, gif, video = prompts_for(tiny_model, shared_media)[:3]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    eos = frozenset({generate(tiny_model, [video], params, frozenset())[0].token_ids[0]})
    together = generate(tiny_model, [video, image, gif], params, eos)
    alone = [generate(tiny_model, [prompt], params, eos)[0] for prompt in (video, image, gif)]
    assert together[0].finish_reason == "eos" and len(together[0].token_ids) == 1
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_decoding_drops_ids_the_tokenizer_does_not_know(tiny_model: TarsierCaptioner) -> None:
    tokenizer = tiny_model.processor.tokenizer
    known = tokenizer("a man walks", add_special_tokens=False)["input_ids"]
    beyond = [tiny_model.config.image_newline_idx, tiny_model.config.image_new_idx, tiny_model.config.text.vocab_size - 1]
    mixed = known[:1] + beyond[:2] + known[1:] + beyond[2:] + [tokenizer.eos_token_id]
    assert tiny_model.decode(mixed) == tiny_model.decode(known) == "a man walks"


def test_out_of_memory_while_decoding_retries_and_counts_tokens_once(settings: CaptionSettings, shared_media: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import SAMPLE_DATA

    items = mixed_items(shared_media, SAMPLE_DATA)[:4]
    expected = caption_ids(replace(settings, batch_size=1), items)
    captioner = Captioner(replace(settings, batch_size=4))
    real_step = captioner.model.forward_step
    steps = {"decode": 0}

    def step_that_runs_out_of_memory(embeds, attention_mask, position_ids, cache):
        if embeds.shape[0] > 1:  # a batched decode step (prefill runs row by row)
            steps["decode"] += 1
            if steps["decode"] == 5:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, mid-decode)")
        return real_step(embeds, attention_mask, position_ids, cache)

    monkeypatch.setattr(captioner.model, "forward_step", step_that_runs_out_of_memory)
    counted: list[int] = []
    results = list(captioner.caption(items, counted.append))
    assert [result.generated_ids for result in results] == expected
    assert captioner.batch_size == 2
    assert any(count < 0 for count in counted), "the failed attempt's tokens are taken back"
    assert sum(counted) == sum(result.generated_tokens for result in results)
