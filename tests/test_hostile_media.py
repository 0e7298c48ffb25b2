"""Awkward inputs: every file gives frames or a clear one-line error, and unusual files are shown right."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from awkward_media import Fails, Ok, frame_number, halves, make_awkward_inputs
from tarsier_batch.cli import app
from tarsier_batch.errors import KINDS, ItemError, printable
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import (
    Media,
    MediaType,
    frame_indices,
    load_media,
    media_type_of,
)


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Ok | Fails]:
    return make_awkward_inputs(tmp_path_factory.mktemp("awkward"))


def load(path: Path, frames: int = 8) -> Media:
    media_type = media_type_of(path)
    assert media_type is not None, path
    return load_media(str(path), media_type, frames)


def test_every_awkward_input_loads_or_fails_with_its_reason(awkward: dict[Path, Ok | Fails]) -> None:
    for path, expected in awkward.items():
        if isinstance(expected, Fails):
            with pytest.raises(ItemError) as error:   # classified where it failed, not from its message
                load(path)
            assert expected.reason in str(error.value) and "\n" not in str(error.value), (path, error.value)
            assert error.value.kind == expected.kind, (path, error.value.kind)
            assert "video_reader.cc" not in str(error.value)  # decord's log prefix is stripped
            continue
        media = load(path)
        facts = (media.media_type.value, (media.width, media.height), len(media.frames))
        assert facts == (expected.media_type, expected.size, expected.frames), path
        assert all(frame.size == expected.size for frame in media.frames), path
        if expected.decoder is not None:
            assert media.decoder == expected.decoder, path


def named(awkward: dict[Path, Ok | Fails], name: str) -> Path:
    return next(path for path in awkward if path.name == name)


def test_rotated_and_anamorphic_video_are_shown_as_a_player_shows_them(awkward: dict[Path, Ok | Fails]) -> None:
    rotated = np.asarray(load(named(awkward, "rotated_phone.mp4")).frames[0]).astype(int)
    # The stream is 90 degrees counter-clockwise: its left (red) half is at the bottom.
    assert rotated.shape == (64, 48, 3)
    assert rotated[-5, 24, 0] > 200 and rotated[-5, 24, 2] < 60
    assert rotated[5, 24, 2] > 200 and rotated[5, 24, 0] < 60
    wide = np.asarray(load(named(awkward, "anamorphic.mp4")).frames[0]).astype(int)
    assert wide.shape == (48, 128, 3) and wide[24, 60, 0] > 200 and wide[24, 68, 2] > 200


def test_every_container_gives_the_frames_asked_for(awkward: dict[Path, Ok | Fails]) -> None:
    """Numbered frames: where decord would seek to other frames (MPEG-TS, MPEG-PS, AVI and MPEG-4
    Part 2 with B-frames), PyAV decodes; a file cut short is sampled over the frames that decode."""
    for name in ["numbered_h264.mp4", "numbered_h264.ts", "numbered_mpeg2.mpg", "numbered_divx.avi"]:
        media = load(named(awkward, name))
        assert media.frame_indices == frame_indices(30, 8)
        assert [frame_number(frame) for frame in media.frames] == media.frame_indices, name
    cut = load(named(awkward, "numbered_cut.mp4"))
    decoded = cut.frame_indices[-1] + 1
    assert 1 < decoded < 30 and cut.frame_indices == frame_indices(decoded, 8)  # the last decodable frame included
    assert [frame_number(frame) for frame in cut.frames] == cut.frame_indices


def test_a_multi_picture_jpeg_is_its_first_picture(awkward: dict[Path, Ok | Fails]) -> None:
    """Pillow opens a JPEG with an embedded preview or gain map as two frames: not an animation."""
    path = named(awkward, "multi_picture.jpg")
    with Image.open(path) as image:
        assert image.format == "MPO" and image.n_frames == 2
        first = image.convert("RGB").tobytes()
    media = load(path)
    assert (media.media_type, media.frame_indices, media.frames[0].tobytes()) == (MediaType.IMAGE, [0], first)


@pytest.fixture()
def no_standard_input() -> Iterator[None]:
    """Standard input on /dev/null, so that a decoder reading it could neither block nor read a clip."""
    saved = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        yield
    finally:
        os.dup2(saved, 0)
        os.close(null)
        os.close(saved)


def test_a_relative_name_like_an_ffmpeg_protocol_is_read_as_a_file(awkward: dict[Path, Ok | Fails],
                                                                   no_standard_input: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(named(awkward, "pipe:0.mp4").parent)  # FFmpeg reads "pipe:0..." as standard input
    media = load_media("pipe:0.mp4", MediaType.VIDEO, 8)
    assert (media.path, media.decoder, len(media.frames)) == ("pipe:0.mp4", "decord", 8)


def test_a_fifo_is_refused_without_being_opened(awkward: dict[Path, Ok | Fails]) -> None:
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            load(named(awkward, "fifo.mp4"))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)  # a safety net: opening would block for ever
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "load_media blocked on a FIFO"
    assert [str(error) for error in outcome] == ["not a regular file: a FIFO (named pipe)"]


def test_an_unreadable_file_is_refused(awkward: dict[Path, Ok | Fails], tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root from reading a file")
    unreadable = tmp_path / "unreadable.mp4"
    shutil.copy(named(awkward, "plain_h264.mp4"), unreadable)
    unreadable.chmod(0)
    with pytest.raises(ValueError, match="permission denied"):
        load(unreadable)


@pytest.mark.parametrize("name", ["plain_h264.mp4", "rotated_phone.mp4"])  # decord's path, PyAV's path
def test_a_transform_error_is_not_taken_for_a_decoder_failure(awkward: dict[Path, Ok | Fails], name: str) -> None:
    calls: list[int] = []

    def broken(frame: Image.Image, frame_count: int) -> None:
        calls.append(frame_count)
        raise RuntimeError("the transform broke")

    with pytest.raises(RuntimeError, match="the transform broke"):  # raised as it is, not "cannot decode video"
        load_media(str(named(awkward, name)), MediaType.VIDEO, 8, frame_transform=broken)
    assert len(calls) == 1  # the other decoder was not tried

    def out_of_memory(frame: Image.Image, frame_count: int) -> None:
        raise MemoryError

    with pytest.raises(MemoryError):  # the worker pool reports it with its memory limit
        load_media(str(named(awkward, name)), MediaType.VIDEO, 8, frame_transform=out_of_memory)


def test_tarsier2_preprocesses_frames_as_they_are_shown(awkward: dict[Path, Ok | Fails],
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-tarsier2"), "tiny", seed=0, family="tarsier2")
    processor = load_caption_model(model_dir, torch.float32, torch.device("cpu")).processor

    def prompt(name: str, frames: int = 4) -> tuple[Media, int]:
        path = named(awkward, name)
        media = processor.load_media(str(path), media_type_of(path), frames)
        return media, len(processor.process(media, None).token_ids)

    wide, _ = prompt("anamorphic.mp4")
    assert (wide.decoder, wide.width, wide.height) == ("pyav", 128, 48)
    assert all(frame.grid_w > frame.grid_h for frame in wide.frames)  # the displayed 8:3 frame, not the stored 4:3
    rotated, _ = prompt("rotated_phone.mp4")
    assert (rotated.width, rotated.height, len(rotated.frames)) == (48, 64, 4)
    clip, _ = prompt("numbered_h264.ts", frames=30)
    assert clip.frame_indices == list(range(30))  # Tarsier2 takes every frame of a clip of at most 30
    animated, _ = prompt("animated.webp")
    assert animated.frame_indices == [0, 1, 2]
    with pytest.raises(ValueError, match="^absolute aspect ratio must be smaller than 200, got 2000.0$"):
        prompt("strip_20000x10.png")  # Qwen2-VL's own limit, as upstream: a one-line error row


def test_unusual_images_are_converted_as_a_viewer_shows_them(awkward: dict[Path, Ok | Fails]) -> None:
    grey16 = np.asarray(load(named(awkward, "grey16.png")).frames[0])
    assert (grey16 == 128).all()  # 0x8000 of 0xffff, not clipped to white
    assert (np.asarray(load(named(awkward, "transparent.png")).frames[0]) == 255).all()  # no hidden green
    palette = np.asarray(load(named(awkward, "palette_alpha.png")).frames[0])
    assert (palette[:, :32] == 255).all()  # the transparent palette entry shows white...
    assert (palette[:, 32:] == (0, 0, 255)).all()  # ...the opaque one its colour
    upright = load(named(awkward, "exif_rotated.jpg")).frames[0]
    with Image.open(named(awkward, "exif_rotated.jpg")) as raw:
        assert upright.tobytes() == raw.convert("RGB").transpose(Image.Transpose.ROTATE_270).tobytes()
    animated = load(named(awkward, "animated.webp"))
    assert animated.frame_indices == [0, 1, 2]
    assert [int(np.asarray(frame).mean()) for frame in animated.frames] == [0, 100, 200]
    cmyk = np.asarray(load(named(awkward, "cmyk.jpg")).frames[0]).astype(int)
    assert cmyk[24, 5, 0] > 200 and cmyk[24, 60, 2] > 200


def test_ordinary_images_stay_exactly_upstream_conversion(tmp_path: Path) -> None:
    for mode, name in [("RGB", "a.png"), ("RGB", "b.jpg"), ("L", "c.png")]:
        Image.fromarray(halves()).convert(mode).save(tmp_path / name)
        with Image.open(tmp_path / name) as image:
            assert load(tmp_path / name).frames[0].tobytes() == image.convert("RGB").tobytes()


def test_v1_square_stretch_is_bounded(tiny_model_dir: Path, awkward: dict[Path, Ok | Fails]) -> None:
    from tarsier_batch.families.tarsier.processing import (
        MAX_SQUARE_SIDE,
        stretch_to_square,
    )

    with Image.open(named(awkward, "strip_20000x10.png")) as strip:
        square = stretch_to_square(strip.convert("RGB"))
    assert square.size == (MAX_SQUARE_SIDE, MAX_SQUARE_SIDE)  # not 20000 x 20000 (1.2 GB)
    frame = Image.fromarray(halves(640, 360))
    assert stretch_to_square(frame).tobytes() == frame.resize((640, 640), Image.Resampling.BICUBIC).tobytes()


# What error rows used to start with: `ValueError: `, `OSError: `, `av.error.InvalidDataError: `.
CLASS_NAME_PREFIX = re.compile(r"^[\w.]*(Error|Exception|Failure)\b")


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "cut.gif"), ("PNG", "cut.png"), ("PNG", "cut_animated.png"),
                                           ("WEBP", "cut.webp"), ("JPEG", "cut.jpg"),
                                           ("GIF", "cut_gif_named.png")])   # a GIF under an image's name
def test_an_image_or_animation_cut_anywhere_is_undecodable_with_a_reason(tmp_path: Path, fmt: str,
                                                                         name: str) -> None:
    # A download cut short: Pillow says so in many ways (OSError "image file is truncated", "Truncated File
    # Read" while opening, IndexError or struct.error while counting a GIF's frames). Each must become an
    # undecodable row that says "cut short", never an `internal` failure (a bug of ours) or an `unreadable`.
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(4)]
    if fmt == "GIF":
        pictures = [picture.convert("P") for picture in pictures]
    whole = tmp_path / f"whole{Path(name).suffix}"
    if name == "cut.png" or fmt == "JPEG":
        pictures[0].save(whole, fmt)
    else:
        pictures[0].save(whole, fmt, save_all=True, append_images=pictures[1:], duration=80, loop=0)
    data = whole.read_bytes()
    cut = tmp_path / name
    media_type = media_type_of(cut)
    assert media_type is not None
    reasons: set[str] = set()
    for length in range(1, len(data), max(1, len(data) // 150)):
        cut.write_bytes(data[:length])
        try:
            media = load_media(str(cut), media_type, 8)
        except ItemError as error:
            assert error.kind == "undecodable", (length, error.kind, str(error))
            assert re.search("cut short|not an image", str(error)), (length, str(error))
            reasons.add(str(error))
        else:   # cut where a frame ends (or only the trailer is missing): the frames before the cut
            assert 1 <= len(media.frames) <= len(pictures), length
    assert any("cut short" in reason for reason in reasons), reasons


def test_a_truncated_mp4_and_a_text_file_named_mp4_fail_apart(awkward: dict[Path, Ok | Fails]) -> None:
    """Both decoders say "Invalid data found when processing input" for both: the message must not."""
    said = {}
    for name in ("truncated.mp4", "text.mp4", "random_bytes.mp4"):
        with pytest.raises(ItemError) as error:
            load(named(awkward, name))
        said[name] = (error.value.kind, str(error.value).partition(";")[0])
    assert said["truncated.mp4"][1].startswith("the video is cut short: the file ends at byte ")
    assert said["text.mp4"][1] == "not a video: no media stream found (the file starts like text)"
    assert len(set(said.values())) == 3 and {kind for kind, _ in said.values()} == {"undecodable"}
    assert all(kind in KINDS
               for kind in {expected.kind for expected in awkward.values() if isinstance(expected, Fails)})


def test_the_cli_gives_every_awkward_input_a_row(awkward: dict[Path, Ok | Fails], tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    folder = next(iter(awkward)).parent
    out = tmp_path / "r.parquet"
    result = CliRunner().invoke(app, ["caption", str(folder), "--model", str(tiny_model_dir), "--out", str(out),
                                      "--max-new-tokens", "2", "--decode-timeout", "60", "--quiet"])
    assert result.exit_code == 1, result.output
    rows = {row["path"]: row for row in pq.read_table(out).to_pylist()}
    assert set(rows) == {printable(str(path)) for path in awkward}
    for path, expected in awkward.items():
        row = rows[printable(str(path))]
        if isinstance(expected, Fails):
            assert row["caption"] is None and expected.reason in row["error"], (path, row["error"])
            assert row["error_kind"] == expected.kind, (path, row["error"], row["error_kind"])
            assert not CLASS_NAME_PREFIX.match(row["error"]), (path, row["error"])
        else:
            assert row["error"] is None and row["error_kind"] is None and row["caption"], (path, row["error"])
            assert (row["width"], row["height"], row["media_type"]) == (*expected.size, expected.media_type)
