"""`tarsier inspect`: what captioning would see in a file, from the same decoding path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from awkward_media import make_awkward_inputs
from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.families.catalog import TARSIER, TARSIER2
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import media_type_of
from tarsier_batch.review.inspection import _in_child, inspect_file

runner = CliRunner()


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("awkward")
    make_awkward_inputs(folder)
    return folder


def test_a_plain_video_in_full(shared_media: Path) -> None:
    found = inspect_file(str(shared_media / "demo_test.mp4"), TARSIER2)
    assert found.ok and found.media_type == "video" and found.size_bytes == 3_075_695
    assert (found.container, found.codec, found.stored_size, found.displayed_size) == \
        ("mov,mp4,m4a,3gp,3g2,mj2", "h264", "1920x800", "1920x800")
    assert (found.rotation, found.fps, found.duration_s, found.frame_count) == (0, 8.0, 10.5, 84)
    assert found.decoder == "decord" and found.frames_asked == 16
    assert found.frame_indices == [0, 6, 11, 17, 22, 28, 33, 39, 44, 50, 55, 61, 66, 72, 77, 83]
    assert found.as_text().splitlines()[-1].split() == ["verdict", "would", "caption"]


@pytest.mark.parametrize("name", ["ball_h264.mp4", "ball_short.mkv", "ball_vp9.webm", "ball.gif", "still.png",
                                  "portrait.JPG"])
def test_sampled_indices_are_those_each_family_loads(name: str, tiny_model_dir: Path,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    path = str(SAMPLE_DATA / name)
    media_type = media_type_of(path)
    v2_dir = make_tiny_model(tmp_path_factory.mktemp("t2"), "tiny", seed=0, family="tarsier2")
    for family, model_dir in [(TARSIER, tiny_model_dir), (TARSIER2, v2_dir)]:
        processor = load_caption_model(model_dir, torch.float32, torch.device("cpu")).processor
        loaded = processor.load_media(path, media_type, 6)
        found = inspect_file(path, family, 6)
        assert (found.frame_indices, found.decoder) == (loaded.frame_indices, loaded.decoder), family.name
        assert found.displayed_size == f"{loaded.width}x{loaded.height}"


def test_why_pyav_reads_a_file(awkward: Path) -> None:
    rotated = inspect_file(str(awkward / "rotated_phone.mp4"), TARSIER)
    assert rotated.ok and rotated.decoder == "pyav" and rotated.rotation in (90, -90)
    assert rotated.stored_size == "64x48" and rotated.displayed_size == "48x64"
    assert "display rotation" in rotated.decoder_reason
    stream = inspect_file(str(awkward / "mpeg2.ts"), TARSIER)
    assert stream.decoder == "pyav" and stream.container == "mpegts"
    assert stream.decoder_reason == "decord seeks to other frames than asked in this container (mpegts)"


@pytest.mark.parametrize(("name", "problem"), [("truncated.mp4", "the video is cut short"),
                                               ("fifo.mp4", "not a regular file: a FIFO"),
                                               ("notes.txt", "not media: .txt files are skipped")])
def test_a_file_that_would_fail_says_why(awkward: Path, name: str, problem: str) -> None:
    if name == "notes.txt":
        (awkward / name).write_text("hello")
    found = inspect_file(str(awkward / name), TARSIER2)
    assert not found.ok and problem in found.problem


def crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def hang() -> None:
    signal.pause()   # a decoder stuck for ever


def test_a_decoder_crash_or_hang_is_reported_not_suffered() -> None:
    assert _in_child(crash, (), timeout_s=30) == {"problem": "the decoder crashed (SIGSEGV)"}
    assert _in_child(hang, (), timeout_s=0.3) == {"problem": "decoding took longer than 0.3 s"}


def test_the_decoding_child_is_not_forked_from_the_caller() -> None:
    # Forking a caller that holds models failed with ENOMEM on a machine that does not overcommit
    assert _in_child(os.getppid, (), timeout_s=30) != os.getpid()


def test_command_exit_codes_json_and_no_torch(awkward: Path, tmp_path: Path) -> None:
    good, bad = str(SAMPLE_DATA / "ball.gif"), str(awkward / "truncated.mp4")
    both = runner.invoke(app, ["inspect", "--json", "--family", "tarsier", good, bad])
    assert both.exit_code == 1
    rows = [json.loads(line) for line in both.output.splitlines()]
    assert [row["problem"] is None for row in rows] == [True, False] and rows[0]["frame_count"] == 10
    assert runner.invoke(app, ["inspect", good]).exit_code == 0
    clash = runner.invoke(app, ["inspect", "--family", "tarsier", "--model", "x", good])
    assert clash.exit_code == 2 and "not both" in clash.output
    unknown = runner.invoke(app, ["inspect", "--model", str(tmp_path), good])
    assert unknown.exit_code == 2 and "use --family tarsier or tarsier2" in unknown.output
    probe = ("import sys, runpy; sys.argv = ['tarsier', 'inspect', sys.argv[1]]\n"
             "try:\n    runpy.run_module('tarsier_batch.cli', run_name='__main__')\n"
             "except SystemExit:\n    print('TORCH', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe, good], capture_output=True, timeout=60)
    assert done.stdout.decode().strip().endswith("TORCH False"), done.stderr.decode()


def test_images_as_captioning_reads_them(awkward: Path) -> None:
    still = inspect_file(str(awkward / "multi_picture.jpg"), TARSIER2)   # MPO: Pillow says animated
    assert (still.media_type, still.animated, still.frame_indices) == ("image", False, [0])
    assert still.decoder_reason == "Pillow reads still images (decord reads only videos)"
    webp = inspect_file(str(awkward / "animated.webp"), TARSIER2)
    assert (webp.media_type, webp.animated, webp.frame_indices) == ("gif", True, [0, 1, 2])   # as the row says
    assert inspect_file(str(awkward / "palette_alpha.png"), TARSIER2).image_mode == "P with transparency"


def test_native_decoder_lines_stay_off_the_terminal(awkward: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tarsier_batch.cli", "inspect", str(awkward / "random_bytes.mp4")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not a video: no media stream found" in done.stdout and done.stderr == ""
