"""Awkward inputs: every file gives frames or a clear one-line error, and unusual files are shown right."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from awkward_media import Fails, Ok, halves, make_awkward_inputs
from PIL import Image
from typer.testing import CliRunner

from tarsier_batch.cli import app
from tarsier_batch.media import Media, load_media, media_type_of
from tarsier_batch.text import printable


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
            with pytest.raises(Exception) as error:
                load(path)
            assert expected.reason in str(error.value) and "\n" not in str(error.value), (path, error.value)
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
    from tarsier_batch.families.tarsier.processing import MAX_SQUARE_SIDE, stretch_to_square

    with Image.open(named(awkward, "strip_20000x10.png")) as strip:
        square = stretch_to_square(strip.convert("RGB"))
    assert square.size == (MAX_SQUARE_SIDE, MAX_SQUARE_SIDE)  # not 20000 x 20000 (1.2 GB)
    frame = Image.fromarray(halves(640, 360))
    assert stretch_to_square(frame).tobytes() == frame.resize((640, 640), Image.Resampling.BICUBIC).tobytes()


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
        else:
            assert row["error"] is None and row["caption"], (path, row["error"])
            assert (row["width"], row["height"], row["media_type"]) == (*expected.size, expected.media_type)
