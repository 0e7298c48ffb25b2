"""Huge images: a 96 Mpx JPEG (a DSLR panorama) is read reduced as it decodes, in bounded memory, and
captions; past --max-image-pixels an image fails undecoded, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.media import MediaType, load_media

runner = CliRunner()
WIDTH, HEIGHT = 12001, 8001   # 96 Mpx, not a multiple of the reduction: Pillow's draft rounds by size // asked


@pytest.fixture(scope="module")
def panorama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12001 x 8001 RGB, left half red, right half blue; made in a child so this process never holds it."""
    path = tmp_path_factory.mktemp("huge") / "panorama.jpg"
    subprocess.run([sys.executable, "-c", f"""
from PIL import Image
image = Image.new("RGB", ({WIDTH}, {HEIGHT}), (220, 20, 20))
image.paste((20, 20, 220), ({WIDTH // 2}, 0, {WIDTH}, {HEIGHT}))
image.save({str(path)!r}, quality=80)
"""], check=True, timeout=120)
    return path


def test_a_96_mpx_jpeg_decodes_reduced_in_bounded_memory(panorama: Path) -> None:
    probe = f"""
import json
from tarsier_batch.media import MediaType, load_media
media = load_media({str(panorama)!r}, MediaType.IMAGE, 1)
frame = media.frames[0]
print(json.dumps({{"size": [media.width, media.height], "frame": list(frame.size), "left": frame.getpixel((10, 10)),
                  "right": frame.getpixel((frame.width - 10, 10)),
                  "peak_mb": int(next(line.split()[1] for line in open("/proc/self/status")
                                      if line.startswith("VmHWM"))) / 1024}}))   # ru_maxrss survives exec
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(done.stdout)
    assert facts["size"] == [WIDTH, HEIGHT]   # the row says the picture's size
    assert facts["frame"] == [-(-WIDTH // 4), -(-HEIGHT // 4)]   # read at 1/4: 6 Mpx
    assert facts["left"][0] > 200 > facts["left"][2] and facts["right"][2] > 200 > facts["right"][0]
    # Decoded whole, the RGB pixels alone would take 288 MB; Python, Pillow and the 6 Mpx frame take far less.
    assert facts["peak_mb"] < 250, facts


def test_the_96_mpx_jpeg_captions(panorama: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    done = runner.invoke(app, ["caption", str(panorama), "--model", str(tiny_model_dir), "-o", str(out),
                               "--max-new-tokens", "3", "--quiet"])
    assert done.exit_code == 0, done.output
    row = pq.read_table(out).to_pylist()[0]
    assert row["error"] is None and row["generated_tokens"] == 3 and (row["width"], row["height"]) == (WIDTH, HEIGHT)


def test_an_image_above_the_limit_fails_undecoded_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"^image too large: 300x200 = 0.06 Mpx, "
                                         r"above max_image_pixels \(0.001 Mpx\)$"):
        load_media(str(SAMPLE_DATA / "still.png"), MediaType.IMAGE, 1, max_image_pixels=1000)
    assert load_media(str(SAMPLE_DATA / "still.png"), MediaType.IMAGE, 1, max_image_pixels=None).width == 300
