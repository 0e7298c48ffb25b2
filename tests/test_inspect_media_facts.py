"""`tarsier inspect` on the real media: the facts /work/shared/media/README.md states, counts the
decoders agree on, the indices each family's own loader records, and how --model picks a family.

Complements tests/test_inspect.py (generated awkward inputs, crash/hang, exit codes, no torch).
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import SAMPLE_DATA
from tarsier_batch.cli import app
from tarsier_batch.families.catalog import TARSIER, TARSIER2, FamilyInfo
from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import media_type_of
from tarsier_batch.review.inspection import Inspection, family_for, inspect_file

runner = CliRunner()

# What /work/shared/media/README.md measured ("Measured properties" and the derived clips' names).
README_FACTS = {
    "demo_test.mp4": dict(media_type="video", size_bytes=3_075_695, codec="h264", stored_size="1920x800",
                          displayed_size="1920x800", rotation=0, fps=8.0, duration_s=10.5, frame_count=84,
                          decoder="decord"),
    "tarsier_logo.jpg": dict(media_type="image", size_bytes=300_507, container="JPEG", image_mode="RGB",
                             stored_size="1650x1516", displayed_size="1650x1516", animated=False, decoder="pillow"),
    "demo_test_8frames.gif": dict(media_type="gif", size_bytes=400_863, container="GIF", image_mode="P",
                                  stored_size="384x160", frame_count=8, duration_s=2.0, animated=True,
                                  decoder="pillow"),
    "clip_12f.gif": dict(media_type="gif", frame_count=12, animated=True, decoder="pillow"),
    "clip_5f.gif": dict(media_type="gif", frame_count=5, animated=True, decoder="pillow"),
    "short_5f.mp4": dict(media_type="video", frame_count=5, decoder="decord"),
    "portrait_25fps.mp4": dict(media_type="video", fps=25.0, rotation=0, decoder="decord"),
    "portrait_200x333.png": dict(media_type="image", stored_size="200x333", displayed_size="200x333",
                                 decoder="pillow"),
    "demo_test_f40.jpg": dict(media_type="image", decoder="pillow"),
}


@pytest.mark.parametrize("name", sorted(README_FACTS))
def test_the_facts_the_media_readme_states(name: str, shared_media: Path) -> None:
    found = inspect_file(str(shared_media / name), TARSIER2)
    assert found.ok, found.problem
    assert {key: getattr(found, key) for key in README_FACTS[name]} == README_FACTS[name]


def independent_frame_count(path: Path) -> int:
    """Frames counted without the tool: PyAV decodes every frame of a video, Pillow counts a GIF's."""
    if path.suffix == ".gif":
        with Image.open(path) as gif:
            return gif.n_frames
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.mark.parametrize("name", ["demo_test.mp4", "short_5f.mp4", "portrait_25fps.mp4", "clip_12f.gif",
                                  "clip_5f.gif", "demo_test_8frames.gif"])
def test_frame_count_agrees_with_a_full_decode(name: str, shared_media: Path) -> None:
    path = shared_media / name
    found = inspect_file(str(path), TARSIER)
    assert found.frame_count == independent_frame_count(path)
    # the duration follows from the count at the average frame rate (videos) or the frame delays (GIFs)
    if found.fps:
        assert found.duration_s == pytest.approx(found.frame_count / found.fps)


@pytest.fixture(scope="module")
def processors(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each family's real processor, from a tiny checkpoint (built once for the module)."""
    v2_dir = make_tiny_model(tmp_path_factory.mktemp("t2"), "tiny", seed=0, family="tarsier2")
    return {family.key: load_caption_model(model_dir, torch.float32, torch.device("cpu")).processor
            for family, model_dir in [(TARSIER, tiny_model_dir), (TARSIER2, v2_dir)]}


@pytest.mark.parametrize("name", ["short_5f.mp4", "clip_5f.gif", "clip_12f.gif", "portrait_25fps.mp4",
                                  "portrait_200x333.png"])
@pytest.mark.parametrize("family", [TARSIER, TARSIER2], ids=lambda family: family.key)
def test_default_frames_sample_what_the_family_loads(name: str, family: FamilyInfo, shared_media: Path,
                                                     processors: dict[str, object]) -> None:
    """At each family's default frame count, on clips shorter and longer than it (drift check)."""
    path = str(shared_media / name)
    loaded = processors[family.key].load_media(path, media_type_of(path), family.default_frames)
    found = inspect_file(path, family)
    assert found.frames_asked == family.default_frames
    assert (found.frame_indices, found.decoder, found.displayed_size) == \
        (loaded.frame_indices, loaded.decoder, f"{loaded.width}x{loaded.height}")


def test_a_short_video_repeats_frames_in_v1_only(shared_media: Path) -> None:
    path = str(shared_media / "short_5f.mp4")
    assert inspect_file(path, TARSIER).frame_indices == [0, 1, 1, 2, 2, 3, 3, 4]
    assert inspect_file(path, TARSIER2).frame_indices == [0, 1, 2, 3, 4]
    # a GIF is walked once, so repeated indices collapse in both families
    assert inspect_file(str(shared_media / "clip_5f.gif"), TARSIER).frame_indices == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("make", "problem"), [(lambda path: path.mkdir(), "not a regular file: a directory"),
                                               (lambda path: path.symlink_to("/dev/null"),
                                                "not a regular file: a character device")])
def test_what_is_not_a_regular_file_is_never_opened(tmp_path: Path, make, problem: str) -> None:
    path = tmp_path / "clip.mp4"
    make(path)
    found = inspect_file(str(path), TARSIER2)
    assert (found.ok, found.problem, found.frame_indices) == (False, problem, [])


def test_model_names_a_family_without_loading_it(tmp_path: Path) -> None:
    assert family_for("tiny-random") is TARSIER and family_for("omni-research/Tarsier2-7b-0115") is TARSIER2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"model_type": "llama"}}))
    assert family_for(str(tmp_path)) is TARSIER   # a checkpoint folder: only its config.json is read
    ball = str(SAMPLE_DATA / "ball_h264.mp4")
    done = runner.invoke(app, ["inspect", "--json", "--model", str(tmp_path), "--frames", "3", ball])
    row = json.loads(done.output)
    assert done.exit_code == 0 and (row["family"], row["frames_asked"], row["frame_indices"]) == \
        ("Tarsier v1", 3, [0, 24, 47])


def test_text_output_is_aligned_and_says_the_verdict(shared_media: Path) -> None:
    done = runner.invoke(app, ["inspect", str(shared_media / "tarsier_logo.jpg"), str(shared_media / "clip_5f.gif")])
    assert done.exit_code == 0
    blocks = done.output.strip().split("\n\n")
    assert len(blocks) == 2
    for block in blocks:
        lines = block.splitlines()
        values_at = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}
        assert len(values_at) == 1, lines   # every value starts in the same column
        assert lines[-1].split() == ["verdict", "would", "caption"]


def test_a_missing_path_is_a_problem_line_and_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "gone.mp4"
    done = runner.invoke(app, ["inspect", "--json", str(missing), str(SAMPLE_DATA / "still.png")])
    rows = [Inspection(**json.loads(line)) for line in done.output.splitlines()]
    assert done.exit_code == 1 and [row.ok for row in rows] == [False, True] and rows[0].problem
