"""Sampling by rate (`--fps`), as qwen-vl-utils' `smart_nframes` counts a clip's frames: the rule, the decoders
reading each clip's rate, the memory plan's cap, the CLI and resume, and the captions against transformers' own
generate."""
# The Qwen2 families' `model` fixture is imported and requested by name (pytest's injection): it loads this module's
# `model_dir`.
# ruff: noqa: F811

from __future__ import annotations

import copy
import json
import re
import sys
import types
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.families.qwen2_vl import QwenVLCaptionModel
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import FramesAtRate, MediaType, Span, even_frame_indices, frames_in_words, media_type_of
from tarsier_batch.media.sampling import frames_for
from tarsier_batch.outputs.resume import SettingsMismatchError, check_settings
from tarsier_batch.settings import CaptionSettings, RunSettings, SettingsError, resume_settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from official_baseline import GenerateLimits, generate_qwen_vl, qwen_vl_for_generation  # noqa: E402

from test_qwen3_vl import processors_timestamps  # noqa: E402
from test_qwen_vl import model, official_temporal_positions  # noqa: E402, F401

MAX_NEW = 12
TWO_FPS = FramesAtRate(2.0, 768, 16)   # what `--fps 2` gives a Qwen-VL checkpoint: the cap 768, else 16 frames
# Clips of 10.5 s (84 frames at 8 fps), 3 s (75 at 25 fps), 0.625 s (5 at 8 fps) and 1.44 s (12 GIF frames of 120 ms).
CLIPS = {"demo_test.mp4": 20, "portrait_25fps.mp4": 6, "short_5f.mp4": 4, "clip_12f.gif": 4}


# -- the rule -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("frames", "rate", "fps", "most", "expected"), [
    (300, 30.0, 2.0, 768, 20),         # 10 s at 30 fps: 20 frames
    (57, 30.0, 2.0, 768, 4),           # 1.9 s: 3.8 frames, raised to the least, 4
    (3, 30.0, 2.0, 768, 2),            # 3 frames: at most the clip's, floored to whole temporal patches
    (30 * 3600, 30.0, 2.0, 768, 768),  # an hour: the cap
    (30 * 3600, 30.0, 2.0, 65, 64),    # an odd cap floored to even
    (210, 30.0, 3.0, 768, 20),         # 7 s at 3 fps: 21 floored to 20
    (210, 30.0, 0.5, 768, 4),          # 7 s at 0.5 fps: 3.5, raised to 4
    (1, 30.0, 2.0, 768, 2),            # one frame: given twice (a temporal patch), where qwen-vl-utils refuses it
])
def test_the_count_is_qwen_vl_utils_rule(frames: int, rate: float, fps: float, most: int, expected: int) -> None:
    assert FramesAtRate(fps, most).count(frames, rate) == expected


def test_a_clip_of_unknown_rate_gives_the_fixed_count_and_a_count_stays_a_count() -> None:
    assert FramesAtRate(2.0, 768, 16).count(300, None) == 16
    assert FramesAtRate(2.0, 8, 16).count(300, None) == 8   # never above the cap
    assert frames_for(12, 300, 30.0) == 12 and frames_for(TWO_FPS, 300, 30.0) == 20
    assert (frames_in_words(TWO_FPS), frames_in_words(16)) == ("2 fps, 4-768 frames", "16 frames")


def test_settings_make_the_rule_and_refuse_what_cannot_work() -> None:
    assert CaptionSettings(fps=2.0).frame_count(16) == TWO_FPS
    assert CaptionSettings(fps=2.0).most_frames(16) == 768
    assert CaptionSettings(fps=0.5, frames=64).frame_count(16) == FramesAtRate(0.5, 64, 64)
    assert CaptionSettings(frames=8).frame_count(16) == 8 and CaptionSettings().frame_count(16) == 16
    with pytest.raises(SettingsError, match="positive rate"):
        CaptionSettings(fps=0.0)
    with pytest.raises(SettingsError, match="at least 2 frames"):
        CaptionSettings(fps=2.0, frames=1)


# -- decoding: each clip's count from its own length and rate ---------------------------------------

@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", seed=0, family=request.param)


def test_decoded_clips_give_the_rules_count_spread_as_linspace(model: QwenVLCaptionModel, shared_media: Path) -> None:
    for name, count in CLIPS.items():
        media = model.processor.load_media(str(shared_media / name), media_type_of(name), TWO_FPS)
        assert len(media.frames) == count, name
        total = {"demo_test.mp4": 84, "portrait_25fps.mp4": 75, "short_5f.mp4": 5, "clip_12f.gif": 12}[name]
        assert media.frame_indices == torch.linspace(0, total - 1, count).round().long().tolist()


