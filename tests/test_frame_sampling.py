"""Frame indices and media decoding follow the official loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from tarsier_batch.errors import ItemError
from tarsier_batch.media import MediaType, frame_indices, load_media, media_type_of


@pytest.mark.parametrize(("total", "wanted", "expected"), [
    (84, 8, [0, 12, 24, 36, 47, 59, 71, 83]),          # demo_test.mp4, as the media README lists
    (84, 1, [0]),                                      # one frame is the first frame
    (5, 8, [0, 1, 1, 2, 2, 3, 3, 4]),                  # shorter than requested: indices repeat
    (1, 4, [0, 0, 0, 0]),
    (3, 5, [0, 0, 1, 2, 2]),                           # 0.5 -> 0 and 1.5 -> 2: round half to even
    (10000, 8, [0, 1428, 2857, 4285, 5714, 7142, 8571, 9999]),
    (16, 16, list(range(16))),
])
def test_frame_indices_match_hand_computed_cases(total: int, wanted: int, expected: list[int]) -> None:
    assert frame_indices(total, wanted) == expected


def test_frame_indices_reject_empty_requests() -> None:
    with pytest.raises(ValueError):
        frame_indices(0, 8)
    with pytest.raises(ValueError):
        frame_indices(10, 0)


@pytest.mark.parametrize(("name", "expected"), [
    ("a.mp4", MediaType.VIDEO), ("a.MOV", MediaType.VIDEO), ("a.WebM", MediaType.VIDEO),
    ("a.mkv", MediaType.VIDEO), ("a.gif", MediaType.GIF), ("a.GIF", MediaType.GIF),
    ("a.JPG", MediaType.IMAGE), ("a.webp", MediaType.IMAGE), ("a.tif", MediaType.IMAGE),
    ("a.txt", None), ("noext", None),
])
def test_media_type_comes_from_the_extension_in_any_case(name: str, expected: MediaType | None) -> None:
    assert media_type_of(name) is expected


def test_long_video_samples_eight_uniform_frames(shared_media: Path) -> None:
    media = load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, 8)
    assert media.frame_indices == [0, 12, 24, 36, 47, 59, 71, 83]
    assert len(media.frames) == 8
    assert {frame.size for frame in media.frames} == {(1920, 800)}
    assert all(frame.mode == "RGB" for frame in media.frames)
    assert (media.width, media.height, media.duration_s) == (1920, 800, 10.5)


def test_short_video_keeps_repeated_frames(shared_media: Path) -> None:
    media = load_media(str(shared_media / "short_5f.mp4"), MediaType.VIDEO, 8)
    assert media.frame_indices == [0, 1, 1, 2, 2, 3, 3, 4]
    assert len(media.frames) == 8
    assert media.frames[1].tobytes() == media.frames[2].tobytes()


def test_short_gif_collapses_repeated_frames(shared_media: Path) -> None:
    media = load_media(str(shared_media / "clip_5f.gif"), MediaType.GIF, 8)
    assert media.frame_indices == [0, 1, 2, 3, 4]
    assert len(media.frames) == 5
    assert all(frame.mode == "RGB" for frame in media.frames)


def test_long_gif_samples_like_a_video(shared_media: Path) -> None:
    media = load_media(str(shared_media / "clip_12f.gif"), MediaType.GIF, 8)
    assert media.frame_indices == frame_indices(12, 8) == [0, 2, 3, 5, 6, 8, 9, 11]
    assert len(media.frames) == 8


def test_image_is_one_rgb_frame(shared_media: Path) -> None:
    media = load_media(str(shared_media / "portrait_200x333.png"), MediaType.IMAGE, 8)
    assert media.frame_indices == [0]
    assert len(media.frames) == 1 and media.frames[0].mode == "RGB"
    assert (media.width, media.height, media.duration_s) == (200, 333, None)


def test_corrupt_video_raises(tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    # Both decoders tried; the file's boxes say what is wrong with it.
    with pytest.raises(ItemError, match="^the video is cut short or was never finished: the MP4 has no index "
                                        r"\(moov box\); decord: Error reading .*; pyav: ") as error:
        load_media(str(broken), MediaType.VIDEO, 8)
    assert error.value.kind == "undecodable"


def test_corrupt_image_raises(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff not really a jpeg")
    with pytest.raises(ItemError, match="^not an image: Pillow recognises no image format in its bytes$") as error:
        load_media(str(broken), MediaType.IMAGE, 8)
    assert error.value.kind == "undecodable"
