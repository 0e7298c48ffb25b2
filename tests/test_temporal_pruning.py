"""Temporal pruning (`--prune-method temporal`, `families.temporal`): which vision vectors go, that the survivors
keep their positions, and that the engine's pruned rows equal a plain reference over the survivors, chunked and
batched, for both families."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.engine import Engine, EngineConfig, SamplingParams
from tarsier_batch.families.base import ProcessedPrompt, VisionBlock, embed_whole_prompt
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.temporal import ALWAYS_KEPT, drop_static_vision
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import MediaType, media_type_of
from test_pruning import _DenseAttention, greedy_decode

runner = CliRunner()
MAX_NEW = 10


def _prompt(blocks: int, per_block: int, text_before: int = 3, text_after: int = 2) -> ProcessedPrompt:
    length = text_before + blocks * per_block + text_after
    return ProcessedPrompt("", torch.arange(100, 100 + length), torch.arange(length).expand(3, -1).clone(), length + 5,
                           [VisionBlock(text_before + index * per_block, per_block) for index in range(blocks)],
                           torch.zeros(blocks, 1))


def test_the_least_changed_vectors_go_and_the_survivors_keep_their_positions() -> None:
    prompt = _prompt(3, 4)
    changes = [None, torch.tensor([0.5, 0.1, ALWAYS_KEPT, 0.3]), torch.tensor([0.2, 0.9, 0.0, 0.4])]
    pruned = drop_static_vision(prompt, changes, 0.5)   # 6 of 12 vision vectors; 7 may go
    dropped = {3 + 4 + 1, 3 + 4 + 3, 3 + 8 + 0, 3 + 8 + 2, 3 + 8 + 3, 3 + 4 + 0}   # 0.1, 0.3, 0.2, 0.0, 0.4, 0.5
    kept = [position for position in range(prompt.length) if position not in dropped]
    assert pruned.positions.tolist() == prompt.positions[:, kept].tolist()
    assert pruned.token_ids.tolist() == prompt.token_ids[kept].tolist()
    assert pruned.next_position == prompt.next_position   # generation continues after the unpruned prompt
    assert [(block.start, block.length, block.kept) for block in pruned.vision_blocks] == [
        (3, 4, None), (7, 1, (2,)), (8, 1, (1,))]
    assert pruned.length == prompt.length - 6


def test_nothing_goes_at_zero_or_without_a_previous_frame_and_never_more_than_may() -> None:
    prompt = _prompt(2, 4)
    changes = [None, torch.tensor([0.5, ALWAYS_KEPT, ALWAYS_KEPT, 0.3])]
    assert drop_static_vision(prompt, changes, 0.0) is prompt
    assert drop_static_vision(prompt, [None, None], 0.9) is prompt   # an image: one frame, nothing to compare
    assert drop_static_vision(prompt, changes, 0.9).length == prompt.length - 2


@pytest.fixture(scope="module", params=["tarsier", "tarsier2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    directory = make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)
    return load_caption_model(directory, torch.float32, torch.device("cpu"))


def _moving_square(folder: Path, frames: int = 8) -> Path:
    """A white square crossing a black picture, as a GIF (frames of exactly these pixels)."""
    pictures = []
    for index in range(frames):
        picture = Image.new("RGB", (112, 112))
        picture.paste((255, 255, 255), (index * 10, 40, index * 10 + 28, 68))
        pictures.append(picture)
    path = folder / "square.gif"
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100)
    return path


def _process(model, path: Path, frames: int = 8) -> ProcessedPrompt:
    processor = model.processor
    media = processor.load_media(str(path), media_type_of(path), frames)
    return processor.process(media, None)


def test_what_moves_survives_and_the_frame_structure_stays(model, tmp_path: Path) -> None:
    prompt = _process(model, _moving_square(tmp_path))
    changes = model.processor.vision_changes(prompt)
    assert changes[0] is None and len(changes) == len(prompt.vision_blocks)
    pruned = drop_static_vision(prompt, changes, 0.5)
    total = sum(block.length for block in prompt.vision_blocks)
    assert sum(block.length for block in pruned.vision_blocks) == total - round(0.5 * total)
    assert pruned.vision_blocks[0].kept is None   # the first frame whole
    kept_scores, gone_scores = [], []
    for block, change in zip(pruned.vision_blocks[1:], changes[1:]):
        kept = torch.tensor(block.kept if block.kept is not None else range(len(change)), dtype=torch.long)
        gone = torch.ones(len(change), dtype=torch.bool)
        gone[kept] = False
        assert not (change == ALWAYS_KEPT)[gone].any()   # v1's row and frame separators are never dropped
        assert change[kept].max() > 0   # the square's vectors, which changed, are among those kept in every frame
        kept_scores.append(change[kept])
        gone_scores.append(change[gone])
    assert torch.cat(kept_scores).min() >= torch.cat(gone_scores).max()   # what goes changed least


def _greedy_reference(model, prompt: ProcessedPrompt, max_new: int = MAX_NEW) -> list[int]:
    """The language model over the survivors at their positions, unchunked and alone, then greedy decoding."""
    attention = _DenseAttention()
    with torch.inference_mode():
        normed = model.forward(embed_whole_prompt(model, prompt), prompt.positions, attention)[-1:]
        return greedy_decode(model, prompt, normed, attention, max_new)


def _engine_tokens(model, prompts: list[ProcessedPrompt], **config) -> list[list[int]]:
    engine = Engine(model, EngineConfig(**config), SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.0))
    rows = [engine.add(prompt) for prompt in prompts]
    while engine.has_work:
        engine.step()
    assert all(row.error is None for row in rows), [row.error for row in rows]
    return [row.output_ids for row in rows]


def test_pruned_rows_equal_the_reference_chunked_and_batched(model, tmp_path: Path, shared_media: Path) -> None:
    clips = [_moving_square(tmp_path), shared_media / "demo_test.mp4"]
    full = [_process(model, clip) for clip in clips]
    pruned = [drop_static_vision(prompt, model.processor.vision_changes(prompt), ratio)
              for prompt, ratio in zip(full, (0.5, 0.3))]
    assert all(p.length < f.length for p, f in zip(pruned, full))
    expected = [_greedy_reference(model, prompt) for prompt in pruned]
    assert expected != [_greedy_reference(model, prompt) for prompt in full], "pruning should change the tokens"
    assert _engine_tokens(model, pruned, max_rows=1, prefill_chunk=0) == expected
    # Chunks that end inside frames, an unpruned row beside the pruned ones, rows joining as others finish.
    mixed = _engine_tokens(model, [pruned[0], full[1], pruned[1]], max_rows=2, prefill_chunk=7, max_batch_tokens=12)
    assert mixed == [expected[0], _greedy_reference(model, full[1]), expected[1]]


def test_a_frame_pruned_whole_leaves_no_vectors_and_the_row_still_equals_the_reference(tmp_path: Path) -> None:
    """A frame that repeats the one before has nothing new: at R = 0.5 every one of its vectors goes (a still
    shot), and its block then puts no vectors in the prompt at all. (v1 keeps its separators: a frame never
    empties there.)"""
    model = load_caption_model(make_tiny_model(tmp_path / "model", "tiny", seed=0, family="tarsier2"),
                               torch.float32, torch.device("cpu"))
    media = model.processor.load_media(str(_moving_square(tmp_path)), MediaType.VIDEO, 2)
    prompt = model.processor.process(replace(media, frames=[media.frames[0]] * 2), None)
    pruned = drop_static_vision(prompt, model.processor.vision_changes(prompt), 0.5)
    assert [block.kept for block in pruned.vision_blocks] == [None, ()]
    encoded = torch.randn(prompt.vision_blocks[-1].length, 4)
    assert pruned.vision_blocks[-1].prompt_vectors(encoded).shape == (0, 4)
    assert _engine_tokens(model, [pruned], max_rows=1, prefill_chunk=0) == [_greedy_reference(model, pruned)]


def test_the_cli_prunes_records_it_and_refuses_a_layer(tiny_model_dir: Path, shared_media: Path, tmp_path: Path
                                                       ) -> None:
    out = tmp_path / "r.jsonl"
    clip = str(shared_media / "demo_test.mp4")
    done = runner.invoke(app, ["caption", clip, "--model", str(tiny_model_dir), "-o", str(out), "--max-new-tokens",
                               "4", "--prune-vision", "0.5", "--prune-method", "temporal", "--quiet"])
    assert done.exit_code == 0, done.output
    row = json.loads(out.read_text().splitlines()[0])
    unpruned = tmp_path / "u.jsonl"
    assert runner.invoke(app, ["caption", clip, "--model", str(tiny_model_dir), "-o", str(unpruned),
                               "--max-new-tokens", "4", "--quiet"]).exit_code == 0
    full_row = json.loads(unpruned.read_text().splitlines()[0])
    assert row["prompt_tokens"] < full_row["prompt_tokens"]
    refused = runner.invoke(app, ["caption", clip, "--model", str(tiny_model_dir), "-o", str(tmp_path / "x.jsonl"),
                                  "--prune-vision", "0.5", "--prune-method", "temporal", "--prune-layer", "1"])
    assert refused.exit_code == 2 and "--prune-layer is for --prune-method fastv" in refused.output
    # Resuming with the other method is refused: the captions would differ.
    other = runner.invoke(app, ["caption", clip, "--model", str(tiny_model_dir), "-o", str(out), "--max-new-tokens",
                                "4", "--prune-vision", "0.5", "--prune-method", "fastv"])
    assert other.exit_code == 2 and "prune" in other.output, other.output


def test_prune_vision_alone_prunes_temporally_and_a_layer_alone_chooses_fastv(tmp_path: Path) -> None:
    """--prune-vision R alone used FastV (89 % on the demo at R = 0.5) where temporal keeps 98 %."""
    from tarsier_batch.settings import CaptionSettings

    assert CaptionSettings(prune_vision=0.5).pruning == {"vision": 0.5, "method": "temporal"}
    assert CaptionSettings(prune_vision=0.5, prune_layer=3).pruning == {"vision": 0.5, "layer": 3}   # K is fastv's
    assert CaptionSettings(prune_vision=0.5, prune_method="fastv").pruning == {"vision": 0.5, "layer": 2}
    assert CaptionSettings().prune_method == "temporal" and CaptionSettings().pruning is None
    (tmp_path / "a.jpg").touch()
    args = ["caption", str(tmp_path / "a.jpg"), "-o", str(tmp_path / "r.parquet"), "--dry-run", "--prune-vision", "0.5"]
    # --offload-kv does not go with fastv: accepted here only because the default method is temporal.
    assert runner.invoke(app, [*args, "--offload-kv"]).exit_code == 0
    fastv = runner.invoke(app, [*args, "--offload-kv", "--prune-method", "fastv"])
    assert fastv.exit_code == 2 and "--offload-kv and --prune-vision with --prune-method fastv" in fastv.output


def test_fastv_without_a_share_to_prune_is_refused(tmp_path: Path) -> None:
    """--prune-method fastv alone was accepted and pruned nothing."""
    (tmp_path / "a.jpg").touch()
    alone = runner.invoke(app, ["caption", str(tmp_path / "a.jpg"), "-o", str(tmp_path / "r.parquet"), "--dry-run",
                                "--prune-method", "fastv"])
    assert alone.exit_code == 2
    assert "--prune-method fastv has no effect without --prune-vision R > 0" in alone.output