def test_a_span_counts_its_own_frames_at_the_files_rate(model: QwenVLCaptionModel, shared_media: Path) -> None:
    """Seconds 2-6 of demo_test.mp4 are its frames 16 to 47: 4 s at 8 fps, 8 frames at 2 fps."""
    media = model.processor.load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, TWO_FPS,
                                       span=Span(2.0, 6.0))
    assert media.frame_indices == [16 + index for index in even_frame_indices(32, 8)] and media.fps == 8.0


def write_video(path: Path, frames: int, rate: int, container: str) -> Path:
    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for index in range(frames):
            picture = np.full((64, 64, 3), index * 2, np.uint8)
            output.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        output.mux(stream.encode())
    return path


def test_pyav_counts_by_the_streams_rate(model: QwenVLCaptionModel, tmp_path: Path) -> None:
    """MPEG-TS goes to PyAV: 95 frames at 30 fps are 3.17 s, 15.8 frames at 5 fps, 14 sampled; the rate counted is
    the one the row's media records (and Qwen-VL's time positions divide by)."""
    path = write_video(tmp_path / "clip.ts", 95, 30, "mpegts")
    media = model.processor.load_media(str(path), MediaType.VIDEO, FramesAtRate(5.0, 768, 16))
    assert (media.decoder, media.fps, len(media.frames)) == ("pyav", 30.0, 14)
    assert media.frame_indices == even_frame_indices(95, 14)


def test_a_one_frame_clip_gives_its_frame_twice(model: QwenVLCaptionModel, tmp_path: Path) -> None:
    media = model.processor.load_media(str(write_video(tmp_path / "one.mp4", 1, 30, "mp4")), MediaType.VIDEO,
                                       TWO_FPS)
    assert media.frame_indices == [0, 0]


@pytest.mark.parametrize(("duration_ms", "expected"), [(100, 8), (0, 16)], ids=["timed", "untimed"])
def test_an_animation_counts_by_its_frames_durations_else_the_fixed_count(model: QwenVLCaptionModel, tmp_path: Path,
                                                                         duration_ms: int, expected: int) -> None:
    """40 frames of 100 ms: 4 s at 10 fps, 8 frames at 2 fps; without durations its rate is unknown: 16 frames."""
    frames = [Image.new("RGB", (32, 32), (index * 6, 0, 0)) for index in range(40)]
    path = tmp_path / "a.gif"
    timing = {"duration": duration_ms} if duration_ms else {}
    frames[0].save(path, save_all=True, append_images=frames[1:], loop=0, **timing)
    media = model.processor.load_media(str(path), MediaType.GIF, TWO_FPS)
    assert media.fps == (10.0 if duration_ms else None)
    assert media.frame_indices == even_frame_indices(40, expected)


# -- the memory plan ------------------------------------------------------------------------------------

def test_the_caps_plan_holds_every_count_below_it(model: QwenVLCaptionModel) -> None:
    """With the published checkpoints' pixel cap, a clip's budget binds from about 300 frames on, where rounding
    each frame up to whole patches lets 302 frames take more vision positions than 306: the plan for a cap is the
    most of every count up to it."""
    processor = copy.copy(model.processor)
    published = 16384 * processor.size_factor**2   # 12,845,056 px for 28-px merged patches
    processor.image_processor = types.SimpleNamespace(size=types.SimpleNamespace(longest_edge=published))
    positions = {count: processor.largest_of_count(count).vision_positions for count in range(2, 769, 2)}
    assert positions[302] > positions[306]
    for cap in (16, 300, 306, 768):
        planned = processor.largest_item(cap)
        assert planned.vision_positions == max(value for count, value in positions.items() if count <= cap)
        assert planned.pixel_bytes >= processor.largest_of_count(cap).pixel_bytes
    assert 115_200 < processor.largest_item(768).vision_positions < 115_200 * 1.001   # the clip's budget


# -- the CLI, resume, and the captions against transformers -------------------------------------------

def test_rate_sampled_captions_equal_transformers_generate_one_at_a_time(model: QwenVLCaptionModel, model_dir: Path,
                                                                         shared_media: Path, tmp_path: Path) -> None:
    """Clips of different lengths in one batch: each row's frames are the rule's, and its tokens are transformers'
    own generate's on the same frames, one item at a time. Qwen2.5-VL's temporal positions are the official chain's
    from the clip's sampled rate; Qwen3-VL's timestamps are its processor's."""
    out = tmp_path / "r.parquet"
    paths = [str(shared_media / name) for name in CLIPS]
    result = CliRunner().invoke(app, ["caption", *paths, "--model", str(model_dir), "-o", str(out), "--fps", "2",
                                      "--max-new-tokens", str(MAX_NEW), "--with-token-ids"])
    assert result.exit_code == 0, result.output
    assert f"({model.family.name}, 2 fps, 4-768 frames)" in result.output
    rows = {Path(row["path"]).name: row for row in pq.read_table(out).to_pylist()}
    assert {name: row["num_frames"] for name, row in rows.items()} == CLIPS
    hf = qwen_vl_for_generation(model)
    for name, path in zip(CLIPS, paths):
        media = model.processor.load_media(path, media_type_of(name), TWO_FPS)
        prompt = model.processor.process(media, None)
        with torch.inference_mode():
            assert rows[name]["generated_ids"] == generate_qwen_vl(model, hf, prompt, GenerateLimits(MAX_NEW)), name
        assert rows[name]["frame_indices"] == media.frame_indices
        total = media.frame_indices[-1] + 1
        if model.config.variant.time_aligned:
            starts = [block.start for block in prompt.vision_blocks]
            times = [int(prompt.positions[0, start] - prompt.positions[0, starts[0]]) for start in starts]
            assert times == official_temporal_positions(len(media.frames), total, media.fps)[0], name
        elif model.config.variant.model_type == "qwen3_vl":
            written = re.findall(r"<(\d+\.\d) seconds>", model.processor.tokenizer.decode(prompt.token_ids))
            assert written == [f"{t:.1f}" for t in processors_timestamps(media.frame_indices, media.fps)], name


def test_a_run_with_another_rate_is_refused(model_dir: Path, shared_media: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    clip = str(shared_media / "short_5f.mp4")
    runner = CliRunner()
    common = ["caption", clip, "--model", str(model_dir), "-o", str(out), "--max-new-tokens", "2"]
    assert runner.invoke(app, [*common, "--fps", "2"]).exit_code == 0
    refused = runner.invoke(app, [*common, "--fps", "1"])
    assert refused.exit_code == 2 and "fps 2.0 there, 1.0 now" in refused.output
    fixed = runner.invoke(app, common)   # a fixed count: off, as outputs written before --fps existed read
    assert fixed.exit_code == 2 and "fps 2.0 there, (default) now" in fixed.output
    assert pq.read_table(out).num_rows == 1


def test_outputs_written_before_the_rate_existed_continue_with_a_fixed_count() -> None:
    now = resume_settings(RunSettings())
    assert now["fps"] is None
    stored = {key: value for key, value in now.items() if key != "fps"}
    check_settings({"r.parquet": stored}, now)
    with pytest.raises(SettingsMismatchError, match="fps"):
        check_settings({"r.parquet": stored}, resume_settings(RunSettings(CaptionSettings(fps=2.0))))


def test_tarsier_refuses_a_rate_in_one_line_before_loading(tiny_model_dir: Path, shared_media: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Tarsier v1 and Tarsier2 sample a fixed count, as their official code does: config.json says the family."""
    import tarsier_batch.api as api

    def load(*args: object) -> None:
        raise AssertionError("the checkpoint loads before the refusal")

    monkeypatch.setattr(api, "load_caption_model", load)
    monkeypatch.setattr(api.preflight, "estimate", load)
    result = CliRunner().invoke(app, ["caption", str(shared_media / "short_5f.mp4"), "--model", str(tiny_model_dir),
                                      "-o", str(tmp_path / "r.parquet"), "--fps", "2"])
    assert result.exit_code == 2, result.output
    assert "--fps: Tarsier v1 samples a fixed count of frames from every clip" in result.output
    assert "--frames" in result.output and not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize("name", list(CLIPS))
def test_inspect_samples_at_a_rate_as_captioning_does(model: QwenVLCaptionModel, shared_media: Path,
                                                      name: str) -> None:
    """`tarsier inspect --fps` shows the frames a run with `--fps` samples from the clip, and its rule in words."""
    media = model.processor.load_media(str(shared_media / name), media_type_of(name), TWO_FPS)
    result = CliRunner().invoke(app, ["inspect", str(shared_media / name), "--family", model.family.key, "--fps",
                                      "2", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert (found["frame_indices"], found["fps_asked"], found["frames_asked"]) == (media.frame_indices, 2.0, 768)
    text = CliRunner().invoke(app, ["inspect", str(shared_media / name), "--family", model.family.key, "--fps", "2",
                                    "--frames", "8"]).output
    assert re.search(r"^frames +2 fps, 4-8 frames$", text, re.MULTILINE), text


def test_inspect_refuses_a_rate_for_a_family_that_samples_a_fixed_count(shared_media: Path) -> None:
    for family, name in (("tarsier", "Tarsier v1"), ("tarsier2", "Tarsier2")):
        result = CliRunner().invoke(app, ["inspect", str(shared_media / "short_5f.mp4"), "--family", family,
                                          "--fps", "2"])
        assert result.exit_code == 2
        assert f"--fps: {name} samples a fixed count of frames from every clip" in result.output
